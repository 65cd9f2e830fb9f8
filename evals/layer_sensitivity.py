"""What makes a model hard for a 4-bit KV cache: each layer's K and V quantized alone. No
engine: the model runs in transformers (fp32, eager attention) on a few GSM8K texts; one pass
exact, one with every layer's K/V through the reference NVFP4 quantizer (the default block
scales, a global scale per layer and side of amax / (6 * 448) over the same texts, no K
centering or rotation), then one pass per (layer, side) with only that layer's K or V
quantized. Each pass's next-token KL divergence from the exact one (full vocabulary) gives
the layer's share of the error; beside it, what might explain it, measured on the exact pass:
K's and V's outlier ratio (max / median per-channel amax, K's over RoPE pairs: what the
backend's K centering triggers on), their relative quantization error, the relative error of
the scores q.k, and whether K's rotation lowers that (the backend's per-layer choice).

    python -P -m evals.layer_sensitivity --model gemma --out evals/results/layer_sensitivity_gemma3_270m_cpu.json
"""
from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from evals import assets, common, fidelity

ARCH = {"smollm2": "llama", "qwen": "qwen2", "gemma": "gemma3"}
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def channel_ratio(x: torch.Tensor, rope_pairs: bool) -> float:
    """Largest max / median per-channel amax over the KV heads of x [B, H, T, D]; with
    rope_pairs the backend's K centering test itself (scales.k_outlier_ratio)."""
    from vllm_nvfp4kv.scales import k_outlier_ratio
    rows = x.transpose(1, 2).flatten(0, 1)                     # [B * T, H, D]
    if rope_pairs:
        return k_outlier_ratio(rows, torch.zeros(rows.shape[0], dtype=torch.long))
    a = rows.abs().amax(0)                                     # [H, D]
    return float((a.amax(-1) / a.median(-1).values.clamp_min(1e-30)).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=sorted(ARCH), default="smollm2")
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="evals/results/layer_sensitivity.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_nvfp4kv.cache_space import fake_quantize, rotation_errors
    from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES

    path = str(assets.MODELS[args.model]())
    modeling = importlib.import_module(
        f"transformers.models.{ARCH[args.model]}.modeling_{ARCH[args.model]}")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    cfg = model.config.get_text_config()
    exact_attention = modeling.eager_attention_forward
    # which (layer, side) pairs are quantized: None = exact; "calibrate" records amax
    mode: dict = {"quant": None}
    amax: dict[tuple[int, str], float] = {}
    stats: dict[int, dict[str, list[float]]] = {}

    def quant(x, layer, side):
        scale = max(amax[layer, side], 1e-12) / (E2M1_MAX * E4M3_MAX)
        return fake_quantize(x.to(torch.bfloat16).float(), scale, DEFAULT_BLOCK_SCALES)

    def attention(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        if mode["quant"] == "calibrate":
            for side, x in (("k", key), ("v", value)):
                amax[i, side] = max(amax.get((i, side), 0.0), float(x.abs().amax()))
        elif mode["quant"] == "measure":
            s = stats.setdefault(i, {})
            kq, vq = quant(key, i, "k"), quant(value, i, "v")
            for name, v in (
                    ("k_rel_err", float((kq - key).pow(2).sum() / key.pow(2).sum())),
                    ("v_rel_err", float((vq - value).pow(2).sum() / value.pow(2).sum())),
                    ("k_outlier_ratio", channel_ratio(key, True)),
                    ("v_outlier_ratio", channel_ratio(value, False))):
                s.setdefault(name, []).append(v)
            q, k = query[0].transpose(0, 1), key[0].transpose(0, 1)   # [T, H, D]
            scale = max(amax[i, "k"], 1e-12) / (E2M1_MAX * E4M3_MAX)
            err = rotation_errors(q, k, scale, DEFAULT_BLOCK_SCALES)
            group = q.shape[1] // k.shape[1]
            ref = torch.einsum("thd,shd->hts", q[:256].float(),
                               k[:256].float().repeat_interleave(group, 1)).pow(2).sum()
            s.setdefault("score_rel_err", []).append(err["score_plain"] / float(ref))
            s.setdefault("rotation_helps", []).append(err["score_rot"] < err["score_plain"])
        elif mode["quant"]:
            if (i, "k") in mode["quant"]:
                key = quant(key, i, "k")
            if (i, "v") in mode["quant"]:
                value = quant(value, i, "v")
        return exact_attention(module, query, key, value, attention_mask, **kw)

    modeling.eager_attention_forward = attention

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits[0, :-1].float(), -1)

    texts = [torch.tensor([tok(t)["input_ids"][:args.max_tokens]])
             for t in fidelity.gsm8k_texts(args.texts)]
    mode["quant"] = "calibrate"
    for ids in texts:
        logprobs(ids)
    mode["quant"] = "measure"
    for ids in texts:
        logprobs(ids)
    layers = cfg.num_hidden_layers
    every = {(i, s) for i in range(layers) for s in "kv"}
    passes = {"all": every, **{f"{s}{i}": {(i, s)} for i in range(layers) for s in "kv"}}
    kl = {name: 0.0 for name in passes}
    tokens = 0
    for ids in texts:
        mode["quant"] = None
        ref = logprobs(ids)
        ref_p = ref.exp()
        tokens += ref.shape[0]
        for name, q in passes.items():
            mode["quant"] = q
            kl[name] += float((ref_p * (ref - logprobs(ids))).sum())
    kl = {k: v / tokens for k, v in kl.items()}
    rows = []
    for i in range(layers):
        s = {k: sum(v) / len(v) for k, v in stats[i].items() if k != "rotation_helps"}
        rows.append({"layer": i, "kl_k": kl[f"k{i}"], "kl_v": kl[f"v{i}"], **s,
                     "rotation_helps": sum(stats[i]["rotation_helps"]) / len(texts),
                     "k_amax": amax[i, "k"], "v_amax": amax[i, "v"]})
    res = common.results_header(
        False, model=Path(path).name, texts=args.texts, tokens=tokens,
        block_scales=DEFAULT_BLOCK_SCALES, head_dim=getattr(cfg, "head_dim", None) or
        cfg.hidden_size // cfg.num_attention_heads, q_heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads, layers=layers, kl_all=kl["all"],
        kl_sum_of_single=sum(r["kl_k"] + r["kl_v"] for r in rows),
        kl_k_share=sum(r["kl_k"] for r in rows) / max(sum(r["kl_k"] + r["kl_v"] for r in rows),
                                                      1e-30))
    res["rows"] = rows
    common.write_json(args.out, res)
    print(table(res))


def table(res: dict) -> str:
    lines = [f"{res['model']}: D {res['head_dim']}, {res['q_heads']}/{res['kv_heads']} heads, "
             f"KL all layers {res['kl_all']:.4f} (sum of single layers "
             f"{res['kl_sum_of_single']:.4f}; K's share {res['kl_k_share']:.0%})",
             "| layer | KL, K alone | KL, V alone | K outlier ratio | V outlier ratio | K rel err "
             "| V rel err | score rel err | rotation helps |", "|" + "---:|" * 9]
    for r in res["rows"]:
        lines.append(f"| {r['layer']} | {r['kl_k']:.5f} | {r['kl_v']:.5f} | "
                     f"{r['k_outlier_ratio']:.1f} | {r['v_outlier_ratio']:.1f} | "
                     f"{r['k_rel_err']:.4f} | {r['v_rel_err']:.4f} | {r['score_rel_err']:.2e} | "
                     f"{r['rotation_helps']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
