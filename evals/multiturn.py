"""Multi-turn / agentic replay against `vllm serve` on loopback: prefix-cache hit rate,
throughput and TTFT vs concurrency, per KV cache dtype, with and without vLLM's KV offloading
to host memory (the seed's AgentX experiment in small).

Workload (seeded, written to / read from JSONL, so a run can be replayed): S sessions, each a
sequence of turns. A turn appends new user tokens (a tool output or a user message, of varied
length) and asks for an assistant reply of K tokens (ignore_eos, so exactly K). The next turn's
prompt is the whole history: the previous prompt + the reply actually produced (its token ids)
+ the new tokens, so a turn hits the prefix cache when its history is still resident. Prompts
are token ids (exact lengths). A session ends before its history would pass --max-history.

Replay: one `vllm serve` per (KV dtype, offload) pair, with one fixed KV cache byte budget
(--kv-cache-memory-bytes) for every dtype, so smaller pages hold more history. For each
concurrency C, C workers take sessions in workload order (the first min(S, rounds x C)) and run
each session's turns one after another (C = sessions in flight). A point ends when its sessions
are done or after --duration-s (no turn starts later; turns in flight finish). The prefix cache
(GPU and, with reset_external, the host tier) is reset between points, and each point's requests
carry their own cache_salt, so nothing is reused across points.

Per point: input-token cache hit rate as the client sees it (usage.prompt_tokens_details.
cached_tokens / prompt tokens: GPU-cache and offload hits, counted once per turn) and from the
server's counters (vllm:prefix_cache_* and vllm:external_prefix_cache_*, deltas over the point;
the scheduler counts a waiting request's query again at every step it retries it, so under
memory pressure the server's rate reads lower than the client's), the ideal hit rate of the
same turns (nothing ever evicted), output and total token throughput, TTFT mean / p50 / p99,
completed turns and sessions, preemptions, offload transfer bytes, and each turn. Each
server's startup lines (KV capacity) are kept. Writes --out (JSON) and a PNG next to it.

KV offloading is vLLM 0.26's native CPU offloading (`--kv-offloading-size GiB
--kv-offloading-backend native`, i.e. the OffloadingConnector with a host tier of that many
bytes; its pages are the engine's pages, so NVFP4 pages stay 4-bit there too). vLLM's CPU
platform refuses it ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"):
on a CPU machine `--offload on` rows record that refusal.

    # GPU (Llama-3-8B shape, dummy weights, histories up to 32K tokens; ~7-8 min per call
    # with two servers; evals/gpu_session.sh multiturn-off|multiturn-on), then join the
    # calls' files on any machine (--combine refuses different workloads or GPU models; the
    # workload is rebuilt bit for bit by --workload-only --sizes gpu, its sha256 is in the JSON):
    python -P -m evals.multiturn --dtypes fp8 nvfp4 --offload off --budget-s 430 \\
        --workload /tmp/multiturn_gpu.workload.jsonl --out evals/results/multiturn_h100_off.json
    python -P -m evals.multiturn --dtypes fp8 nvfp4 --offload on --budget-s 430 \\
        --workload /tmp/multiturn_gpu.workload.jsonl --out evals/results/multiturn_h100_on.json
    python -P -m evals.multiturn --combine evals/results/multiturn_h100_{off,on}.json \\
        --out evals/results/multiturn_h100.json
    # CPU (SmolLM2-135M, tiny sizes; offload on only records vLLM's refusal):
    python -P -m evals.multiturn --dtypes auto nvfp4 --offload off on \\
        --out evals/results/multiturn_cpu.json
    # the workload only (--sizes gpu: the GPU run's, bit for bit) / plot an existing result:
    python -P -m evals.multiturn --workload-only --sizes gpu --out /tmp/mt.json
    python -P -m evals.multiturn --plot-only --out evals/results/multiturn_cpu.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import math
import os
import random
import re
import threading
import time
import urllib.request
from pathlib import Path

from evals import assets, common
from evals.server import (Server, completion_result, cpu_env, metrics, offline_report, report,
                          serve_cmd, sse_events)

FIRST_TOKEN_ID = 100  # token ids are drawn from [100, vocab - 100): no special tokens

# ---------------------------------------------------------------- workload
GPU_WORKLOAD = dict(sessions=48, first=(2048, 6144), tool=(512, 8192), user=(64, 1024),
                    reply=(64, 192), tool_fraction=0.7, max_turns=16, max_history=32768)
CPU_WORKLOAD = dict(sessions=8, first=(192, 384), tool=(32, 256), user=(8, 48),
                    reply=(4, 8), tool_fraction=0.7, max_turns=6, max_history=1536)


def _loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_session(seed: int, sid: int, vocab: int, p: dict) -> dict:
    """One session, from its own RNG (so session i does not depend on how many there are).
    Turn 0: a first message of p['first'] tokens; later turns: a tool output (p['tool'],
    probability p['tool_fraction']) or a user message (p['user']); lengths log-uniform within
    [lo, hi]. Reply lengths uniform in p['reply']. A turn is added only while its prompt plus
    reply stays within p['max_history'] tokens, up to p['max_turns'] turns."""
    rng = random.Random(seed * 1_000_003 + sid)
    turns, history = [], 0
    while len(turns) < p["max_turns"]:
        if not turns:
            kind, n = "first", _loguniform(rng, *p["first"])
        elif rng.random() < p["tool_fraction"]:
            kind, n = "tool", _loguniform(rng, *p["tool"])
        else:
            kind, n = "user", _loguniform(rng, *p["user"])
        k = rng.randint(*p["reply"])
        if history + n + k > p["max_history"]:
            break
        turns.append({"kind": kind, "new_tokens": [rng.randrange(FIRST_TOKEN_ID,
                                                                 vocab - FIRST_TOKEN_ID)
                                                   for _ in range(n)],
                      "reply_tokens": k})
        history += n + k
    return {"session": sid, "turns": turns}


def make_workload(seed: int, vocab: int, p: dict) -> dict:
    return {"header": {"seed": seed, "vocab": vocab, "params": p},
            "sessions": [make_session(seed, i, vocab, p) for i in range(p["sessions"])]}


def write_workload(w: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"type": "header", **w["header"]}) + "\n")
        for s in w["sessions"]:
            f.write(json.dumps({"type": "session", **s}, separators=(",", ":")) + "\n")


def read_workload(path: Path) -> dict:
    header, sessions = None, []
    for line in common.read_text(path).splitlines():
        rec = json.loads(line)
        kind = rec.pop("type")
        if kind == "header":
            header = rec
        else:
            sessions.append(rec)
    if header is None:
        raise ValueError(f"{path}: no header line")
    return {"header": header, "sessions": sessions}


def planned_prompt_lens(session: dict) -> list[int]:
    """Prompt length of each turn when every reply has its planned length (what ignore_eos
    gives): the whole history so far plus the turn's new tokens."""
    out, history = [], 0
    for t in session["turns"]:
        out.append(history + len(t["new_tokens"]))
        history = out[-1] + t["reply_tokens"]
    return out


def workload_stats(w: dict) -> dict:
    lens = [n for s in w["sessions"] for n in planned_prompt_lens(s)]
    last = [planned_prompt_lens(s)[-1] + s["turns"][-1]["reply_tokens"] for s in w["sessions"]]
    return {"sessions": len(w["sessions"]), "turns": len(lens),
            "turns_per_session_mean": round(len(lens) / len(w["sessions"]), 2),
            "prompt_tokens_total": sum(lens), "prompt_len_max": max(lens),
            "final_history_mean": round(sum(last) / len(last), 1),
            "final_history_max": max(last),
            "new_tokens_total": sum(len(t["new_tokens"]) for s in w["sessions"]
                                    for t in s["turns"])}


def ideal_cached(prev_prompt: int, prev_reply: int, block: int) -> int:
    """Tokens a turn can hit if nothing was evicted: the full blocks of the previous prompt
    plus its reply, whose last sampled token never had its K/V written."""
    return (prev_prompt + prev_reply - 1) // block * block if prev_prompt else 0


# ---------------------------------------------------------------- client
def stream_completion(port: int, body: dict, timeout: float) -> dict:
    """One streamed /v1/completions request; returns its generated token ids, usage, TTFT."""
    def read(r, t0):
        ids, ttft, usage, finish = [], None, None, None
        for ev in sse_events(r):
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                if ch.get("token_ids"):
                    if ttft is None:
                        ttft = time.time() - t0
                    ids += ch["token_ids"]
                finish = ch.get("finish_reason") or finish
        return {"status": "completed", "token_ids": ids, "usage": usage, "ttft_s": ttft,
                "latency_s": time.time() - t0, "finish_reason": finish}
    return completion_result(port, body, timeout, read)


def reset_prefix_cache(port: int, tries: int = 10) -> bool:
    """POST /reset_prefix_cache?reset_external=true (VLLM_SERVER_DEV_MODE=1); retried while
    blocks are still held (e.g. offload transfers in flight)."""
    for _ in range(tries):
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/reset_prefix_cache?reset_external=true", b"",
                method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                if json.load(r).get("success"):
                    return True
        except Exception:  # noqa: BLE001 - an older server may not have it; the salt still holds
            pass
        time.sleep(1)
    return False


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def run_point(port: int, sessions: list[dict], concurrency: int, salt: str, args) -> dict:
    """Replays `sessions` with `concurrency` sessions in flight; returns the per-turn results."""
    queue = list(sessions)
    lock = threading.Lock()
    t_start = time.time()
    stop_at = t_start + args.duration_s if args.duration_s else float("inf")
    turns, sessions_done, sessions_cut = [], [0], [0]

    def worker():
        while True:
            with lock:
                if not queue or time.time() >= stop_at:
                    return
                s = queue.pop(0)
            history: list[int] = []
            prev_prompt = prev_reply = 0
            for ti, t in enumerate(s["turns"]):
                if time.time() >= stop_at:
                    with lock:
                        sessions_cut[0] += 1
                    return
                prompt = history + t["new_tokens"]
                body = {"model": "m", "prompt": prompt, "max_tokens": t["reply_tokens"],
                        "min_tokens": t["reply_tokens"], "ignore_eos": True, "temperature": 0.0,
                        "stream": True, "stream_options": {"include_usage": True},
                        "return_token_ids": True, "cache_salt": salt}
                t_send = time.time()
                r = stream_completion(port, body, args.request_timeout_s)
                rec = {"session": s["session"], "turn": ti, "prompt_len": len(prompt),
                       "ideal_cached": ideal_cached(prev_prompt, prev_reply, args.block_size),
                       "t_send_s": round(t_send - t_start, 3), "status": r["status"]}
                if r["status"] == "completed":
                    u = r["usage"] or {}
                    rec.update(
                        completion_tokens=u.get("completion_tokens", len(r["token_ids"])),
                        server_prompt_tokens=u.get("prompt_tokens"),
                        cached_tokens=(u.get("prompt_tokens_details") or {}).get(
                            "cached_tokens"),
                        ttft_s=r["ttft_s"], latency_s=r["latency_s"],
                        t_done_s=round(time.time() - t_start, 3))
                    if len(r["token_ids"]) != t["reply_tokens"]:
                        rec["status"] = "short_reply"
                else:
                    rec["error"] = r["error"]
                with lock:
                    turns.append(rec)
                if rec["status"] != "completed":
                    return  # the history cannot be extended: the session ends here
                history = prompt + r["token_ids"]
                prev_prompt, prev_reply = len(prompt), len(r["token_ids"])
            with lock:
                sessions_done[0] += 1

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return {"turns": turns, "sessions_completed": sessions_done[0],
            "sessions_cut_by_duration": sessions_cut[0],
            "sessions_not_started": len(queue), "wall_s": time.time() - t_start}


TURN_FIELDS = ("session", "turn", "prompt_len", "cached_tokens", "ideal_cached", "ttft_s",
               "latency_s", "t_send_s")


def summarize(res: dict, m0: dict, m1: dict) -> dict:
    turns = res["turns"]
    ok = [t for t in turns if t["status"] == "completed"]
    wall = max([t["t_done_s"] for t in ok], default=res["wall_s"])
    prompt = sum(t["prompt_len"] for t in ok)
    out_tok = sum(t["completion_tokens"] for t in ok)
    cached = sum(t["cached_tokens"] or 0 for t in ok)
    ideal = sum(t["ideal_cached"] for t in ok)
    ttft = [t["ttft_s"] * 1e3 for t in ok if t["ttft_s"] is not None]
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1
         if k.startswith(("vllm:prefix_cache", "vllm:external_prefix_cache",
                          "vllm:num_preemptions", "vllm:kv_offload_load_bytes",
                          "vllm:kv_offload_store_bytes", "vllm:kv_offload_allocation_failure"))}
    q, h, eh = (d.get("vllm:prefix_cache_queries", 0), d.get("vllm:prefix_cache_hits", 0),
                d.get("vllm:external_prefix_cache_hits", 0))
    r3 = (lambda x: round(x, 4) if x is not None else None)
    return {
        "turns_completed": len(ok), "turns_failed": len(turns) - len(ok),
        "sessions_completed": res["sessions_completed"],
        "sessions_cut_by_duration": res["sessions_cut_by_duration"],
        "sessions_not_started": res["sessions_not_started"],
        "wall_s": round(wall, 2), "prompt_tokens": prompt, "output_tokens": out_tok,
        "cached_tokens": cached, "ideal_cached_tokens": ideal,
        "hit_rate": r3(cached / prompt) if prompt else None,
        "ideal_hit_rate": r3(ideal / prompt) if prompt else None,
        "server_hit_rate": r3((h + eh) / q) if q else None,
        "server_gpu_hit_rate": r3(h / q) if q else None,
        "server_offload_hit_rate": r3(eh / q) if q else None,
        "output_tok_s": round(out_tok / wall, 1) if wall else None,
        "total_tok_s": round((prompt + out_tok) / wall, 1) if wall else None,
        "prefill_computed_tok_s": round((prompt - cached) / wall, 1) if wall else None,
        "turns_per_s": round(len(ok) / wall, 3) if wall else None,
        "ttft_ms_mean": round(sum(ttft) / len(ttft), 1) if ttft else None,
        "ttft_ms_p50": r3(pct(ttft, 50)), "ttft_ms_p99": r3(pct(ttft, 99)),
        "latency_s_p50": r3(pct([t["latency_s"] for t in ok], 50)),
        "prompt_len_mean": round(prompt / len(ok), 1) if ok else None,
        "prompt_len_max": max((t["prompt_len"] for t in ok), default=None),
        "preemptions": int(d.get("vllm:num_preemptions", 0)),
        "server_counters_delta": {k: v for k, v in d.items() if v},
        "errors": [t.get("error") or t["status"] for t in turns
                   if t["status"] != "completed"][:5],
        # one list per completed turn, in the order of TURN_FIELDS
        "turns": [[t[k] if k not in ("ttft_s", "latency_s") or t[k] is None
                   else round(t[k], 4) for k in TURN_FIELDS]
                  for t in sorted(ok, key=lambda t: t["t_send_s"])],
    }


# ---------------------------------------------------------------- plot
def combine(parts: list[dict], files: list[str]) -> dict:
    """Servers and rows of several results of the same workload on the same GPU model; a
    later file's (dtype, offload, concurrency) row replaces an earlier file's."""
    for k in ("workload_sha256_16", "device"):
        if len({r[k] for r in parts}) != 1:
            raise SystemExit(f"--combine: the results differ in {k}")
    rows: dict[tuple, dict] = {}
    for r in parts:
        for x in r["rows"]:
            rows[(x["kv_dtype"], x["offload"], x.get("concurrency"))] = x
    dates = sorted({r["date"] for r in parts})
    return {**parts[0], "combined_from": [str(f) for f in files],
            "date": dates[0] if len(dates) == 1 else f"{dates[0]} .. {dates[-1]}",
            "servers": [x for r in parts for x in r["servers"]],
            "rows": list(rows.values()),
            "args": {**parts[0]["args"], "offload": sorted(
                {o for r in parts for o in r["args"]["offload"]})}}


def plot(res: dict, png: Path) -> None:
    plt = common.pyplot()
    rows = [r for r in res["rows"] if r.get("turns_completed")]
    series: dict[tuple, list] = {}
    for r in rows:
        series.setdefault((r["kv_dtype"], r["offload"]), []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    panels = [("hit_rate", "input-token cache hit rate (client)"),
              ("output_tok_s", "output tokens/s"), ("ttft_ms_p50", "p50 TTFT (ms)")]
    colors = {"nvfp4": "tab:green", "fp8": "tab:blue", "auto": "tab:gray"}
    ideal_labelled = False
    for ax, (key, label) in zip(axes, panels):
        for (dt, off), rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in rs], [r[key] for r in rs], marker="o",
                    color=colors.get(dt), linestyle="--" if off == "on" else "-",
                    label=f"{'bf16' if dt == 'auto' else dt}" + (" + host offload"
                                                                 if off == "on" else ""))
            if key == "hit_rate":  # the same turns with nothing ever evicted
                ax.plot([r["concurrency"] for r in rs], [r["ideal_hit_rate"] for r in rs],
                        color=colors.get(dt), linestyle=":", linewidth=0.8,
                        label=None if ideal_labelled else "ideal: nothing evicted")
                ideal_labelled = True
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.set_xlabel("concurrency (sessions in flight)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if key == "hit_rate":
            ax.set_ylim(0, 1)
    if rows:
        axes[0].legend(fontsize=8)
    a = res["args"]
    fig.suptitle(f"multi-turn replay, {res['device']}, {res['model_label']}, KV budget "
                 f"{a['kv_cache_memory_bytes'] / 2**20:,.0f} MiB"
                 + (f", host tier {a['offload_gib']} GiB" if any(
                     r["offload"] == "on" for r in rows) else "")
                 + f" ({res['date']})", fontsize=10)
    fig.tight_layout()
    common.save_figure(fig, png, dpi=110)
    plt.close(fig)


def print_table(res: dict) -> None:
    print(f"\n{'kv':>6} {'offl':>4} {'C':>3} {'turns':>5} {'hit':>6} {'ideal':>6} {'srv':>6} "
          f"{'out tok/s':>9} {'tot tok/s':>9} {'TTFT p50':>9} {'p99':>8} {'preempt':>7}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['kv_dtype']:>6} {r['offload']:>4} {r.get('concurrency', '-')!s:>3} "
                  f"error: {r['error'][-200:]}")
            continue
        f = (lambda x, s="{:.3f}": s.format(x) if x is not None else "-")
        print(f"{r['kv_dtype']:>6} {r['offload']:>4} {r['concurrency']:>3} "
              f"{r['turns_completed']:>5} {f(r['hit_rate']):>6} {f(r['ideal_hit_rate']):>6} "
              f"{f(r['server_hit_rate']):>6} {f(r['output_tok_s'], '{:.0f}'):>9} "
              f"{f(r['total_tok_s'], '{:.0f}'):>9} {f(r['ttft_ms_p50'], '{:.0f}'):>9} "
              f"{f(r['ttft_ms_p99'], '{:.0f}'):>8} {r['preemptions']:>7}")


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: GPU Llama-3-8B shape with dummy "
                    "weights and SmolLM2's tokenizer, as serve_bench.py; CPU SmolLM2-135M)")
    ap.add_argument("--dtypes", nargs="+", help="KV cache dtypes; default fp8 nvfp4 (GPU), "
                    "auto nvfp4 (CPU: vLLM's CPU FP8 KV cache needs AMX)")
    ap.add_argument("--offload", nargs="+", choices=["off", "on"], default=["off"],
                    help="without / with KV offloading to host memory (--kv-offloading-size)")
    ap.add_argument("--offload-gib", type=float, help="host tier per server, GiB; default 8 "
                    "(GPU) / 0.05 (CPU)")
    ap.add_argument("--concurrency", nargs="+", type=int,
                    help="sessions in flight; default 2 8 16 (GPU) / 1 4 (CPU)")
    ap.add_argument("--rounds", type=int,
                    help="a point replays the first min(S, rounds x C) sessions (default 3 "
                         "GPU / 2 CPU)")
    ap.add_argument("--duration-s", type=float,
                    help="per point: no turn starts after this (default 25 GPU, 0 = none CPU)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="KV cache budget, the same for every dtype; default 8 GiB (GPU: "
                         "131K FP8 / 233K NVFP4 tokens of Llama-3-8B, ~4 / ~7 histories of "
                         "32K) / 48 MiB (CPU: 2.2K BF16 / 7.8K NVFP4 tokens of SmolLM2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, help="default max(--concurrency)")
    ap.add_argument("--workload", help="JSONL to replay; written from the generator when it "
                    "does not exist (default: OUT with suffix .workload.jsonl)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int, help="S (default 48 GPU / 8 CPU)")
    ap.add_argument("--max-history", type=int, help="tokens (default 32768 GPU / 1536 CPU)")
    ap.add_argument("--max-turns", type=int)
    ap.add_argument("--reply", type=int, nargs=2, metavar=("LO", "HI"),
                    help="reply length range K (default 64 192 GPU / 4 8 CPU)")
    ap.add_argument("--sizes", choices=["auto", "gpu", "cpu"], default="auto",
                    help="which defaults (workload, budget, concurrencies): the device's, "
                         "or e.g. gpu to write the GPU workload on a CPU machine")
    ap.add_argument("--workload-only", action="store_true", help="write the workload, exit")
    ap.add_argument("--plot-only", action="store_true", help="re-plot --out, exit")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="join the rows of these "
                    "results (same workload; a later file's (dtype, offload) pairs replace an "
                    "earlier's) into --out and plot it; starts no server")
    ap.add_argument("--request-timeout-s", type=float, default=600)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop starting servers/points once this much wall time has passed")
    ap.add_argument("--port", type=int, default=8014)
    ap.add_argument("--out", default="evals/results/multiturn.json")
    args = ap.parse_args()
    t_begin = time.time()
    out = Path(args.out)
    if args.plot_only or args.combine:
        offline_report(out, args.combine, combine, plot, print_table)
        return

    import torch
    on_gpu = torch.cuda.is_available()

    big = args.sizes == "gpu" or (args.sizes == "auto" and on_gpu)

    def gc(g, c):  # the GPU or the CPU default
        return g if big else c

    dummy = args.model is None and on_gpu
    model = assets.serving_model(args.model, on_gpu)
    cfg = json.loads((Path(model) / "config.json").read_text())
    args.dtypes = args.dtypes or gc(["fp8", "nvfp4"], ["auto", "nvfp4"])
    args.concurrency = args.concurrency or gc([2, 8, 16], [1, 4])
    args.offload_gib = args.offload_gib or gc(8.0, 0.05)
    args.duration_s = args.duration_s if args.duration_s is not None else gc(25.0, 0.0)
    args.rounds = args.rounds or gc(3, 2)
    args.kv_cache_memory_bytes = args.kv_cache_memory_bytes or gc(8 << 30, 48 << 20)
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)

    # workload
    p = dict(gc(GPU_WORKLOAD, CPU_WORKLOAD))
    for k in ("sessions", "max_history", "max_turns"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    if args.reply:
        p["reply"] = tuple(args.reply)
    wpath = Path(args.workload) if args.workload else out.with_suffix(".workload.jsonl")
    if wpath.exists() and not args.workload_only:
        w = read_workload(wpath)
        print(f"replaying {wpath}")
    else:
        w = make_workload(args.seed, cfg["vocab_size"], p)
        write_workload(w, wpath)
        print(f"wrote {wpath}")
    w_sha = hashlib.sha256(wpath.read_bytes()).hexdigest()[:16]
    stats = workload_stats(w)
    print("workload:", json.dumps(stats))
    if args.workload_only:
        return
    max_model_len = w["header"]["params"]["max_history"]
    if stats["prompt_len_max"] > max_model_len:
        raise SystemExit("workload prompts exceed its max_history")

    import vllm
    res = {"device": common.device_name(on_gpu), "vllm": vllm.__version__, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model,
           "model_label": "Llama-3-8B shape, dummy weights" if dummy else Path(model).name,
           "workload": str(wpath), "workload_sha256_16": w_sha, "workload_stats": stats,
           "workload_params": w["header"]["params"], "args": vars(args),
           "kv_bytes_per_token": {d: assets.kv_bytes_per_token(cfg, d) for d in ("auto", "fp8",
                                                                          "nvfp4")},
           "turn_fields": TURN_FIELDS, "run": common.run_info(on_gpu), "servers": [], "rows": []}
    def save():
        common.write_json(out, res)

    for off in args.offload:
        for dt in args.dtypes:
            if args.budget_s and time.time() - t_begin > args.budget_s:
                res["servers"].append({"kv_dtype": dt, "offload": off,
                                       "skipped": "out of --budget-s"})
                continue
            extra = ["--max-model-len", str(max_model_len), "--block-size",
                     str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
                     "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
                     "--enable-prompt-tokens-details"]
            extra += ["--gpu-memory-utilization", "0.9"] if on_gpu else ["--enforce-eager"]
            if dummy:
                extra += ["--load-format", "dummy"]
            if off == "on":
                extra += ["--kv-offloading-size", str(args.offload_gib),
                          "--kv-offloading-backend", "native"]
            env = dict(os.environ) if on_gpu else cpu_env()
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the byte budget
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between points
            cmd = serve_cmd(model, dt, args.port, *extra)
            log = out.with_name(f"{out.stem}.{dt}_offload-{off}.log")
            srv = {"kv_dtype": dt, "offload": off, "cmd": " ".join(cmd[2:]), "log": str(log)}
            res["servers"].append(srv)
            try:
                with Server(cmd, log, env) as s:
                    srv["startup_s"] = s.startup_s
                    _, info = metrics(args.port)
                    srv["kv_cache_size_tokens"] = int(info.get("kv_cache_size_tokens") or 0)
                    srv["num_gpu_blocks"] = info.get("num_gpu_blocks")
                    for ci, c in enumerate(args.concurrency):
                        if args.budget_s and time.time() - t_begin > args.budget_s:
                            srv.setdefault("points_skipped", []).append(c)
                            continue
                        row = {"kv_dtype": dt, "offload": off, "concurrency": c,
                               "kv_cache_size_tokens": srv["kv_cache_size_tokens"]}
                        row["prefix_cache_reset"] = reset_prefix_cache(args.port)
                        m0, _ = metrics(args.port)
                        n = min(len(w["sessions"]), args.rounds * c)
                        r = run_point(args.port, w["sessions"][:n], c,
                                      f"{w_sha}-{dt}-{off}-c{c}-{ci}", args)
                        time.sleep(1.5)  # let the server's stats logger publish the last step
                        m1, _ = metrics(args.port)
                        row.update(sessions=n, **summarize(r, m0, m1))
                        res["rows"].append(row)
                        print(f"{dt} offload={off} C={c}: {row['turns_completed']} turns, hit "
                              f"{row['hit_rate']} (ideal {row['ideal_hit_rate']}), "
                              f"{row['output_tok_s']} out tok/s, TTFT p50 "
                              f"{row['ttft_ms_p50']} ms", flush=True)
                        save()
                srv["startup_log"] = s.startup_lines() + [
                    x for x in log.read_text(errors="replace").splitlines()
                    if "offload" in x.lower() and ("INFO" in x or "WARN" in x)][:8]
                srv["errors_in_log"] = s.serving_errors()
            except Exception as e:  # noqa: BLE001 - record it, go on with the next server
                srv["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"[:400]
                # the root cause: the first logged exception (later ones wrap it)
                cause = [x for x in log.read_text(errors="replace").splitlines()
                         if re.search(r"\b\w*(Error|Exception): ", x) and "WARNING" not in x
                         ] if log.exists() else []
                srv["error_cause"] = cause[0][-400:] if cause else None
                res["rows"].append({"kv_dtype": dt, "offload": off,
                                    "error": srv["error_cause"] or srv["error"][-400:]})
            save()
    save()
    report(res, out, plot, print_table)


if __name__ == "__main__":
    main()
