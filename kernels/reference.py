"""Plain-torch references for every kernel: the oracles of the tests, and the CPU runtime
(vllm_nvfp4kv/ops.py picks them where there is no CUDA device). FP32 math, CPU or GPU.

Format and rounding rules: see ``format.py``. Cache tensors are vLLM's logical NVFP4 shape
``[num_blocks, 2*H, block_size, D/2 + D/16]`` uint8 (any page stride).
"""
from __future__ import annotations

import math

import torch

from .format import (BLOCK_SCALE_RULES, DEFAULT_BLOCK_SCALES, E2M1_MAX, E2M1_THRESHOLDS,
                     E2M1_VALUES, E4M3_MAX, E4M3_MAX_CODE, GROUP_SIZE, VWORD_MAG_BITS,
                     VWORD_SIGN_BITS, WORD_MAG_BITS, WORD_SIGN_BITS, PageLayout, v_slot,
                     v_token_bytes)


# ---------------------------------------------------------------- scalar formats
def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> E4M3 bytes, round-to-nearest-even, saturating at 448."""
    return s.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by the block scale) -> 4-bit codes in uint8. NaN -> 0."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for t, tie_up in E2M1_THRESHOLDS:
        code += (a >= t if tie_up else a > t).to(torch.uint8)
    return code | ((y < 0) & (code > 0)).to(torch.uint8) << 3


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = lut[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


# ---------------------------------------------------------------- quantize / dequantize
def _e4m3_of(amax: torch.Tensor, g: torch.Tensor, target: float) -> torch.Tensor:
    """The scale byte that maps amax to `target`: e4m3(amax / target / g)."""
    # divide by a tensor: CUDA torch turns `x / 6.0` into `x * (1 / 6.0)`, which is not the
    # IEEE quotient the format (and the Triton writer's div_rn) is defined by
    t = torch.tensor(target, dtype=torch.float32, device=amax.device)
    return e4m3_encode(amax / t / g)


def scale_candidates(amax: torch.Tensor, g: torch.Tensor, block_scales: str) -> list:
    """The scale bytes a rule of format.BLOCK_SCALE_RULES tries, in order, for blocks with
    maximum amax (same shape). Where a rule has fewer candidates for a block, the rest repeat
    the first (never strictly better)."""
    assert block_scales in BLOCK_SCALE_RULES, block_scales
    s6 = _e4m3_of(amax, g, 6.0)
    if block_scales == "amax6":
        return [s6]
    s4 = _e4m3_of(amax, g, 4.0)
    if block_scales == "4over6":
        return [s6, s4]
    c6, c4 = s6.to(torch.int32), s4.to(torch.int32)
    below6 = torch.where((c6 >= 1) & (c6 < E4M3_MAX_CODE), c6 - 1, c6)
    below4 = torch.where(c4 - 1 > c6, c4 - 1, c6)
    return [s6, s4, below6.to(torch.uint8), below4.to(torch.uint8)]


def _encode_with(xb: torch.Tensor, s: torch.Tensor, g: torch.Tensor):
    """Blocks [..., 16] with scale bytes s [..., 1] -> (codes, decoded values)."""
    scale = e4m3_decode(s) * g
    r = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    code = e2m1_encode(xb * r)
    return code, e2m1_decode(code) * scale


def quantize_codes(x: torch.Tensor, global_scale: float | torch.Tensor,
                   block_scales: str = DEFAULT_BLOCK_SCALES):
    """x [..., D] -> (4-bit codes [..., D] uint8, scales [..., D/16] uint8).

    block_scales: how each block's scale byte is chosen (format.py): amax6, 4over6 (amax -> 6
    or amax -> 4, whichever has the smaller squared error) or search (those two and the E4M3
    code just below each). Same format."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    xb = x.float().unflatten(-1, (-1, GROUP_SIZE))                        # [..., D/16, 16]
    amax = torch.nan_to_num(xb.abs(), nan=0.0).amax(-1, keepdim=True)
    cands = scale_candidates(amax, g, block_scales)
    s = cands[0]
    code, deq = _encode_with(xb, s, g)
    if len(cands) > 1:  # squared errors, NaN / Inf inputs counted as 0
        xf = torch.nan_to_num(xb, nan=0.0, posinf=0.0, neginf=0.0)
        err = ((deq - xf) ** 2).sum(-1, keepdim=True)
        for sc in cands[1:]:
            code_c, deq_c = _encode_with(xb, sc, g)
            err_c = ((deq_c - xf) ** 2).sum(-1, keepdim=True)
            better = err_c < err
            s, code, err = (torch.where(better, sc, s), torch.where(better, code_c, code),
                            torch.where(better, err_c, err))
    return code.flatten(-2), s.squeeze(-1)


def quantize(x: torch.Tensor, global_scale: float | torch.Tensor,
             block_scales: str = DEFAULT_BLOCK_SCALES):
    """x [..., D] -> (K data [..., D/2] uint8 (K word layout), scales [..., D/16] uint8)."""
    code, s = quantize_codes(x, global_scale, block_scales)
    return pack_codes(code), s


def _word_bits(device, mag_bits=WORD_MAG_BITS, sign_bits=WORD_SIGN_BITS):
    """A word layout of format.py as int64 tensors [8]: magnitude and sign bit of each element."""
    return (torch.tensor(mag_bits, dtype=torch.int64, device=device),
            torch.tensor(sign_bits, dtype=torch.int64, device=device))


def _place(c: torch.Tensor, mag_pos: torch.Tensor, sign_pos: torch.Tensor) -> torch.Tensor:
    """4-bit codes (int64) -> their bits in a word: magnitude rotated left by mag_pos in 32
    bits, sign at sign_pos."""
    mag = c & 7
    return (((mag << mag_pos) | (mag >> (32 - mag_pos))) & 0xFFFFFFFF) | ((c >> 3) << sign_pos)


def pack_codes(code: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., D] (element order) -> K data bytes [..., D/2] in the K word layout of
    format.py (WORD_MAG_BITS, WORD_SIGN_BITS; little-endian words of 8 elements)."""
    mag_pos, sign_pos = _word_bits(code.device)
    c = code.to(torch.int64).unflatten(-1, (-1, 8))                      # [..., D/8, 8]
    word = _place(c, mag_pos, sign_pos).sum(-1)                          # disjoint bits
    data = (word[..., None] >> torch.arange(0, 32, 8, device=code.device)) & 0xFF
    return data.flatten(-2).to(torch.uint8)


def _unpack_words(word: torch.Tensor, mag_bits, sign_bits) -> torch.Tensor:
    """int32 words [...] -> their 8 elements' codes [..., 8] (int32)."""
    codes = []
    for mag_pos, sign_pos in zip(mag_bits, sign_bits):
        mag = word >> mag_pos                       # arithmetic shift: masked below
        if mag_pos > 29:                            # the magnitude wraps to bit 0
            mag = (mag & ((1 << (32 - mag_pos)) - 1)) | (word << (32 - mag_pos))
        codes.append((mag & 7) | (((word >> sign_pos) & 1) << 3))
    return torch.stack(codes, dim=-1)


def _words(data: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 4] -> little-endian int32 words [...]."""
    b = data.to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """K data bytes [..., D/2] -> 4-bit codes [..., D] (uint8, element order). One int32 pass
    per element (the CPU backend runs this on every step)."""
    word = _words(data.unflatten(-1, (-1, 4)))
    return _unpack_words(word, WORD_MAG_BITS, WORD_SIGN_BITS).flatten(-2).to(torch.uint8)


def pack_v_token(code: torch.Tensor, parity: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., D] of tokens with V slot parity `parity` (broadcast to [...]) -> the
    bytes they own in their V words, [..., D/4, 2]: for quad q, the bytes of word
    (q, slot // 2) at format.v_token_bytes(p)."""
    p = parity.to(torch.int64)[..., None, None]                          # [..., 1, 1]
    mag_tab, sign_tab = (t.view(4, 2) for t in _word_bits(code.device, VWORD_MAG_BITS,
                                                          VWORD_SIGN_BITS))
    k = torch.arange(4, device=code.device)
    mag_pos = mag_tab[k, 0] + 16 * p                                     # [..., 1, 4]
    sign_pos = sign_tab[k, 0] + 16 * p
    c = code.to(torch.int64).unflatten(-1, (-1, 4))                      # [..., D/4, 4]
    word = _place(c, mag_pos % 32, sign_pos % 32).sum(-1)                # [..., D/4]
    return torch.stack([(word >> (8 * b)) & 0xFF for b in v_token_bytes(p[..., 0])],
                       dim=-1).to(torch.uint8)


def unpack_v_token(data: torch.Tensor, parity: torch.Tensor) -> torch.Tensor:
    """V words as bytes [..., D/4, 4] and the slot parity of the token wanted (broadcast to
    [...]) -> its 4-bit codes [..., D] (uint8, element order)."""
    codes = _unpack_words(_words(data), VWORD_MAG_BITS, VWORD_SIGN_BITS)  # [..., D/4, 8]
    codes = codes.unflatten(-1, (4, 2))                                   # [..., D/4, k, p]
    p = parity.to(torch.int64)[..., None, None, None].expand(*codes.shape[:-1], 1)
    return codes.gather(-1, p)[..., 0].flatten(-2).to(torch.uint8)


def dequantize_codes(code: torch.Tensor, scales: torch.Tensor,
                     global_scale: float | torch.Tensor) -> torch.Tensor:
    """(codes [..., D], scales [..., D/16]) -> fp32 [..., D]."""
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=code.device)
    vals = e2m1_decode(code).unflatten(-1, (-1, GROUP_SIZE))
    return (vals * e4m3_decode(scales)[..., None] * g).flatten(-2)


def dequantize(data: torch.Tensor, scales: torch.Tensor,
               global_scale: float | torch.Tensor) -> torch.Tensor:
    """(K data [..., D/2], scales [..., D/16]) -> fp32 [..., D]."""
    return dequantize_codes(unpack_codes(data), scales, global_scale)


# ---------------------------------------------------------------- paged cache
def page_views(kv_cache: torch.Tensor, head_dim: int):
    """Views (k_data [nb, H, N, D/2], k_scales [nb, H, N, D/16], v_data [nb, H, D/4, N/2, 4],
    v_scales [nb, H, D/16, N]) of a cache's pages (format.py; V indexed by V slot)."""
    nb, two_h, n, _ = kv_cache.shape
    lay = PageLayout(n, two_h // 2, head_dim)
    flat = kv_cache.flatten(1)
    h, q, g = lay.num_kv_heads, head_dim // 4, lay.scale_bytes
    k, v = flat[:, :lay.side_bytes], flat[:, lay.side_bytes:]
    return (k[:, :lay.side_data].unflatten(1, (h, n, lay.data_bytes)),
            k[:, lay.side_data:].unflatten(1, (h, n, g)),
            v[:, :lay.side_data].unflatten(1, (h, q, n // 2, 4)),
            v[:, lay.side_data:].unflatten(1, (h, g, n)))


def write_cache(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: float | torch.Tensor,
                v_scale: float | torch.Tensor, block_scales: str = DEFAULT_BLOCK_SCALES) -> None:
    """Quantize key/value [T, H, D] into the pages at slot_mapping [T]; slots < 0 are skipped.
    block_scales: format.BLOCK_SCALE_RULES."""
    n = kv_cache.shape[2]
    keep = slot_mapping >= 0
    blk, off = slot_mapping[keep] // n, slot_mapping[keep] % n
    kd, ks, vd, vs = page_views(kv_cache, key.shape[-1])
    data, scales = quantize(key[keep], k_scale, block_scales)                           # [T', H, *]
    kd[blk, :, off] = data
    ks[blk, :, off] = scales
    code, scales = quantize_codes(value[keep], v_scale, block_scales)
    slot = v_slot(off)
    own = pack_v_token(code, slot[:, None] % 2)                            # [T', H, Q, 2]
    for i, b in enumerate(v_token_bytes(slot % 2)):
        vd[blk, :, :, slot // 2, b] = own[..., i]
    vs[blk, :, :, slot] = scales


def dequantize_rows(kv_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, head_dim: int,
                    k_scale, v_scale):
    """Tokens at (page blk, token-in-page off) [T] -> dequantized fp32 (k, v) [T, H, D]."""
    kd, ks, vd, vs = page_views(kv_cache, head_dim)
    slot = v_slot(off)
    v_codes = unpack_v_token(vd[blk, :, :, slot // 2], (slot % 2)[:, None])
    return (dequantize(kd[blk, :, off], ks[blk, :, off], k_scale),
            dequantize_codes(v_codes, vs[blk, :, :, slot], v_scale))


def dequantize_pages(kv_cache: torch.Tensor, head_dim: int, k_scale, v_scale):
    """Every token of every page -> fp32 (k, v), each [num_blocks, H, N, D]."""
    nb, _, n, _ = kv_cache.shape
    tok = torch.arange(nb * n, device=kv_cache.device)
    k, v = dequantize_rows(kv_cache, tok // n, tok % n, head_dim, k_scale, v_scale)
    return tuple(x.unflatten(0, (nb, n)).transpose(1, 2) for x in (k, v))


def gather_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_tokens: torch.Tensor,
                 seq_starts: torch.Tensor, head_dim: int, k_scale: float | torch.Tensor,
                 v_scale: float | torch.Tensor):
    """Dequantize tokens [seq_starts[b], seq_starts[b] + cu_tokens[b+1] - cu_tokens[b]) of each
    sequence b into contiguous fp32 (k, v), each [cu_tokens[-1], H, D], in batch order."""
    n = kv_cache.shape[2]
    ks_out, vs_out = [], []
    for b in range(block_table.shape[0]):
        count = int(cu_tokens[b + 1] - cu_tokens[b])
        pos = int(seq_starts[b]) + torch.arange(count, device=kv_cache.device)
        k, v = dequantize_rows(kv_cache, block_table[b, pos // n].long(), pos % n, head_dim,
                               k_scale, v_scale)
        ks_out.append(k)
        vs_out.append(v)
    return torch.cat(ks_out), torch.cat(vs_out)


def put_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
             sub: torch.Tensor | None = None, mul: torch.Tensor | None = None,
             rot: torch.Tensor | None = None, out_div: torch.Tensor | None = None) -> None:
    """out[rows] = x [T, H, D] made finite (NaN -> 0, +-Inf -> +-max of x's dtype), minus sub,
    times mul ([H, D] each), times rot ([D, D]), each step in x's dtype as torch computes it;
    out in its dtype (float8_e4m3fn: x / out_div saturated to +-448). The workspace rows of a
    chunk's exact K/V as the cache space stores them (vllm_nvfp4kv/cache_space.py)."""
    big = torch.finfo(x.dtype).max
    x = torch.nan_to_num(x, nan=0.0, posinf=big, neginf=-big)
    if sub is not None:
        x = x - sub
    if mul is not None:
        x = x * mul
    if rot is not None:
        x = x @ rot
    if out.dtype == torch.float8_e4m3fn:
        x = (x.float() / out_div).clamp(-E4M3_MAX, E4M3_MAX).to(out.dtype)
        out.view(torch.uint8).index_copy_(0, rows, x.view(torch.uint8))
        return
    out.index_copy_(0, rows, x.to(out.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
              q_positions: torch.Tensor, sliding_window: int | None = None,
              softcap: float = 0.0, sinks: torch.Tensor | None = None,
              return_lse: bool = False):
    """One sequence: q [L, Hq, D] at absolute positions q_positions [L], k/v [S, Hkv, D] at
    positions 0..S-1. Causal; GQA; optional sliding window (keys in (p - window, p]), logit
    soft-cap and per-head sink logits [Hq]. Returns fp32 [L, Hq, D] (and lse [L, Hq])."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(hq // hkv, dim=1)
    v = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("lhd,shd->hls", q.float(), k) * sm_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    mask = kpos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        mask &= kpos[None, :] > q_positions[:, None] - sliding_window
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)                                     # [Hq, L]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("hls,shd->lhd", p, v)
    return (out, lse.transpose(0, 1)) if return_lse else out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                    k_scale: float | torch.Tensor, v_scale: float | torch.Tensor,
                    sliding_window: int | None = None, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over a paged NVFP4 cache. Sequence b owns query rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1], the last rows of its seq_lens[b] tokens (decode: one
    row). Returns fp32 [T, Hq, D]; rows of empty sequences are zero."""
    d = q.shape[-1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    zero = torch.zeros(1, dtype=torch.long, device=q.device)
    for b in range(len(seq_lens)):
        q0, q1, s_len = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seq_lens[b])
        if q1 == q0 or s_len == 0:
            continue
        cu = torch.tensor([0, s_len], device=q.device)
        k, v = gather_cache(kv_cache, block_table[b:b + 1], cu, zero, d, k_scale, v_scale)
        pos = torch.arange(s_len - (q1 - q0), s_len, device=q.device)
        out[q0:q1] = attention(q[q0:q1], k, v, sm_scale, pos, sliding_window, softcap, sinks)
    return out


# ---------------------------------------------------------------- global scales (calibration)
def scale_from_amax(amax: torch.Tensor, headroom: float) -> torch.Tensor:
    """fp32 amax (> 0) -> the power of two >= headroom * amax / 2688, fp32, same device.
    Bit arithmetic, so the Triton kernel (global_scale.py) and this function agree exactly."""
    y = amax.float() * torch.tensor(headroom / (E2M1_MAX * E4M3_MAX), dtype=torch.float32,
                                    device=amax.device)
    y = y.clamp(2.0 ** -120, 2.0 ** 120)
    bits = y.view(torch.int32)
    exp = bits & 0x7F800000
    return torch.where((bits & 0x007FFFFF) == 0, exp, exp + 0x00800000).view(torch.float32)


def masked_amax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """max |x| over the rows of x [T, ...] where valid [T]; NaN/Inf count as 0. fp32 scalar."""
    a = x.detach().abs().float()
    a = torch.where(torch.isfinite(a), a, torch.zeros((), device=a.device)).flatten(1).amax(1)
    return torch.where(valid, a, torch.zeros((), device=a.device)).max()


def calibrate_global_scales(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                            k_scale: torch.Tensor, v_scale: torch.Tensor, flag: torch.Tensor,
                            headroom: float) -> None:
    """In place: each side of flag [2] ([k, v]) still 0 whose amax over the first T rows of
    key / value [>= T, H, D] with slot_mapping [T] >= 0 is > 0 gets its scale
    (scale_from_amax) and its flag set to 1; other sides are left as they are."""
    t = slot_mapping.shape[0]
    if t == 0:
        return
    valid = slot_mapping >= 0
    amax = torch.stack((masked_amax(key[:t], valid), masked_amax(value[:t], valid)))
    new = scale_from_amax(amax, headroom)
    fix = (flag == 0) & (amax > 0)
    for i, s in enumerate((k_scale, v_scale)):
        s.copy_(torch.where(fix[i], new[i].to(s.dtype), s))
    flag.copy_(torch.where(fix, torch.ones_like(flag), flag))
