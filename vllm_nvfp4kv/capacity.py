"""The startup line on the NVFP4 KV cache's capacity (once per process)."""
from __future__ import annotations

import logging

from vllm_nvfp4kv.kernels.format import row_bytes

logger = logging.getLogger("vllm.nvfp4kv")
_logged = False


def same_memory_tokens(tokens: int, head_size: int) -> tuple[int, int]:
    """The tokens an FP8 and a BF16 cache hold in the memory of `tokens` NVFP4 tokens."""
    nvfp4 = 2 * row_bytes(head_size)  # K + V bytes per token, head and layer
    return tokens * nvfp4 // (2 * head_size), tokens * nvfp4 // (4 * head_size)


def log_capacity(vllm_config, head_size: int, ws_rows: int, kv_heads: int) -> None:
    """KV capacity in tokens and what FP8 / BF16 would hold in the same memory (the workspace
    was counted before the KV cache was sized). Once per process, when vLLM knows the blocks."""
    global _logged
    blocks = vllm_config.cache_config.num_gpu_blocks
    if _logged or not blocks:
        return
    _logged = True
    tokens = blocks * vllm_config.cache_config.block_size
    per_token = 2 * row_bytes(head_size)  # K + V bytes per token, head and layer
    # hybrid models (sliding and full layers, e.g. Gemma 3): vLLM's allocator shares one block
    # pool among layer groups, so blocks x block_size is not what one request can hold
    types = getattr(vllm_config.model_config.hf_text_config, "layer_types", None) or ()
    hybrid = len(set(types)) > 1
    unit = "token slots" if hybrid else "tokens"
    logger.info(
        "NVFP4 KV cache (vllm-nvfp4kv): %s %s, %.2fx the %s %s an FP8 cache holds in "
        "the same memory (%.2fx BF16); %d bytes per token per KV head; dequantization "
        "workspace %d rows x %d KV heads%s", f"{tokens:,}", unit, 2 * head_size / per_token,
        f"{same_memory_tokens(tokens, head_size)[0]:,}", unit, 4 * head_size / per_token,
        per_token, ws_rows, kv_heads,
        "; hybrid model: the slots of one block pool shared by its layer groups, vLLM's "
        "'GPU KV cache size' line gives the tokens a request can use" if hybrid else "")
