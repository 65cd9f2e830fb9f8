"""Bounded load test of `vllm serve MODEL --kv-cache-dtype nvfp4` on loopback.

N requests through the OpenAI completions API (prompts given as token ids, so their lengths are
exact), with prompt lengths mixed up to the context limit and more requests in flight than the
KV cache holds, so that the scheduler preempts; a fraction are streamed and closed by the
client after a few chunks (aborted mid-stream); some groups of identical greedy requests must
give identical outputs. Checked at the end:

  * every request not aborted completed with exactly max_tokens tokens (ignore_eos);
    aborted ones were closed after their first chunks; no request failed;
  * the server is idle afterwards (vllm:num_requests_running / waiting back to 0);
  * identical greedy requests gave identical token sequences;
  * preemptions happened (vllm:num_preemptions, unless --allow-no-preemption);
  * no ERROR line / traceback in the server log while serving;
  * memory stable: the server's resident memory (process tree) ends within 10% of its median
    over the first quarter of the run, and GPU memory (nvidia-smi, when present) varies by
    less than 2% (vLLM allocates the KV cache up front).

Memory is sampled every --sample-interval-s. Results go to --out (JSON, server log next to it); a
summary table is printed last. Exit status 0 only when every check holds.

    python -P -m evals.soak                               # GPU: 1000 requests, 8K context
    python -P -m evals.soak --requests 30 --max-tokens 12 --out evals/results/soak_cpu.json

By default the server runs with NVFP4KV_PREFILL_FROM_CACHE=1, the setting under which identical
greedy requests are expected to match under prefix caching (evals/RESULTS.md, "Serving
through the OpenAI API"); --exact-prefill serves with the default instead.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from evals import assets, common
from evals.server import (Server, completion_result, cpu_env, prometheus, serve_cmd,
                          sse_events)


# ---------------------------------------------------------------- client
def completion(port: int, body: dict, abort_after: int | None = None,
               timeout: float = 900) -> dict:
    """One /v1/completions request. Streamed when abort_after is not None (the connection is
    closed after that many data chunks) or body["stream"]. Returns what was seen."""
    def read(r, t0):
        if not body.get("stream"):
            out = json.load(r)
            ch = out["choices"][0]
            return {"status": "completed", "finish_reason": ch["finish_reason"],
                    "tokens": out["usage"]["completion_tokens"], "text": ch["text"],
                    "latency_s": round(time.time() - t0, 3)}
        chunks, text, finish, ttft, usage = 0, [], None, None, None
        for ev in sse_events(r):
            if ttft is None:
                ttft = round(time.time() - t0, 3)
            if ev.get("usage"):
                usage = ev["usage"]["completion_tokens"]
            if not ev.get("choices"):
                continue
            for ch in ev["choices"]:
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                return {"status": "aborted", "chunks": chunks, "ttft_s": ttft,
                        "latency_s": round(time.time() - t0, 3)}
        if abort_after is not None:
            return {"status": "error", "error": f"stream ended after {chunks} chunks, before "
                                                "the client could abort it"}
        return {"status": "completed", "finish_reason": finish, "chunks": chunks, "tokens": usage,
                "text": "".join(text), "ttft_s": ttft, "latency_s": round(time.time() - t0, 3)}
    return completion_result(port, body, timeout, read)


def metrics(port: int) -> dict[str, float]:
    """Prometheus counters/gauges of the server, summed over labels (finish reasons kept)."""
    out: dict[str, float] = {}
    for name, labels, val in prometheus(port):
        reason = re.search(r'finished_reason="(\w+)"', labels)
        if reason:
            name += "[" + reason.group(1) + "]"
        out[name] = out.get(name, 0.0) + val
    return out


# ---------------------------------------------------------------- memory sampling
class MemorySampler(threading.Thread):
    """Every interval: GPU memory used (MiB, all GPUs, nvidia-smi) when present, and the
    resident memory (MiB) of the server process and its children."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval, self.samples, self.t0 = pid, interval, [], time.time()
        self.stop = threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def sample(self) -> dict:
        s = {"t_s": round(time.time() - self.t0, 1)}
        try:
            import psutil
            p = psutil.Process(self.pid)
            s["server_rss_mib"] = round(sum(q.memory_info().rss for q in
                                            [p, *p.children(recursive=True)]) / 2 ** 20, 1)
        except Exception:  # noqa: BLE001 - a process may exit between listing and reading
            pass
        if self.smi:
            try:
                out = subprocess.run([self.smi, "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=10).stdout
                s["gpu_used_mib"] = sum(float(x) for x in out.split())
            except Exception:  # noqa: BLE001
                pass
        return s

    def run(self):
        while not self.stop.is_set():
            self.samples.append(self.sample())
            self.stop.wait(self.interval)


# ---------------------------------------------------------------- workload
def plan(args, rng: random.Random, vocab: int) -> list[dict]:
    """The requests, shuffled: identical greedy groups, aborted streams, plain and streamed
    requests. Prompt lengths: uniform in [1, limit], a fifth within 10% of the limit
    (limit = max_model_len - max_tokens)."""
    limit = args.max_model_len - args.max_tokens

    def prompt():
        n = rng.randint(int(0.9 * limit), limit) if rng.random() < 0.2 else rng.randint(1, limit)
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    reqs = []
    for g in range(args.identical_groups):
        p = prompt()
        reqs += [{"kind": "identical", "group": g, "prompt": p}
                 for _ in range(args.identical_copies)]
    n_abort = round(args.abort_fraction * args.requests)
    reqs += [{"kind": "abort", "prompt": prompt(), "abort_after": rng.randint(1, 3)}
             for _ in range(n_abort)]
    while len(reqs) < args.requests:
        reqs.append({"kind": rng.choice(["plain", "stream"]), "prompt": prompt()})
    reqs = reqs[:args.requests]
    rng.shuffle(reqs)
    for i, r in enumerate(reqs):
        r["id"] = i
    return reqs


def run_one(port: int, r: dict, max_tokens: int, temperature: float, seeded: bool) -> dict:
    body = {"model": "m", "prompt": r["prompt"], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0 if r["kind"] == "identical" else temperature}
    if seeded:
        body["seed"] = r["id"]
    if r["kind"] in ("stream", "abort"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    res = completion(port, body, r.get("abort_after"))
    return {k: v for k, v in r.items() if k != "prompt"} | {"prompt_len": len(r["prompt"])} \
        | res


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct from its package)")
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--requests", type=int, help="default 1000 (GPU) / 30 (CPU)")
    ap.add_argument("--concurrency", type=int, help="requests in flight; default 256 (GPU) / "
                    "12 (CPU): above what the KV cache holds, so that preemption happens")
    ap.add_argument("--max-model-len", type=int, help="default 8192 (GPU) / 512 (CPU)")
    ap.add_argument("--max-tokens", type=int, help="per request; default 256 (GPU) / 12 (CPU)")
    ap.add_argument("--max-num-seqs", type=int, help="default 128 (GPU) / 16 (CPU)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="KV cache size; default: 3 x max_model_len tokens of the model on "
                         "CPU, 32 x on GPU (both below what max_num_seqs requests of mixed "
                         "lengths hold at once, so that the scheduler preempts)")
    ap.add_argument("--abort-fraction", type=float, default=0.15)
    ap.add_argument("--identical-groups", type=int, default=3)
    ap.add_argument("--identical-copies", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature of the requests outside identical groups")
    ap.add_argument("--no-seed", action="store_true",
                    help="sample without per-request seeds (always so on the CPU: vLLM 0.26's "
                         "CPU engine dies on a seeded request in a chunked-prefill step, "
                         "'CPU Generator does not use offset')")
    ap.add_argument("--exact-prefill", action="store_true",
                    help="serve with NVFP4KV_PREFILL_FROM_CACHE unset (the default setting)")
    ap.add_argument("--allow-no-preemption", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="nvfp4")
    ap.add_argument("--sample-interval-s", type=float, default=2.0)
    ap.add_argument("--deadline-s", type=float, default=3600,
                    help="server start + all requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="evals/results/soak.json")
    args = ap.parse_args()
    model = args.model or str(assets.smollm2())
    import torch
    on_gpu = torch.cuda.is_available()

    def gpu_cpu(g, c):
        return g if on_gpu else c

    args.requests = args.requests or gpu_cpu(1000, 30)
    args.concurrency = args.concurrency or gpu_cpu(256, 12)
    args.max_model_len = args.max_model_len or gpu_cpu(8192, 512)
    args.max_tokens = args.max_tokens or gpu_cpu(256, 12)
    args.max_num_seqs = args.max_num_seqs or gpu_cpu(128, 16)
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    per_token = assets.kv_bytes_per_token(cfg, "nvfp4")
    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = gpu_cpu(32, 3) * args.max_model_len * per_token

    extra = ["--max-model-len", str(args.max_model_len), "--block-size", "16",
             "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory_bytes:
        extra += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    extra += ["--gpu-memory-utilization", "0.5"] if on_gpu else ["--enforce-eager"]
    cmd = serve_cmd(model, args.kv_cache_dtype, args.port, *extra)
    env = dict(os.environ) if on_gpu else cpu_env()
    if args.kv_cache_memory_bytes:  # VLLM_CPU_KVCACHE_SPACE would override it on the CPU
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if not args.exact_prefill:
        env["NVFP4KV_PREFILL_FROM_CACHE"] = "1"
    rng = random.Random(args.seed)
    reqs = plan(args, rng, vocab)
    log_path = Path(args.out).with_suffix(".log")
    res = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
           "date": time.strftime("%Y-%m-%d"), "cmd": " ".join(cmd[2:]),
           "env": {k: env[k] for k in env if k.startswith("NVFP4KV_")},
           "args": {k: v for k, v in vars(args).items()},
           "kv_bytes_per_token": per_token, "run": common.run_info(on_gpu)}
    t_start = time.time()
    with Server(cmd, log_path, env, args.deadline_s) as server:
        res["startup_s"] = server.startup_s
        sampler = MemorySampler(server.proc.pid, args.sample_interval_s)
        sampler.start()
        m0 = metrics(args.port)
        t1 = time.time()
        results = []
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            futs = [pool.submit(run_one, args.port, r, args.max_tokens, args.temperature,
                                on_gpu and not args.no_seed) for r in reqs]
            for f in concurrent.futures.as_completed(
                    futs, timeout=max(60.0, args.deadline_s - (time.time() - t_start))):
                results.append(f.result())
        res["wall_s"] = round(time.time() - t1, 1)
        # the server must drain: aborted requests released, nothing left running/waiting
        idle, m1 = False, {}
        for _ in range(30):
            m1 = metrics(args.port)
            if m1.get("vllm:num_requests_running", 0) == 0 and \
                    m1.get("vllm:num_requests_waiting", 0) == 0:
                idle = True
                break
            time.sleep(1)
        sampler.stop.set()
        sampler.join()
        res["memory_samples"] = sampler.samples + [sampler.sample()]
    res["startup_log"] = server.startup_lines()
    lines = log_path.read_text(errors="replace").splitlines()
    lines = lines[:next((i for i, x in enumerate(lines) if "[shutdown]" in x), len(lines))]
    errors = [x for x in lines if "ERROR" in x or "Traceback" in x]
    res["server_log_errors"] = len(errors)
    res["server_log_error_lines"] = errors[:10]

    results.sort(key=lambda r: r["id"])
    by_kind = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    not_aborted = [r for r in results if r["kind"] != "abort"]
    bad_completion = [r["id"] for r in not_aborted
                      if r["status"] != "completed" or r.get("tokens") != args.max_tokens
                      or r.get("finish_reason") != "length"]
    bad_abort = [r["id"] for r in by_kind.get("abort", []) if r["status"] != "aborted"]
    groups = {}
    for r in by_kind.get("identical", []):
        groups.setdefault(r["group"], set()).add(r.get("text"))
    kept = ("vllm:num_preemptions", "vllm:request_success", "vllm:prompt_tokens_total",
            "vllm:generation_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
    delta = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1
             if "_created" not in k and k.startswith(kept)}
    preemptions = int(sum(v for k, v in delta.items() if k.startswith("vllm:num_preemptions")))
    rss = [s["server_rss_mib"] for s in res["memory_samples"] if "server_rss_mib" in s]
    gpu = [s["gpu_used_mib"] for s in res["memory_samples"] if "gpu_used_mib" in s]
    early = sorted(rss[:max(1, len(rss) // 4)])
    rss_stable = bool(rss) and rss[-1] <= 1.10 * early[len(early) // 2]
    gpu_stable = not gpu or max(gpu) - min(gpu) <= 0.02 * max(gpu)
    checks = {
        "all_completed_or_aborted_as_asked": not bad_completion and not bad_abort,
        "no_failed_requests": all(r["status"] != "error" for r in results),
        "server_idle_afterwards": idle,
        "identical_greedy_outputs_identical": all(len(v) == 1 for v in groups.values()),
        "preemption_happened": preemptions > 0 or args.allow_no_preemption,
        "no_errors_in_server_log": not errors,
        "memory_stable": rss_stable and gpu_stable,
    }
    res["checks"] = checks
    res["counts"] = {
        "requests": len(results),
        **{f"{k}_requests": len(v) for k, v in sorted(by_kind.items())},
        "completed": sum(r["status"] == "completed" for r in results),
        "aborted_by_client": sum(r["status"] == "aborted" for r in results),
        "errors": sum(r["status"] == "error" for r in results),
        "preemptions": preemptions,
        "prompt_len_max": max(r["prompt_len"] for r in results),
        "prompt_len_mean": round(sum(r["prompt_len"] for r in results) / len(results), 1),
        "identical_groups_diverged": sum(len(v) > 1 for v in groups.values()),
    }
    res["server_metrics_delta"] = delta
    res["bad_completions"], res["bad_aborts"] = bad_completion[:20], bad_abort[:20]
    res["memory"] = {"server_rss_mib_min_max_last": [min(rss), max(rss), rss[-1]] if rss else None,
                     "gpu_used_mib_min_max_last": [min(gpu), max(gpu), gpu[-1]] if gpu else None}
    res["requests"] = [{k: v for k, v in r.items() if k != "text"} for r in results]
    res["identical_group_outputs"] = {g: sorted(v) for g, v in groups.items()}
    common.write_json(args.out, res)

    lat = sorted(r["latency_s"] for r in results if r["status"] == "completed")
    rows = [("device", res["device"]), ("model", Path(model).name),
            ("requests / concurrency", f"{len(results)} / {args.concurrency}"),
            ("max_model_len / max_tokens", f"{args.max_model_len} / {args.max_tokens}"),
            ("KV cache", " ".join(x.split("KV cache size:")[-1].strip()
                                  for x in res["startup_log"] if "KV cache size" in x) or "?"),
            ("completed / aborted / errors", f"{res['counts']['completed']} / "
             f"{res['counts']['aborted_by_client']} / {res['counts']['errors']}"),
            ("preemptions", preemptions),
            ("latency p50 / max (s)", f"{lat[len(lat) // 2]:.1f} / {lat[-1]:.1f}" if lat else "-"),
            ("wall (s)", res["wall_s"]),
            ("server RSS MiB min/max/last", res["memory"]["server_rss_mib_min_max_last"]),
            ("GPU MiB min/max/last", res["memory"]["gpu_used_mib_min_max_last"]),
            ("server log errors", len(errors))]
    rows += [(f"check: {k}", "PASS" if v else "FAIL") for k, v in checks.items()]
    w = max(len(k) for k, _ in rows)
    print(f"\nsoak results -> {args.out}")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    raise SystemExit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
