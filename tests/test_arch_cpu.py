"""The architectures #35 names, started with --kv-cache-dtype nvfp4 on vLLM's CPU engine
(dummy weights, the real attention shapes of evals/models with the rest shrunk to fit a CI
machine): every attention layer is served by the backend with its model's head size, sliding
window and sinks, and the engine generates. The GPU runs of the same configs, at full width,
are the `arch-*` stages of evals/gpu_stages.py.

- Gemma 3 (12B's attention): head_dim 256, 8 KV heads, 5 sliding-window (1,024) : 1 global.
- gpt-oss (20B's attention): head_dim 64, 64 q / 8 KV heads, sink logits in every layer,
  alternating 128-token sliding window.
- Qwen3-Next / Qwen3.5 (80B-A3B's attention): gated attention at head_dim 256 with 2 KV heads
  between Gated-DeltaNet layers, MoE; its state pages and ours share one block pool
  (tests/test_hybrid_pages.py works out the page sizes). vLLM 0.26's CPU build runs it with
  float32 recurrent state only (BF16 state fails inside vLLM for every KV dtype).
"""
import os
from pathlib import Path

import pytest

from helpers import CPU_BLOCK_SIZE

vllm = pytest.importorskip("vllm")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")             # skip inductor warm-up on CPU
# vLLM inspects a model's architecture in a `python -m` subprocess: with the working directory
# first on its path, this checkout's kernels/ would shadow Hugging Face's `kernels` package
os.environ.setdefault("PYTHONSAFEPATH", "1")

MODELS = Path(__file__).resolve().parents[1] / "evals" / "models"
SMALL = dict(hidden_size=256, vocab_size=1024)
# name -> (hf_overrides that keep the attention and cut the rest, engine kwargs,
#          per attention layer: (window or None, sinks))
ARCHS = {
    "gemma3-12b-12layers": (
        dict(SMALL, intermediate_size=256, num_hidden_layers=6,
             layer_types=["sliding_attention"] * 5 + ["full_attention"]),
        {}, [(1024, False)] * 5 + [(None, False)]),
    "gpt-oss-20b-8layers": (
        dict(SMALL, intermediate_size=128, num_local_experts=4, num_hidden_layers=4,
             layer_types=["sliding_attention", "full_attention"] * 2),
        {}, [(128, True), (None, True)] * 2),
    "qwen3-next-8layers": (
        dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
             shared_expert_intermediate_size=64, linear_num_key_heads=2,
             linear_num_value_heads=4, num_hidden_layers=4),
        dict(mamba_ssm_cache_dtype="float32"), [(None, False)]),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_serves_with_nvfp4(name):
    from vllm import LLM, SamplingParams

    from vllm_nvfp4kv.backend import NvFp4AttentionImpl
    overrides, extra, expected = ARCHS[name]
    cfg = vllm_config_json(name)
    llm = LLM(model=str(MODELS / name), load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="bfloat16", max_model_len=1024, max_num_seqs=2,
              max_num_batched_tokens=128, kv_cache_memory_bytes=32 << 20,
              kv_cache_dtype="nvfp4", seed=0, hf_overrides=overrides,
              **({} if "qwen3" in name else dict(block_size=CPU_BLOCK_SIZE)), **extra)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        layers = [m for m in runner.model.modules() if hasattr(m, "impl")]
        assert [type(m.impl) for m in layers] == [NvFp4AttentionImpl] * len(expected)
        assert [(m.impl.attn.window, m.impl.attn.sinks is not None) for m in layers] == expected
        assert {m.impl.head_size for m in layers} == {cfg["head_dim"]}
        assert {m.impl.num_kv_heads for m in layers} == {cfg["num_key_value_heads"]}
        prompt = {"prompt_token_ids": list(range(3, 203))}  # two chunks of prefill
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                    detokenize=False, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        # the next engine in this process builds its own parallel groups (with or without
        # expert parallelism: a MoE model after a dense one asserts on a stale group)
        from vllm.distributed import cleanup_dist_env_and_memory
        del llm
        cleanup_dist_env_and_memory()


def vllm_config_json(name: str) -> dict:
    import json
    return json.loads((MODELS / name / "config.json").read_text())
