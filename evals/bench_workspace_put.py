"""GPU time of putting a prefill chunk's exact K/V into the chunked-prefill workspace, in the
cache's space (prefill._put_chunk): the put_rows kernel (one launch per side) against the torch
sequence it replaced (nan_to_num, K - mu, the rotation GEMM, index_copy; still the CPU path).
Llama-3-8B KV heads (8 x 128), BF16 chunk; BF16 or FP8 workspace; K centered and rotated as
the defaults do on a model with K outlier channels, or not transformed. Median of CUDA-graph
replays (bench_decode.time_fn: launch overhead, which the kernel also cuts, is not counted).
Writes JSON and a PNG plot.

    python -P -m evals.bench_workspace_put --out evals/results/workspace_put_h100.json
    python -P -m evals.bench_workspace_put --plot-only --out evals/results/workspace_put_h200.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from evals import common
from evals.bench_decode import time_fn
from vllm_nvfp4kv.cache_space import CacheSpace
from vllm_nvfp4kv.prefill import _put_chunk


def bench(tokens: int, heads: int, d: int, transforms: bool, ws_dtype, device) -> dict:
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, heads, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn_like(k)
    space = CacheSpace()
    if transforms:
        space.set_center(torch.randn(heads, d, generator=g).to(device), torch.bfloat16)
        space.reserve_rotation_choice(d, device, torch.bfloat16)
    rows = (torch.arange(tokens) + 3 * tokens).to(device)  # after a prefix of 3x the chunk
    ws_k = torch.zeros(4 * tokens, heads, d, dtype=ws_dtype, device=device)
    ws_v = torch.zeros_like(ws_k)
    div = torch.tensor(1 / 256, device=device) if ws_dtype == torch.float8_e4m3fn else None
    us = {}
    for name, kernel in (("torch", False), ("put_rows", True)):
        us[name] = round(1e3 * time_fn(lambda: _put_chunk(k, v, rows, ws_k, ws_v, space, div,
                                                           div, kernel=kernel), device), 2)
    bytes_moved = 2 * tokens * heads * d * (k.element_size() + ws_k.element_size())
    return {"tokens": tokens, "transforms": transforms, "workspace": str(ws_dtype)[6:],
            **{f"us_{n}": u for n, u in us.items()},
            "speedup": round(us["torch"] / us["put_rows"], 2),
            "put_rows_GBps": round(bytes_moved / us["put_rows"] / 1e3, 1)}


def plot(res: dict, png: str) -> None:
    plt = common.pyplot()
    rows = res["rows"]
    labels = [f"{r['tokens']} tok, {r['workspace']}" + (", K centered+rotated"
                                                         if r["transforms"] else "")
              for r in rows]
    y = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh([i - 0.2 for i in y], [r["us_torch"] for r in rows], 0.4, label="torch ops (before)",
            color="tab:gray")
    ax.barh([i + 0.2 for i in y], [r["us_put_rows"] for r in rows], 0.4, label="put_rows",
            color="tab:green")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us per chunk (K and V), CUDA-graph median")
    ax.legend(fontsize=8)
    ax.set_title(f"Chunk K/V into the prefill workspace ({res['kv_heads']} x "
                 f"{res['head_dim']}), {res['run']['device']}", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, png, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", default="evals/results/workspace_put.json")
    ap.add_argument("--plot-only", action="store_true", help="re-plot --out, exit")
    args = ap.parse_args()
    png = str(Path(args.out).with_suffix(".png"))
    if args.plot_only:
        plot(common.read_json(args.out), png)
        return
    device = torch.device("cuda")
    res = {"kv_heads": 8, "head_dim": 128, "run": common.run_info(True), "rows": []}
    for t in args.tokens:
        for transforms in (True, False):
            for ws in (torch.bfloat16, torch.float8_e4m3fn):
                res["rows"].append(bench(t, 8, 128, transforms, ws, device))
    common.write_json(args.out, res)
    plot(res, png)
    print(f"{res['run']['device']}: us per chunk put (K and V), 8 KV heads x 128")
    print("| tokens | K centered + rotated | workspace | torch | put_rows | speed-up | GB/s |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for r in res["rows"]:
        print(f"| {r['tokens']} | {'yes' if r['transforms'] else 'no'} | {r['workspace']} | "
              f"{r['us_torch']} | {r['us_put_rows']} | {r['speedup']}x | {r['put_rows_GBps']} |")


if __name__ == "__main__":
    main()
