"""What bounds the 32K serving gains: a two-term model of the sweep's measured throughput.

Each request of the sweep prefills IN tokens (compute-bound, the same work for every KV
dtype) and then decodes OUT tokens in steps shared by the C requests in flight. If prefill
and decode steps add up (chunked prefill does overlap them somewhat, so the decode step this
infers is a lower bound), the output throughput at concurrency C is

    X = C * OUT / (C * P + OUT * T_C)

with P the prefill time of one request and T_C the decode step time at C. Given the measured
X (evals/serve_bench.py), P (evals/bench_e2e.py, prefill of IN-token prompts) and the step's
non-attention time (evals/profile_step.py, scaled from its layer count to the model's by
weight bytes), this solves for T_C, the attention part of it, and the KV bandwidth the
attention then runs at; and, for the issue's targets (1.6x FP8 at iso-capacity, 1.3x at
iso-concurrency), the step time and KV bandwidth they would need. Pure arithmetic on recorded
JSON: no GPU.

    python -P -m evals.serving_bound   # the H200 records of 2026-12-04/05 (defaults below)
    # the H100 records of 2026-12-06 (sweep, prefill and decode step of the same commit's
    # kernels; prefill as GPU time in 8K chunks)
    python -P -m evals.serving_bound --sweep evals/results/serve_sweep_h100_32k_repeat.json \
        --prefill evals/results/profile_prefill_h100.json \
        --step evals/results/profile_step_h100_b8_32k.json \
        --decode evals/results/decode_h100.json --out evals/results/serving_bound_h100_32k.json
"""
from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from evals import common
from evals.assets import kv_bytes_per_token

RES = common.RESULTS
# the attention kernels of a decode step (profile_step's kernel names)
ATTN_KERNELS = ("_decode_kernel", "_reduce_kernel", "FlashAttnFwd")


def implied_step_s(x_tok_s: float, c: int, out_len: int, prefill_s: float) -> float:
    """T_C from X = C * OUT / (C * P + OUT * T_C)."""
    return (c * out_len / x_tok_s - c * prefill_s) / out_len


def throughput(step_s: float, c: int, out_len: int, prefill_s: float) -> float:
    return c * out_len / (c * prefill_s + out_len * step_s)


def weight_bytes(cfg: dict, layers: int, vocab: int) -> int:
    """BF16 bytes of the projections a decode step reads: attention and MLP per layer, plus
    the LM head (the embedding is a lookup)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qkv_o = h * d * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    return 2 * (layers * (qkv_o + 3 * h * i) + vocab * h)


def layers_of(record: dict) -> int:
    """The measured model's layer count: recorded since 2026-12-06; before, only in the
    model's description ("Llama-3-8B-shaped, 8 layers, dummy weights")."""
    return record.get("layers") or int(record["model"].split(" layers")[0].split()[-1])


def prefill_s_per_request(prefill: dict, in_len: int, layers: int) -> dict:
    """One IN-token prompt's prefill time per KV dtype, scaled to the model's layers, from
    bench_e2e.py (wall time of `requests` prompts) or profile_step.py --prefill-chunk (GPU
    time of `batch` prompts of `ctx` tokens)."""
    scale = layers / layers_of(prefill)
    if "requests" in prefill:
        return {r["kv_dtype"]: r["inputs"][str(in_len)]["prefill_s"] * scale / prefill["requests"]
                for r in prefill["rows"]}
    a = prefill["args"]
    assert a["ctx"] == in_len, f"prefill profiled at {a['ctx']} tokens, the sweep has {in_len}"
    return {r["kv_dtype"]: r["gpu_us_prefill"] / 1e6 * scale / a["batch"] for r in prefill["rows"]}


def analyse(sweep: dict, prefill: dict, step: dict, cfg: dict, vocab: int, copy_gbps: float,
            targets: dict) -> dict:
    a = sweep["args"]
    in_len, out_len = a["input_len"], a["output_len"]
    ctx = in_len + out_len / 2  # mean context over the decode
    layers = cfg["num_hidden_layers"]
    per_req = prefill_s_per_request(prefill, in_len, layers)
    s_layers = layers_of(step)
    scale = weight_bytes(cfg, layers, vocab) / weight_bytes(cfg, s_layers, vocab)
    non_attn = {}
    for r in step["rows"]:
        attn_us = sum(k["us_per_step"] for k in r["top"]
                      if any(n in k["kernel"] for n in ATTN_KERNELS))
        non_attn[r["kv_dtype"]] = (r["gpu_us_per_decode_step"] - attn_us) * scale / 1e6
    rows = []
    for r in sweep["rows"]:
        dt, c, x = r["kv_dtype"], r["concurrency"], r["output_throughput"]
        t = implied_step_s(x, c, out_len, per_req[dt])
        attn = t - non_attn[dt]
        kv = c * ctx * kv_bytes_per_token(cfg, dt)
        rows.append(dict(kv_dtype=dt, concurrency=c, output_tok_s=x,
                         prefill_s_per_request=round(per_req[dt], 4),
                         step_ms=round(t * 1e3, 2), non_attention_ms=round(non_attn[dt] * 1e3, 2),
                         attention_ms=round(attn * 1e3, 2), kv_gb_per_step=round(kv / 1e9, 2),
                         attention_tbps=round(kv / attn / 1e12, 2),
                         attention_share_of_copy=round(kv / attn / 1e9 / copy_gbps, 3)))
    fp8 = {r["concurrency"]: r for r in rows if r["kv_dtype"] == "fp8"}
    need = []
    for name, (c, c_fp8, ratio) in targets.items():
        ours = next(r for r in rows if r["kv_dtype"] == "nvfp4" and r["concurrency"] == c)
        x = ratio * fp8[c_fp8]["output_tok_s"]
        t = implied_step_s(x, c, out_len, per_req["nvfp4"])
        attn = t - non_attn["nvfp4"]
        kv = ours["kv_gb_per_step"] * 1e9
        need.append(dict(target=name, concurrency=c, vs_fp8_at=c_fp8, ratio=ratio,
                         output_tok_s=round(x, 1), step_ms=round(t * 1e3, 2),
                         attention_ms=round(attn * 1e3, 2),
                         attention_tbps=round(kv / attn / 1e12, 2) if attn > 0 else None,
                         attention_share_of_copy=round(kv / attn / 1e9 / copy_gbps, 3)
                         if attn > 0 else None,
                         measured_ratio=round(ours["output_tok_s"]
                                              / fp8[c_fp8]["output_tok_s"], 3),
                         # the most this model allows: NVFP4's attention at copy bandwidth
                         ceiling_ratio=round(throughput(
                             non_attn["nvfp4"] + kv / (copy_gbps * 1e9), c, out_len,
                             per_req["nvfp4"]) / fp8[c_fp8]["output_tok_s"], 3)))
    return {"model": "X = C*OUT / (C*P + OUT*T_C); prefill and decode additive",
            "input_len": in_len, "output_len": out_len, "copy_bandwidth_GBps": copy_gbps,
            "non_attention_scale": round(scale, 3), "rows": rows, "targets": need}


def plot(res: dict, png: Path, title: str) -> None:
    """Implied attention bandwidth of each measured point, what each target needs, and the
    GPU's copy bandwidth."""
    plt = common.pyplot()
    rows, need = res["rows"], res["targets"]
    labels = [f"{r['kv_dtype']} C={r['concurrency']}" for r in rows] + [
        f"{t['target']}\n{t['ratio']}x FP8 (C={t['concurrency']})" for t in need]
    vals = [r["attention_tbps"] for r in rows] + [t["attention_tbps"] or 0 for t in need]
    colors = ["tab:blue" if r["kv_dtype"] == "fp8" else "tab:green" for r in rows] + \
        ["white"] * len(need)
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(range(len(vals)), vals, color=colors, edgecolor="black")
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v + 0.05, f"{v:.2f}", ha="center", fontsize=8)
    copy = res["copy_bandwidth_GBps"] / 1e3
    ax.axhline(copy, color="gray", linestyle="--", label=f"copy bandwidth {copy:.2f} TB/s")
    ax.set_xticks(range(len(vals)), labels, fontsize=8)
    ax.set_ylabel("decode attention, implied TB/s of KV")
    ax.set_title(textwrap.fill(title, 110), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    common.save_figure(fig, png, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default=RES / "serve_sweep_h200_32k_bt_ahead.json")
    ap.add_argument("--prefill", default=RES / "options_cost_h200.json",
                    help="bench_e2e.py result with prefill_s at the sweep's input length, "
                         "or profile_step.py --prefill-chunk at it")
    ap.add_argument("--step", default=RES / "profile_step_h200_bt_ahead.json")
    ap.add_argument("--decode", default=RES / "decode_h200.json",
                    help="bench_decode.py result: the copy bandwidth of the same GPU model")
    ap.add_argument("--config", default=common.MODELS / "llama3-8b" / "config.json")
    ap.add_argument("--vocab", type=int, default=49152,
                    help="the LM head's rows: SmolLM2's tokenizer, what the dummy-weight runs "
                         "use (assets.llama8b_with_tokenizer)")
    ap.add_argument("--out", default=RES / "serving_bound_h200_32k.json")
    args = ap.parse_args()
    load = common.read_json
    sweep = load(args.sweep)
    iso_cap = max(r["concurrency"] for r in sweep["rows"] if r["kv_dtype"] == "nvfp4")
    iso_c = max(r["concurrency"] for r in sweep["rows"] if r["kv_dtype"] == "fp8")
    res = analyse(sweep, load(args.prefill), load(args.step), load(args.config), args.vocab,
                  load(args.decode)["copy_bandwidth_GBps"],
                  {"iso-capacity": (iso_cap, iso_c, 1.6), "iso-concurrency": (iso_c, iso_c, 1.3)})
    res["inputs"] = {k: str(getattr(args, k)) for k in ("sweep", "prefill", "step", "decode",
                                                         "config")}
    common.write_json(args.out, res)
    png = Path(args.out).with_suffix(".png")
    gpu = sweep.get("run", {}).get("device") or sweep["rows"][0].get("gpu", "")
    plot(res, png, f"{res['input_len'] // 1024}K in / {res['output_len']} out, {gpu}: attention "
         "bandwidth implied by the measured throughput (bars), what the targets need (white)")
    print(f"{'kv':>6} {'C':>3} {'tok/s':>7} {'step ms':>8} {'non-attn':>8} {'attn ms':>8} "
          f"{'KV GB':>6} {'TB/s':>5} {'of copy':>7}")
    for r in res["rows"]:
        print(f"{r['kv_dtype']:>6} {r['concurrency']:>3} {r['output_tok_s']:>7.1f} "
              f"{r['step_ms']:>8.2f} {r['non_attention_ms']:>8.2f} {r['attention_ms']:>8.2f} "
              f"{r['kv_gb_per_step']:>6.2f} {r['attention_tbps']:>5.2f} "
              f"{r['attention_share_of_copy']:>7.0%}")
    for t in res["targets"]:
        print(f"{t['target']}: {t['ratio']}x FP8 at C={t['vs_fp8_at']} = {t['output_tok_s']} "
              f"tok/s needs a {t['step_ms']} ms step, attention at {t['attention_tbps']} TB/s "
              f"({t['attention_share_of_copy']:.0%} of copy); measured {t['measured_ratio']}x, "
              f"{t['ceiling_ratio']}x with attention at copy bandwidth")
    print(f"-> {args.out}, {png}")


if __name__ == "__main__":
    main()
