"""One-shot calibration of a layer's FP32 global scales (format.py's ``g``) on the device, as a
CUDA graph can capture it: one program, no host read (reference:
reference.calibrate_global_scales).

For each side (K, V) whose device flag is still 0: amax = the largest finite |x| over the rows
whose slot is >= 0; if amax > 0, the scale becomes the power of two >= amax * headroom / 2688
(reference.scale_from_amax, bit for bit) and the flag 1. A side with a set flag, or with no
finite non-zero value in a real row (padded-only batch, all zeros, all NaN/Inf), is left as it
is. When both flags are set the kernel returns after reading them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .format import E2M1_MAX, E4M3_MAX


@triton.jit
def _masked_amax(x_ptr, slot_ptr, T, stride_t, stride_h, H: tl.constexpr, D: tl.constexpr,
                 D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """max |x| over rows t < T with slot[t] >= 0 of x [T, H, D]; NaN/Inf count as 0."""
    tt = tl.arange(0, BLOCK_T)
    dd = tl.arange(0, D_PAD)
    acc = tl.zeros((BLOCK_T, D_PAD), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tt
        slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1)
        ok = (slot >= 0)[:, None] & (dd < D)[None, :]
        for h in tl.static_range(H):
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_t + h * stride_h
                        + dd[None, :], mask=ok, other=0.0).to(tl.float32)
            a = tl.abs(x)
            acc = tl.maximum(acc, tl.where((a == a) & (a < float("inf")), a, 0.0))
    return tl.max(tl.max(acc, axis=1), axis=0)


@triton.jit
def _pow2_at_least(y):
    y = tl.minimum(tl.maximum(y, 2.0 ** -120), 2.0 ** 120)
    bits = y.to(tl.int32, bitcast=True)
    e = bits & 0x7F800000
    return tl.where((bits & 0x007FFFFF) == 0, e, e + 0x00800000).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["T"])  # captured at every CUDA-graph size: one build for all
def _calibrate_kernel(key_ptr, value_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, flag_ptr, T,
                      factor, stride_kt, stride_kh, stride_vt, stride_vh, H: tl.constexpr,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    fk = tl.load(flag_ptr)
    fv = tl.load(flag_ptr + 1)
    if fk + fv < 2:  # otherwise return at once: the cost of a replay after calibration
        ak = _masked_amax(key_ptr, slot_ptr, T, stride_kt, stride_kh, H, D, D_PAD, BLOCK_T)
        av = _masked_amax(value_ptr, slot_ptr, T, stride_vt, stride_vh, H, D, D_PAD, BLOCK_T)
        if (fk == 0) & (ak > 0):
            tl.store(k_scale_ptr, _pow2_at_least(ak * factor))
            tl.store(flag_ptr, 1)
        if (fv == 0) & (av > 0):
            tl.store(v_scale_ptr, _pow2_at_least(av * factor))
            tl.store(flag_ptr + 1, 1)


def calibrate_global_scales(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                            k_scale: torch.Tensor, v_scale: torch.Tensor, flag: torch.Tensor,
                            headroom: float) -> None:
    """In place, one single-program launch without host reads: the sides of flag [2] int32
    ([k, v], 1 = fixed) still 0 get k_scale / v_scale (fp32, one element each) from the first
    T rows of key / value [>= T, H, D] (bf16/fp16/fp32, last dim contiguous) whose
    slot_mapping [T] entry is >= 0, by the rule above."""
    t, (h, d) = slot_mapping.shape[0], key.shape[1:]
    if t == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert flag.dtype == torch.int32 and flag.numel() == 2
    # headroom / 2688 rounded to fp32 once, as reference.scale_from_amax does
    factor = float(torch.tensor(headroom / (E2M1_MAX * E4M3_MAX), dtype=torch.float32))
    _calibrate_kernel[(1,)](
        key, value, slot_mapping, k_scale, v_scale, flag, t, factor,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), H=h, D=d,
        D_PAD=triton.next_power_of_2(d), BLOCK_T=16, num_warps=4)
