"""Attention over contiguous (unquantized) K/V for the prefill paths: FlashAttention (FA3 on
Hopper, FA2 on Ampere/Ada) from vLLM's own build on CUDA, the torch reference on the CPU."""
from __future__ import annotations

import torch

from vllm_nvfp4kv.kernels import reference


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                    scale: float, causal: bool, window: int | None, softcap: float,
                    sinks: torch.Tensor | None, fa_version: int | None,
                    cu_q_cpu: torch.Tensor | None = None, cu_k_cpu: torch.Tensor | None = None,
                    return_lse: bool = False, descale: tuple | None = None):
    """Varlen attention: sequence b has queries q[cu_q[b]:cu_q[b+1]] and keys k[cu_k[b]:...];
    causal masks align the last query with the last key. Writes out [Tq, Hq, D]; returns the
    LSE [Hq, Tq] (natural log) when return_lse. descale: (q, k, v) one-element fp32 tensors
    when q, k, v are FP8 E4M3 (true value = stored * descale; FlashAttention-3 FP8)."""
    if q.device.type == "cuda":
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
        fp8 = {}
        if descale is not None:  # FA3 wants them per (sequence, KV head)
            shape = (cu_q.shape[0] - 1, k.shape[1])
            fp8 = {f"{n}_descale": x.reshape(1, 1).expand(shape)
                   for n, x in zip("qkv", descale)}
        res = flash_attn_varlen_func(
            q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
            cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
            window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap,
            s_aux=None if sinks is None else sinks.to(torch.bfloat16),  # FA3 takes bf16 only
            fa_version=fa_version, out=out, return_softmax_lse=return_lse, **fp8)
        return res[1] if return_lse else None
    # CPU: the reference, one sequence at a time (small models in tests)
    if descale is not None:
        q, k, v = (x.float() * s for x, s in zip((q, k, v), descale))
    cu_q_cpu = cu_q.cpu() if cu_q_cpu is None else cu_q_cpu
    cu_k_cpu = cu_k.cpu() if cu_k_cpu is None else cu_k_cpu
    lses = []
    for b in range(len(cu_q_cpu) - 1):
        q0, q1 = int(cu_q_cpu[b]), int(cu_q_cpu[b + 1])
        k0, k1 = int(cu_k_cpu[b]), int(cu_k_cpu[b + 1])
        if q1 == q0:
            continue
        lk = k1 - k0
        pos = torch.arange(lk - (q1 - q0), lk, device=q.device)
        if not causal:  # every key visible: place the queries after all keys
            pos = torch.full((q1 - q0,), lk, device=q.device)
        o, lse = reference.attention(q[q0:q1], k[k0:k1], v[k0:k1], scale, pos, window,
                                     softcap, sinks, return_lse=True)
        out[q0:q1] = o.to(out.dtype)
        lses.append(lse)
    if return_lse:
        return torch.cat(lses).transpose(0, 1).contiguous() if lses else \
            torch.empty(q.shape[1], 0, device=q.device)
    return None


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
