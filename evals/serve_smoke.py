"""`vllm serve MODEL --kv-cache-dtype nvfp4` on loopback, answered through the OpenAI API.

Starts the server (SmolLM2-135M-Instruct from its package by default), waits for /health,
sends chat requests (some concurrently), checks that greedy answers to identical requests are
identical, and prints the startup lines that show the chosen backend and the KV capacity.
Bounded: a fixed number of requests and a deadline; the server is stopped at the end. GPU
when there is one, CPU otherwise.

    python evals/serve_smoke.py --out evals/results/serve_smoke.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    model = args.model or str(__import__("assets").smollm2())
    import torch
    on_gpu = torch.cuda.is_available()
    env = dict(os.environ)
    # the OpenAI server module `vllm serve` runs (the `vllm` CLI itself needs the dist named
    # "vllm", which vLLM's CPU build is not)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--kv-cache-dtype", args.kv_cache_dtype, "--port", str(args.port), "--host", "127.0.0.1",
           "--max-model-len", "2048", "--block-size", "16", "--served-model-name", "m"]
    if args.no_prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    if on_gpu:
        cmd += ["--gpu-memory-utilization", "0.5"]
    else:
        env.update(TORCHDYNAMO_DISABLE="1", VLLM_CPU_KVCACHE_SPACE="1")
        cmd += ["--enforce-eager", "--max-num-seqs", "8"]
    log_path = Path(args.out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline_s
    res = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
           "cmd": " ".join(cmd[2:])}
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            t0 = time.time()
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"server exited ({server.returncode}); see {log_path}")
                if time.time() > deadline:
                    raise SystemExit("server did not become healthy before the deadline")
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                    break
                except OSError:
                    time.sleep(2)
            res["startup_s"] = round(time.time() - t0, 1)

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
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    lines = log_path.read_text().splitlines()
    res["startup_log"] = [x for x in lines if "CUSTOM" in x or "NVFP4 KV cache" in x
                          or "KV cache size" in x]
    # errors while serving (SIGTERM at the end makes the client log an EngineDeadError)
    serving = lines[:next((i for i, x in enumerate(lines) if "[shutdown]" in x), len(lines))]
    res["errors_in_log"] = [x for x in serving if "ERROR" in x or "Traceback" in x][:10]
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    ok = res["identical_requests_identical_answers"] and not res["errors_in_log"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
