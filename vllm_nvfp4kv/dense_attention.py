"""Attention over contiguous (unquantized) K/V for the prefill paths on CUDA: FlashAttention
(FA3 on Hopper, FA2 on Ampere/Ada) from vLLM's own build (ops.dense_attention picks it, or
the torch reference elsewhere); and the helpers around it (FP8 inputs, merging partial
attentions by LSE)."""
from __future__ import annotations

import torch


def flash_attn_version(head_size: int, has_sinks: bool, workspace_dtype: torch.dtype) -> int:
    """vLLM's FlashAttention version for this layer; an FP8 workspace needs FA3."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    version = get_flash_attn_version(head_size=head_size, has_sinks=has_sinks)
    if workspace_dtype == torch.float8_e4m3fn and version != 3:
        raise ValueError("NVFP4 KV option workspace_dtype=fp8 (NVFP4KV_WORKSPACE_DTYPE) needs "
                         f"FlashAttention 3 (Hopper); this GPU has FA{version}: unset it (BF16 "
                         "workspace)")
    return version


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                    scale: float, causal: bool, window: int | None, softcap: float,
                    sinks: torch.Tensor | None, fa_version: int | None,
                    return_lse: bool = False, descale: tuple | None = None):
    """ops.dense_attention on CUDA: vLLM's flash_attn_varlen_func (FA3 FP8 with descales)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    fp8 = {}
    if descale is not None:  # FA3 wants them per (sequence, KV head)
        shape = (cu_q.shape[0] - 1, k.shape[1])
        fp8 = {f"{n}_descale": x.reshape(1, 1).expand(shape) for n, x in zip("qkv", descale)}
    res = flash_attn_varlen_func(
        q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
        cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
        window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap,
        s_aux=None if sinks is None else sinks.to(torch.bfloat16),  # FA3 takes bf16 only
        fa_version=fa_version, out=out, return_softmax_lse=return_lse, **fp8)
    return res[1] if return_lse else None


def to_fp8(x: torch.Tensor, div: torch.Tensor) -> torch.Tensor:
    """x / div in E4M3, saturating (a plain cast would turn values beyond 448 into NaN)."""
    return (x.float() / div).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def merge_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
              lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets. out [T, H, D], lse [H, T]."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0).transpose(0, 1)[..., None]
    wb = torch.exp(lse_b - lse).nan_to_num(0.0).transpose(0, 1)[..., None]
    return (out_a.float() * wa + out_b.float() * wb), lse
