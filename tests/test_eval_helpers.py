"""Helpers the eval scripts share (evals/common.py, evals/server.py), without an engine."""
import json
import os
import sys
import time
from unittest import mock

import pytest

from evals import common

# a stand-in eval script: parses --dtypes/--out like bench_e2e and writes one row per dtype,
# with the pid (one process each) and the other arguments it saw
SCRIPT = '''
import argparse, json, os, sys
ap = argparse.ArgumentParser()
ap.add_argument("--dtypes", nargs="+")
ap.add_argument("--out")
ap.add_argument("--inputs", type=int, nargs="+")
a = ap.parse_args()
if a.dtypes == ["bad"]:
    sys.exit(3)
json.dump({"rows": [{"kv_dtype": d, "pid": os.getpid(), "inputs": a.inputs}
                    for d in a.dtypes]}, open(a.out, "w"))
'''


def test_rows_one_process_per_dtype(tmp_path, monkeypatch):
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT)
    out = tmp_path / "res.json"
    monkeypatch.setattr(sys, "argv", [str(script), "--dtypes", "fp8", "nvfp4+fp8ws", "bad",
                                      "--inputs", "8", "16", "--out", str(out)])
    rows = common.rows_one_process_per_dtype([sys.executable, str(script)],
                                             ["fp8", "nvfp4+fp8ws", "bad"], str(out))
    assert [r["kv_dtype"] for r in rows] == ["fp8", "nvfp4+fp8ws", "bad"]
    assert rows[0]["pid"] != rows[1]["pid"]           # a fresh process per dtype
    assert rows[0]["inputs"] == [8, 16]               # the other arguments pass through
    assert rows[2] == {"kv_dtype": "bad", "error": "its process exited with 3"}
    assert not list(tmp_path.glob("*.part.json"))     # the per-dtype files are gone
    json.dumps(rows)


def test_results_read_plain_or_gzipped(tmp_path):
    """common.read_json: a result stored as NAME.json.gz reads by either name (the larger
    recorded results are gzipped); write_json makes the folder."""
    import gzip
    res = {"rows": [{"kv_dtype": "nvfp4", "x": 1.5}]}
    common.write_json(tmp_path / "sub" / "a.json", res)
    (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps(res).encode()))
    for name in ("sub/a.json", "b.json", "b.json.gz"):
        assert common.read_json(tmp_path / name) == res


def test_rows_per_dtype_one_dtype_in_process():
    rows = common.rows_per_dtype("evals.unused", ["nvfp4"], "unused.json",
                                 lambda dt: {"kv_dtype": dt, "pid": os.getpid()})
    assert rows == [{"kv_dtype": "nvfp4", "pid": os.getpid()}]


# ---------------------------------------------------------------- the serving clients
class _FakeVllm(__import__("http.server").server.BaseHTTPRequestHandler):
    """/v1/completions as vLLM streams it: three SSE chunks of one token each, a usage chunk,
    [DONE]; a prompt "fail" gets HTTP 500; stream=false gets one JSON answer."""
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == "fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        self.send_response(200)
        self.end_headers()
        if not body.get("stream"):
            self.wfile.write(json.dumps({"choices": [{"text": "abc", "finish_reason": "length"}],
                                         "usage": {"completion_tokens": 3}}).encode())
            return
        for i, t in enumerate("abc"):
            ch = {"text": t, "token_ids": [i], "finish_reason": "length" if i == 2 else None}
            self.wfile.write(f"data: {json.dumps({'choices': [ch]})}\n\n".encode())
        self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n')
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_completion_clients_against_a_fake_server():
    import threading
    from http.server import ThreadingHTTPServer
    from evals import multiturn, soak
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        r = multiturn.stream_completion(port, {"prompt": "x", "stream": True}, 10)
        assert r["status"] == "completed" and r["token_ids"] == [0, 1, 2]
        assert r["usage"] == {"completion_tokens": 3} and r["finish_reason"] == "length"
        r = soak.completion(port, {"prompt": "x", "stream": True})
        assert (r["status"], r["text"], r["chunks"], r["tokens"]) == ("completed", "abc", 3, 3)
        assert soak.completion(port, {"prompt": "x", "stream": True}, abort_after=2)["status"] \
            == "aborted"
        assert soak.completion(port, {"prompt": "x"})["text"] == "abc"
        for r in (multiturn.stream_completion(port, {"prompt": "fail"}, 10),
                  soak.completion(port, {"prompt": "fail"})):
            assert r["status"] == "error" and "HTTP 500" in r["error"]
    finally:
        srv.shutdown()
        srv.server_close()
    r = soak.completion(port, {"prompt": "x"}, timeout=2)   # nobody listens any more
    assert r["status"] == "error" and "Connection" in r["error"]


def test_decode_check_agreement_counts_tokens_before_the_first_difference():
    from evals import decode_check
    got = decode_check.agreement([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 9, 4], [5, 6, 7], []])
    assert got["common_prefix"] == [2, 2, 0]
    assert got["common_prefix_fraction"] == 4 / 7


def test_run_info_names_device_versions_and_commit():
    info = common.run_info(on_gpu=False)
    assert info["device"] == f"CPU ({os.cpu_count()} cores)" and info["date"][:2] == "20"
    assert "torch" in info["versions"] and "vllm-nvfp4kv (git)" in info["versions"]
    with mock.patch.dict(os.environ, {"NVFP4KV_DECODE_VARIANT": "v_halves"}):
        assert common.run_info(on_gpu=False)["nvfp4kv_env"]["NVFP4KV_DECODE_VARIANT"] == "v_halves"


def test_sm_clock_mhz_samples_while_the_block_runs(tmp_path):
    """common.sm_clock_mhz: min/median/max of the sampler's lines after its first, filled
    on exit (here a stand-in for `nvidia-smi -lms`: a sample from before the block, then
    three and a non-number, and it runs on until stopped); empty without the tool."""
    sampled = tmp_path / "sampled"
    fake = [sys.executable, "-c", "import time; print(345, 1980, 1410, 1755, 'N/A', sep='\\n', "
            f"flush=True); open({str(sampled)!r}, 'w').close(); time.sleep(60)"]
    with common.sm_clock_mhz(cmd=fake) as clock:
        for _ in range(600):
            if sampled.exists():
                break
            time.sleep(0.05)
        assert clock == {}
    assert clock == {"min": 1410, "median": 1755, "max": 1980, "samples": 3}
    with common.sm_clock_mhz(cmd=["no-such-nvidia-smi"]) as clock:
        pass
    assert clock == {}


def test_fidelity_plot_panels_by_model_and_device(tmp_path):
    from evals import fidelity
    sweep = {"device": "cpu", "model": "/m/smollm2", "date": "2026-12-04T00:00:00",
             "rows": [{"kv_dtype": "auto", "kl": 0.0}, {"kv_dtype": "nvfp4", "kl": 0.02},
                      {"kv_dtype": "nvfp4 + 4over6", "kl": 0.01}, {"kv_dtype": "x"}]}
    plain = {"device": "NVIDIA H200", "model": "/m/smollm2", "date": "2026-12-04T00:00:00",
             "nvfp4kv_env": {}, "rows": [{"kv_dtype": "nvfp4", "kl": 0.03},
                                         {"kv_dtype": "fp8", "kl": float("nan")}]}
    files = []
    for name, res in (("a.json", sweep), ("b.json", plain)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(res))
    panels = fidelity.plot_panels(files)
    assert list(panels) == ["smollm2 (CPU)", "smollm2 (NVIDIA H200)"]
    assert panels["smollm2 (CPU)"] == [("auto", 0.0), ("nvfp4 (no option)", 0.02),
                                       ("nvfp4 + 4over6", 0.01)]
    (label, kl), (fp8, nan) = panels["smollm2 (NVIDIA H200)"]
    assert (label, kl) == ("nvfp4 (the defaults of 2026-12-04; b)", 0.03)
    assert fp8 == "fp8 (scale 1)" and nan != nan
    fidelity.plot(tmp_path / "f.png", files)
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_turboquant_baseline_attends_like_exact_attention():
    """bench_decode's turboquant_4bit_nc baseline (vLLM's store and decode kernels, run in the
    interpreter here) is set up right: over a cache it wrote, its decode output is within 4-bit
    error of exact attention over the same K/V (not garbage from a wrong layout or codebook)."""
    import torch
    from evals import bench_decode as bd
    p = bd.Problem(1, 96, 8, 2, 128, 16, torch.device("cpu"))
    kv = torch.randn(p.num_blocks * p.page, 2, 128,
                     generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = bd.tq4_fn(p, kv)().float()[0]
    tok = torch.arange(96)
    slots = p.block_table[0, tok // 16].long() * 16 + tok % 16
    k = kv[slots].float().repeat_interleave(4, 1)                      # [T, Hq, D]
    s = torch.einsum("hd,thd->ht", p.q[0].float(), k) * p.scale
    exact = torch.einsum("ht,thd->hd", s.softmax(-1), k)
    err = float((out - exact).norm() / exact.norm())
    assert err < 0.25, err  # measured 0.14 (torch 2.11 CPU, triton 3.6 interpreter)


def test_bench_write_toy_runs_every_rule(tmp_path):
    """evals.bench_write --toy (Triton's interpreter): one row per block-scale rule, plain
    and with the K transforms fused, a JSON with the run's provenance, and its PNG."""
    import subprocess
    from vllm_nvfp4kv.kernels.format import BLOCK_SCALE_RULES
    out = tmp_path / "write.json"
    subprocess.run([sys.executable, "-P", "-m", "evals.bench_write", "--toy", "--out", str(out)],
                   check=True, capture_output=True)
    res = json.loads(out.read_text())
    assert [(r["rule"], r["fused"]) for r in res["rows"]] == [
        (rule, fused) for fused in (False, True) for rule in BLOCK_SCALE_RULES]
    assert all(r["us"] > 0 for r in res["rows"]) and res["run"]["device"].startswith("CPU")
    assert out.with_suffix(".png").stat().st_size > 0


def test_gpu_gaps_sums_idle_time_between_kernels():
    """profile_step.gpu_gaps: idle time inside the kernels' span, overlapping kernels (other
    streams) counted once, gaps summed by the kernels around them."""
    with mock.patch.dict(os.environ):  # the script sets an engine variable when imported
        from evals import profile_step
    ks = [(0, 10, "gemm"), (12, 20, "attn"), (15, 30, "write"),  # overlap: no gap at 15
          (35, 40, "gemm"), (42, 50, "attn"), (60, 61, "gemm")]
    g = profile_step.gpu_gaps(ks, top=5)
    assert g["span_us"] == 61 and g["idle_us"] == 2 + 5 + 2 + 10
    gaps = {(x["before"], x["after"]): (x["us"], x["count"]) for x in g["top_gaps"]}
    assert gaps == {("gemm", "attn"): (4, 2), ("write", "gemm"): (5, 1),
                    ("attn", "gemm"): (10, 1)}
    assert g["top_gaps"][0]["before"] == "attn"  # largest first
    assert profile_step.gpu_gaps([], 3) == {"span_us": 0.0, "idle_us": 0.0, "top_gaps": []}


def test_fp8_scales_from_a_scales_file(tmp_path, monkeypatch):
    """The FP8 baseline with fitted scales: each named layer's k/v scale (tensor and float,
    what vLLM's attention reads) becomes amax / 448; other layers keep theirs. The function
    reaches the engine through LLM.apply_model, pickled where the engine is another process."""
    import pickle
    from types import SimpleNamespace

    import torch

    from evals import common

    class Layer(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.layer_name, self._k_scale, self._v_scale = name, torch.ones(1), torch.ones(1)
            self._k_scale_float = self._v_scale_float = 1.0

    model = torch.nn.Sequential(Layer("a"), Layer("b"))
    llm = SimpleNamespace(apply_model=lambda fn: [pickle.loads(pickle.dumps(fn))(model)])
    f = tmp_path / "scales.json"
    f.write_text(json.dumps({"a": [1.0, 1.0], "_meta": {"amax": {"a": [224.0, 896.0]}}}))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")  # restored after the test
    assert common.kv_spec(f"fp8+scales={f}") == ("fp8", {}, str(f))
    assert common.kv_spec("fp8+calculate_kv_scales") == ("fp8", {"calculate_kv_scales": True},
                                                         None)
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert common.kv_spec("nvfp4") == ("nvfp4", {}, None)
    with pytest.raises(SystemExit):
        common.kv_spec(f"nvfp4+scales={f}")
    assert common.set_fp8_scales(llm, str(f)) == 1
    assert (model[0]._k_scale.item(), model[0]._v_scale.item()) == (0.5, 2.0)
    assert (model[0]._k_scale_float, model[0]._v_scale_float) == (0.5, 2.0)
    assert (model[1]._k_scale.item(), model[1]._k_scale_float) == (1.0, 1.0)


def test_side_by_side_runs_at_most_n_and_stops_at_the_deadline(tmp_path):
    """evals.side_by_side: every job runs (never more than max_running at once), each with
    its own log and exit status; one past the deadline is stopped, and one not yet started by
    then never starts."""
    from evals import side_by_side
    count = tmp_path / "count"
    # each job notes how many run beside it (a file per running job)
    body = (f"touch {count}.$$; ls {count}.* | wc -l >> {tmp_path}/seen; sleep 0.6; "
            f"rm {count}.$$; echo ok")
    jobs = [(f"j{i}", body) for i in range(4)] + [("slow", "sleep 30"), ("late", "echo no")]
    st = side_by_side.run(jobs, tmp_path / "out", max_running=2, stagger_s=0,
                          deadline_s=4, poll_s=0.05)
    assert [st[f"j{i}"]["exit"] for i in range(4)] == [0] * 4
    assert (tmp_path / "out" / "j0.log").read_text() == "ok\n"
    assert max(int(x) for x in (tmp_path / "seen").read_text().split()) <= 2
    assert st["slow"]["stopped"] == "at the deadline" and st["slow"]["exit"] != 0
    assert st["late"]["state"] in ("done", "not started: deadline")
    assert json.loads((tmp_path / "out" / "status.json").read_text()) == st


def test_layer_sensitivity_channel_ratio():
    """The outlier ratio layer_sensitivity reports: max / median per-channel amax of the worst
    KV head, K's over RoPE pairs (channel i with i + D/2), as the backend's centering test."""
    import torch

    from evals.layer_sensitivity import channel_ratio
    x = torch.ones(1, 2, 5, 8)        # [B, H, T, D]
    x[0, 1, 3, 1] = -40.0             # head 1, channel 1: 40x the rest
    assert channel_ratio(x, rope_pairs=False) == 40.0
    x[0, 1, 3, 5] = 80.0              # channel 5 pairs with channel 1 (D/2 = 4)
    assert channel_ratio(x, rope_pairs=True) == 80.0   # pairs: [80, 1, 1, 1] -> median 1
