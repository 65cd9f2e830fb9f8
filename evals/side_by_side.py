"""Eval jobs side by side on one GPU: a small model's engine leaves most of an H100 idle, so
several accuracy runs (one engine each) finish in about the time of one. Each job is a shell
command with its own log; at most --max-running run at once, started --stagger-s apart (their
engines compile and warm up at different moments); a job still running at --deadline-s is
stopped. What each did goes to DIR/status.json as it ends, so a later call on the same machine
can pack the results while others still run.

    python -P -m evals.side_by_side --dir /tmp/acc --max-running 6 \\
        --job gsm8k_fp8="python3 -P -m evals.lm_eval_kv ... --out /tmp/acc/gsm8k_fp8.json" \\
        --job needle_auto="python3 -P -m evals.needle ..."

Accuracy only: the jobs share the GPU, so no job's times mean anything.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def run(jobs: list[tuple[str, str]], out_dir: Path, max_running: int, stagger_s: float,
        deadline_s: float, poll_s: float = 1.0) -> dict:
    """Runs the jobs in order, at most max_running at once -> {name: its status}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    status = {name: {"command": cmd, "state": "waiting"} for name, cmd in jobs}
    todo, running, t0, last_start = list(jobs), {}, time.time(), -stagger_s

    def save():
        (out_dir / "status.json").write_text(json.dumps(status, indent=1))

    save()
    while todo or running:
        now = time.time() - t0
        for name, p in list(running.items()):
            if p.poll() is not None:
                status[name].update(state="done", exit=p.returncode, end_s=round(now, 1))
                del running[name]
                save()
            elif now > deadline_s and not status[name].get("stopped"):
                with contextlib.suppress(ProcessLookupError):  # its engines too
                    os.killpg(p.pid, signal.SIGTERM)
                status[name]["stopped"] = "at the deadline"
        if todo and len(running) < max_running and now - last_start >= stagger_s \
                and now < deadline_s:
            name, cmd = todo.pop(0)
            log = open(out_dir / f"{name}.log", "w")
            running[name] = subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=log,
                                             start_new_session=True)
            status[name].update(state="running", start_s=round(now, 1))
            last_start = now
            save()
        if todo and now >= deadline_s:
            for name, _ in todo:
                status[name]["state"] = "not started: deadline"
            todo = []
            save()
        time.sleep(poll_s)
    return status


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", required=True, help="logs and status.json")
    ap.add_argument("--job", action="append", default=[], metavar="NAME=COMMAND")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--stagger-s", type=float, default=15)
    ap.add_argument("--deadline-s", type=float, default=3600)
    args = ap.parse_args()
    jobs = [tuple(j.split("=", 1)) for j in args.job]
    if any(len(j) != 2 or not j[0] for j in jobs):
        ap.error("--job NAME=COMMAND")
    status = run(jobs, Path(args.dir), args.max_running, args.stagger_s, args.deadline_s)
    for name, s in status.items():
        print(f"{name:<40} {s['state']:<24} exit {s.get('exit')}")
    sys.exit(0 if all(s.get("exit") == 0 for s in status.values()) else 1)


if __name__ == "__main__":
    main()
