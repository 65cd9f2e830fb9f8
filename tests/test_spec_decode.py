"""Speculative decoding (vLLM's ngram proposer, no draft model) with the NVFP4 cache on the
CPU engine: greedy outputs equal those without speculation, and the verification steps
(1 + k query tokens over a cached context) really ran through the backend, on its extend
path (cached prefix through the workspace + the step's own K/V)."""
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
MODEL = str(Path(__file__).resolve().parents[1] / "evals" / "models" / "tiny-llama")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
K = 3  # speculative tokens per step


def _generate(spec: bool, monkeypatch) -> tuple[list, list]:
    from vllm import LLM, SamplingParams
    from vllm_nvfp4kv import backend
    steps = []  # (query lens, seq lens) of each step planned on the prefill/extend path
    orig = backend.plan_prefill

    def spy(qsl, sl, first, n, *a, **k):
        q = (qsl[1:] - qsl[:-1]).tolist()
        steps.append((q[first:n], sl.tolist()[first:n]))
        return orig(qsl, sl, first, n, *a, **k)
    monkeypatch.setattr(backend, "plan_prefill", spy)
    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
              kv_cache_memory_bytes=64 << 20, kv_cache_dtype="nvfp4", seed=0, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}
              if spec else None)
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(3, 900, (12,), generator=g).tolist()
    prompts = [pattern * 8, torch.randint(3, 900, (40,), generator=g).tolist()]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=24, temperature=0, detokenize=False))
    return [list(o.outputs[0].token_ids) for o in out], steps


def test_ngram_speculation_matches_plain_decoding(monkeypatch):
    plain, _ = _generate(False, monkeypatch)
    spec, steps = _generate(True, monkeypatch)
    assert spec == plain
    verify = [(q, s) for qs, ss in steps for q, s in zip(qs, ss) if 1 < q <= K + 1 and s > q]
    assert verify, "no verification step reached the backend"
