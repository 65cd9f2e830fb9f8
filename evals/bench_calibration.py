"""GPU cost of online calibration inside CUDA graphs: a full decode graph captured before
calibration holds one guard kernel per layer (vllm_nvfp4kv/calibration.py). Times a graph of
--layers guards per replay once the layers are calibrated (each guard returns at once), and
the one replay that calibrates (flags 0).

    python -P -m evals.bench_calibration      # needs CUDA; no vLLM
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from evals import common
from vllm_nvfp4kv import calibration as cal


def bench(layers: int, batch: int, heads: int, head_dim: int, reps: int = 200) -> dict:
    dev = "cuda"
    k = torch.randn(batch, heads, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.arange(batch, device=dev)
    ls = [SimpleNamespace(_k_scale=torch.ones((), device=dev),
                          _v_scale=torch.ones((), device=dev)) for _ in range(layers)]
    sts = [cal.LayerCalibration("online", dev, True, False, cal.ONLINE_HEADROOM) for _ in ls]

    def step():
        for layer, st in zip(ls, sts):
            cal.guard_update(layer, st, k, v, slots)

    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for st in sts:
        st.flag.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    calibrated = start.elapsed_time(end) / reps * 1e3
    first = []
    for _ in range(10):
        for st in sts:
            st.flag.zero_()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        first.append(start.elapsed_time(end) * 1e3)
    return {"layers": layers, "batch": batch, "kv_heads": heads, "head_dim": head_dim,
            "us_per_replay_calibrated": calibrated,
            "us_calibrating_replay": sorted(first)[len(first) // 2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [bench(args.layers, b, 8, 128) for b in (1, 64, 512)]
    res = {"run": common.run_info(on_gpu=True), "rows": rows}
    for r in rows:
        print(json.dumps(r))
    if args.out:
        common.write_json(args.out, res)


if __name__ == "__main__":
    main()
