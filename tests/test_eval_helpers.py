"""Helpers the eval scripts share (evals/assets.py), without an engine."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))
import assets  # noqa: E402

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
    rows = assets.rows_one_process_per_dtype(str(script), ["fp8", "nvfp4+fp8ws", "bad"],
                                             str(out))
    assert [r["kv_dtype"] for r in rows] == ["fp8", "nvfp4+fp8ws", "bad"]
    assert rows[0]["pid"] != rows[1]["pid"]           # a fresh process per dtype
    assert rows[0]["inputs"] == [8, 16]               # the other arguments pass through
    assert rows[2] == {"kv_dtype": "bad", "error": "its process exited with 3"}
    assert not list(tmp_path.glob("*.part.json"))     # the per-dtype files are gone
    json.dumps(rows)



def test_rows_per_dtype_in_process_without_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rows = assets.rows_per_dtype("unused.py", ["fp8", "nvfp4"], "unused.json",
                                 lambda dt: {"kv_dtype": dt})
    assert rows == [{"kv_dtype": "fp8"}, {"kv_dtype": "nvfp4"}]
