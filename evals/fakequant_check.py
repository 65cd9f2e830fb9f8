"""Independent cross-check of evals/fidelity.py without vLLM's engine: Hugging Face
transformers (fp32, eager attention) scores the same texts with exact K/V and with every K/V
value quantized-dequantized by kernels/reference.py (NVFP4, global scale 1.0) — an upper bound
on the cache's error, since the engine keeps the current chunk's own K/V exact.

    python -P -m evals.fakequant_check --out evals/results/fakequant_smollm2_cpu.json

--variants also tries K transforms before quantization (undone after, as Q would absorb
them): `rotate` (the plugin's Hadamard rotation of K), `smooth` (the plugin's per-channel K
smoothing, scales.k_smoothing_factors: each RoPE channel pair of each KV head divided by
max(1, amax / median amax) rounded to a power of two, the amax from --calib-texts other GSM8K
texts run exactly first), `smooth+rotate`, `center` (the plugin's K centering: K - mu, mu the
per-channel mid-range of the same calibration texts; the scores move by q.mu for all keys),
`center+smooth`. For models whose K has
outlier channels (Qwen2's k_proj bias), which 4-bit blocks of 16 cannot hold:

    python -P -m evals.fakequant_check --model qwen --variants plain rotate smooth smooth+rotate \\
        --out evals/results/fakequant_qwen2.5_coder_1.5b_cpu.json

--block-scales: the writer's block-scale rules to try (kernels/format.py; default amax6, the
seed's), each with every variant. Every row also gets its next-token KL divergence from the
exact run (full vocabulary) and top-1 agreement: deterministic, unlike the engine's, whose
per-layer choices come from each run's first batch. What chose the default rule:

    python -P -m evals.fakequant_check --variants plain rotate --block-scales amax6 4over6 search \\
        --out evals/results/fakequant_block_scales_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path

import torch

from evals import assets, common, fidelity

MODELS = {"smollm2": ("smollm2", "llama"), "qwen": ("qwen_coder", "qwen2")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--calib-texts", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["plain"],
                    choices=["plain", "rotate", "smooth", "smooth+rotate", "center",
                             "center+smooth"])
    ap.add_argument("--block-scales", nargs="+", default=["amax6"],
                    choices=["amax6", "4over6", "search"])
    ap.add_argument("--out", default="evals/results/fakequant.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_nvfp4kv.kernels import reference
    from vllm_nvfp4kv.kernels.rotation import rotate
    from vllm_nvfp4kv.scales import k_center_and_smoothing

    get_path, arch = MODELS[args.model]
    path = str(getattr(assets, get_path)())
    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    exact_attention = modeling.eager_attention_forward
    mode = {"variant": None, "calibrate": False, "rule": "amax6"}
    k_hi: dict[int, torch.Tensor] = {}  # layer -> [Hkv, D] channel max of K (post-RoPE)
    k_lo: dict[int, torch.Tensor] = {}  # and min

    def fake_quant(x):  # [B, H, T, D], values as bf16 activations would give them
        data, scales = reference.quantize(x.to(torch.bfloat16), 1.0, mode["rule"])
        return reference.dequantize(data, scales, 1.0)

    smooth: dict[int, torch.Tensor] = {}

    def transform(layer, variant):  # (mu, s), each [Hkv, 1, D], as the calibration writes them
        if "smooth" not in variant and "center" not in variant:
            return 0.0, 1.0
        if (layer, variant) not in smooth:
            mu, s, _ = k_center_and_smoothing(k_hi[layer], k_lo[layer], "center" in variant,
                                              "smooth" in variant)
            smooth[layer, variant] = (mu[:, None, :], s[:, None, :])
        return smooth[layer, variant]

    def attention(module, query, key, value, attention_mask, **kw):
        if mode["calibrate"]:
            i, hi, lo = module.layer_idx, key[0].amax(1), key[0].amin(1)
            k_hi[i] = torch.maximum(k_hi.get(i, hi), hi)
            k_lo[i] = torch.minimum(k_lo.get(i, lo), lo)
        elif mode["variant"]:
            mu, s = transform(module.layer_idx, mode["variant"])
            k = (key - mu) / s
            if "rotate" in mode["variant"]:
                k = rotate(fake_quant(rotate(k)))  # H is its own inverse
            else:
                k = fake_quant(k)
            key, value = k * s + mu, fake_quant(value)
        return exact_attention(module, query, key, value, attention_mask, **kw)

    modeling.eager_attention_forward = attention

    def logprobs(text):
        ids = torch.tensor([tok(text)["input_ids"][:1000]])
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0, :-1].float(), -1), ids[0, 1:]

    texts = fidelity.gsm8k_texts(args.texts + args.calib_texts)
    if any("smooth" in v or "center" in v for v in args.variants):  # disjoint from scored
        mode["calibrate"] = True
        for text in texts[args.texts:]:
            logprobs(text)
        mode["calibrate"] = False
    rows = [(None, None)] + [(v, r) for v in args.variants for r in args.block_scales]
    sums = [{"nll": 0.0, "kl": 0.0, "top1": 0, "tokens": 0} for _ in rows]
    for text in texts[:args.texts]:  # per text: the exact run is every row's reference
        ref = ref_p = None
        for (variant, rule), acc in zip(rows, sums):
            mode["variant"], mode["rule"] = variant, rule or "amax6"
            lp, target = logprobs(text)
            if ref is None:
                ref, ref_p = lp, lp.exp()
            acc["nll"] -= float(lp.gather(1, target[:, None]).sum())
            acc["kl"] += float((ref_p * (ref - lp)).sum())
            acc["top1"] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            acc["tokens"] += len(target)
    res = {"model": Path(path).name, "texts": args.texts, "calib_texts": args.calib_texts,
           "device": "cpu", "torch": torch.__version__,
           "run": common.run_info(False), "rows": []}
    for (variant, rule), acc in zip(rows, sums):
        name = {None: "exact", "plain": "nvfp4 fake-quant (all K/V)"}.get(
            variant, f"nvfp4 fake-quant, K {variant}")
        n = acc["tokens"]
        row = {"kv": name if rule is None else f"{name}, {rule} block scales", "tokens": n,
               "ppl": math.exp(acc["nll"] / n), "kl": acc["kl"] / n, "top1": acc["top1"] / n}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    common.write_json(args.out, res)


if __name__ == "__main__":
    main()
