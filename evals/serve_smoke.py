"""`vllm serve MODEL --kv-cache-dtype nvfp4` on loopback, answered through the OpenAI API.

Starts the server (SmolLM2-135M-Instruct from its package by default), waits for /health,
sends chat requests (some concurrently), checks that greedy answers to identical requests are
identical, and prints the startup lines that show the chosen backend and the KV capacity.
Bounded: a fixed number of requests and a deadline; the server is stopped at the end. GPU
when there is one, CPU otherwise.

    python -P -m evals.serve_smoke --out evals/results/serve_smoke.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path

from evals import assets, common
from evals.server import Server, cpu_env, serve_cmd

QUESTIONS = ["What is the capital of France?", "What is 7 times 6?", "Name a primary color."]


def post(port: int, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct from its package)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=600)
    ap.add_argument("--kv-cache-dtype", default="nvfp4")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--out", default="evals/results/serve_smoke.json")
    args = ap.parse_args()
    model = args.model or str(assets.smollm2())
    import torch
    on_gpu = torch.cuda.is_available()
    extra = ["--max-model-len", "2048", "--block-size", "16"]
    if args.no_prefix_caching:
        extra += ["--no-enable-prefix-caching"]
    if on_gpu:
        extra += ["--gpu-memory-utilization", "0.5"]
    else:
        extra += ["--enforce-eager", "--max-num-seqs", "8"]
    cmd = serve_cmd(model, args.kv_cache_dtype, args.port, *extra)
    res = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
           "cmd": " ".join(cmd[2:])}
    with Server(cmd, Path(args.out).with_suffix(".log"), None if on_gpu else cpu_env(),
                args.deadline_s) as server:
        res["startup_s"] = server.startup_s

        def ask(i):
            q = QUESTIONS[i % len(QUESTIONS)]
            r = post(args.port, {"model": "m", "temperature": 0, "max_tokens": 24,
                                 "messages": [{"role": "user", "content": q}]})
            return q, r["choices"][0]["message"]["content"]

        t1 = time.time()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(ask, range(args.requests)))
        res["requests"] = len(answers)
        res["wall_s"] = round(time.time() - t1, 2)
        by_q = {}
        for q, a in answers:
            by_q.setdefault(q, set()).add(a)
        res["answers"] = {q: sorted(a) for q, a in by_q.items()}
        res["identical_requests_identical_answers"] = all(len(a) == 1 for a in by_q.values())
    res["startup_log"] = server.startup_lines()
    res["errors_in_log"] = server.serving_errors()
    common.write_json(args.out, res)
    print(json.dumps(res, indent=1))
    ok = res["identical_requests_identical_answers"] and not res["errors_in_log"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
