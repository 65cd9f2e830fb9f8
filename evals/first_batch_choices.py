"""Do the NVFP4 cache's first-batch choices depend on the traffic? One engine per (first
request, adapt_at_startup): the engine serves that request, then each layer's choices are
read back: whether K is centered and the offsets' sum, whether K's rotation was kept, and
the global scales. With adapt_at_startup the choices come from the engine's own start-up
text and must be equal whatever came first; without it they follow the first request.

    python -P -m evals.first_batch_choices --model qwen \\
        --out evals/results/first_batch_choices_qwen_cpu.json

CPU (vLLM's CPU engine, one engine at a time, in this process) or GPU. Prints a table last.
"""
from __future__ import annotations

import argparse
import gc

from evals import assets, common

FIRST_REQUESTS = {
    "greeting": "Hi",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
            "fibonacci(n - 2)\n\nWrite a docstring for this function and explain its "
            "complexity in two sentences.",
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?",
}


def choices(model: str, first: str, adapt: bool, on_gpu: bool) -> dict:
    """The per-layer choices of one engine after it served `first`."""
    import torch
    from vllm import LLM, SamplingParams
    kw = common.engine_memory(on_gpu)
    llm = LLM(model=model, kv_cache_dtype="nvfp4", max_model_len=1024, seed=0, max_num_seqs=4,
              block_size=common.block_size(on_gpu),
              additional_config={"nvfp4kv": {"adapt_at_startup": adapt}}, **kw)
    llm.generate([first], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layers = [m for m in runner.model.modules() if hasattr(m, "impl")]
    out = dict(centered=[], k_offset_sum=[], rotation_kept=[], k_scale=[], v_scale=[])
    for m in layers:
        space = m.impl.space
        sub, rot = space.k_sub, space.k_rot
        out["centered"].append(bool(sub is not None and sub.abs().sum() > 0))
        out["k_offset_sum"].append(None if sub is None else float(sub.float().sum()))
        out["rotation_kept"].append(None if rot is None else bool(
            (rot.float().cpu() - torch.eye(rot.shape[0])).abs().sum() > 0))
        out["k_scale"].append(float(m._k_scale))
        out["v_scale"].append(float(m._v_scale))
    del llm, runner, layers
    gc.collect()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, qwen, gemma or an HF folder")
    ap.add_argument("--first", nargs="+", default=list(FIRST_REQUESTS),
                    choices=list(FIRST_REQUESTS))
    ap.add_argument("--out", default="evals/results/first_batch_choices.json")
    args = ap.parse_args(argv)
    on_gpu = common.engine_env()
    model = str(assets.MODELS.get(args.model, lambda: args.model)())
    res = common.results_header(on_gpu, model=model, first_requests=FIRST_REQUESTS, rows=[])
    for adapt in (True, False):
        for name in args.first:
            row = dict(adapt_at_startup=adapt, first=name,
                       **choices(model, FIRST_REQUESTS[name], adapt, on_gpu))
            res["rows"].append(row)
            common.write_json(args.out, res)
    for adapt in (True, False):
        rows = [r for r in res["rows"] if r["adapt_at_startup"] == adapt]
        same = all(r[k] == rows[0][k] for r in rows for k in
                   ("centered", "k_offset_sum", "rotation_kept", "k_scale", "v_scale"))
        res[f"identical_with_adapt_at_startup_{adapt}"] = same
    common.write_json(args.out, res)
    print("| adapt_at_startup | first request | layers centered | layers keeping K's rotation "
          "| sum of K offsets (first 3 layers) |\n|---|---|---:|---:|---|")
    for r in res["rows"]:
        kept = [x for x in r["rotation_kept"] if x is not None]
        offs = ", ".join(f"{x:.1f}" for x in r["k_offset_sum"][:3] if x is not None)
        print(f"| {r['adapt_at_startup']} | {r['first']} | {sum(r['centered'])} / "
              f"{len(r['centered'])} | {sum(kept)} / {len(kept)} | {offs} |")
    print({k: v for k, v in res.items() if k.startswith("identical")})


if __name__ == "__main__":
    main()
