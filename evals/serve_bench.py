"""`vllm serve --kv-cache-dtype {nvfp4, fp8, auto}` + `vllm bench serve` (random prompts of a
fixed length, ignore_eos) on loopback, one server per KV dtype in turn: throughput, TTFT and
TPOT from vLLM's own benchmark client at one or more max-concurrencies, plus each server's
startup lines (backend, capacity).

Per dtype one server is started once and the client runs each concurrency C in turn against
it, with C x --prompts-per-concurrency prompts (or a fixed --num-prompts). --iso-capacity adds,
per dtype, the concurrency its KV cache admits at this input + output length: the capacity in
tokens read from the server's startup log (the backend's "NVFP4 KV cache (vllm-nvfp4kv): N
tokens" line for nvfp4, vLLM's "GPU KV cache size: N tokens" otherwise), divided by
input_len + output_len, rounded down; exactly: in whole blocks (block size from /metrics),
less the block vLLM reserves, over the blocks a request fills (see admitted_concurrency). That
point runs first on its server. --kv-cache-memory-bytes gives every dtype the same KV byte
budget, so that admitted concurrencies stay small enough to measure in one call. One row per (dtype, concurrency): output / total tok/s, req/s,
median / p99 TTFT and TPOT, per-user output tok/s (1000 / median TPOT), preemptions during the
point, capacity and admitted concurrency. The JSON holds ratios against the baseline dtype
(fp8 when measured, else the first): at equal concurrency (iso-concurrency), and each dtype at
its admitted concurrency against the baseline at its own (iso-capacity). A PNG next to --out:
output tok/s against per-user tok/s (the seed's Pareto figure, admitted points starred) and
TTFT against concurrency. --budget-s: no server or point starts after that much wall time;
the JSON is written after every point.

Default model on a GPU: Llama-3-8B-shaped (evals/models/llama3-8b: 32 layers, 32 q / 8 kv
heads, D=128) with dummy weights and SmolLM2's tokenizer (the API and the benchmark client need
one and no Llama-3 tokenizer is available offline), its vocabulary size set to the tokenizer's.
On a CPU: SmolLM2-135M-Instruct (dtypes auto nvfp4: vLLM's CPU FP8 KV cache needs AMX).

    # H200, 32K in / 1K out, 16 GiB of KV for each dtype (FP8 admits 7, NVFP4 13); points
    # FP8 7, 2 and NVFP4 13, 7, 2 (C=2 is what --budget-s drops first). Measured: a
    # server's first start on a fresh machine takes ~4 min (compilation), FP8's two points
    # ~2 min, NVFP4's C=13 ~1 min; so one dtype per call, then --combine (below):
    timeout 570 python -P -m evals.serve_bench --dtypes fp8 --input-len 32768 \\
        --output-len 1024 --kv-cache-memory-bytes 17179869184 --iso-capacity \\
        --concurrency 7 2 --budget-s 360 --out evals/results/serve_sweep_h200_32k_fp8.json
    # H200, 128K context (129,984 in + 1,024 out + 64 = Llama-3's 131,072), 20 GiB of KV
    # (FP8 admits 2, NVFP4 4), one prompt per request slot. Measured (2026-12-04): the FP8
    # server's cold start 238 s, its point 30 s; NVFP4's start 134 s. One dtype per call:
    timeout 570 python -P -m evals.serve_bench --dtypes fp8 --input-len 129984 \\
        --output-len 1024 --kv-cache-memory-bytes 21474836480 --iso-capacity \\
        --concurrency 2 --prompts-per-concurrency 1 --budget-s 480 \\
        --out evals/results/serve_sweep_h200_128k_fp8.json      # then --dtypes nvfp4, _nvfp4
    # CPU (SmolLM2-135M, 12 MiB of KV in blocks of 128 tokens: BF16 holds 4 blocks, NVFP4
    # 15, one reserved, so they admit 3 and 14 requests of 96 + 32 tokens), ~6 min:
    python -P -m evals.serve_bench --dtypes auto nvfp4 --input-len 96 --output-len 32 \\
        --kv-cache-memory-bytes 12582912 --concurrency 1 3 --iso-capacity \\
        --out evals/results/serve_sweep_cpu.json
    # the single-concurrency run of before (one point per dtype, 64 prompts):
    python -P -m evals.serve_bench --input-len 8192 --output-len 256 --num-prompts 64 \\
        --max-concurrency 32 --out evals/results/serve_bench_h200.json
    # join results of separate calls (same lengths and KV budget; a later file's
    # (dtype, concurrency) rows replace an earlier's), or re-plot one:
    python -P -m evals.serve_bench --combine a.json b.json --out joined.json
    python -P -m evals.serve_bench --plot-only --out evals/results/serve_sweep_cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import time
import urllib.request
from pathlib import Path

from evals import assets, common
from evals.server import Server, cpu_env, metrics, offline_report, report, serve_cmd

# what is kept of `vllm bench serve`'s result, per point
KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
        "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
# metrics compared against the baseline dtype (higher is better for the first four)
RATIO_KEYS = ("output_throughput", "total_token_throughput", "request_throughput",
              "per_user_output_tok_s", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
              "p99_tpot_ms")
MAX_MODEL_LEN_SLACK = 64  # tokens over input + output (a prompt may re-tokenize a bit longer)
# --max-model-len is rounded up to this (the CPU's block size, a multiple of the GPU's 16):
# vLLM logs "GPU KV cache size" as max concurrency x max_model_len, blocks x block size only
# when max_model_len is a whole number of blocks
MAX_MODEL_LEN_ROUND = 128


def default_max_model_len(input_len: int, output_len: int) -> int:
    n = input_len + output_len + MAX_MODEL_LEN_SLACK
    return -(-n // MAX_MODEL_LEN_ROUND) * MAX_MODEL_LEN_ROUND


# ---------------------------------------------------------------- plan (no server needed)
def capacity_tokens(lines: list[str], kv_dtype: str) -> int | None:
    """KV capacity in tokens from a server's startup lines: the backend's own line for nvfp4
    (nvfp4+fp8ws too), vLLM's 'GPU KV cache size' otherwise (or when the backend's is
    missing)."""
    def last(pattern):
        hits = [m.group(1) for x in lines for m in [re.search(pattern, x)] if m]
        return int(hits[-1].replace(",", "")) if hits else None
    vllm_line = last(r"GPU KV cache size: ([\d,]+) tokens")
    if kv_dtype.startswith("nvfp4"):
        own = last(r"NVFP4 KV cache \(vllm-nvfp4kv\): ([\d,]+) tokens")
        return own if own is not None else vllm_line
    return vllm_line


def admitted_concurrency(capacity: int | None, input_len: int, output_len: int,
                         block_size: int | None = None) -> int | None:
    """Requests of input_len + output_len tokens that the cache holds at once: capacity //
    (input_len + output_len); with the block size, exactly what vLLM's scheduler can run: the
    capacity in whole blocks less the one its block pool reserves (the null block), over the
    blocks one request fills (input + output - 1 tokens: the last sampled token's K/V is
    never written). The CPU sweep showed the difference (blocks of 128 tokens: 11 running of
    a 12-block cache, not 12)."""
    if not capacity:
        return None
    if not block_size:
        return capacity // (input_len + output_len)
    per_request = -(-(input_len + output_len - 1) // block_size)
    return max(0, capacity // block_size - 1) // per_request


def plan_points(concurrency: list[int], admitted: int | None, iso: bool) -> list[int]:
    """Concurrencies to run on one server, in order: the admitted one first (with
    --iso-capacity; a budget cut then loses the extra points, not the comparison), then the
    list, each once."""
    pts = ([admitted] if iso and admitted else []) + list(concurrency)
    return list(dict.fromkeys(c for c in pts if c and c > 0))


def num_prompts(c: int, args) -> int:
    return args.num_prompts or c * args.prompts_per_concurrency


def label(kv: str) -> str:
    return {"auto": "auto (model dtype)"}.get(kv, kv)


def ratios(rows: list[dict], baseline: str) -> dict:
    """Each other dtype against `baseline`: at equal concurrency, and at its admitted
    concurrency against the baseline at its own (rows with is_admitted)."""
    ok = [r for r in rows if "error" not in r and r.get("completed")]
    base = {r["concurrency"]: r for r in ok if r["kv_dtype"] == baseline}
    base_adm = next((r for r in ok if r["kv_dtype"] == baseline and r.get("is_admitted")), None)

    def cmp(r, b):
        d = {f"{k}_ratio": round(r[k] / b[k], 4) for k in RATIO_KEYS
             if r.get(k) is not None and b.get(k)}
        return {"kv_dtype": r["kv_dtype"], "concurrency": r["concurrency"],
                "baseline_concurrency": b["concurrency"], **d}

    iso_c = [cmp(r, base[r["concurrency"]]) for r in ok
             if r["kv_dtype"] != baseline and r["concurrency"] in base]
    iso_cap = []
    if base_adm:
        for r in ok:
            if r["kv_dtype"] != baseline and r.get("is_admitted"):
                d = cmp(r, base_adm)
                d["concurrency_ratio"] = round(r["concurrency"] / base_adm["concurrency"], 4)
                if r.get("capacity_tokens") and base_adm.get("capacity_tokens"):
                    d["capacity_ratio"] = round(r["capacity_tokens"]
                                                / base_adm["capacity_tokens"], 4)
                iso_cap.append(d)
    return {"baseline": baseline, "iso_concurrency": iso_c, "iso_capacity": iso_cap}


def combine(parts: list[dict], files: list[str]) -> dict:
    """Rows of several results of the same workload; a later file's (dtype, concurrency)
    rows replace an earlier's."""
    same = ("input_len", "output_len", "kv_cache_memory_bytes")
    for k in same:
        if len({json.dumps(p["args"].get(k)) for p in parts}) != 1:
            raise SystemExit(f"--combine: the results differ in {k}")
    if len({p.get("model") for p in parts}) != 1:
        raise SystemExit("--combine: the results come from different models")
    rows: dict[tuple, dict] = {}
    for p in parts:
        for r in p["rows"]:
            rows[(r["kv_dtype"], r.get("concurrency"))] = r
    res = {**parts[-1], "combined_from": list(files),
           "servers": [s for p in parts for s in p.get("servers", [])],
           "rows": list(rows.values())}
    dts = list(dict.fromkeys(r["kv_dtype"] for r in res["rows"]))
    res["ratios"] = ratios(res["rows"], "fp8" if "fp8" in dts else
                           (parts[0].get("ratios") or {}).get("baseline", dts[0]))
    return res


# ---------------------------------------------------------------- plot / table
def plot(res: dict, png: Path) -> None:
    plt = common.pyplot()
    from matplotlib.ticker import ScalarFormatter
    rows = [r for r in res["rows"] if "error" not in r and r.get("completed")]
    colors = {"nvfp4": "tab:green", "nvfp4+fp8ws": "tab:olive", "fp8": "tab:blue",
              "auto": "tab:gray"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for dt in dict.fromkeys(r["kv_dtype"] for r in rows):
        rs = sorted((r for r in rows if r["kv_dtype"] == dt), key=lambda r: r["concurrency"])
        col = colors.get(dt)
        a1.plot([r["per_user_output_tok_s"] for r in rs], [r["output_throughput"] for r in rs],
                marker="o", color=col, label=label(dt))
        a2.plot([r["concurrency"] for r in rs], [r["median_ttft_ms"] for r in rs],
                marker="o", color=col, label=f"{label(dt)} median")
        a2.plot([r["concurrency"] for r in rs], [r["p99_ttft_ms"] for r in rs],
                marker=".", color=col, linestyle=":", linewidth=0.9, label=f"{label(dt)} p99")
        for r in rs:
            a1.annotate(f"C={r['concurrency']}", (r["per_user_output_tok_s"],
                                                  r["output_throughput"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=7, color=col)
            if r.get("is_admitted"):
                a1.scatter([r["per_user_output_tok_s"]], [r["output_throughput"]], marker="*",
                           s=220, color=col, edgecolor="black", zorder=5)
                a2.scatter([r["concurrency"]], [r["median_ttft_ms"]], marker="*", s=220,
                           color=col, edgecolor="black", zorder=5)
    a1.scatter([], [], marker="*", s=120, color="white", edgecolor="black",
               label="concurrency the KV cache admits")
    a1.set_xlabel("interactivity: per-user output tok/s (1000 / median TPOT)")
    a1.set_ylabel(f"throughput per {'device' if res['device'].startswith('cpu') else 'GPU'}"
                  ": output tok/s")
    top = max([r["output_throughput"] for r in rows], default=1)
    a1.set_ylim(0, top * 1.15)
    a1.set_xlim(0, max([r["per_user_output_tok_s"] or 0 for r in rows], default=1) * 1.15)
    a2.set_xlabel("concurrency (requests in flight)")
    a2.set_ylabel("TTFT (ms)")
    a2.set_xscale("log", base=2)
    a2.set_xticks(sorted({r["concurrency"] for r in rows}) or [1])
    a2.get_xaxis().set_major_formatter(ScalarFormatter())
    a2.set_ylim(bottom=0)
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        if rows:
            ax.legend(fontsize=8)
    a = res["args"]
    kv = (f", KV budget {a['kv_cache_memory_bytes'] / 2**20:,.0f} MiB per dtype"
          if a.get("kv_cache_memory_bytes") else "")
    fig.suptitle(f"vllm serve + vllm bench serve, {res['device']}, {res['model']},\n"
                 f"{a['input_len']} in / {a['output_len']} out{kv} ({res['date']}, vLLM "
                 f"{res['vllm']})", fontsize=9)
    fig.tight_layout()
    common.save_figure(fig, png, dpi=110)
    plt.close(fig)


def print_table(res: dict) -> None:
    print(f"\n{'kv':>12} {'C':>4} {'adm':>4} {'out tok/s':>10} {'tot tok/s':>10} "
          f"{'req/s':>7} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} "
          f"{'user tok/s':>10} {'preempt':>7}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['kv_dtype']:>12} {r.get('concurrency', '-')!s:>4} "
                  f"error: {r['error'][-300:]}")
            continue
        print(f"{r['kv_dtype']:>12} {r['concurrency']:>4} {'*' if r.get('is_admitted') else '':>4}"
              f" {r['output_throughput']:>10.1f} {r['total_token_throughput']:>10.1f}"
              f" {r['request_throughput']:>7.3f} {r['median_ttft_ms']:>9.0f}"
              f" {r['p99_ttft_ms']:>8.0f} {r['median_tpot_ms']:>9.1f} {r['p99_tpot_ms']:>7.1f}"
              f" {r['per_user_output_tok_s'] or 0:>10.1f} {r.get('preemptions', '-')!s:>7}")
    rt = res.get("ratios") or {}
    for kind in ("iso_concurrency", "iso_capacity"):
        for d in rt.get(kind, []):
            print(f"{kind}: {d['kv_dtype']} C={d['concurrency']} vs {rt['baseline']} "
                  f"C={d['baseline_concurrency']}: output tok/s x"
                  f"{d.get('output_throughput_ratio')}, per-user tok/s x"
                  f"{d.get('per_user_output_tok_s_ratio')}, median TTFT x"
                  f"{d.get('median_ttft_ms_ratio')}")


# ---------------------------------------------------------------- server side
def warmup(port: int, n_tokens: int) -> None:
    """One short-output request of n_tokens prompt tokens (compiles what the first measured
    request would otherwise compile; replaces the client's full-length test request)."""
    body = {"model": "m", "prompt": [100 + i % 900 for i in range(n_tokens)], "max_tokens": 4,
            "ignore_eos": True, "temperature": 0.0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)


def cache_blocks(port: int) -> tuple[int | None, int | None]:
    """(num_gpu_blocks, block_size) from the server's vllm:cache_config_info."""
    try:
        info = metrics(port)[1]
        return int(info["num_gpu_blocks"]), int(info["block_size"])
    except Exception:  # noqa: BLE001 - then the plain rule, capacity // (input + output)
        return None, None


def preemptions(port: int) -> float | None:
    try:
        return metrics(port)[0].get("vllm:num_preemptions", 0.0)
    except Exception:  # noqa: BLE001 - a counter is a nicety
        return None


def bench(port: int, tokenizer: str, args, concurrency: int, n: int) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    p = FlexibleArgumentParser()
    add_cli_args(p)
    a = p.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
        "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(n), "--max-concurrency", str(concurrency),
        "--ready-check-timeout-sec", "0",  # the server is up and warmed (warmup())
        "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"])
    r = main(a)
    out = {k: r[k] for k in KEEP if k in r}
    errs = [e for e in r.get("errors") or [] if e]
    if errs:
        out["client_errors"] = errs[:3]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder (default: Llama-3-8B shape on a GPU, "
                    "SmolLM2-135M-Instruct on a CPU, see above)")
    ap.add_argument("--dtypes", nargs="+",
                    help="KV cache dtypes, one server each, in this order; nvfp4+fp8ws = nvfp4 "
                         "with the FP8 prefill workspace (default fp8 nvfp4; CPU auto nvfp4)")
    ap.add_argument("--baseline", help="dtype the ratios compare against (default fp8 when "
                    "in --dtypes, else the first)")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", "--max-concurrency", nargs="+", type=int, default=[],
                    dest="concurrency", help="client max-concurrencies, run in turn against "
                    "each server (default 32 unless --iso-capacity)")
    ap.add_argument("--iso-capacity", action="store_true",
                    help="also run, first, the concurrency each dtype's cache admits: capacity "
                         "tokens // (input_len + output_len)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2,
                    help="a point sends C x this many prompts")
    ap.add_argument("--num-prompts", type=int,
                    help="a fixed number of prompts per point (overrides the above)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="KV cache bytes, the same for every dtype (default: vLLM's, from "
                         "--gpu-memory-utilization; on the CPU VLLM_CPU_KVCACHE_SPACE=1 GiB)")
    ap.add_argument("--max-model-len", type=int,
                    help=f"default input + output + {MAX_MODEL_LEN_SLACK}, rounded up to a "
                         f"multiple of {MAX_MODEL_LEN_ROUND}")
    ap.add_argument("--max-num-seqs", type=int, help="server's (default: vLLM's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--budget-s", type=float, default=0,
                    help="no server or point starts after this many seconds (0: no limit)")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--out", default="evals/results/serve_bench.json")
    ap.add_argument("--plot-only", action="store_true", help="re-plot --out, exit")
    ap.add_argument("--combine", nargs="+", metavar="JSON",
                    help="join these results into --out (ratios recomputed), plot; no server")
    args = ap.parse_args()
    t_begin = time.time()
    out = Path(args.out)
    if args.plot_only or args.combine:
        offline_report(out, args.combine, combine, plot, print_table)
        return

    import torch
    import vllm
    on_gpu = torch.cuda.is_available()
    if not args.concurrency and not args.iso_capacity:
        args.concurrency = [32]
    args.dtypes = args.dtypes or (["fp8", "nvfp4"] if on_gpu else ["auto", "nvfp4"])
    args.baseline = args.baseline or ("fp8" if "fp8" in args.dtypes else args.dtypes[0])
    args.max_model_len = args.max_model_len or default_max_model_len(args.input_len,
                                                                     args.output_len)
    dummy = args.model is None and on_gpu
    model = assets.serving_model(args.model, on_gpu)
    try:
        from importlib.metadata import version
        plugin = version("vllm-nvfp4kv")
    except Exception:  # noqa: BLE001 - not installed as a dist
        plugin = None
    run = common.run_info(on_gpu)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": common.device_name(on_gpu), "vllm": vllm.__version__, "torch": torch.__version__,
           "vllm_nvfp4kv": plugin, "git": run["versions"].get("vllm-nvfp4kv (git)"),
           "model": "Llama-3-8B shape, dummy weights, SmolLM2 tokenizer" if dummy
           else Path(model).name, "model_path": model,
           "tokens_per_request": args.input_len + args.output_len,
           "args": vars(args), "run": run, "servers": [], "rows": []}

    def save():
        res["ratios"] = ratios(res["rows"], args.baseline)
        common.write_json(out, res)

    def over_budget():
        return args.budget_s and time.time() - t_begin > args.budget_s

    for name in args.dtypes:
        if over_budget():
            res["servers"].append({"kv_dtype": name, "skipped": "out of --budget-s"})
            save()
            continue
        # "nvfp4+fp8ws": the NVFP4 cache with the FP8 E4M3 prefill workspace
        dt = "nvfp4" if name == "nvfp4+fp8ws" else name
        env = dict(os.environ) if on_gpu else cpu_env()
        if name == "nvfp4+fp8ws":
            env["NVFP4KV_WORKSPACE_DTYPE"] = "fp8"
        extra = ["--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching"]
        extra += (["--gpu-memory-utilization", str(args.gpu_memory_utilization)] if on_gpu
                  else ["--enforce-eager"])
        if args.kv_cache_memory_bytes:
            extra += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the byte budget
        if args.max_num_seqs:
            extra += ["--max-num-seqs", str(args.max_num_seqs)]
        if dummy:
            extra += ["--load-format", "dummy"]
        cmd = serve_cmd(model, dt, args.port, *extra)
        log = out.with_name(f"{out.stem}_{name}.log")
        srv = {"kv_dtype": name, "cmd": " ".join(cmd[2:]), "log": log.name}
        res["servers"].append(srv)
        try:
            with Server(cmd, log, env) as s:
                srv["startup_s"] = s.startup_s
                srv["startup_log"] = s.startup_lines()
                cap = capacity_tokens(srv["startup_log"], name)
                blocks, bs = cache_blocks(args.port)
                adm = admitted_concurrency(cap, args.input_len, args.output_len, bs)
                srv.update(capacity_tokens=cap, admitted_concurrency=adm, block_size=bs,
                           num_gpu_blocks=blocks,
                           admitted_by_plain_rule=admitted_concurrency(
                               cap, args.input_len, args.output_len))
                if blocks and cap != blocks * bs:
                    print(f"!! {name}: capacity {cap} from the log, {blocks} x {bs} from "
                          f"/metrics", flush=True)
                save()
                t0 = time.time()
                warmup(args.port, min(args.input_len, 16384))
                srv["warmup_s"] = round(time.time() - t0, 1)
                for c in plan_points(args.concurrency, adm, args.iso_capacity):
                    if over_budget():
                        srv.setdefault("points_skipped", []).append(c)
                        continue
                    n = num_prompts(c, args)
                    row = {"kv_dtype": name, "concurrency": c, "num_prompts": n,
                           "capacity_tokens": cap, "admitted_concurrency": adm,
                           "is_admitted": c == adm}
                    p0 = preemptions(args.port)
                    try:
                        row.update(bench(args.port, model, args, c, n))
                        tpot = row.get("median_tpot_ms")
                        row["per_user_output_tok_s"] = round(1000 / tpot, 3) if tpot else None
                        p1 = preemptions(args.port)
                        row["preemptions"] = (int(p1 - p0) if None not in (p0, p1) else None)
                    except Exception as e:  # noqa: BLE001 - record it, go on
                        row["error"] = f"{type(e).__name__}: {e}"[-1500:]
                    res["rows"].append(row)
                    save()
                    print(f"== {name} C={c}: {row.get('output_throughput', 0):.1f} out tok/s, "
                          f"{time.time() - t_begin:.0f} s elapsed", flush=True)
            srv["errors_in_log"] = s.serving_errors()
        except Exception as e:  # noqa: BLE001 - record it, go on with the next dtype
            srv["error"] = f"{type(e).__name__}: {e}"[-1500:]
            res["rows"].append({"kv_dtype": name, "error": srv["error"]})
        save()
    report(res, out, plot, print_table)


if __name__ == "__main__":
    main()
