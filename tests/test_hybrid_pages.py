"""The NVFP4 page in a Gated-DeltaNet hybrid (Qwen3-Next / Qwen3.5: evals/models/qwen3-next-8layers,
the real 80B-A3B shapes), worked out on the CPU with the installed vLLM's own start-up arithmetic.

In a hybrid, vLLM keeps one block pool for attention and Gated-DeltaNet (mamba) layers, so
every layer's page has the same bytes: `Platform._align_hybrid_block_size` (run by
`update_block_size_for_backend` once the attention backend is known) grows the attention
block, in multiples of the backend's smallest kernel block, until one attention page holds a
layer's recurrent state, then pads the state page up to it. The attention page of a token is
2 * KV heads * (D/2 + D/16) bytes for NVFP4 (576 at 2 KV heads of 256), 2 * heads * D for FP8
(1024), twice that for BF16; the state page is the conv state (conv_dim x (kernel - 1), model
dtype) plus the delta-rule state (value heads x value dim x key dim, mamba_ssm_cache_dtype).
For Qwen3-Next (BF16 state: 49,152 + 1,048,576 = 1,097,728 bytes):

    kv dtype  tokens per block  page bytes   state padded by
    nvfp4     1920              1,105,920    0.75 %
    fp8       1072              1,097,728    0
    auto      544               1,114,112    1.49 %

so one block holds 1.79x FP8's tokens in the same bytes. vLLM splits the 1920-token block into
kernel pages the backend takes (`select_common_block_size`: 15 pages of 128 tokens), each one
our page format. With `--mamba-ssm-cache-dtype float32` (state 2,146,304 bytes) NVFP4's block
is 3728 tokens = 233 kernel pages of 16 (FP8: 2096). Prefix caching ('align' mode) keeps the
same block sizes. Nothing here starts an engine (tests/test_arch_cpu.py runs one).
"""
from math import ceil
from pathlib import Path

import pytest

from vllm_nvfp4kv.kernels import format as fmt

vllm = pytest.importorskip("vllm")

MODEL = Path(__file__).resolve().parents[1] / "evals" / "models" / "qwen3-next-8layers"
GPU_DEFAULT_BLOCK = 16  # what vLLM's phase 1 picks on a GPU for both backends


@pytest.fixture(autouse=True)
def _gpu_state_dtype(monkeypatch):
    """The GPU engine's state dtype: vLLM's CPU platform resets the SSM cache dtype to float32
    for its accelerated Gated-DeltaNet where the host CPU has AMX tiles (0.26) or AVX-512 BF16
    (0.32), which would make the result depend on the machine the tests run on."""
    import torch
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        if hasattr(torch.cpu, probe):
            monkeypatch.setattr(torch.cpu, probe, lambda: False)


def engine_config(kv_cache_dtype: str, ssm_dtype: str = "auto", prefix_caching: bool = False,
                  **overrides):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=str(MODEL), load_format="dummy", skip_tokenizer_init=True,
                      dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=40960,
                      enforce_eager=True, mamba_ssm_cache_dtype=ssm_dtype,
                      enable_prefix_caching=prefix_caching,
                      hf_overrides=overrides).create_engine_config()


def backend_for(kv_cache_dtype: str):
    """Ours for nvfp4; FlashAttention (FA3 on Hopper, kernel blocks of any multiple of 16) for
    the others, as a GPU engine would pick them."""
    if kv_cache_dtype == "nvfp4":
        from vllm_nvfp4kv.backend import NvFp4AttentionBackend
        return NvFp4AttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    return FlashAttentionBackend


def align(vllm_config, backend, monkeypatch) -> None:
    """vLLM's block-size pass as a GPU engine runs it once the model's attention backend is
    known (the platform-independent one: the CPU platform's would keep its own 128)."""
    from vllm.platforms.interface import Platform
    if hasattr(Platform, "_find_non_ssm_backends"):  # vLLM >= 0.32
        monkeypatch.setattr(Platform, "_find_non_ssm_backends",
                            classmethod(lambda cls, vc: [backend]))
    else:
        monkeypatch.setattr(Platform, "_find_non_ssm_backend",
                            classmethod(lambda cls, vc: backend))
    Platform.update_block_size_for_backend(vllm_config)


def state_bytes(cfg: dict, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """One Gated-DeltaNet layer's recurrent state: conv state + delta-rule state."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * kh * kd + vh * vd
    return conv_dim * (cfg["linear_conv_kernel_dim"] - 1) * conv_bytes + vh * vd * kd * ssm_bytes


def token_bytes(cfg: dict, kv_cache_dtype: str) -> int:
    """One attention layer's page bytes per token."""
    d, h = cfg["head_dim"], cfg["num_key_value_heads"]
    per_side = {"nvfp4": fmt.row_bytes(d), "fp8": d}.get(kv_cache_dtype, 2 * d)
    return 2 * h * per_side


def aligned_block(state: int, per_token: int, alignment: int = GPU_DEFAULT_BLOCK) -> int:
    return alignment * ceil(state / (alignment * per_token))


@pytest.fixture(scope="module")
def cfg():
    import json
    return json.loads((MODEL / "config.json").read_text())


def test_model_is_the_real_qwen3_next_shape(cfg):
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (16, 2, 256)
    assert state_bytes(cfg, 2) == 49_152 + 1_048_576
    assert token_bytes(cfg, "nvfp4") == 576 and token_bytes(cfg, "fp8") == 1024


@pytest.mark.parametrize("kv,ssm,block,page", [
    ("nvfp4", "auto", 1920, 1_105_920), ("fp8", "auto", 1072, 1_097_728),
    ("auto", "auto", 544, 1_114_112),
    ("nvfp4", "float32", 3728, 2_147_328), ("fp8", "float32", 2096, 2_146_304)])
def test_attention_page_shares_the_state_page(cfg, monkeypatch, kv, ssm, block, page):
    vc = engine_config(kv, ssm)
    align(vc, backend_for(kv), monkeypatch)
    cc = vc.cache_config
    state = state_bytes(cfg, 4 if ssm == "float32" else 2)
    assert cc.block_size == block == aligned_block(state, token_bytes(cfg, kv))
    assert block * token_bytes(cfg, kv) == page
    # the state page is padded to the attention page (not at all where they are equal)
    assert (cc.mamba_page_size_padded or state) == page
    assert 0 <= page - state < GPU_DEFAULT_BLOCK * token_bytes(cfg, kv)


@pytest.mark.parametrize("ssm,kernel", [("auto", 128), ("float32", 16)])
def test_the_block_splits_into_kernel_pages_of_our_format(cfg, monkeypatch, ssm, kernel):
    """The worker views each 1920- (3728-) token page as kernel pages of a size the backend
    declares; each is one page of kernels/format.py, and together they fill the vLLM page."""
    from vllm.v1.worker.utils import select_common_block_size

    from vllm_nvfp4kv.backend import NvFp4AttentionBackend as B
    vc = engine_config("nvfp4", ssm)
    align(vc, B, monkeypatch)
    block = vc.cache_config.block_size
    assert select_common_block_size(block, [B]) == kernel
    assert kernel in fmt.SUPPORTED_BLOCK_SIZES and block % kernel == 0
    h, d = cfg["num_key_value_heads"], cfg["head_dim"]
    layout = fmt.PageLayout(kernel, h, d)
    assert (block // kernel) * layout.page_bytes == block * token_bytes(cfg, "nvfp4")
    n = 3  # vLLM blocks
    assert B.get_kv_cache_shape(n * block // kernel, kernel, h, d) == \
        (n * block // kernel, 2 * h, kernel, fmt.row_bytes(d))


def test_prefix_caching_keeps_the_block(monkeypatch):
    """--enable-prefix-caching puts the states in 'align' mode: a state per block, blocks as
    above."""
    from vllm_nvfp4kv.backend import NvFp4AttentionBackend
    vc = engine_config("nvfp4", prefix_caching=True)
    align(vc, NvFp4AttentionBackend, monkeypatch)
    assert vc.cache_config.mamba_cache_mode in ("align", "all")
    assert vc.cache_config.block_size == 1920


def test_nvfp4_block_holds_1_79x_fp8_tokens_in_the_same_page(cfg):
    state = state_bytes(cfg, 2)
    nv, f8 = (aligned_block(state, token_bytes(cfg, k)) for k in ("nvfp4", "fp8"))
    pages = {k: b * token_bytes(cfg, k) for k, b in (("nvfp4", nv), ("fp8", f8))}
    assert abs(pages["nvfp4"] / pages["fp8"] - 1) < 0.01  # (almost) the same page bytes
    assert round(nv / f8, 2) == 1.79
