"""The multi-turn workload generator of evals.multiturn: deterministic, histories grow turn
by turn within their limit, JSONL round trip. Imports no vLLM/torch (no server is started)."""
from evals import multiturn as mt

P = dict(mt.CPU_WORKLOAD, sessions=5)


def test_deterministic_and_per_session():
    a = mt.make_workload(7, 1000, P)
    assert a == mt.make_workload(7, 1000, P)
    assert a != mt.make_workload(8, 1000, P)
    # session i does not depend on how many sessions there are
    more = mt.make_workload(7, 1000, dict(P, sessions=9))
    assert more["sessions"][:5] == a["sessions"]


def test_history_grows_within_limits():
    w = mt.make_workload(0, 1000, P)
    for s in w["sessions"]:
        turns = s["turns"]
        assert 1 <= len(turns) <= P["max_turns"]
        assert turns[0]["kind"] == "first"
        lens = mt.planned_prompt_lens(s)
        for i, t in enumerate(turns):
            assert len(t["new_tokens"]) >= 1
            assert P["reply"][0] <= t["reply_tokens"] <= P["reply"][1]
            assert all(mt.FIRST_TOKEN_ID <= x < 1000 - mt.FIRST_TOKEN_ID
                       for x in t["new_tokens"])
            if i:  # the whole history (previous prompt + reply) plus the new tokens
                assert lens[i] == lens[i - 1] + turns[i - 1]["reply_tokens"] \
                    + len(t["new_tokens"])
        assert lens[-1] + turns[-1]["reply_tokens"] <= P["max_history"]
        # the ideal hit of a later turn: full blocks of the previous prompt + reply
        if len(turns) > 1:
            c = mt.ideal_cached(lens[0], turns[0]["reply_tokens"], 16)
            assert c % 16 == 0 and lens[0] + turns[0]["reply_tokens"] - 16 <= c < lens[1]


def test_jsonl_round_trip(tmp_path):
    w = mt.make_workload(3, 1000, P)
    path = tmp_path / "w.jsonl"
    mt.write_workload(w, path)
    back = mt.read_workload(path)
    assert back["sessions"] == w["sessions"]
    assert back["header"]["seed"] == 3 and back["header"]["vocab"] == 1000
    assert tuple(back["header"]["params"]["reply"]) == tuple(P["reply"])
    assert mt.workload_stats(back)["turns"] == sum(len(s["turns"]) for s in w["sessions"])


def _res(rows, device="GPU A", sha="w1", offload=("off",)):
    return {"workload_sha256_16": sha, "device": device, "date": "2026-12-05 13:00:00",
            "args": {"offload": list(offload)},
            "servers": [{"kv_dtype": r[0], "offload": r[1]} for r in rows],
            "rows": [{"kv_dtype": d, "offload": o, "concurrency": c, "hit_rate": h}
                     for d, o, c, h in rows]}


def test_combine_replaces_rows_by_dtype_offload_and_concurrency():
    a = _res([("fp8", "off", 8, 0.5), ("nvfp4", "off", 2, 0.8), ("nvfp4", "off", 8, 0.9)])
    b = _res([("nvfp4", "off", 16, 0.7), ("nvfp4", "off", 8, 0.85)])
    c = _res([("nvfp4", "on", 8, 0.95)], offload=("on",))
    got = mt.combine([a, b, c], ["a", "b", "c"])
    hits = {(r["kv_dtype"], r["offload"], r["concurrency"]): r["hit_rate"] for r in got["rows"]}
    assert hits == {("fp8", "off", 8): 0.5, ("nvfp4", "off", 2): 0.8,
                    ("nvfp4", "off", 8): 0.85, ("nvfp4", "off", 16): 0.7,
                    ("nvfp4", "on", 8): 0.95}
    assert got["args"]["offload"] == ["off", "on"] and len(got["servers"]) == 6


def test_combine_refuses_other_workloads_or_gpus():
    import pytest
    for other in (_res([], sha="w2"), _res([], device="GPU B")):
        with pytest.raises(SystemExit):
            mt.combine([_res([]), other], ["a", "b"])
