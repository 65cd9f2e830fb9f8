"""Independent cross-check of evals/fidelity.py without vLLM's engine: Hugging Face
transformers (fp32, eager attention) scores the same texts with exact K/V and with every K/V
value quantized-dequantized by kernels/reference.py (NVFP4, global scale 1.0) — an upper bound
on the cache's error, since the engine keeps the current chunk's own K/V exact.

    python evals/fakequant_check.py --out evals/results/fakequant_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--texts", type=int, default=16)
    ap.add_argument("--out", default="evals/results/fakequant.json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import assets
    import fidelity
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_nvfp4kv.kernels import reference

    path = str(assets.smollm2())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    exact_attention = llama.eager_attention_forward
    quantize_kv = {"on": False}

    def fake_quant(x):  # [B, H, T, D], values as bf16 activations would give them
        data, scales = reference.quantize(x.to(torch.bfloat16), 1.0)
        return reference.dequantize(data, scales, 1.0)

    def attention(module, query, key, value, attention_mask, **kw):
        if quantize_kv["on"]:
            key, value = fake_quant(key), fake_quant(value)
        return exact_attention(module, query, key, value, attention_mask, **kw)

    llama.eager_attention_forward = attention
    res = {"model": Path(path).name, "texts": args.texts, "rows": []}
    for on in (False, True):
        quantize_kv["on"] = on
        nll = []
        for text in fidelity.gsm8k_texts(args.texts):
            ids = torch.tensor([tok(text)["input_ids"][:1000]])
            with torch.no_grad():
                logits = model(ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").tolist()
        row = {"kv": "nvfp4 fake-quant (all K/V)" if on else "exact", "tokens": len(nll),
               "ppl": math.exp(sum(nll) / len(nll))}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
