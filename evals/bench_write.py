"""Cache-writer benchmark: what each block-scale rule (NVFP4KV_BLOCK_SCALES: amax6, 4over6,
search) costs the fused quantize-and-write kernel, at a decode step's token count (latency:
one token per sequence) and at prefill sizes (throughput), with and without K centering +
rotation fused into the writer, and (--tokens-per-program) per writer launch shape
(cache_write.tokens_per_program_for picks one by default). Median of CUDA-graph replays
(bench_decode.time_fn); writes JSON and a PNG plot.

    python -P -m evals.bench_write --out evals/results/write_h200.json
    python -P -m evals.bench_write --tokens-per-program 1 2 4 8 --out evals/results/write_bt_h200.json
    python -P -m evals.bench_write --toy     # CPU, Triton interpreter, one tiny shape
    python -P -m evals.bench_write --tokens 8192 --engine-layout   # K/V as a prefill passes them
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __name__ == "__main__" and "--toy" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from evals import common  # noqa: E402
from evals.bench_decode import time_fn  # noqa: E402
from vllm_nvfp4kv.kernels import kv_cache_shape, write_cache  # noqa: E402
from vllm_nvfp4kv.kernels.cache_write import tokens_per_program_for  # noqa: E402
from vllm_nvfp4kv.kernels.format import BLOCK_SCALE_RULES  # noqa: E402


def bench(tokens: int, heads: int, d: int, rule: str, fused: bool, bt: int, device,
          engine_layout: bool = False) -> float:
    """ms per write of `tokens` tokens x `heads` KV heads into random slots of a page pool.
    engine_layout: K and V as vLLM hands them to the writer in a prefill, views into one
    [tokens, (32 + 2 * heads) * d] qkv output (Llama-3-8B: 32 query heads), into consecutive
    slots (one sequence's pages in order)."""
    n = 16
    g = torch.Generator(device="cpu").manual_seed(tokens)
    nb = tokens // n + 1
    cache = torch.zeros(kv_cache_shape(nb, n, heads, d), dtype=torch.uint8, device=device)
    if engine_layout:
        qkv = torch.randn(tokens, (32 + 2 * heads) * d, generator=g).to(device, torch.bfloat16)
        key = qkv[:, 32 * d:(32 + heads) * d].view(tokens, heads, d)
        value = qkv[:, (32 + heads) * d:].view(tokens, heads, d)
        slots = torch.arange(tokens, device=device)
    else:
        key = torch.randn(tokens, heads, d, generator=g).to(device, torch.bfloat16)
        value = torch.randn(tokens, heads, d, generator=g).to(device, torch.bfloat16)
        slots = torch.randperm(nb * n, generator=g)[:tokens].to(device)
    extra = {}
    if fused:  # K - mu and the rotation (behind the per-layer flag) inside the writer
        extra = dict(k_sub=torch.zeros(heads, d, dtype=torch.bfloat16, device=device),
                     rotate_k=torch.ones(1, dtype=torch.int32, device=device))
    # scales as device tensors, as vLLM passes them: a Python float would be copied from the
    # host inside the CUDA-graph capture of time_fn
    one = torch.ones(1, dtype=torch.float32, device=device)
    return time_fn(lambda: write_cache(cache, key, value, slots, one, one, rule,
                                       tokens_per_program=bt, **extra), device)


def plot(res: dict, png: str) -> None:
    plt = common.pyplot()
    shapes = sorted({r["tokens"] for r in res["rows"]})
    tall = 3.2 * max(1, len({r["tokens_per_program"] for r in res["rows"]}) / 2)
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.4 * len(shapes), tall), squeeze=False)
    for ax, t in zip(axes[0], shapes):
        rows = [r for r in res["rows"] if r["tokens"] == t]
        labels = [r["rule"] + (" +fused" if r["fused"] else "") + f" bt{r['tokens_per_program']}"
                  for r in rows]
        ax.barh(labels, [r["us"] for r in rows], color="tab:green")
        ax.set_title(f"{t} tokens x {res['heads']} heads", fontsize=9)
        ax.set_xlabel("us per write")
        ax.invert_yaxis()
    fig.suptitle(f"NVFP4 cache writer by block-scale rule ({res['run']['device']})", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, png, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 2048, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-program", type=int, nargs="+", default=[0],
                    help="writer launch shapes to time (0: the launcher's choice)")
    ap.add_argument("--engine-layout", action="store_true",
                    help="K/V as views of a qkv output, consecutive slots (as in a prefill)")
    ap.add_argument("--toy", action="store_true", help="CPU interpreter, one tiny shape")
    ap.add_argument("--out", default="evals/results/write.json")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.toy
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.toy:
        args.tokens, args.heads = [2], 1
    res = {"heads": args.heads, "head_dim": args.head_dim, "engine_layout": args.engine_layout,
           "run": common.run_info(on_gpu), "rows": []}
    for t in args.tokens:
        bts = sorted({b or tokens_per_program_for(t, args.heads, rule)
                      for b in args.tokens_per_program for rule in BLOCK_SCALE_RULES})
        # the writer is instruction-bound: its time follows the SM clock (profile_step
        # records the clock it gets inside an engine step)
        with common.sm_clock_mhz() as clock:
            for fused in (False, True):
                for bt in bts:
                    for rule in BLOCK_SCALE_RULES:
                        ms = bench(t, args.heads, args.head_dim, rule, fused, bt, device,
                                   args.engine_layout)
                        res["rows"].append({"tokens": t, "rule": rule, "fused": fused,
                                            "tokens_per_program": bt, "us": round(ms * 1e3, 2),
                                            "launcher_default":
                                                bt == tokens_per_program_for(t, args.heads, rule)})
        res.setdefault("sm_clock_mhz", {})[str(t)] = clock
        common.write_json(args.out, res)  # kept if a later size times out
    plot(res, str(Path(args.out).with_suffix(".png")))
    print(f"{res['run']['device']}: us per write ({args.heads} KV heads, D={args.head_dim})")
    print("| tokens | fused K transforms | tokens per program | "
          + " | ".join(BLOCK_SCALE_RULES) + " |")
    print("|---:|---|---:|" + "---:|" * len(BLOCK_SCALE_RULES))
    shapes = dict.fromkeys((r["tokens"], r["fused"], r["tokens_per_program"]) for r in res["rows"])
    for t, fused, bt in shapes:
        us = {r["rule"]: r["us"] for r in res["rows"]
              if (r["tokens"], r["fused"], r["tokens_per_program"]) == (t, fused, bt)}
        print(f"| {t} | {'yes' if fused else 'no'} | {bt} | "
              + " | ".join(f"{us[r]:.1f}" for r in BLOCK_SCALE_RULES) + " |")


if __name__ == "__main__":
    main()
