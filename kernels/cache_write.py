"""Fused quantize-and-write of K and V into the paged NVFP4 cache
(reference: reference.write_cache)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import (e2m1_code_of, e2m1_pack_v_token, e2m1_pack_words, e2m1_round, e4m3_decode,
                    e4m3_encode, round_to, v_slot, v_token_bytes)
from .format import BLOCK_SCALE_RULES, DEFAULT_BLOCK_SCALES, GROUP_SIZE, PageLayout
from .format import E4M3_MAX_CODE as _E4M3_MAX_CODE
from .rotation import fwht, hadamard_entry

E4M3_MAX_CODE = tl.constexpr(_E4M3_MAX_CODE)  # a constexpr: jit code reads only those
# Compiled without fused multiply-add (Triton contracts a*b+c by default): e2m1_round's add
# must see x * (1/scale) rounded to fp32, as the reference computes it. An fma rounds the exact
# product instead and settles values whose rounded product is an E2M1 tie by the reciprocal's
# rounding error, not to the even code: 0.1-1% of bf16 values, so the codes would differ
# from the reference's. Costs 0-8% more instructions (sm_90 search, tokens_per_program 1/2:
# 1,440 -> 1,488, 988 -> 1,048) and 0-4% of the time (evals/RESULTS.md, "KV fidelity at a
# glance").
WRITE_COMPILE_OPTIONS = dict(num_warps=1, enable_fp_fusion=False)


@triton.jit
def _encode_with(ae, ao, fe, fo, s, g):
    """Blocks as magnitudes (even [G, 8], odd [G, 8]; NaN as 0) and their finite parts (Inf as
    0: what the error compares with, as the reference's) with scale codes s [G] -> (even,
    odd E2M1 magnitudes of the codes, squared error per block [G]) (reference._encode_with).
    Signs do not change the error: E2M1 rounds |x| and keeps x's sign."""
    scale = e4m3_decode(s) * g
    r = tl.where(scale > 0, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), 0.0)
    ve = e2m1_round(ae * r[:, None])
    vo = e2m1_round(ao * r[:, None])
    de = ve * scale[:, None] - fe
    do = vo * scale[:, None] - fo
    return ve, vo, tl.sum(de * de, axis=1) + tl.sum(do * do, axis=1)


@triton.jit
def _try_scale(ae, ao, fe, fo, g, s, ve, vo, err, s2):
    """The best candidate so far (scale codes s, magnitudes ve/vo, errors err) against scale
    codes s2: s2's where its squared error is strictly smaller."""
    ve2, vo2, err2 = _encode_with(ae, ao, fe, fo, s2, g)
    u = err2 < err
    return (tl.where(u, s2, s), tl.where(u[:, None], ve2, ve), tl.where(u[:, None], vo2, vo),
            tl.where(u, err2, err))


@triton.jit
def _e4m3_of(amax, g, TARGET: tl.constexpr):
    return e4m3_encode(tl.math.div_rn(tl.math.div_rn(amax, TARGET), g)).to(tl.int32)


@triton.jit
def _key_as_cached(k_rows, tmask, k_sub_ptr, h, rot_c, rot_on_ptr, D: tl.constexpr,
                   HAS_K_SUB: tl.constexpr, ROTATE_K: tl.constexpr, ROT_FLAG: tl.constexpr,
                   LOG2_D: tl.constexpr):
    """K rows (pointers k_rows [BT], rows where tmask) transformed as cache_space.CacheSpace.key
    does it in torch (K - mu, then x @ H with H's entries +-rot_c), each step rounded to K's
    dtype as torch rounds it -> (even, odd) elements [BT * D / 16, 8] in fp32. D is a power of
    two. ROT_FLAG: the rotation only where *rot_on_ptr != 0 (a per-layer choice made after
    CUDA graphs captured this kernel; x @ I, its alternative, is x)."""
    BT: tl.constexpr = k_rows.shape[0]
    d = tl.arange(0, D)
    x = tl.load(k_rows[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
    if HAS_K_SUB:
        x = round_to(x.to(tl.float32) - tl.load(k_sub_ptr + h * D + d).to(tl.float32)[None, :],
                     x.dtype)
    if ROTATE_K:
        y = round_to(fwht(x.to(tl.float32), D, LOG2_D) * rot_c, x.dtype)
        # a select, also for a fixed rotation (rot_c != 0 always): it keeps the rows in the
        # load's layout; carrying fwht's layout into the 4-over-6 encoder costs Triton ~10
        # layout conversions (sm_90: 2,032 instructions instead of 1,552)
        if ROT_FLAG:
            x = tl.where(tl.load(rot_on_ptr) != 0, y, x)
        else:
            x = tl.where(rot_c != 0, y, x)
    xe, xo = tl.split(tl.reshape(x.to(tl.float32), (BT * (D // 16), 8, 2)))
    return xe, xo


@triton.jit
def _quantize_rows(x_ptr, g, col, cmask, RULE: tl.constexpr, V: tl.constexpr = False, p=0):
    """16-value blocks of (side, head, token) rows. col [M, 8]: offsets of the even elements
    of each block."""
    xe = tl.load(x_ptr + col, mask=cmask, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + col + 1, mask=cmask, other=0.0).to(tl.float32)
    return _quantize_vals(xe, xo, g, RULE, V, p)


@triton.jit
def _quantize_vals(xe, xo, g, RULE: tl.constexpr, V: tl.constexpr = False, p=0):
    """Even and odd elements [M, 8] of M 16-value blocks -> (data, scale codes [M]). RULE: the
    index of the block-scale rule in format.BLOCK_SCALE_RULES (reference.scale_candidates,
    same order). Data: K words [M, 2], or where V the token's bits of its 4 V words per block
    [M, 4] (p [M, 1, 1]: its token's V slot parity)."""
    ae = tl.where(xe == xe, tl.abs(xe), 0.0)
    ao = tl.where(xo == xo, tl.abs(xo), 0.0)
    fe = tl.where(ae < float("inf"), ae, 0.0)
    fo = tl.where(ao < float("inf"), ao, 0.0)
    amax = tl.maximum(tl.max(ae, axis=1), tl.max(ao, axis=1))
    s = _e4m3_of(amax, g, 6.0)
    ve, vo, err = _encode_with(ae, ao, fe, fo, s, g)
    if RULE == 1:  # 4over6
        s, ve, vo, err = _try_scale(ae, ao, fe, fo, g, s, ve, vo, err, _e4m3_of(amax, g, 4.0))
    if RULE == 2:  # search: c4, then the codes one below c6 and c4 (reference.scale_candidates)
        c6, c4 = s, _e4m3_of(amax, g, 4.0)
        s, ve, vo, err = _try_scale(ae, ao, fe, fo, g, s, ve, vo, err, c4)
        s, ve, vo, err = _try_scale(ae, ao, fe, fo, g, s, ve, vo, err,
                                    tl.where((c6 >= 1) & (c6 < E4M3_MAX_CODE), c6 - 1, c6))
        s, ve, vo, err = _try_scale(ae, ao, fe, fo, g, s, ve, vo, err,
                                    tl.where(c4 - 1 > c6, c4 - 1, c6))
    ce = e2m1_code_of(ve, xe < 0)
    co = e2m1_code_of(vo, xo < 0)
    M: tl.constexpr = xe.shape[0]
    codes = tl.reshape(tl.join(tl.reshape(ce, (M, 2, 4)), tl.reshape(co, (M, 2, 4))), (M, 2, 8))
    if V:
        data = e2m1_pack_v_token(tl.reshape(codes, (M, 4, 4)), p)
    else:
        data = e2m1_pack_words(codes)
    return data, s.to(tl.uint8)


@triton.jit(do_not_specialize=["T"])  # tokens of the step: one build for every count
def _write_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                  k_sub_ptr, rot_on_ptr, T, stride_kt, stride_kh, stride_vt, stride_vh,
                  page_stride, rot_c, H: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
                  G_PAD: tl.constexpr, RULE: tl.constexpr, HAS_K_SUB: tl.constexpr,
                  ROTATE_K: tl.constexpr, ROT_FLAG: tl.constexpr, LOG2_D: tl.constexpr,
                  BT: tl.constexpr):
    """BT tokens of KV head h. Its blocks are the rows of [BT * G_PAD, 8] tiles (row r: token
    r // G_PAD, block r % G_PAD): one program quantizes BT * 2 * D / 16 independent blocks,
    which costs fewer instructions per block than one row per program (the writer is
    instruction-bound in prefill)."""
    h = tl.program_id(1)
    G: tl.constexpr = D // 16
    SIDE_BYTES: tl.constexpr = H * N * (D // 2 + G)
    r = tl.arange(0, BT * G_PAD)
    t = tl.program_id(0) * BT + r // G_PAD        # each block's token, slot and group
    slot = tl.load(slot_ptr + t, mask=t < T, other=-1).to(tl.int64)
    t64 = t.to(tl.int64)  # row offsets: tokens x qkv's row stride can pass 2**31
    gi = r % G_PAD
    valid = (slot >= 0) & (gi < G)  # slot < 0: a padded token
    cmask = valid[:, None]
    col = (gi * 16)[:, None] + 2 * tl.arange(0, 8)[None, :]
    tok = slot % N
    page = cache_ptr + (slot // N) * page_stride
    # K: the tokens' rows of words and of scales
    if HAS_K_SUB or ROTATE_K:  # whole rows: per token, not per block
        tb = tl.program_id(0) * BT + tl.arange(0, BT)
        tslot = tl.load(slot_ptr + tb, mask=tb < T, other=-1)
        xe, xo = _key_as_cached(key_ptr + tb.to(tl.int64) * stride_kt + h * stride_kh, tslot >= 0,
                                k_sub_ptr, h, rot_c, rot_on_ptr, D, HAS_K_SUB, ROTATE_K,
                                ROT_FLAG, LOG2_D)
        word, s = _quantize_vals(xe, xo, tl.load(k_scale_ptr), RULE)
    else:
        word, s = _quantize_rows(key_ptr + (t64 * stride_kt + h * stride_kh)[:, None],
                                 tl.load(k_scale_ptr), col, cmask, RULE)
    row = h * N + tok
    wptr = (page + row * (D // 2)).to(tl.pointer_type(tl.int32))  # rows are 4-aligned
    tl.store((wptr + gi * 2)[:, None] + tl.arange(0, 2)[None, :], word, mask=cmask)
    tl.store(page + H * N * (D // 2) + row * G + gi, s, mask=valid)
    # V: each token's two bytes of each of its D/4 token-pair words, its scales at its V slot
    vs = v_slot(tok)
    p = (vs % 2).to(tl.uint32)
    bits, s = _quantize_rows(value_ptr + (t64 * stride_vt + h * stride_vh)[:, None],
                             tl.load(v_scale_ptr), col, cmask, RULE, True,
                             p[:, None, None])                            # [M, 4] uint32
    base = page + SIDE_BYTES
    q = 4 * gi[:, None] + tl.arange(0, 4)[None, :]
    wbyte = base[:, None] + h * (N * (D // 2)) + (q * (N // 2) + (vs // 2)[:, None]) * 4
    b0, b1 = v_token_bytes(p[:, None])
    tl.store(wbyte + b0, ((bits >> (8 * b0)) & 0xFF).to(tl.uint8), mask=cmask)
    tl.store(wbyte + b1, ((bits >> (8 * b1)) & 0xFF).to(tl.uint8), mask=cmask)
    tl.store(base + H * N * (D // 2) + h * (N * G) + gi * N + vs, s, mask=valid)


SMALL_WRITE_ROWS = 4096  # tokens x KV heads up to which a write takes one token per program


def tokens_per_program_for(tokens: int, kv_heads: int, block_scales: str) -> int:
    """BT for a write of `tokens` x `kv_heads` rows: one token per program for small writes (a
    decode step's: latency-bound, the shortest program wins) and for amax6, two beyond for the
    rules that try several scales (prefill: instruction-bound; two tokens per program cost
    ~30% fewer instructions per block, four cost fewer still but hold 115 registers a thread,
    too few warps to hide latency on Hopper)."""
    return 2 if tokens * kv_heads > SMALL_WRITE_ROWS and block_scales != "amax6" else 1


def write_sizes(max_tokens: int, kv_heads: int) -> list[int]:
    """Token counts up to max_tokens that give every tokens_per_program_for of any rule: the
    writes that compile each build of _write_kernel (the engine's start-up warm-up)."""
    return sorted({1, min(max_tokens, SMALL_WRITE_ROWS // kv_heads + 1)})


def device_scalar(x, device) -> torch.Tensor:
    """A scalar kernel argument (global scale, divisor: float or tensor) as the 1-element fp32
    device tensor the kernels load; no copy where it already is one (CUDA-graph safe)."""
    return torch.as_tensor(x, dtype=torch.float32, device=device).reshape(1)


def write_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale, v_scale,
                block_scales: str = DEFAULT_BLOCK_SCALES,
                k_sub: torch.Tensor | None = None,
                rotate_k: bool | torch.Tensor = False,
                tokens_per_program: int | None = None) -> None:
    """Quantize the first T rows of key/value [>=T, H, D] (bf16/fp16/fp32) into kv_cache
    [num_blocks, 2H, N, D/2 + D/16] uint8 at slot_mapping [T] (int; slots < 0 skipped).
    k_scale / v_scale: the layer's FP32 global scales (floats or 1-element tensors).
    block_scales: how each block's scale is chosen, format.BLOCK_SCALE_RULES (reference.
    quantize_codes; where two candidates' squared errors nearly tie the pick may differ, the
    sums' order differs). k_sub [H, D] (key's dtype) and rotate_k (power-of-two D): K is cached as
    rotation.rotate(key - k_sub) (vllm_nvfp4kv.cache_space), computed here instead of by two
    torch ops, with the same roundings (up to fp32 summation order). rotate_k may be a
    1-element int32 device tensor: rotate where it is nonzero, read at run time (CUDA graphs
    replay the choice made after their capture: cache_space's per-layer rotation).
    tokens_per_program: BT of _write_kernel (a power of two); None: tokens_per_program_for."""
    t, (h, d) = slot_mapping.shape[0], key.shape[1:]
    n = kv_cache.shape[2]
    PageLayout(n, h, d)  # validates head_dim
    if t == 0:
        return
    assert kv_cache.dtype == torch.uint8 and kv_cache.shape[1] == 2 * h
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert kv_cache[0].is_contiguous(), "each page must be contiguous"
    # a flag tensor is never read on the host here (bool() would sync: no CUDA graph capture)
    flag = rotate_k if isinstance(rotate_k, torch.Tensor) else None
    assert flag is None or (flag.dtype == torch.int32 and flag.numel() == 1)
    rotate_k = flag is not None or bool(rotate_k)
    if rotate_k or k_sub is not None:  # the transform reads whole rows
        assert d & (d - 1) == 0 and key.stride(2) == 1
        assert k_sub is None or (k_sub.shape == (h, d) and k_sub.is_contiguous()
                                 and k_sub.dtype == key.dtype)
    rot_c = hadamard_entry(d, key.dtype) if rotate_k else 1.0
    bt = tokens_per_program or tokens_per_program_for(t, h, block_scales)
    _write_kernel[(triton.cdiv(t, bt), h)](
        key, value, kv_cache, slot_mapping,
        device_scalar(k_scale, key.device), device_scalar(v_scale, key.device),
        key if k_sub is None else k_sub, slot_mapping if flag is None else flag, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), kv_cache.stride(0),
        rot_c, H=h, N=n, D=d, G_PAD=triton.next_power_of_2(d // GROUP_SIZE),
        RULE=BLOCK_SCALE_RULES.index(block_scales), HAS_K_SUB=k_sub is not None, ROTATE_K=rotate_k,
        ROT_FLAG=flag is not None, LOG2_D=d.bit_length() - 1, BT=bt, **WRITE_COMPILE_OPTIONS)
