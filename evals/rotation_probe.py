"""Per layer: does the Hadamard rotation of K (and q) lower NVFP4's error, on K itself and on
the scores q.k? No engine: the model runs in transformers (fp32, eager attention) on a few
GSM8K texts, its post-RoPE queries and keys are captured per layer (K rounded to BF16, as the
cache receives it) and sent through the reference quantizer with and without the rotation
(cache_space.rotation_errors, what the backend decides by), the default block scales (4-over-6
until 2026-12-05, when the recorded results were made; now search), global scale
amax / (6 * 448). Qwen2.5's keys are centred (per-channel
mid-range) first, as the backend does online. Score error: every query against every key of
its head group, squared, summed per layer. What NVFP4KV_ROTATE_K=auto (the per-layer choice,
cache_space.rotation_helps) was designed from (evals/RESULTS.md, "K's rotation chosen per
layer").

    python -P -m evals.rotation_probe --model gemma --out evals/results/rotation_probe_gemma3_270m_cpu.json
"""
from __future__ import annotations

import argparse
import importlib

import torch

from evals import assets, common, fidelity
from vllm_nvfp4kv.cache_space import rotation_errors
from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(assets.MODELS), default="gemma")
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = assets.MODELS[args.model]()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    mod = importlib.import_module(type(model).__module__)
    captured = []
    apply_rope = mod.apply_rotary_pos_emb

    def capture(q, k, *a, **kw):  # the model's own RoPE, its outputs kept
        qe, ke = apply_rope(q, k, *a, **kw)
        captured.append((qe.detach(), ke.detach()))
        return qe, ke
    mod.apply_rotary_pos_emb = capture
    layers: dict[int, dict] = {}
    for text in fidelity.gsm8k_texts(args.texts):
        captured.clear()
        with torch.no_grad():
            model(tok(text, return_tensors="pt").input_ids[:, :args.max_tokens])
        for i, (q, k) in enumerate(captured):
            k = k[0].transpose(0, 1).bfloat16().float()                  # [T, Hkv, D]
            if args.model == "qwen":
                k = k - (k.amax(0) + k.amin(0)) / 2
            err = rotation_errors(q[0].transpose(0, 1), k, k.abs().amax() / (6 * 448),
                                  DEFAULT_BLOCK_SCALES, max_tokens=args.max_tokens)
            for key, v in err.items():
                layers.setdefault(i, {}).setdefault(key, 0.0)
                layers[i][key] += v
    rows = [{"layer": i, **e, "score_ratio_rot_over_plain": e["score_rot"] / e["score_plain"],
             "k_ratio_rot_over_plain": e["k_rot"] / e["k_plain"]} for i, e in layers.items()]
    n = len(rows)
    summary = {"layers": n,
               "rotation_lowers_k_error": sum(r["k_ratio_rot_over_plain"] < 1 for r in rows),
               "rotation_lowers_score_error": sum(r["score_ratio_rot_over_plain"] < 1
                                                  for r in rows)}
    print(f"{args.model}: of {n} layers the rotation lowers K's error in "
          f"{summary['rotation_lowers_k_error']}, the score error in "
          f"{summary['rotation_lowers_score_error']}")
    print("score error ratio rot / plain per layer:",
          " ".join(f"{r['score_ratio_rot_over_plain']:.2f}" for r in rows))
    if args.out:
        common.write_json(args.out, {
            "model": str(path), "texts": args.texts, "max_tokens": args.max_tokens,
            "run": common.run_info(on_gpu=False), "summary": summary, "rows": rows})
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
