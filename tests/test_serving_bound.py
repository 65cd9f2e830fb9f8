"""evals.serving_bound: the two-term serving model inverts exactly, counts Llama-3-8B's
weights, and on the recorded H200 sweep reproduces each measured throughput from the step
time it infers. Pure arithmetic on committed JSON (no vLLM, no GPU)."""
import pytest

from evals import common
from evals import serving_bound as sb

CFG = common.read_json(common.MODELS / "llama3-8b" / "config.json")


def test_step_and_throughput_invert():
    for c, p, t in ((7, 1.1, 0.012), (13, 1.2, 0.0118), (2, 0.9, 0.006)):
        x = sb.throughput(t, c, 1024, p)
        assert sb.implied_step_s(x, c, 1024, p) == pytest.approx(t, rel=1e-12)


def test_weight_bytes_llama3_8b():
    # 8,030,261,248 parameters less the embedding (a lookup, not read per step) and the 65
    # RMSNorm weight vectors (not counted: a few KB)
    assert sb.weight_bytes(CFG, 32, 128256) == 2 * (8_030_261_248 - 128256 * 4096 - 65 * 4096)


@pytest.mark.parametrize("records,copy_gbps", [
    # H200: prefill as bench_e2e's wall time
    (("serve_sweep_h200_32k_bt_ahead.json", "options_cost_h200.json",
      "profile_step_h200_bt_ahead.json"), 4296.7),
    # H100: prefill as profile_step's GPU time in chunks
    (("serve_sweep_h100_32k_repeat.json", "profile_prefill_h100.json",
      "profile_step_h100_b8_32k.json"), 3047.2),
])
def test_recorded_sweep_is_reproduced(records, copy_gbps):
    res = sb.analyse(*(common.read_json(common.RESULTS / f) for f in records), CFG, 49152,
                     copy_gbps, {"iso-capacity": (13, 7, 1.6)})
    for r in res["rows"]:
        x = sb.throughput(r["step_ms"] / 1e3, r["concurrency"], 1024,
                          r["prefill_s_per_request"])
        assert x == pytest.approx(r["output_tok_s"], rel=2e-3)
        assert 0 < r["attention_ms"] < r["step_ms"]
    (t,) = res["targets"]
    assert t["attention_tbps"] > max(r["attention_tbps"] for r in res["rows"])
    # the ceiling (attention at copy bandwidth) is above what was measured, and above the
    # target exactly when the target needs less than the copy bandwidth
    assert t["ceiling_ratio"] > t["measured_ratio"]
    assert (t["ceiling_ratio"] > t["ratio"]) == (t["attention_share_of_copy"] < 1)
