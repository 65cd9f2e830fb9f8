"""End-to-end decode throughput through vLLM's engine, BF16 vs FP8 vs NVFP4 KV, same method as
../shared/docs/h200-baselines.md: a Llama-3-8B-shaped model (8 layers, dummy weights), N
requests of a fixed input length; decode time = time(O output tokens) - time(1 output token).
Also records the backend vLLM chose and the KV capacity in tokens.

    python -P -m evals.bench_e2e --out evals/results/e2e_h200.json --inputs 8192 32768

Prefill workspace, BF16 vs FP8 (option `workspace_dtype`): with a small token budget every
chunk after the first attends over the cached prefix through the workspace, so the prefill
time of long prompts measures the gather + attention path of each workspace dtype:

    python -P -m evals.bench_e2e --dtypes fp8 nvfp4 nvfp4+fp8ws --inputs 32768 \\
        --max-num-batched-tokens 2048 --output-tokens 2 --requests 8

What the accuracy options cost (each variant a fresh engine process; "+" joins options):

    python -P -m evals.bench_e2e --dtypes fp8 nvfp4 nvfp4+norot nvfp4+4o6 nvfp4+amax6 nvfp4+norot+amax6

Other architectures (#35): --model names a folder of evals/models (or any folder with a
config.json; dummy weights). --ttft-reps N adds the time to first token of one request alone
on the idle engine (median of N) at each input length:

    python -P -m evals.bench_e2e --model qwen3-next-8layers --inputs 32768 --ttft-reps 3

One engine start per file (what a cut run leaves survives), then joined into one table:

    python -P -m evals.bench_e2e --join e2e_fp8.json e2e_nvfp4.json --out e2e.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from evals import common

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MODEL = common.LLAMA3_8B_8LAYERS


def model_folder(name: str | None) -> Path:
    """--model: a folder of evals/models by name, or a path to a folder with a config.json."""
    if not name:
        return MODEL
    path = common.MODELS / name if (common.MODELS / name).is_dir() else Path(name)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name}: no config.json there (evals/models holds "
                         f"{sorted(p.name for p in common.MODELS.iterdir())})")
    return path


def results_header(model: Path = MODEL, **fields) -> dict:
    """How a result of the dummy-weight engine runs (this script, profile_step.py) begins:
    common.results_header with the model and its layer count before fields."""
    cfg = common.read_json(model / "config.json")
    name = ("Llama-3-8B-shaped, 8 layers" if model == MODEL else
            f"{cfg['architectures'][0]} shape ({model.name})")
    return common.results_header(model=f"{name}, dummy weights",
                                 layers=cfg["num_hidden_layers"], **fields)


# variant suffixes of nvfp4 -> the plugin's options (vllm_nvfp4kv.config.NvFp4KVConfig)
OPTIONS = {"fp8ws": ("workspace_dtype", "fp8"),  # FP8 prefill workspace
           "norot": ("rotate_k", "0"),           # no Hadamard rotation of K
           "4o6": ("block_scales", "4over6"),    # 4-over-6 block scales, not search
           "amax6": ("block_scales", "amax6"),   # plain amax/6 block scales
           # the decode split count and tile size before 2026-12-06 (a benchmark-only knob)
           "per_sm8": ("decode_variant", "per_sm8")}


def parse_variant(variant: str) -> tuple[str, dict]:
    """variant: a kv_cache_dtype, or nvfp4 with options: "nvfp4+norot+amax6" (OPTIONS).
    Returns (kv_cache_dtype, the options for additional_config["nvfp4kv"])."""
    kv_dtype, *opts = variant.split("+")
    return kv_dtype, dict(OPTIONS[opt] for opt in opts)


def engine(variant: str, max_model_len: int, gpu_memory_utilization: float = 0.85,
           model: Path = MODEL, additional_config: dict | None = None, **extra):
    """vLLM in this process (dummy weights, a model folder) for a kv_cache_dtype, or nvfp4
    with options (parse_variant; given to the engine as additional_config, beside the
    engine's other additional_config entries)."""
    from vllm import LLM
    kv_dtype, options = parse_variant(variant)
    config = dict(additional_config or {}, **({"nvfp4kv": options} if options else {}))
    return LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True,
               dtype="bfloat16", kv_cache_dtype=kv_dtype,
               max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
               enable_prefix_caching=False, seed=0, additional_config=config, **extra)


def run(variant: str, inputs: list[int], n: int, out_tokens: int, gpu_util: float,
        max_batched: int | None = None, model: Path = MODEL, ttft_reps: int = 0,
        max_seqs: int | None = None, additional_config: dict | None = None) -> dict:
    """variant: as parse_variant."""
    import statistics

    import torch
    from vllm import SamplingParams
    kv_dtype = variant.split("+")[0]
    t0 = time.time()
    extra = dict(max_num_batched_tokens=max_batched) if max_batched else {}
    if max_seqs:
        extra["max_num_seqs"] = max_seqs
    llm = engine(variant, max(inputs) + out_tokens + 16, gpu_util, model, additional_config,
                 **extra)
    cfg = llm.llm_engine.vllm_config.cache_config
    # hybrid models: vLLM's attention block (block_size) may hold several kernel pages
    row = {"kv_dtype": variant, "startup_s": round(time.time() - t0, 1),
           "kv_capacity_tokens": cfg.num_gpu_blocks * cfg.block_size,
           "num_gpu_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
           "attention_backends": attention_backends(llm), "inputs": {}}
    g = torch.Generator().manual_seed(0)
    for length in inputs:
        prompts = [{"prompt_token_ids": torch.randint(3, 31000, (length,), generator=g).tolist()}
                   for _ in range(n)]
        times = {}
        # untimed pass: Triton JIT, graph warm-up and allocator growth are not prefill time
        llm.generate(prompts, SamplingParams(max_tokens=2, detokenize=False, ignore_eos=True),
                     use_tqdm=False)
        for m in (1, out_tokens):
            sp = SamplingParams(max_tokens=m, min_tokens=m, temperature=0, detokenize=False,
                                ignore_eos=True)
            t = time.time()
            llm.generate(prompts, sp, use_tqdm=False)
            times[m] = time.time() - t
        decode_s = times[out_tokens] - times[1]
        row["inputs"][length] = {"prefill_s": round(times[1], 3), "decode_s": round(decode_s, 3),
                                 "decode_tok_per_s": round(n * (out_tokens - 1) / decode_s, 1)}
        if ttft_reps:  # one request alone on the idle engine: its time to the first token
            one = SamplingParams(max_tokens=1, detokenize=False, ignore_eos=True)
            ttft = []
            for _ in range(ttft_reps):
                t = time.time()
                llm.generate(prompts[:1], one, use_tqdm=False)
                ttft.append(time.time() - t)
            row["inputs"][length]["ttft_s"] = round(statistics.median(ttft), 4)
        print(kv_dtype, length, row["inputs"][length], flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def attention_backends(llm) -> dict[str, int] | None:
    """Layers per attention backend (name -> count) in this process's engine; None where the
    model runs in another process."""
    try:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    except AttributeError:
        return None
    names = {}
    for layer in ctx.values():
        impl = getattr(layer, "impl", None)
        if impl is not None:
            key = type(impl).__name__
            names[key] = names.get(key, 0) + 1
    return names or None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="evals/results/e2e.json")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "nvfp4"])
    ap.add_argument("--inputs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=257)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="token budget per step (small: long prompts prefill in chunks)")
    ap.add_argument("--model", help="a folder of evals/models by name, or a path to a folder "
                    "with a config.json (default llama3-8b-8layers)")
    ap.add_argument("--ttft-reps", type=int, default=0,
                    help="also time N single requests alone at each input length (TTFT)")
    ap.add_argument("--max-num-seqs", type=int,
                    help="engine's (default vLLM's; fewer: fewer CUDA graphs to capture)")
    ap.add_argument("--additional-config", type=json.loads, default=None,
                    help="the engine's additional_config (JSON), e.g. '{\"gdn_prefill_backend\": "
                         "\"triton\"}' for Qwen3-Next on a GPU without FlashInfer's GDN kernel")
    ap.add_argument("--join", nargs="+", metavar="JSON",
                    help="join the rows of these results into --out, print the table; no "
                         "engine")
    args = ap.parse_args()
    if args.join:
        parts = [common.read_json(f) for f in args.join]
        res = {**parts[0], "rows": [r for p in parts for r in p["rows"]], "joined": args.join}
        common.write_json(args.out, res)
        print_table(res["rows"], sorted({int(i) for r in res["rows"]
                                         for i in r.get("inputs", {})}))
        return
    model = model_folder(args.model)
    res = results_header(model, requests=args.requests, output_tokens=args.output_tokens,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_num_seqs=args.max_num_seqs,
                         additional_config=args.additional_config)

    def measure(dt):
        try:
            return run(dt, args.inputs, args.requests, args.output_tokens,
                       args.gpu_memory_utilization, args.max_num_batched_tokens, model,
                       args.ttft_reps, args.max_num_seqs, args.additional_config)
        except Exception as e:  # noqa: BLE001 - record the failure, keep the other dtypes
            print(dt, "failed:", e, flush=True)
            return {"kv_dtype": dt, "error": f"{type(e).__name__}: {e}"[:500]}
    res["rows"] = common.rows_per_dtype("evals.bench_e2e", args.dtypes, args.out, measure)
    common.write_json(args.out, res)
    print_table(res["rows"], args.inputs)


def print_table(rows: list[dict], inputs: list[int]) -> None:
    """Per dtype: start-up, capacity, and per input length decode tok/s, the batch's prefill
    time and (with --ttft-reps) one request's TTFT; ratios against fp8 where it ran."""
    def at(row, length):  # JSON read back has string keys
        return row["inputs"].get(length) or row["inputs"].get(str(length))
    base = next((r for r in rows if r["kv_dtype"] == "fp8" and "error" not in r), None)
    print(f"{'kv':>12} {'start s':>8} {'capacity':>10} {'x fp8':>6} "
          + " ".join(f"{'in' + str(i):>36}" for i in inputs))
    for r in rows:
        if "error" in r:
            print(f"{r['kv_dtype']:>12} error: {r['error'][:100]}")
            continue
        cap_x = f"{r['kv_capacity_tokens'] / base['kv_capacity_tokens']:.2f}" if base else "-"
        cells = []
        for i in inputs:
            c = at(r, i)
            if not c:
                continue
            b = base and at(base, i)
            x = f"({c['decode_tok_per_s'] / b['decode_tok_per_s']:.2f}x)" if b else ""
            ttft = f" ttft {c['ttft_s']:.3f}s" if "ttft_s" in c else ""
            cells.append(f"{c['decode_tok_per_s']:>8} tok/s{x} {c['prefill_s']:.1f}s{ttft}")
        print(f"{r['kv_dtype']:>12} {r.get('startup_s', 0):>8} {r['kv_capacity_tokens']:>10} "
              f"{cap_x:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
