"""Where a decode step's GPU time goes, per KV dtype: vLLM's engine in this process (dummy
Llama-3-8B-shaped weights, 8 layers), `batch` sequences of `ctx` prompt tokens prefilled
first (engine stepped by hand), then `steps` pure decode steps of all of them under
torch.profiler; prints the kernels that take the most
GPU time per step, grouped by name, for each dtype. Answers "the attention kernel is x% of a
step and what else the NVFP4 path adds" (the writer, the split-KV reduce, ...). Before the
profiled steps, as many pure decode steps are timed by wall clock (host work included: the
decode throughput a server sees at this batch); the GPU's idle time between kernels is
recorded too (gpu_gaps).

    python -P -m evals.profile_step --dtypes fp8 nvfp4 --batch 16 --ctx 8192 \\
        --out evals/results/profile_step_h200.json

With --prefill-chunk N it profiles the prefill instead: `batch` prompts of `ctx` tokens
prefilled in chunks of N tokens per step (max_num_batched_tokens), the GPU time of the whole
prefill by kernel, its wall time (profiled, and again unprofiled), and where the GPU sat
idle between kernels (gpu_gaps: host time it could not hide, by the kernels around each
gap). Answers "where does NVFP4's longer chunked prefill (TTFT) go": the workspace gather of
each chunk's cached prefix, attention over it, the writer, host time. Variants as
evals/bench_e2e.py's (nvfp4+fp8ws: the FP8 workspace):

    python -P -m evals.profile_step --dtypes fp8 nvfp4 nvfp4+fp8ws --batch 4 --ctx 32768 \\
        --prefill-chunk 8192 --out evals/results/profile_prefill_h200.json
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import time

from evals import bench_e2e, common

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process


def _kernels(prof, per: float, top: int, key: str = "us_per_step") -> tuple[float, list[dict]]:
    """GPU time of the profiled region's kernels, grouped by name, divided by `per`."""
    import torch
    acc = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:90]] += e.device_time_total if hasattr(e, "device_time_total") \
                else e.cuda_time_total
    acc = collections.Counter({k: v / per for k, v in acc.items()})
    total = sum(v for v in acc.values() if v > 0)
    return total, [{"kernel": k, key: round(v, 1), "share": round(v / total, 4)}
                   for k, v in acc.most_common(top)]


def gpu_gaps(kernels: list[tuple[float, float, str]], top: int) -> dict:
    """Where the GPU waits: kernels [(start_us, end_us, name)] (any streams; overlaps count
    once) -> the span from the first start to the last end, the idle time inside it, and
    the largest idle totals by (kernel before, kernel after) with how often each occurred.
    Idle time between kernels is host time the GPU could not hide (launches, planning,
    synchronisation)."""
    if not kernels:
        return {"span_us": 0.0, "idle_us": 0.0, "top_gaps": []}
    ks = sorted(kernels)
    first, end, before = ks[0][0], ks[0][1], ks[0][2]
    idle, total, count = 0.0, collections.Counter(), collections.Counter()
    for start, stop, name in ks[1:]:
        if start > end:
            idle += start - end
            total[(before, name)] += start - end
            count[(before, name)] += 1
        if stop > end:
            end, before = stop, name
    return {"span_us": round(end - first, 1), "idle_us": round(idle, 1),
            "top_gaps": [{"before": a[:60], "after": b[:60], "us": round(v, 1),
                          "count": count[(a, b)]} for (a, b), v in total.most_common(top)]}


def _kernel_spans(prof) -> list[tuple[float, float, str]]:
    import torch
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profile_prefill(variant: str, batch: int, ctx: int, chunk: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from vllm import SamplingParams
    llm = bench_e2e.engine(variant, ctx + 64, max_num_batched_tokens=chunk)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 31000, (ctx,), generator=g).tolist()}
               for _ in range(batch + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up: every chunk shape once
    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if gpu
                                            else ProfilerActivity.CPU]) as prof, \
            common.sm_clock_mhz() as clock:
        llm.generate(prompts[1:], sp, use_tqdm=False)
        sync()
    wall_s = time.perf_counter() - t0
    total, rows = _kernels(prof, 1.0, top, key="us")
    gaps = gpu_gaps(_kernel_spans(prof), top)
    t0 = time.perf_counter()  # the same prefill again, unprofiled (no prefix caching)
    llm.generate(prompts[1:], sp, use_tqdm=False)
    sync()
    wall_unprofiled_s = time.perf_counter() - t0
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"kv_dtype": variant, "gpu_us_prefill": round(total, 1),
            "wall_s_prefill": round(wall_s, 3),
            "wall_s_prefill_unprofiled": round(wall_unprofiled_s, 3),
            "gpu_idle_us": gaps["idle_us"], "gpu_span_us": gaps["span_us"],
            "sm_clock_mhz": clock, "top_gaps": gaps["top_gaps"], "top": rows}


def profile(kv_dtype: str, batch: int, ctx: int, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from vllm import SamplingParams
    llm = bench_e2e.engine(kv_dtype, ctx + steps + 64)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 31000, (ctx,), generator=g).tolist()}
               for _ in range(batch)]

    def sp(n):
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, detokenize=False,
                              ignore_eos=True)
    llm.generate(prompts, sp(2), use_tqdm=False)  # warm-up: compile, graphs, caches
    # Step the engine by hand: prefill every request (chunked prefill mixes decodes into
    # those steps), then profile only steps that are pure decode of all `batch` requests.
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp(2 * steps + 8))
    started = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    engine.step()  # one more: the step that was in flight when the last prefill ended
    gpu = torch.cuda.is_available()  # on a CPU this only exercises the flow (no kernels)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if gpu
                                            else ProfilerActivity.CPU]) as prof, \
            common.sm_clock_mhz() as clock:
        for _ in range(steps):
            engine.step()
        if gpu:
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    total, rows = _kernels(prof, steps, top)
    gaps = gpu_gaps(_kernel_spans(prof), top)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"kv_dtype": kv_dtype, "gpu_us_per_decode_step": round(total, 1),
            "wall_us_per_decode_step": round(wall_us, 1),
            "gpu_idle_us_per_decode_step": round(gaps["idle_us"] / steps, 1),
            "sm_clock_mhz": clock, "top_gaps": gaps["top_gaps"], "top": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["fp8", "nvfp4"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="profile the prefill in chunks of this many tokens instead")
    ap.add_argument("--out", default="evals/results/profile_step.json")
    args = ap.parse_args()
    res = bench_e2e.results_header(args=vars(args))
    if args.prefill_chunk:
        measure = lambda dt: profile_prefill(  # noqa: E731
            dt, args.batch, args.ctx, args.prefill_chunk, args.top)
    else:
        measure = lambda dt: profile(dt, args.batch, args.ctx, args.steps, args.top)  # noqa: E731
    res["rows"] = common.rows_per_dtype("evals.profile_step", args.dtypes, args.out, measure)
    common.write_json(args.out, res)
    for r in res["rows"]:
        if "error" in r:
            print(f"\n{r['kv_dtype']}: {r['error']}")
            continue
        if args.prefill_chunk:
            print(f"\n{r['kv_dtype']}: {r['gpu_us_prefill'] / 1e3:.1f} ms of GPU time, "
                  f"{r['wall_s_prefill']:.3f} s wall to prefill {args.batch} x {args.ctx} tokens "
                  f"in chunks of {args.prefill_chunk} (8 layers); unprofiled "
                  f"{r['wall_s_prefill_unprofiled']:.3f} s; GPU idle "
                  f"{r['gpu_idle_us'] / 1e3:.1f} ms of its {r['gpu_span_us'] / 1e3:.1f} ms span")
            for gp in r["top_gaps"][:5]:
                print(f"  idle {gp['us']:>8.1f} us x{gp['count']:<4} {gp['before'][:40]} -> "
                      f"{gp['after'][:40]}")
        else:
            print(f"\n{r['kv_dtype']}: {r['gpu_us_per_decode_step']:.0f} us of GPU time per "
                  f"decode step, {r['wall_us_per_decode_step']:.0f} us wall (batch "
                  f"{args.batch}, context {args.ctx}, 8 layers); GPU idle "
                  f"{r['gpu_idle_us_per_decode_step']:.0f} us per step under the profiler")
        if r.get("sm_clock_mhz"):
            c = r["sm_clock_mhz"]
            print(f"  SM clock while profiled: median {c['median']} MHz ({c['min']}-{c['max']}, "
                  f"{c['samples']} samples)")
        for k in r["top"]:
            us = k.get("us_per_step", k.get("us"))
            print(f"  {us:>8.1f} us {100 * k['share']:>5.1f}%  {k['kernel']}")


if __name__ == "__main__":
    main()
