"""The dequantization workspace of the chunked-prefill path: ONE pair of K/V buffers shared by
all layers (vLLM's WorkspaceManager buffer), sized once from the scheduler limits.

Rows = max_num_batched_tokens (the chunk's own K/V) + the cached prefix attended in one piece
(at most the option workspace_prefix_tokens, default 65536, or the model length if smaller;
a sliding window bounds it too). A longer prefix is attended in pieces merged by LSE, so a
1M-token prefix does not need a 1M-token workspace. The buffer is reserved when the metadata
builder is created and touched in the profiling run, so vLLM counts it before sizing the KV
cache.
"""
from __future__ import annotations

import torch

FP8_DIV = 8.0  # FP8 workspace values are (e2m1 * e4m3) / FP8_DIV; descale = FP8_DIV * g
_fallback: dict = {}  # device -> buffer, where vLLM's manager is not initialised (CPU tests)


def workspace_capacity(vllm_config, window: int | None, prefix_tokens: int) -> int:
    """Workspace rows for this configuration (prefix_tokens: NvFp4KVConfig's
    workspace_prefix_tokens)."""
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    prefix = min(model.max_model_len, prefix_tokens)
    if window:
        prefix = min(prefix, window)
    return sched.max_num_batched_tokens + prefix


def workspace_dtype(model_dtype: torch.dtype, option: str) -> torch.dtype:
    """The workspace dtype for NvFp4KVConfig's workspace_dtype ("auto": the model's, "fp8")."""
    return torch.float8_e4m3fn if option == "fp8" else model_dtype


def workspace_views(rows: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views [rows, num_kv_heads, head_size] into the shared workspace."""
    shape = (rows, num_kv_heads, head_size)
    from vllm.v1.worker.workspace import (current_workspace_manager,
                                          is_workspace_manager_initialized)
    if is_workspace_manager_initialized():
        return tuple(current_workspace_manager().get_simultaneous((shape, dtype),
                                                                  (shape, dtype)))
    need = 2 * rows * num_kv_heads * head_size
    key = (str(device), dtype)
    buf = _fallback.get(key)
    if buf is None or buf.numel() < need:
        buf = _fallback[key] = torch.empty(need, dtype=dtype, device=device)
    return buf[:need // 2].view(shape), buf[need // 2:need].view(shape)
