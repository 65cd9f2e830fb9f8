"""Gather-and-dequantize cached prefixes into a contiguous workspace, one launch for a batch
(reference: reference.gather_cache)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import E2M1_FP16_FACTOR, E4M3_FP16_FACTOR, e2m1_unpack_fp16, e4m3_decode_fp16
from .format import GROUP_SIZE, PageLayout


@triton.jit
def _gather_kernel(cache_ptr, block_table_ptr, cu_tokens_ptr, seq_starts_ptr,
                   k_out_ptr, v_out_ptr, k_scale_ptr, v_scale_ptr, out_div,
                   stride_bt, page_stride, stride_ot, stride_oh,
                   H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, USE_ASM: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    out0 = tl.load(cu_tokens_ptr + b)
    count = tl.load(cu_tokens_ptr + b + 1) - out0
    if tile * BLOCK_T >= count:
        return
    G: tl.constexpr = D // 16
    SIDE_BYTES: tl.constexpr = H * N * (D // 2 + G)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < count
    pos = tl.load(seq_starts_ptr + b) + t
    blk = tl.load(block_table_ptr + b * stride_bt + pos // N, mask=tmask, other=0).to(tl.int64)
    row = h * N + pos % N
    gi = tl.arange(0, G_PAD)
    ii = tl.arange(0, 8)
    m3 = tmask[:, None, None] & (gi < G)[None, :, None]
    # out[t, h, 16 g + 2 i (+1)]: even elements from low nibbles, odd from high nibbles
    out_off = ((out0 + t) * stride_ot + h * stride_oh)[:, None, None] \
        + (gi[:, None] * 16 + 2 * ii[None, :])[None, :, :]
    for side in tl.static_range(2):
        base = cache_ptr + blk * page_stride + side * SIDE_BYTES
        data = tl.load(base[:, None, None] + (row * (D // 2))[:, None, None]
                       + (gi[:, None] * 8 + ii[None, :])[None, :, :], mask=m3, other=0)
        sc = tl.load(base[:, None] + H * N * (D // 2) + (row * G)[:, None] + gi[None, :],
                     mask=tmask[:, None] & (gi < G)[None, :], other=0)
        if side == 0:
            g = tl.load(k_scale_ptr)
            out_ptr = k_out_ptr
        else:
            g = tl.load(v_scale_ptr)
            out_ptr = v_out_ptr
        # e2m1 * e4m3 is exact in fp32; one rounding for * g, as in the reference.
        sc32 = e4m3_decode_fp16(sc).to(tl.float32)[:, :, None]
        gmul = tl.math.div_rn(g * (E2M1_FP16_FACTOR * E4M3_FP16_FACTOR), out_div)
        lo, hi = e2m1_unpack_fp16(data, USE_ASM)
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + out_off, (lo.to(tl.float32) * sc32 * gmul).to(ty), mask=m3)
        tl.store(out_ptr + out_off + 1, (hi.to(tl.float32) * sc32 * gmul).to(ty), mask=m3)


def gather_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_tokens: torch.Tensor,
                 seq_starts: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                 k_scale, v_scale, max_tokens: int, out_div: float = 1.0) -> None:
    """Dequantize tokens [seq_starts[b], seq_starts[b] + cu_tokens[b+1] - cu_tokens[b]) of each
    sequence b into rows cu_tokens[b]: of k_out / v_out [>= cu_tokens[-1], H, D].

    block_table [B, max_blocks] int32; cu_tokens [B+1], seq_starts [B] int32 on the device;
    max_tokens: an upper bound of the per-sequence counts (sizes the grid; host int).
    Values written are value / out_div in k_out.dtype (bf16, fp16, fp32 or float8_e4m3fn,
    where out_div lets the FP8 range hold e2m1 * e4m3 * g, up to 2688 g)."""
    b = block_table.shape[0]
    h, d = k_out.shape[1], k_out.shape[2]
    n = kv_cache.shape[2]
    PageLayout(n, h, d)
    if b == 0 or max_tokens == 0:
        return
    assert k_out.stride() == v_out.stride() and k_out.stride(-1) == 1
    dev = kv_cache.device
    block_t = 32 if d <= 128 else 16
    grid = (b, triton.cdiv(max_tokens, block_t), h)
    _gather_kernel[grid](
        kv_cache, block_table, cu_tokens, seq_starts, k_out, v_out,
        torch.as_tensor(k_scale, dtype=torch.float32, device=dev).reshape(1),
        torch.as_tensor(v_scale, dtype=torch.float32, device=dev).reshape(1),
        float(out_div), block_table.stride(0), kv_cache.stride(0), k_out.stride(0),
        k_out.stride(1), H=h, N=n, D=d, G_PAD=triton.next_power_of_2(d // GROUP_SIZE),
        BLOCK_T=block_t, USE_ASM=dev.type == "cuda", num_warps=4)
