"""Greedy generation through the decode path, each KV dtype against BF16 ("auto").

Fidelity (evals/fidelity.py) scores prompts, which only exercises prefill; this script
generates: every new token reads the whole context from the cache through the decode kernel
(on the GPU inside CUDA graphs, unless `+eager`). For each GSM8K question (zero-shot
"Question: ...\\nAnswer:") it records the generated text and how many tokens match the BF16
run before the first difference. A broken decode path shows as near-zero agreement and
garbage text; a sound lossy cache as long common prefixes that drift apart later.

    python -P -m evals.decode_check --model qwen --dtypes auto nvfp4 nvfp4+eager \\
        --out evals/results/decode_check_qwen_h200.json

Dtype tokens: auto, fp8, nvfp4; `+eager` adds enforce_eager (no CUDA graphs, no compile);
`+noscales` runs without the scales file (option scales_file unset over NVFP4KV_SCALES_FILE:
the file's scales and K centering off, the defaults, online K centering included).
"""
from __future__ import annotations

import argparse
import os

from evals import assets, common
from evals.fidelity import gsm8k_rows


def questions(n: int) -> list[str]:
    return [f"Question: {r['question']}\nAnswer:" for r in gsm8k_rows()[:n]]


def generate(model: str, token: str, prompts: list[str], max_tokens: int, on_gpu: bool) -> dict:
    dtype, *flags = token.split("+")
    scales_file = None if "noscales" in flags else os.environ.get("NVFP4KV_SCALES_FILE")
    from vllm import LLM, SamplingParams
    kw = dict(gpu_memory_utilization=0.4, enforce_eager="eager" in flags) if on_gpu else dict(
        kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    if "noscales" in flags:
        kw["additional_config"] = {"nvfp4kv": {"scales_file": None}}
    llm = LLM(model=model, kv_cache_dtype=dtype, max_model_len=2048, block_size=16, seed=0,
              **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                        use_tqdm=False)
    return {"kv_dtype": token, "scales_file": scales_file,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "texts": [o.outputs[0].text for o in outs]}


def agreement(ref: list[list[int]], run: list[list[int]]) -> dict:
    """Tokens equal to the reference before the first difference, per prompt and in all."""
    common = []
    for a, b in zip(ref, run):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        common.append(k)
    return {"common_prefix": common,
            "common_prefix_fraction": sum(common) / max(1, sum(len(a) for a in ref))}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, qwen or an HF folder")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "nvfp4"])
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="evals/results/decode_check.json")
    args = ap.parse_args()
    on_gpu = common.engine_env()
    model = {"smollm2": assets.smollm2, "qwen": assets.qwen_coder}.get(
        args.model, lambda: args.model)()
    prompts = questions(args.questions)
    rows = common.rows_per_dtype("evals.decode_check", args.dtypes, args.out, lambda dt: generate(
        str(model), dt, prompts, args.max_tokens, on_gpu))
    ref = next((r for r in rows if r.get("kv_dtype") == "auto" and "token_ids" in r), None)
    for r in rows:
        if ref is not None and "token_ids" in r:
            r.update(agreement(ref["token_ids"], r["token_ids"]))
    res = {**common.run_info(on_gpu), "model": str(model), "questions": args.questions,
           "max_tokens": args.max_tokens, "rows": rows}
    common.write_json(args.out, res)
    print("| KV dtype | tokens equal to BF16 before the first difference | first answer |")
    print("|---|---:|---|")
    for r in rows:
        frac = r.get("common_prefix_fraction")
        text = (r.get("texts") or [r.get("error", "")])[0][:90].replace("\n", " ")
        print(f"| {r['kv_dtype']} | {'' if frac is None else f'{frac:.1%}'} | {text} |")


if __name__ == "__main__":
    main()
