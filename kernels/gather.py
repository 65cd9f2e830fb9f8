"""What fills the chunked-prefill workspace: the cached prefixes, gathered and dequantized in one
launch for a batch (reference: reference.gather_cache), and the chunk's own exact K/V put after
them in the cache's space (reference: reference.put_rows)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write import device_scalar
from .codec import ROW_FACTOR, e4m3_encode, load_page_rows, round_to
from .format import PageLayout
from .rotation import fwht, hadamard_entry


# block_table_ptr: a prefill round's rows of the table (any offset); neither it nor the row
# stride is specialised on, so one build serves every batch (the sm_90 SASS is the same)
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_table_ptr"])
def _gather_kernel(cache_ptr, block_table_ptr, cu_tokens_ptr, seq_starts_ptr, out_starts_ptr,
                   k_out_ptr, v_out_ptr, k_scale_ptr, v_scale_ptr, out_div,
                   stride_bt, page_stride, stride_ot, stride_oh,
                   H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, USE_ASM: tl.constexpr,
                   HAS_OUT_STARTS: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    out0 = tl.load(cu_tokens_ptr + b)
    count = tl.load(cu_tokens_ptr + b + 1) - out0
    first = tl.load(seq_starts_ptr + b)
    lead = first % 2  # tiles start at even positions: V rows come in token pairs (codec)
    if tile * BLOCK_T >= count + lead:
        return
    if HAS_OUT_STARTS:
        out0 = tl.load(out_starts_ptr + b)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T) - lead   # index of the token in the sequence's
    tmask = (t >= 0) & (t < count)                       # range
    pos = first + t
    blk = tl.load(block_table_ptr + b * stride_bt + pos // N, mask=tmask, other=0)
    page_off = blk.to(tl.int64) * page_stride
    row = h * N + pos % N
    d = tl.arange(0, G_PAD * 16)
    out_off = ((out0 + t) * stride_ot + h * stride_oh)[:, None] + d[None, :]
    omask = tmask[:, None] & (d < D)[None, :]
    for side in tl.static_range(2):
        if side == 0:
            g = tl.load(k_scale_ptr)
            out_ptr = k_out_ptr
        else:
            g = tl.load(v_scale_ptr)
            out_ptr = v_out_ptr
        # rows are exact (e2m1 * e4m3 * 2**-7 in fp16): one rounding for * g, as the reference
        x = load_page_rows(cache_ptr, page_off, row, side, tmask, H, N, D, G_PAD, USE_ASM)
        mult = tl.math.div_rn(g * ROW_FACTOR, out_div)
        tl.store(out_ptr + out_off, (x.to(tl.float32) * mult).to(out_ptr.dtype.element_ty),
                 mask=omask)


def gather_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_tokens: torch.Tensor,
                 seq_starts: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                 k_scale, v_scale, max_tokens: int, out_div: float = 1.0,
                 out_starts: torch.Tensor | None = None) -> None:
    """Dequantize tokens [seq_starts[b], seq_starts[b] + cu_tokens[b+1] - cu_tokens[b]) of each
    sequence b into rows cu_tokens[b]: (or out_starts[b]: when given) of k_out / v_out
    [rows, H, D].

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
    # the kernel's row offsets are 32-bit (int64 costs the gather 3% more instructions):
    # a workspace passes 2**31 elements only at ~2M rows of 8 x 128
    assert k_out.shape[0] * k_out.stride(0) < 2 ** 31, "workspace too large for the gather"
    dev = kv_cache.device
    block_t = 32 if d <= 128 else 16
    grid = (b, triton.cdiv(max_tokens + 1, block_t), h)  # + 1: tiles start at even positions
    _gather_kernel[grid](
        kv_cache, block_table, cu_tokens, seq_starts,
        out_starts if out_starts is not None else cu_tokens, k_out, v_out,
        device_scalar(k_scale, dev), device_scalar(v_scale, dev),
        float(out_div), block_table.stride(0), kv_cache.stride(0), k_out.stride(0),
        k_out.stride(1), H=h, N=n, D=d, G_PAD=triton.next_power_of_2(d // 16),
        BLOCK_T=block_t, USE_ASM=dev.type == "cuda", HAS_OUT_STARTS=out_starts is not None,
        num_warps=4)


@triton.jit(do_not_specialize=["T"])  # the chunk's tokens: one build for every count
def _put_rows_kernel(x_ptr, rows_ptr, out_ptr, sub_ptr, mul_ptr, rot_on_ptr, div_ptr, T, big,
                     rot_c, stride_xt, stride_xh, stride_ot, stride_oh,
                     D: tl.constexpr, LOG2_D: tl.constexpr, BLOCK_T: tl.constexpr,
                     HAS_SUB: tl.constexpr, HAS_MUL: tl.constexpr, ROTATE: tl.constexpr,
                     ROT_FLAG: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    tmask = t < T
    x = tl.load(x_ptr + (t.to(tl.int64) * stride_xt + h * stride_xh)[:, None] + d[None, :],
                mask=tmask[:, None], other=0.0)  # int64: tokens x qkv's row stride can pass 2**31
    xf = x.to(tl.float32)
    # finite (NaN -> 0, +-Inf -> +-big, x's dtype's largest: exact), then each step rounded
    # to x's dtype, as torch computes the same ops in that dtype
    xf = tl.where(xf == xf, tl.minimum(tl.maximum(xf, -big), big), 0.0)
    if HAS_SUB:
        xf = round_to(xf - tl.load(sub_ptr + h * D + d).to(tl.float32)[None, :], x.dtype).to(
            tl.float32)
    if HAS_MUL:
        xf = round_to(xf * tl.load(mul_ptr + h * D + d).to(tl.float32)[None, :], x.dtype).to(
            tl.float32)
    if ROTATE:
        y = round_to(fwht(xf, D, LOG2_D) * rot_c, x.dtype).to(tl.float32)
        if ROT_FLAG:  # the per-layer choice, read at run time (x @ I, its alternative, is x)
            xf = tl.where(tl.load(rot_on_ptr) != 0, y, xf)
        else:
            xf = y
    rows = tl.load(rows_ptr + t, mask=tmask, other=0)
    dst = out_ptr + (rows * stride_ot + h * stride_oh)[:, None] + d[None, :]
    if FP8:  # out_ptr: the workspace's bytes; E4M3 by bit arithmetic, saturating (as the
        # reference's clamp + cast), exact in Triton's interpreter too
        xf = tl.math.div_rn(xf, tl.load(div_ptr))
        sign = ((xf.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
        tl.store(dst, e4m3_encode(tl.abs(xf)) | sign, mask=tmask[:, None])
    else:
        tl.store(dst, round_to(xf, out_ptr.dtype.element_ty), mask=tmask[:, None])


def put_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
             sub: torch.Tensor | None = None, mul: torch.Tensor | None = None,
             rotate: bool | torch.Tensor = False, out_div=None) -> None:
    """out[rows[t]] = x[t] [T, H, D] made finite, minus sub, times mul ([H, D] each), rotated
    by the normalised Hadamard matrix (rotate: True, or a device int32 flag read at run time,
    as the per-layer choice is), each step rounded to x's dtype; out in its dtype
    (float8_e4m3fn: divided by out_div, a float or 1-element tensor, and saturated). One
    launch replaces the torch sequence reference.put_rows (up to the order of the rotation's
    fp32 sums).
    D a power of two; rows int64 [T] on the device."""
    t, h, d = x.shape
    if t == 0:
        return
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and d & (d - 1) == 0
    fp8 = out.dtype == torch.float8_e4m3fn
    flag = rotate if isinstance(rotate, torch.Tensor) else None
    block_t = max(1, 2048 // d)
    unused = rows  # a pointer for the arguments the constexprs switch off
    _put_rows_kernel[(triton.cdiv(t, block_t), h)](
        x, rows, out.view(torch.uint8) if fp8 else out, unused if sub is None else sub,
        unused if mul is None else mul, unused if flag is None else flag,
        device_scalar(out_div, x.device) if fp8 else unused, t,
        torch.finfo(x.dtype).max, hadamard_entry(d, x.dtype), x.stride(0), x.stride(1),
        out.stride(0), out.stride(1), D=d, LOG2_D=d.bit_length() - 1, BLOCK_T=block_t,
        HAS_SUB=sub is not None, HAS_MUL=mul is not None,
        ROTATE=flag is not None or bool(rotate), ROT_FLAG=flag is not None, FP8=fp8,
        num_warps=4)
