"""The main job: generate with the NVFP4 KV cache through vLLM and the plugin.

Default model: SmolLM2-135M-Instruct from the package index (evals/assets.py), on the GPU when
there is one and on the CPU otherwise. Prints the answers and the KV capacity against FP8.

    python -P -m evals.generate [--model DIR] [--kv-cache-dtype nvfp4] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import time

from evals import assets, common

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three primary colors.",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct from its package)")
    ap.add_argument("--kv-cache-dtype", default="nvfp4")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    on_gpu = common.engine_env()  # spawn on GPU, in-process engine on CPU
    model = args.model or str(assets.smollm2())
    from vllm import LLM, SamplingParams
    kw = common.engine_memory(on_gpu)
    if not on_gpu:
        kw["max_num_seqs"] = 8
    t = time.time()
    llm = LLM(model=model, kv_cache_dtype=args.kv_cache_dtype, max_model_len=2048,
              block_size=16, seed=0, **kw)
    print(f"engine ready in {time.time() - t:.0f} s on {'GPU' if on_gpu else 'CPU'}")
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(msgs, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    for p, o in zip(PROMPTS, outs):
        print(f"\nQ: {p}\nA: {o.outputs[0].text.strip()}")
    cfg = llm.llm_engine.vllm_config.cache_config
    tokens = cfg.num_gpu_blocks * cfg.block_size
    if args.kv_cache_dtype == "nvfp4":
        print(f"\nKV cache: {tokens:,} tokens with NVFP4; an FP8 cache would hold "
              f"{tokens * 9 // 16:,} in the same memory (1.78x more with NVFP4)")
    else:
        print(f"\nKV cache: {tokens:,} tokens ({args.kv_cache_dtype})")


if __name__ == "__main__":
    main()
