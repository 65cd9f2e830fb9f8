"""Where each operation of the backend runs: the Triton kernels (``vllm_nvfp4kv.kernels``) and
vLLM's FlashAttention on a CUDA device, their plain-torch references (``kernels/reference.py``)
elsewhere, i.e. on vLLM's CPU engine. The one module of the package that chooses by device,
and the only one that imports the references (besides the tests, which compare the two).

Also from the references, the few torch formulas the backend runs on every device: the global
scale rule of calibration (bit for bit the CUDA-graph guard kernel's) and quantize-then-
dequantize (K's rotation choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nvfp4kv import dense_attention as flash, kernels
from vllm_nvfp4kv.kernels import reference
from vllm_nvfp4kv.kernels.reference import masked_amax, scale_from_amax  # calibration's rule
from vllm_nvfp4kv.kernels.rotation import hadamard

__all__ = ["AttentionParams", "on_triton", "write_cache", "writer_transforms_k", "decode",
           "gather_cache", "put_rows", "dense_attention", "flash_attn_version", "fake_quantize",
           "masked_amax", "scale_from_amax"]


@dataclass
class AttentionParams:
    """A layer's attention besides its tensors (fixed once the layer is built; fa_version is
    known at the first prefill on a GPU)."""
    scale: float                            # softmax scale
    window: int | None = None               # sliding window: keys in (pos - window, pos]
    softcap: float = 0.0                    # logit soft-cap (0: none)
    sinks: torch.Tensor | None = None       # [Hq] fp32 sink logits
    fa_version: int | None = None           # FlashAttention's (CUDA)


def on_triton(device: torch.device) -> bool:
    """Whether the operations below run the Triton kernels on this device (else the torch
    references)."""
    return device.type == "cuda"


def write_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale, v_scale, block_scales: str,
                fused_k: tuple[torch.Tensor | None, bool | torch.Tensor] | None = None) -> None:
    """Quantize key/value [T, Hkv, D] into kv_cache [num_blocks, 2 Hkv, N, D/2 + D/16] uint8 at
    slot_mapping [T] (slots < 0 skipped) with the block-scale rule block_scales.
    fused_k: (k_sub, rotate_k) of the cache space applied to K inside the writer
    (kernels.write_cache), which only the Triton writer does (on a CPU: Triton's
    interpreter, as the tests run it)."""
    if fused_k is not None:
        k_sub, rotate_k = fused_k
        kernels.write_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale, block_scales,
                            k_sub=k_sub, rotate_k=rotate_k)
    elif on_triton(kv_cache.device):
        kernels.write_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale, block_scales)
    else:
        reference.write_cache(kv_cache, key, value, slot_mapping, k_scale, v_scale,
                              block_scales)


def writer_transforms_k(device: torch.device) -> bool:
    """Whether write_cache on this device can take K's transforms (fused_k): the Triton writer
    on CUDA can; the reference writer has none (the torch ops of the cache space run first)."""
    return on_triton(device)


def decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, k_scale, v_scale, attn: AttentionParams,
           num_splits: int, variant: dict) -> None:
    """One query row per sequence: q [B, Hq, D] over its seq_lens [B] cached tokens (block
    table [B, max_blocks] int32) into out [B, Hq, D]. num_splits / variant: the Triton
    kernel's split-KV count and launch variant (kernels.decode.DECODE_VARIANTS)."""
    if on_triton(q.device):
        kernels.decode_attention(q, kv_cache, block_table, seq_lens, out, attn.scale, k_scale,
                                 v_scale, sliding_window=attn.window, softcap=attn.softcap,
                                 sinks=attn.sinks, num_splits=num_splits, **variant)
        return
    res = reference.paged_attention(q, kv_cache, block_table, torch.arange(q.shape[0] + 1),
                                    seq_lens, attn.scale, k_scale, v_scale, attn.window,
                                    attn.softcap, attn.sinks)
    out.copy_(res.to(out.dtype))


def gather_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_tokens: torch.Tensor,
                 seq_starts: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, k_scale,
                 v_scale, max_tokens: int, out_div: float, out_starts: torch.Tensor) -> None:
    """Dequantize tokens [seq_starts[b], + cu_tokens[b+1] - cu_tokens[b]) of each sequence b
    into rows out_starts[b]: of k_out / v_out [rows, Hkv, D], divided by out_div, in their
    dtype (kernels.gather_cache)."""
    if on_triton(kv_cache.device):
        kernels.gather_cache(kv_cache, block_table, cu_tokens, seq_starts, k_out, v_out,
                             k_scale, v_scale, max_tokens, out_div=out_div,
                             out_starts=out_starts)
        return
    k, v = reference.gather_cache(kv_cache, block_table, cu_tokens, seq_starts, k_out.shape[-1],
                                  k_scale, v_scale)
    if out_div != 1.0:
        k, v = k / out_div, v / out_div
    for b in range(block_table.shape[0]):
        t0, t1, dst = int(cu_tokens[b]), int(cu_tokens[b + 1]), int(out_starts[b])
        _copy(k_out[dst:dst + t1 - t0], k[t0:t1])
        _copy(v_out[dst:dst + t1 - t0], v[t0:t1])


def _copy(out: torch.Tensor, x: torch.Tensor) -> None:
    """out = x in out's dtype (FP8 through a byte view: not every CPU copy has FP8)."""
    x = x.to(out.dtype)
    if out.dtype == torch.float8_e4m3fn:
        out, x = out.view(torch.uint8), x.view(torch.uint8)
    out.copy_(x)


def put_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
             sub: torch.Tensor | None, mul: torch.Tensor | None, rotate: bool | torch.Tensor,
             out_div: torch.Tensor | None, kernel: bool | None = None) -> None:
    """out[rows] = x [T, Hkv, D] made finite, minus sub, times mul, rotated (rotate: True, or
    a device int32 flag [1]), FP8 out divided by out_div (kernels.put_rows). kernel: the
    Triton kernel (default: on CUDA; the tests also run it in Triton's interpreter), which
    needs a power-of-two D; else the torch reference."""
    d = x.shape[-1]
    if (on_triton(x.device) if kernel is None else kernel) and d & (d - 1) == 0:
        kernels.put_rows(x, rows, out, sub, mul, rotate, out_div)
        return
    if isinstance(rotate, torch.Tensor):
        rotate = bool(rotate)  # a host read: this path runs eagerly (CPU)
    rot = hadamard(d, str(x.device), x.dtype) if rotate else None
    reference.put_rows(x, rows, out, sub, mul, rot, out_div)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                    scale: float, causal: bool, window: int | None, softcap: float,
                    sinks: torch.Tensor | None, fa_version: int | None,
                    cu_q_cpu: torch.Tensor | None = None, cu_k_cpu: torch.Tensor | None = None,
                    return_lse: bool = False, descale: tuple | None = None):
    """Varlen attention over contiguous K/V: sequence b has queries q[cu_q[b]:cu_q[b+1]] and
    keys k[cu_k[b]:...]; causal masks align the last query with the last key. Writes out
    [Tq, Hq, D]; returns the LSE [Hq, Tq] (natural log) when return_lse. descale: (q, k, v)
    one-element fp32 tensors when q, k, v are FP8 E4M3 (true value = stored * descale).
    FlashAttention on CUDA (dense_attention.flash_attention), the reference elsewhere, one
    sequence at a time (small models in tests)."""
    if q.is_cuda:
        return flash.flash_attention(q, k, v, out, cu_q, cu_k, max_q, max_k, scale, causal,
                                     window, softcap, sinks, fa_version, return_lse, descale)
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


def flash_attn_version(device: torch.device, head_size: int, has_sinks: bool,
                       workspace_dtype: torch.dtype) -> int | None:
    """The FlashAttention version dense_attention runs for a layer on CUDA (an FP8 workspace
    needs FA3); None elsewhere (the reference)."""
    if device.type != "cuda":
        return None
    return flash.flash_attn_version(head_size, has_sinks, workspace_dtype)


def fake_quantize(x: torch.Tensor, global_scale, block_scales: str) -> torch.Tensor:
    """x [..., D] through the 4-bit format and back (fp32), on x's device: what the cache
    gives back of it (reference.quantize / dequantize)."""
    data, s = reference.quantize(x, global_scale, block_scales)
    return reference.dequantize(data, s, global_scale)
