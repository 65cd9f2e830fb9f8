"""Fused paged decode attention over an NVFP4 cache (reference: reference.paged_attention with
one query row per sequence).

One program per (sequence, KV head, split): it holds the G query heads of its KV head, so every
KV byte is read once. K/V pages are dequantized in registers (codec.load_page_rows: bit
arithmetic on 32-bit words, no lookup tables or branches) into fp16 values
``e2m1 * e4m3 * 2**-7`` (exact); ``2**7 * k_scale`` is folded into the softmax scale and
``2**7 * v_scale`` into the output. Q is converted to fp16 (exact in range), P is
rounded to fp16 for the P.V product, accumulation is fp32. Split-KV over the sequence (flash-
decoding) with an LSE reduction; the split count depends only on the batch shape, so the
launch can be captured in a CUDA graph.

Both products are written transposed (S^T = K Q^T, O^T = V^T P^T) so that the freshly decoded
tile is the MMA's A operand, which Hopper's wgmma takes from registers. At D = 64, 128 and 256
on Hopper K is decoded straight into that operand's register layout (codec.load_tile_mma; Q is
loaded with its head dim in the same permuted order) and so is V^T, from the page's token-pair
V words (codec.load_vt_mma; the output is stored in its row order), so no decoded value goes
through shared memory (elsewhere, and at other head sizes, the dots are mma.sync or K and V
are decoded in rows: has_wgmma, MMA_HEAD_DIMS). Each head size has its tile, register cap
and programs per SM (HOPPER_LAUNCHES).
The raw page bytes do: Triton pipelines every load of the loop through cp.async into shared
memory, in the layout of the load's pointer tensor, so the loaders shape their pointers as
[16-token chunk, contiguous bytes] (each warp reads whole sectors) and relabel afterwards.
Instructions per KV byte (evals/profile_decode.py: 0.217 in the sm_90 loop at D = 128, 0.30 at
64, 0.21 at 256) and latency hiding at 3-4 programs per SM bound it (evals/RESULTS.md, "What
bounds it").
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from .codec import (ROW_FACTOR, load_page_rows, load_tile_mma, load_vt_mma, mma_col_to_d,
                    vt_row_to_d)
from .cache_write import device_scalar
from .format import PageLayout

LOG2E = tl.constexpr(1.4426950408889634)


# Ints that vary with the traffic are not specialised on (Triton builds a variant for the value 1
# and one for multiples of 16): the split count, a batch-shape choice (1 is SPLIT = False,
# whose code does not read it), and the block table's row stride (the engine's table width).
# So the builds an engine's start-up warm-up compiles are all there are; the sm_90 SASS is the
# same as with either specialisation (aot.py builds).
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
                   sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, page_stride,
                   sm_scale, softcap, window, num_splits,
                   H: tl.constexpr, QPK: tl.constexpr, QG_PAD: tl.constexpr, N: tl.constexpr,
                   D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, USE_ASM: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, MMA_K: tl.constexpr,
                   NW: tl.constexpr, V_HALVES: tl.constexpr, MMA_V: tl.constexpr,
                   BT_AHEAD: tl.constexpr = False, MIN_SPLIT_TILES: tl.constexpr = 1):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if HAS_WINDOW:  # tiles start at multiples of 16 (load_vt_mma's chunks); keys < start masked
        start = tl.maximum(seq_len - window, 0)
    base = start // 16 * 16
    if SPLIT:
        tiles = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N)
        if MIN_SPLIT_TILES > 1:  # fewer, longer splits where the sequence is short for the count
            tiles = tl.maximum(tiles, MIN_SPLIT_TILES)
        per_split = tiles * BLOCK_N
    else:  # num_splits == 1 (not specialised on: the same code as if it were)
        per_split = tl.cdiv(seq_len - base, BLOCK_N) * BLOCK_N
    lo = base + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    gq = tl.arange(0, QG_PAD)
    heads = kvh * QPK + gq
    d = tl.arange(0, G_PAD * 16)
    qo_mask = (gq < QPK)[:, None] & (d < D)[None, :]
    qd = mma_col_to_d(d, D) if MMA_K else d  # Q's head dim in the order K is decoded in
    od = vt_row_to_d(d, D) if MMA_V else d   # the output's, in the order V^T is decoded in
    q_rows = q_ptr + b * stride_qt + heads[:, None] * stride_qh
    q = _load_q(q_rows, qd, qo_mask)

    qk_scale = sm_scale * tl.load(k_scale_ptr) * ROW_FACTOR
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * LOG2E
    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    if MMA_K:
        l_acc = tl.zeros([QG_PAD, NW, 8], tl.float32)  # l summed within threads
    if MMA_V:
        acc = tl.zeros([G_PAD * 16, QG_PAD], tl.float32)
    elif V_HALVES:  # transposed: [D, heads], in two halves
        acc_lo = tl.zeros([G_PAD * 8, QG_PAD], tl.float32)
        acc_hi = tl.zeros([G_PAD * 8, QG_PAD], tl.float32)
    else:
        acc = tl.zeros([G_PAD * 16, QG_PAD], tl.float32)
    bt_row = block_table_ptr + b * stride_bt
    # block-table entries: the MMA loaders take one per 16-token chunk (a page holds whole
    # chunks), load_page_rows one per token. bt_ahead loads them a tile ahead, so the K/V
    # copies do not wait on a load of their own iteration and Triton's pipeliner can keep
    # num_stages - 1 tiles in flight
    if BT_AHEAD:
        if MMA_K or MMA_V:
            blk_next = _entries(bt_row, lo, hi, BLOCK_N // 16, 16, N)
        if not (MMA_K and MMA_V):
            blk_rows_next = _entries(bt_row, lo, hi, BLOCK_N, 1, N)
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        if MMA_K or MMA_V:
            chunk = n0 + 16 * tl.arange(0, BLOCK_N // 16)
            live = chunk < hi
            if BT_AHEAD:
                blk = blk_next
                blk_next = _entries(bt_row, n0 + BLOCK_N, hi, BLOCK_N // 16, 16, N)
            else:
                blk = _entries(bt_row, n0, hi, BLOCK_N // 16, 16, N)
            chunk_off = blk.to(tl.int64) * page_stride
            chunk_tok = tl.multiple_of(chunk % N, 16)
        if not (MMA_K and MMA_V):  # rows decoded by load_page_rows
            if BT_AHEAD:
                blk_rows = blk_rows_next
                blk_rows_next = _entries(bt_row, n0 + BLOCK_N, hi, BLOCK_N, 1, N)
            else:
                blk_rows = _entries(bt_row, n0, hi, BLOCK_N, 1, N)
            page_off = blk_rows.to(tl.int64) * page_stride
            row = kvh * N + tok % N
        if HAS_WINDOW:
            tmask = tmask & (tok >= start)
        if MMA_K:
            st = tl.dot(load_tile_mma(cache_ptr, chunk_off, kvh * N + chunk_tok, live, H, N, NW,
                                      USE_ASM, D), tl.trans(q))
        else:
            k = load_page_rows(cache_ptr, page_off, row, 0, tmask, H, N, D, G_PAD, USE_ASM)
            st = tl.dot(k, tl.trans(q))
        s = tl.trans(st)  # K as the register (A) operand
        s_scale = qk_scale  # > 0: applied inside exp2's argument (an FFMA) and to the maxima
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh via exp2
            e = tl.exp2(s * (qk_scale * 2.0 * LOG2E / softcap))
            s = softcap * (1.0 - 2.0 / (e + 1.0)) * LOG2E
            s_scale = 1.0
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * s_scale)
        p = tl.exp2(s * s_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if MMA_K:  # sums within each thread only (rows i = [rep, w, h, r], see load_tile_mma):
            # the cross-warp reduction of l then runs once, after the loop, not per tile
            p5 = tl.reshape(p, (QG_PAD, BLOCK_N // (16 * NW), NW, 2, 8))
            l_acc = l_acc * alpha[:, None, None] + tl.sum(tl.sum(p5, axis=3), axis=1)
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        pt = tl.trans(p.to(tl.float16))
        if MMA_V:  # V^T straight into the A operand's registers (codec.load_vt_mma)
            vt = load_vt_mma(cache_ptr, chunk_off, chunk_tok, n0, hi, kvh, H, N, USE_ASM, D)
            acc = tl.dot(vt, pt, acc * alpha[None, :])
        elif V_HALVES:  # half the head dim at a time: half the shared-memory staging of V^T
            v = load_page_rows(cache_ptr, page_off, row, 1, tmask, H, N, D, G_PAD // 2,
                               USE_ASM, 0)
            acc_lo = tl.dot(tl.trans(v), pt, acc_lo * alpha[None, :])
            v = load_page_rows(cache_ptr, page_off, row, 1, tmask, H, N, D, G_PAD // 2,
                               USE_ASM, G_PAD // 2)
            acc_hi = tl.dot(tl.trans(v), pt, acc_hi * alpha[None, :])
        else:
            v = load_page_rows(cache_ptr, page_off, row, 1, tmask, H, N, D, G_PAD, USE_ASM)
            acc = tl.dot(tl.trans(v), pt, acc * alpha[None, :])
        m_i = m_new

    if MMA_K:
        l_i = tl.sum(tl.sum(l_acc, axis=2), axis=1)
    if V_HALVES and not MMA_V:  # [D/2, heads] x 2 -> [D, heads]
        acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (2, 0, 1)),
                         (G_PAD * 16, QG_PAD))
    acc = tl.trans(acc)
    out_mult = tl.load(v_scale_ptr) * ROW_FACTOR
    if not SPLIT:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=gq < QPK, other=float("-inf")) * LOG2E
            m_f = tl.maximum(m_i, sink)
            keep = tl.exp2(m_i - m_f)
            l_i = l_i * keep + tl.exp2(sink - m_f)
            out_mult = out_mult * keep
        inv = tl.where(l_i > 0, out_mult / l_i, 0.0)[:, None]
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + od[None, :],
                 (acc * inv).to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        # partials: out [B, Hq, S, D] fp32 normalised, lse [B, Hq, S] in log2 units
        inv = tl.where(l_i > 0, out_mult / l_i, 0.0)[:, None]
        prow = (b * (H * QPK) + heads) * num_splits + split
        tl.store(part_out_ptr + prow[:, None] * D + od[None, :], acc * inv, mask=qo_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        tl.store(part_lse_ptr + prow, lse, mask=gq < QPK)


@triton.jit
def _entries(bt_row, first, hi, COUNT: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr):
    """Block-table entries (pages) of positions first + STEP * i, i < COUNT, of one sequence's
    row bt_row; 0 at and past hi."""
    pos = first + STEP * tl.arange(0, COUNT)
    return tl.load(bt_row + pos // N, mask=pos < hi, other=0)


@triton.jit
def _load_q(q_rows, dd, mask):
    """Query elements dd of rows q_rows as fp16 for the MMA (clamped: exact in range)."""
    q = tl.load(q_rows + dd[None, :], mask=mask, other=0.0)
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit(do_not_specialize=["num_splits"])  # a batch-shape choice (see _decode_kernel)
def _reduce_kernel(part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh,
                   num_splits, HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   S_PAD: tl.constexpr, S_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """out[b, h] = the LSE-weighted sum of the num_splits partials of (b, h) (S_PAD >=
    num_splits). The [S_CHUNK, D] partials are summed a chunk at a time: 128 splits at D =
    256 hold no more in registers than 64 (all [128, 256] at once spill; S_CHUNK = 64: one
    chunk, the same arithmetic as in one piece, where there are at most 64)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    prow = (b * HQ + h) * num_splits
    lse = tl.load(part_lse_ptr + prow + sp, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * LOG2E
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m_safe), axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    o = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, num_splits, S_CHUNK):
        sc = s0 + tl.arange(0, S_CHUNK)
        live = sc < num_splits
        w = tl.exp2(tl.load(part_lse_ptr + prow + sc, mask=live, other=float("-inf")) - m_safe)
        # splits of weight 0 (past a short sequence's end: their partials are 0) not read
        parts = tl.load(part_out_ptr + (prow + sc)[:, None] * D + d[None, :],
                        mask=(live & (w > 0))[:, None] & (d < D)[None, :], other=0.0)
        o += tl.sum(parts * w[:, None], axis=0)
    o = o / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < D)


@dataclasses.dataclass(frozen=True)
class HopperLaunch:
    """The Hopper launch at one head size: tokens per tile, the programs of its sm_90 build
    (4 warps, 4 load stages, K and V^T decoded into the wgmma operands) that fit one SM
    (tests/test_compile.py checks them against the compiler), and the register cap that makes
    them fit (ptxas's maxnreg; None: none, the build needs no spill either way)."""
    block_n: int
    programs_per_sm: int
    maxnreg: int | None = None


# Launch variants, A/B'd by evals/bench_decode.py --ab and chosen in the backend by
# NVFP4KV_DECODE_VARIANT. The default on Hopper at D = 128 decodes V^T straight into the MMA
# operand (mma_v); "v_rows" decodes V in rows and transposes it through shared memory (P.V
# in head-dim halves): 0.60-0.77x the speed of FA3 FP8 where mma_v runs at 1.14-1.36x (both
# without bt_ahead). Q.K^T in halves with registers capped at 128/96 (4-5 programs per SM
# instead of 3) is 7-28% slower, so no variant keeps it (evals/RESULTS.md, "What bounds
# it"). The default loads the block-table entries a tile ahead with 4 stages, so Triton's
# pipeliner keeps 2 tiles' copies in flight across the loop top; "bt_ahead_s3" keeps 1,
# "drain" none.
DECODE_VARIANTS = {
    "default": {},
    # block-table entries loaded in the tile's own iteration, so Triton drains the K/V
    # copies every tile (1.13-1.19x slower than the default on Hopper at batch >= 4)
    "drain": dict(bt_ahead=False, num_stages=2),
    "v_rows": dict(mma_v=False, bt_ahead=False, num_stages=2),
    "bt_ahead_s3": dict(bt_ahead=True, num_stages=3),
    # about 8 programs per SM and 64-token tiles from 16 splits up on Hopper too: the
    # split rule of other GPUs and head sizes (choose_num_splits)
    "per_sm8": dict(split_rule="per_sm8"),
    # other Hopper launches at D = 64 and 256 (HOPPER_LAUNCHES; the split count follows the
    # variant's programs per SM where decode_attention chooses it, as bench_decode does; the
    # backend's metadata builder keeps the default's): D = 64 capped at 96 registers (5
    # programs per SM, 0.31 warp-instructions per KV byte against 0.30), in 64-token tiles
    # (6 per SM, 0.38) or 256 (2 per SM, 0.26); D = 256 without the register cap (179
    # registers, 2 per SM)
    "d64_r96": dict(launches={64: HopperLaunch(128, 5, 96)}),
    "d64_bn64": dict(launches={64: HopperLaunch(64, 6)}),
    "d64_bn256": dict(launches={64: HopperLaunch(256, 2)}),
    "d256_uncapped": dict(launches={256: HopperLaunch(64, 2)}),
    # at most 64 splits at every grid, small ones included (max_splits; a split rule: the
    # backend's metadata builder follows it too)
    "cap64": dict(split_rule="waves_cap64"),
    # at least 4 tiles per split: a sequence shorter than the split count's 4 tiles each
    # leaves the splits past its end empty (the count is sized for max_model_len, a batch
    # shape's choice, so at 32K of a 128K model 128 splits get 2 tiles each)
    "floor4": dict(min_split_tiles=4),
}


MMA_HEAD_DIMS = (64, 128, 256)  # the head sizes codec.load_tile_mma / load_vt_mma decode


def mma_k_applies(d: int, num_warps: int, block_n: int) -> bool:
    """Whether codec.load_tile_mma's register layout fits the launch (D = 64, 128 or 256, a
    wgmma row block of 16 rows per warp, 4 or 8 warps)."""
    return d in MMA_HEAD_DIMS and num_warps in (4, 8) and block_n >= 16 * num_warps


@functools.lru_cache
def has_wgmma(device: torch.device) -> bool:
    """Whether Triton's dots run as Hopper wgmma here (sm_90), the MMA whose register layout
    codec.load_tile_mma decodes K into. Elsewhere they are mma.sync (sm_80/89), whose operand
    layout differs, so the decoded K would be converted through shared memory: in the sm_80
    and sm_89 builds that costs registers and shared memory at every tile size and P.V
    variant, and on sm_89 halves the programs per SM (evals/RESULTS.md, "Ampere and Ada").
    The interpreter (CPU) follows the Hopper kernel."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# D = 128: 165 registers x 128 threads and 62 KB of shared memory allow 3. D = 64: 103 and
# 33 KB allow 4 (128-token tiles: 0.30 warp-instructions per KV byte in the loop, 0.37 at 64,
# evals/profile_decode.py). D = 256: 64-token tiles (128 need 250 registers), 179 registers
# uncapped (2 programs), 168 capped without a spill (3), 64 KB. Timed at D = 128 only; the
# others are the same rule on the static figures (DECODE_VARIANTS A/B them).
HOPPER_LAUNCHES = {64: HopperLaunch(128, 4), 128: HopperLaunch(128, 3),
                   256: HopperLaunch(64, 3, 168)}
HOPPER_PROGRAMS_PER_SM = HOPPER_LAUNCHES[128].programs_per_sm
# how the split-KV count and tile size are chosen where the caller gives none: "waves" (one
# wave of resident programs on Hopper), "waves_cap64" (the same, at most 64 splits at every
# grid: max_splits) or "per_sm8" (about 8 programs per SM everywhere; DECODE_VARIANTS)
DEFAULT_SPLIT_RULE = "waves"
WAVE_RULES = ("waves", "waves_cap64")

# The most split-KV splits per sequence and KV head (clamp_splits, max_splits). 64 keep
# the partials small and fill one wave of resident programs on Hopper wherever batch x KV
# heads >= 7 at D = 128. A grid of at most 3 (D = 128, 256; 4 at D = 64, on 132 SMs: batch
# 1 of a model with few KV heads) would fill at most half of that wave with 64 splits: the
# idle SMs add no bandwidth, and the step takes one split's serial pass over 1/64 of the
# tokens. There up to 128 splits: 128 decode 1.1-1.7x faster than 64 at batch 1 with 1-3
# KV heads (D = 64 and 256, 32K-128K tokens), while 99 instead of 64 at 4 x 1 KV heads
# (D = 256, 64 already filling 65% of the wave) are no faster. Past 64 splits
# the reduction sums the partials in chunks (_reduce_kernel: 128 x 256 at once spill).
MAX_SPLITS = 64
SMALL_GRID_MAX_SPLITS = 128


def max_splits(programs: int, wave: int, rule: str = DEFAULT_SPLIT_RULE) -> int:
    """The split cap of a grid of `programs` (batch x KV heads) where one wave holds `wave`
    programs (0 where no one-wave launch applies): SMALL_GRID_MAX_SPLITS under rule "waves"
    where MAX_SPLITS per program fill at most half the wave, else MAX_SPLITS."""
    small = rule == "waves" and 2 * MAX_SPLITS * programs <= wave
    return SMALL_GRID_MAX_SPLITS if small else MAX_SPLITS


def hopper_launch(head_dim: int, launches: dict | None = None) -> HopperLaunch | None:
    """The Hopper launch at head_dim (launches: per-head-size replacements of HOPPER_LAUNCHES,
    a DECODE_VARIANTS entry's), None where K and V^T have no wgmma operand decoder."""
    return {**HOPPER_LAUNCHES, **(launches or {})}.get(head_dim)


def _wave_launch(device: torch.device, head_dim: int, rule: str,
                 launches: dict | None = None) -> HopperLaunch | None:
    """The launch of the one-wave rule where it applies: rules "waves" and "waves_cap64",
    Hopper's kernel at the head sizes of HOPPER_LAUNCHES (the interpreter follows it, as
    has_wgmma)."""
    if rule in WAVE_RULES and has_wgmma(device):
        return hopper_launch(head_dim, launches)
    return None


def clamp_splits(want: int, max_seq_len: int, cap: int = MAX_SPLITS) -> int:
    """A split count kept in [1, cap] and to at least 256 tokens per split."""
    return max(1, min(cap, want, math.ceil(max_seq_len / 256)))


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      head_dim: int = 128, rule: str = DEFAULT_SPLIT_RULE,
                      launches: dict | None = None) -> int:
    """Split-KV count from the batch shape only (so a CUDA graph captured for a batch size
    stays valid for any sequence length), at least 256 tokens per split, at most
    max_splits' cap (64; 128 where 64 fill at most half of one wave). On Hopper at D = 64,
    128, 256, where one wave of resident programs (HOPPER_LAUNCHES: 3 or 4 per SM) gives
    each KV head of the batch 4 or more splits (batch x KV heads <= 99 on 132 SMs at 3): as
    many as fill that one wave: a grid of 1.05-1.5 waves leaves most SMs idle for its last
    part and runs up to 1.3x slower than one whole wave, and 8 programs per SM would give
    1.3-2.7 waves at batch 1-8 (D = 128; evals/RESULTS.md, "Decode attention kernel").
    Larger batches, where one wave would leave each head 1-3 long splits (1-8% slower than
    more waves), head sizes without a wgmma decoder (80, 96), other GPUs (untimed) and rule
    "per_sm8" (DECODE_VARIANTS): about 8 programs per SM.
    launches: replacements of HOPPER_LAUNCHES (hopper_launch)."""
    programs = max(1, batch * num_kv_heads)
    sms = _num_sms(device)
    launch = _wave_launch(device, head_dim, rule, launches)
    wave = launch.programs_per_sm * sms if launch else 0
    one_wave = wave // programs
    want = one_wave if one_wave >= 4 else math.ceil(8 * sms / programs)
    return clamp_splits(want, max_seq_len, max_splits(programs, wave, rule))


# Tiles by head size where no Hopper launch applies (kernels/aot.py builds for sm_80/89/90
# with triton 3.6 and 3.7; tests/test_compile.py). Above LARGE_HEAD_DIM the kernel pads D to
# 512 (G_PAD): 64- and 128-token tiles hold 255 registers a thread and spill, and 128-token
# tiles need 150 KB of shared memory, more than an Ada SM has (100 KB): no program would
# launch. 32-token tiles: no spill, about 50 KB, 2-3 programs per SM. Above MID_HEAD_DIM,
# 128-token tiles take 250-255 registers (spilling on sm_89 with triton 3.7); 64-token tiles
# take 155-216 without a spill, 2-3 programs per SM.
MID_HEAD_DIM, LARGE_HEAD_DIM = 128, 256


def choose_block_n(num_splits: int, device: torch.device, head_dim: int = 128,
                   rule: str = DEFAULT_SPLIT_RULE, launches: dict | None = None) -> int:
    """Tokens per tile: HOPPER_LAUNCHES' on Hopper (D = 128: 128, as fast as 64 or faster at
    110 of 116 split counts timed, at most 6% slower at the others); elsewhere, and under
    rule "per_sm8", 128 below 16 splits and 64 from 16 splits up (bench_decode --tune);
    above MID_HEAD_DIM 64, above LARGE_HEAD_DIM 32."""
    launch = _wave_launch(device, head_dim, rule, launches)
    if launch:
        return launch.block_n
    if head_dim > LARGE_HEAD_DIM:
        return 32
    return 128 if num_splits < 16 and head_dim <= MID_HEAD_DIM else 64


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, sm_scale: float, k_scale,
                     v_scale, sliding_window: int | None = None, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, num_splits: int | None = None,
                     max_seq_len: int | None = None, block_n: int | None = None,
                     num_warps: int = 4, num_stages: int | None = None,
                     use_asm: bool | None = None, mma_k: bool | None = None,
                     v_halves: bool = True, mma_v: bool | None = None,
                     bt_ahead: bool | None = None,
                     split_rule: str = DEFAULT_SPLIT_RULE,
                     launches: dict | None = None, min_split_tiles: int = 1) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] (bf16/fp16; one token per sequence) over the NVFP4
    cache [num_blocks, 2*Hkv, N, D/2 + D/16] uint8. block_table [B, max_blocks] int32,
    seq_lens [B] int32 (tokens including this step's, already written to the cache). Writes
    out [B, Hq, D] and returns it. sliding_window: keys in (pos - window, pos]. sinks: [Hq]
    fp32 sink logits. k_scale / v_scale: 1-element fp32 tensors or floats (global scales).
    num_splits: split-KV count (default from choose_num_splits with max_seq_len).
    use_asm: the inline-PTX word decoder (default on CUDA; False: the portable formula).
    mma_k: decode K straight into the MMA's register layout (codec.load_tile_mma; default on
    Hopper (has_wgmma) where it applies: D = 64, 128 or 256, 4 or 8 warps, tiles of at least
    16 tokens per warp).
    v_halves (default): where V is decoded in rows, P.V in two halves of the head dim, so V^T's
    shared-memory staging is half as large (3-5% faster than the full width on Hopper).
    mma_v: decode V^T straight into the MMA's register layout (codec.load_vt_mma; default
    where K is (mma_k) and the launch has 4 warps; at D = 64 on Hopper only).
    bt_ahead: load each tile's block-table entries one tile ahead, so the K/V byte loads no
    longer wait on a load of their own iteration and Triton's pipeliner keeps num_stages - 1
    tiles in flight instead of draining every tile (with num_stages >= 3; evals/RESULTS.md,
    "What bounds it"). Default: on, with 4 stages, where K and V^T are decoded into the MMA
    layouts in tiles of <= 128 tokens (the Hopper default: 1.09-1.19x faster than without at
    batch >= 4); elsewhere off with 2 stages (untimed).
    split_rule: how num_splits and block_n are chosen where not given (DEFAULT_SPLIT_RULE's
    rules; choose_num_splits).
    launches: {head_dim: HopperLaunch} replacing HOPPER_LAUNCHES' (a DECODE_VARIANTS entry's):
    the tile and split count where not given, and the register cap of a launch with K and V^T
    in the MMA layouts in that launch's tile size.
    min_split_tiles: tiles each split walks at least (the splits past a sequence's end stay
    empty)."""
    bsz, hq, d = q.shape
    nb, two_h, n, _ = kv_cache.shape
    hkv = two_h // 2
    PageLayout(n, hkv, d)
    assert hq % hkv == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
    assert kv_cache[0].is_contiguous(), "each page must be contiguous"
    if bsz == 0:
        return out
    dev = q.device
    if num_splits is None:
        max_seq_len = max_seq_len or block_table.shape[1] * n
        num_splits = choose_num_splits(bsz, hkv, max_seq_len, dev, d, split_rule, launches)
    block_n = block_n or choose_block_n(num_splits, dev, d, split_rule, launches)
    if block_n not in (32, 64, 128, 256):
        # 16-token tiles give wrong results on Hopper with Triton 3.6 (correct in the
        # interpreter); refused until that is understood
        raise ValueError(f"block_n must be 32, 64, 128 or 256, got {block_n}")
    qpk = hq // hkv
    mma_ok = mma_k_applies(d, num_warps, block_n)
    mma_k = mma_ok and (has_wgmma(dev) if mma_k is None else mma_k)
    # at D = 64 load_vt_mma decodes by lane id, right in the wgmma operand layout only
    wgmma_v = d != 64 or has_wgmma(dev)
    mma_v = mma_k and num_warps == 4 and wgmma_v if mma_v is None else mma_v
    assert not mma_v or (mma_k and num_warps == 4 and wgmma_v), \
        "mma_v needs mma_k, 4 warps, and at D = 64 Hopper"

    bt_ahead = mma_v and block_n <= 128 if bt_ahead is None else bt_ahead
    if num_stages is None:
        num_stages = 4 if bt_ahead else 2
    launch = hopper_launch(d, launches)
    maxnreg = launch.maxnreg if launch and mma_v and block_n == launch.block_n else None
    k_scale, v_scale = device_scalar(k_scale, dev), device_scalar(v_scale, dev)
    # the split count is a runtime argument (the reduction's S_PAD: 64, 128 past 64 splits):
    # an eager mixed batch with any number of decodes reuses the compiled kernels instead of
    # compiling new ones
    if num_splits > 1:
        part_out = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=dev)
        part_lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=dev)
    else:
        part_out = part_lse = out
    sinks_arg = sinks if sinks is not None else k_scale
    _decode_kernel[(bsz, hkv, num_splits)](
        q, kv_cache, block_table, seq_lens, k_scale, v_scale, sinks_arg, out, part_out,
        part_lse, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        kv_cache.stride(0), float(sm_scale), float(softcap), int(sliding_window or 0), num_splits,
        H=hkv, QPK=qpk, QG_PAD=max(16, triton.next_power_of_2(qpk)), N=n, D=d,
        G_PAD=triton.next_power_of_2(d // 16), BLOCK_N=block_n,
        SPLIT=num_splits > 1, USE_ASM=dev.type == "cuda" if use_asm is None else use_asm,
        HAS_SOFTCAP=softcap > 0, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        MMA_K=mma_k, NW=num_warps,
        V_HALVES=v_halves and d >= 32, MMA_V=mma_v, BT_AHEAD=bt_ahead,
        MIN_SPLIT_TILES=min_split_tiles, num_warps=num_warps,
        num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    if num_splits > 1:
        _reduce_kernel[(bsz, hq)](
            part_out, part_lse, sinks_arg, out, out.stride(0), out.stride(1), num_splits,
            **reduce_constexprs(hq, d, num_splits, sinks is not None), num_warps=4)
    return out


def launch_splits(split_counts, device: torch.device, head_dim: int,
                  rule: str = DEFAULT_SPLIT_RULE, launches: dict | None = None) -> list[int]:
    """One of split_counts per distinct build of the decode launch (the kernel and its
    reduction) among them: a split count enters the builds only through whether it splits,
    the tile (choose_block_n) and the reduction's S_PAD (the count is a runtime argument). What
    the engine's start-up warm-up launches, for the counts choose_num_splits gives."""
    builds = {}
    for s in sorted(set(split_counts)):
        key = (s > 1, choose_block_n(s, device, head_dim, rule, launches),
               s > 1 and reduce_constexprs(1, head_dim, s, False)["S_PAD"])
        builds.setdefault(key, s)
    return sorted(builds.values())


def reduce_constexprs(hq: int, d: int, num_splits: int, has_sinks: bool) -> dict:
    """_reduce_kernel's constexprs for num_splits partials per sequence and query head of
    hq heads of size d: S_PAD covers them (at least 64, so one build serves every count up
    to 64), summed MAX_SPLITS at a time (S_CHUNK)."""
    return dict(HQ=hq, D=d, D_PAD=triton.next_power_of_2(d),
                S_PAD=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), S_CHUNK=MAX_SPLITS,
                HAS_SINKS=has_sinks)
