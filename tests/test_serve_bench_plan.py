"""evals.serve_bench without a server: capacity parsing, the points per server, the ratios
in the JSON, --combine and the plot."""
import json
from types import SimpleNamespace

import pytest

from evals import serve_bench as sb

NVFP4_LINES = [
    "(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 3,226,432 tokens",
    "(EngineCore pid=1) INFO [kv_cache_utils.py:2178] Maximum concurrency for 16,384 tokens "
    "per request: 196.93x",
    "(EngineCore pid=1) INFO [backend.py:217] NVFP4 KV cache (vllm-nvfp4kv): 3,226,400 tokens, "
    "1.78x the 1,814,868 tokens an FP8 cache holds in the same memory (3.56x BF16)",
]
FP8_LINES = ["(EngineCore pid=2) INFO [kv_cache_utils.py:2177] GPU KV cache size: 1,815,888 "
             "tokens"]


def test_capacity_from_startup_lines():
    # nvfp4 reads the backend's own line (not the FP8 figure in it), others vLLM's
    assert sb.capacity_tokens(NVFP4_LINES, "nvfp4") == 3_226_400
    assert sb.capacity_tokens(NVFP4_LINES, "nvfp4+fp8ws") == 3_226_400
    assert sb.capacity_tokens(FP8_LINES, "fp8") == 1_815_888
    assert sb.capacity_tokens(NVFP4_LINES[:2], "nvfp4") == 3_226_432  # fallback
    assert sb.capacity_tokens(["nothing"], "auto") is None


def test_admitted_concurrency_rounds_down():
    assert sb.admitted_concurrency(1_815_888, 32768, 1024) == 53
    assert sb.admitted_concurrency(3_226_400, 32768, 1024) == 95
    assert sb.admitted_concurrency(447, 96, 32) == 3
    assert sb.admitted_concurrency(None, 96, 32) is None
    # whole blocks less vLLM's reserved null block, over the blocks a request fills
    assert sb.admitted_concurrency(1536, 96, 32, 128) == 11  # 12 blocks: 11 ran on the CPU
    assert sb.admitted_concurrency(384, 96, 32, 128) == 2
    assert sb.admitted_concurrency(512, 96, 32, 128) == 3
    assert sb.admitted_concurrency(128, 96, 32, 128) == 0
    # the H200 commands: 16 GiB at 32K + 1K, 20 GiB at 129,984 + 1,024 (block 16)
    assert sb.admitted_concurrency((16 << 30) // 65536, 32768, 1024, 16) == 7
    assert sb.admitted_concurrency((16 << 30) // 36864 // 16 * 16, 32768, 1024, 16) == 13
    assert sb.admitted_concurrency((20 << 30) // 65536, 129984, 1024, 16) == 2
    assert sb.admitted_concurrency((20 << 30) // 36864 // 16 * 16, 129984, 1024, 16) == 4


def test_default_max_model_len_is_whole_blocks():
    assert sb.default_max_model_len(96, 32) == 256
    assert sb.default_max_model_len(32768, 1024) == 33920
    assert sb.default_max_model_len(129984, 1024) == 131072  # Llama-3's 128K context
    assert sb.default_max_model_len(8192, 256) % 128 == 0


def test_plan_points():
    assert sb.plan_points([1, 3], 12, True) == [12, 1, 3]  # admitted first
    assert sb.plan_points([1, 3], 3, True) == [3, 1]  # once
    assert sb.plan_points([1, 3], 12, False) == [1, 3]
    assert sb.plan_points([], 5, True) == [5]
    assert sb.plan_points([4], None, True) == [4]  # capacity not found
    args = SimpleNamespace(num_prompts=None, prompts_per_concurrency=3)
    assert sb.num_prompts(5, args) == 15
    assert sb.num_prompts(5, SimpleNamespace(num_prompts=64, prompts_per_concurrency=3)) == 64


def _row(dt, c, out, tpot, ttft, adm, cap):
    return {"kv_dtype": dt, "concurrency": c, "completed": 2 * c, "output_throughput": out,
            "total_token_throughput": 5 * out, "request_throughput": out / 32,
            "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot,
            "p99_tpot_ms": 2 * tpot, "per_user_output_tok_s": 1000 / tpot,
            "capacity_tokens": cap, "admitted_concurrency": adm, "is_admitted": c == adm}


ROWS = [_row("fp8", 7, 100.0, 20.0, 500.0, 7, 240_000),
        _row("fp8", 2, 50.0, 10.0, 300.0, 7, 240_000),
        _row("nvfp4", 13, 150.0, 40.0, 900.0, 13, 427_000),
        _row("nvfp4", 7, 80.0, 25.0, 600.0, 13, 427_000),
        _row("nvfp4", 2, 40.0, 12.5, 330.0, 13, 427_000),
        {"kv_dtype": "nvfp4+fp8ws", "error": "RuntimeError: server exited"}]


def test_ratios_iso_concurrency_and_iso_capacity():
    r = sb.ratios(ROWS, "fp8")
    assert r["baseline"] == "fp8"
    iso_c = {d["concurrency"]: d for d in r["iso_concurrency"]}
    assert set(iso_c) == {7, 2}  # only the concurrencies both ran
    assert iso_c[7]["output_throughput_ratio"] == 0.8
    assert iso_c[7]["median_tpot_ms_ratio"] == 1.25
    assert iso_c[7]["per_user_output_tok_s_ratio"] == 0.8
    (cap,) = r["iso_capacity"]
    assert (cap["concurrency"], cap["baseline_concurrency"]) == (13, 7)
    assert cap["output_throughput_ratio"] == 1.5
    assert cap["concurrency_ratio"] == round(13 / 7, 4)
    assert cap["capacity_ratio"] == round(427 / 240, 4)
    assert sb.ratios(ROWS[2:], "fp8")["iso_capacity"] == []  # no baseline rows


def _res(rows, **args):
    return {"date": "2026-12-04T00:00:00", "device": "cpu (test)", "model": "m", "vllm": "0.26",
            "args": {"input_len": 96, "output_len": 32, "kv_cache_memory_bytes": 10 << 20,
                     **args},
            "servers": [{"kv_dtype": r["kv_dtype"]} for r in rows],
            "rows": rows, "ratios": sb.ratios(rows, "fp8")}


def test_combine_later_file_replaces_and_ratios_recomputed(tmp_path):
    a, b = _res(ROWS[:2]), _res(ROWS[2:5])
    b["rows"] = b["rows"] + [dict(ROWS[0], output_throughput=200.0)]  # fp8 C=7 again
    res = sb.combine([a, b], ["a.json", "b.json"])
    assert len(res["rows"]) == 5
    fp8_7 = next(r for r in res["rows"] if r["kv_dtype"] == "fp8" and r["concurrency"] == 7)
    assert fp8_7["output_throughput"] == 200.0
    assert res["ratios"]["iso_capacity"][0]["output_throughput_ratio"] == 0.75
    with pytest.raises(SystemExit):
        sb.combine([a, _res(ROWS[2:5], input_len=128)], ["a", "c"])


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    sb.plot(_res(ROWS), png)
    assert png.stat().st_size > 10_000
    json.dumps(_res(ROWS))  # the result is plain JSON
