"""Offline calibration of the NVFP4 KV cache's per-layer global scales on GSM8K texts, for
NVFP4KV_SCALES_FILE (README "Calibrated global scales").

The calibration texts are the LAST --texts rows of GSM8K test (question + solution), disjoint
from the first rows evals/fidelity.py and lm-eval score. Each text is prefilled in one piece
(attention over exact K/V), every layer's K/V amax is recorded (NVFP4KV_CALIBRATE=collect),
and the scales file gets 2**ceil(log2(headroom * amax / 2688)) per layer and side. The generic
command is `python -m vllm_nvfp4kv.calibration --model DIR --texts FILE.jsonl --out F.json`.

    python -P -m evals.calibrate --out evals/results/scales_smollm2.json
    NVFP4KV_SCALES_FILE=evals/results/scales_smollm2.json python -P -m evals.generate

--study (CPU): the data behind the rule. Records the K/V the writer gets (K rotated, as
cached) while the first --texts GSM8K texts run in 32-token chunks, then per layer and side
the relative squared error of NVFP4 (4-over-6) at g = 1 and at calibrated scales (first
batch x headroom, rounded to a power of two, or not), and how far a first batch's amax falls
below the layer's amax over all texts.
"""
from __future__ import annotations

import argparse
import json

from evals import assets, common, fidelity


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: SmolLM2-135M-Instruct from its package)")
    ap.add_argument("--texts", type=int, default=64, help="GSM8K rows, from the end")
    ap.add_argument("--headroom", type=float, default=None, help="default: calibration.py's 8")
    ap.add_argument("--out", default="evals/results/scales.json")
    ap.add_argument("--center-k", action="store_true", help="also per-channel K centering")
    ap.add_argument("--smooth-k", action="store_true", help="also per-channel K smoothing")
    ap.add_argument("--study", action="store_true", help="the rule study (see above)")
    args = ap.parse_args()
    on_gpu = common.engine_env()
    from vllm_nvfp4kv import calibration
    model = args.model or str(assets.smollm2())
    if args.study:
        return study(model, fidelity.gsm8k_texts(args.texts), args.out)
    rows = fidelity.gsm8k_rows()
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows[-args.texts:]]
    kw = dict(gpu_memory_utilization=0.5) if on_gpu else dict(kv_cache_memory_bytes=256 << 20)
    res = calibration.calibrate(model, texts, args.out,
                                args.headroom or calibration.OFFLINE_HEADROOM,
                                max_model_len=1024, center_k=args.center_k,
                                smooth_k=args.smooth_k, block_size=16, seed=0, **kw)
    meta = res["_meta"]
    print(f"wrote {args.out}: {calibration.describe(res)}; {meta['texts']} texts (GSM8K rows "
          f"{len(rows) - args.texts}..{len(rows) - 1})")


def study(model: str, texts: list[str], out: str) -> None:
    import datetime
    import math

    import torch
    from vllm import LLM, SamplingParams

    from vllm_nvfp4kv import calibration
    from vllm_nvfp4kv.kernels import reference
    from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES
    seen: list = []
    write = reference.write_cache

    def spy(cache, key, value, slots, *a, **k):
        ok = slots >= 0
        seen.append((key[ok].float().clone(), value[ok].float().clone()))
        return write(cache, key, value, slots, *a, **k)

    reference.write_cache = spy
    llm = LLM(model=model, kv_cache_dtype="nvfp4", max_model_len=1024, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False,
              seed=0, kv_cache_memory_bytes=256 << 20, enforce_eager=True,
              additional_config={"nvfp4kv": {"calibrate": "off"}})
    tok = llm.get_tokenizer()
    llm.generate([{"prompt_token_ids": tok(t)["input_ids"][:1000]} for t in texts],
                 SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    n_layers = len({id(m) for m in llm.llm_engine.model_executor.driver_worker.worker
                    .model_runner.model.modules() if hasattr(m, "layer_name")})
    reference.write_cache = write

    def rel_err(x, g):
        data, sc = reference.quantize(x, g, DEFAULT_BLOCK_SCALES)
        return float(((reference.dequantize(data, sc, g) - x) ** 2).sum() / (x ** 2).sum())

    def pow2(a, h):
        return float(calibration.scale_from_amax(torch.tensor(a), h))

    rules = {"g = 1": lambda a1, a: 1.0,
             "first batch, h = 1, exact": lambda a1, a: a1 / calibration.RANGE}
    for h in (2, 8, 64, 256):
        rules[f"first batch, h = {h}, power of two"] = lambda a1, a, h=h: pow2(a1, h)
    rules["first batch, h = 64, exact"] = lambda a1, a: 64 * a1 / calibration.RANGE
    rules["all texts, h = 1 (oracle), power of two"] = lambda a1, a: pow2(a, 1)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "model": model,
           "texts": len(texts), "chunk_tokens": 32, "sides": {}}
    for side in (0, 1):
        xs = [torch.cat([w[side] for w in seen[i::n_layers]]) for i in range(n_layers)]
        first = [seen[i][side] for i in range(n_layers)]  # the first real batch of layer i
        amax = [x.abs().max().item() for x in xs]
        a1 = [f.abs().max().item() for f in first]
        one = [x[:1].abs().max().item() for x in xs]
        errs = {r: sum(rel_err(x, f(b, a)) for x, b, a in zip(xs, a1, amax)) / n_layers
                for r, f in rules.items()}
        changed = total = 0
        for x, b in zip(xs, a1):  # blocks whose values differ between g = 1 and online
            d1, s1 = reference.quantize(x, 1.0, DEFAULT_BLOCK_SCALES)
            g = pow2(b, calibration.ONLINE_HEADROOM)
            d2, s2 = reference.quantize(x, g, DEFAULT_BLOCK_SCALES)
            diff = reference.dequantize(d1, s1, 1.0) != reference.dequantize(d2, s2, g)
            changed += int(diff.unflatten(-1, (-1, 16)).any(-1).sum())
            total += x.numel() // 16
        name = "K (rotated)" if side == 0 else "V"
        res["sides"][name] = {
            "tokens": xs[0].shape[0], "first_batch_tokens": first[0].shape[0],
            "max_ratio_amax_to_first_batch": max(a / b for a, b in zip(amax, a1)),
            "max_ratio_amax_to_one_token": max(a / b for a, b in zip(amax, one)),
            "rel_sq_error_mean_over_layers": errs,
            "blocks_changed_by_online_scales": changed / total,
            "layers_amax": amax}
        print(name, json.dumps({k: v for k, v in res["sides"][name].items()
                                if k != "layers_amax"}, indent=1))
        assert all(math.isfinite(e) for e in errs.values())
    common.write_json(out, res)


if __name__ == "__main__":
    main()
