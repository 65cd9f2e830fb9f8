"""Cache-writer benchmark: what each block-scale rule (NVFP4KV_BLOCK_SCALES: amax6, 4over6,
search) costs the fused quantize-and-write kernel, at a decode step's token count (latency:
one token per sequence) and at prefill sizes (throughput), with and without K centering +
rotation fused into the writer. Median of CUDA-graph replays (bench_decode.time_fn); writes
JSON and a PNG plot.

    python evals/bench_write.py --out evals/results/write_h200.json
    python evals/bench_write.py --toy        # CPU, Triton interpreter, one tiny shape
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__" and "--toy" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import assets  # noqa: E402
from bench_decode import time_fn  # noqa: E402

from vllm_nvfp4kv.kernels import kv_cache_shape, write_cache  # noqa: E402
from vllm_nvfp4kv.kernels.format import BLOCK_SCALE_RULES  # noqa: E402


def bench(tokens: int, heads: int, d: int, rule: str, fused: bool, device) -> float:
    """ms per write of `tokens` tokens x `heads` KV heads into random slots of a page pool."""
    n = 16
    g = torch.Generator(device="cpu").manual_seed(tokens)
    nb = tokens // n + 1
    cache = torch.zeros(kv_cache_shape(nb, n, heads, d), dtype=torch.uint8, device=device)
    key = torch.randn(tokens, heads, d, generator=g).to(device, torch.bfloat16)
    value = torch.randn(tokens, heads, d, generator=g).to(device, torch.bfloat16)
    slots = torch.randperm(nb * n, generator=g)[:tokens].to(device)
    extra = {}
    if fused:  # K - mu and the rotation (behind the per-layer flag) inside the writer
        extra = dict(k_sub=torch.zeros(heads, d, dtype=torch.bfloat16, device=device),
                     rotate_k=torch.ones(1, dtype=torch.int32, device=device))
    return time_fn(lambda: write_cache(cache, key, value, slots, 1.0, 1.0, rule, **extra),
                   device)


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = sorted({r["tokens"] for r in res["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.2), squeeze=False)
    for ax, t in zip(axes[0], shapes):
        rows = [r for r in res["rows"] if r["tokens"] == t]
        labels = [r["rule"] + (" +fused" if r["fused"] else "") for r in rows]
        ax.barh(labels, [r["us"] for r in rows], color="tab:green")
        ax.set_title(f"{t} tokens x {res['heads']} heads", fontsize=9)
        ax.set_xlabel("us per write")
        ax.invert_yaxis()
    fig.suptitle(f"NVFP4 cache writer by block-scale rule ({res['run']['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 2048, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--toy", action="store_true", help="CPU interpreter, one tiny shape")
    ap.add_argument("--out", default="evals/results/write.json")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.toy
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.toy:
        args.tokens, args.heads = [2], 1
    res = {"heads": args.heads, "head_dim": args.head_dim, "run": assets.run_info(on_gpu),
           "rows": []}
    for t in args.tokens:
        for fused in (False, True):
            for rule in BLOCK_SCALE_RULES:
                ms = bench(t, args.heads, args.head_dim, rule, fused, device)
                res["rows"].append({"tokens": t, "rule": rule, "fused": fused,
                                    "us": round(ms * 1e3, 2)})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    plot(res, str(Path(args.out).with_suffix(".png")))
    print(f"{res['run']['device']}: us per write ({args.heads} KV heads, D={args.head_dim})")
    print("| tokens | fused K transforms | " + " | ".join(BLOCK_SCALE_RULES) + " |")
    print("|---:|---|" + "---:|" * len(BLOCK_SCALE_RULES))
    for t in args.tokens:
        for fused in (False, True):
            us = {r["rule"]: r["us"] for r in res["rows"] if r["tokens"] == t
                  and r["fused"] == fused}
            print(f"| {t} | {'yes' if fused else 'no'} | "
                  + " | ".join(f"{us[r]:.1f}" for r in BLOCK_SCALE_RULES) + " |")


if __name__ == "__main__":
    main()
