"""`vllm serve --kv-cache-dtype {nvfp4, fp8, auto}` + `vllm bench serve` (random prompts of a
fixed length) on loopback, one server per KV dtype in turn, on one GPU: throughput, TTFT and
TPOT from vLLM's own benchmark client, plus each server's startup lines (backend, capacity).

Default model: Llama-3-8B-shaped (evals/models/llama3-8b: 32 layers, 32 q / 8 kv heads, D=128)
with dummy weights and SmolLM2's tokenizer (the API and the benchmark client need one and no
Llama-3 tokenizer is available offline), its vocabulary size set to the tokenizer's.

    python evals/serve_bench.py --input-len 8192 --output-len 256 --num-prompts 64 \\
        --max-concurrency 32 --out evals/results/serve_bench_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from server import Server, serve_cmd  # noqa: E402


def llama8b_with_tokenizer() -> Path:
    """evals/models/llama3-8b config + SmolLM2 tokenizer files, in the assets cache."""
    import assets
    tok = assets.smollm2()
    out = assets.CACHE / "llama3-8b-shape-smollm2-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((HERE / "models" / "llama3-8b" / "config.json").read_text())
    tcfg = json.loads((tok / "config.json").read_text())
    cfg.update(vocab_size=tcfg["vocab_size"], bos_token_id=tcfg["bos_token_id"],
               eos_token_id=tcfg["eos_token_id"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def bench(port: int, tokenizer: str, args) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    p = FlexibleArgumentParser()
    add_cli_args(p)
    a = p.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
        "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
        "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"])
    r = main(a)
    keep = ("completed", "duration", "request_throughput", "output_throughput",
            "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms")
    return {k: r[k] for k in keep if k in r}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: Llama-3-8B shape, see above)")
    ap.add_argument("--dtypes", nargs="+", default=["nvfp4", "fp8"],
                    help="KV cache dtypes; nvfp4+fp8ws = nvfp4 with the FP8 prefill workspace")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--out", default="evals/results/serve_bench.json")
    args = ap.parse_args()
    import torch
    import vllm
    dummy = args.model is None
    model = str(args.model or llama8b_with_tokenizer())
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "vllm": vllm.__version__,
           "torch": torch.__version__, "model": model if not dummy else
           "Llama-3-8B shape, dummy weights, SmolLM2 tokenizer", "args": vars(args), "rows": []}
    out = Path(args.out)
    for name in args.dtypes:
        # "nvfp4+fp8ws": the NVFP4 cache with the FP8 E4M3 prefill workspace
        dt, env = name, None
        if name == "nvfp4+fp8ws":
            dt, env = "nvfp4", {**os.environ, "NVFP4KV_WORKSPACE_DTYPE": "fp8"}
        extra = ["--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching",
                 "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if dummy:
            extra += ["--load-format", "dummy"]
        row = {"kv_dtype": name}
        try:
            with Server(serve_cmd(model, dt, args.port, *extra),
                        out.with_name(f"{out.stem}_{name}.log"), env) as s:
                row["startup_s"] = s.startup_s
                row.update(bench(args.port, model, args))
            row["startup_log"] = s.startup_lines()
            row["errors_in_log"] = s.serving_errors()
        except Exception as e:  # noqa: BLE001 - record it, go on with the next dtype
            row["error"] = f"{type(e).__name__}: {e}"[-1500:]
        res["rows"].append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
    print(f"{'kv':>6} {'out tok/s':>10} {'req/s':>7} {'TTFT ms':>9} {'TPOT ms':>9}  startup")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['kv_dtype']:>6} error: {r['error'][-300:]}")
            continue
        print(f"{r['kv_dtype']:>6} {r['output_throughput']:>10.0f} {r['request_throughput']:>7.2f} "
              f"{r['median_ttft_ms']:>9.0f} {r['median_tpot_ms']:>9.1f}  {r['startup_s']} s")


if __name__ == "__main__":
    main()
