"""Triton device functions that encode and decode the NVFP4 scalars (see format.py).

Hopper has no E2M1 convert instruction, so decoding is bit arithmetic: a value's 3-bit code
moved to fp16 bits 9..11 and its sign to bit 15 is exactly ``e2m1_value * 2**-14`` as fp16
(code 1 lands on an fp16 subnormal, which fp16 arithmetic keeps). An E4M3 byte moved to fp16
bits 7..14 is ``e4m3_value * 2**-8``. The callers fold those powers of two into one scale.
Both are exact, branch-free and the same on every GPU and in Triton's interpreter. The
page's data words place those bits so that a rotation brings them there (format.py).
"""
import types

import triton
import triton.language as tl

from . import format as _format
from .format import (VWORD_PAIR_ROTATION, VWORD_SIGN_ROTATION, WORD_PAIR_ROTATION,
                     WORD_SIGN_ROTATION)


def _jit_here(fn):
    """A format.py function jitted with this module's globals (Triton's interpreter looks for
    triton.language among a jitted function's globals; format.py imports no Triton)."""
    return triton.jit(types.FunctionType(fn.__code__, globals(), fn.__name__, fn.__defaults__))


# format.py's V slot and word bit rules, written once there in operators Triton compiles as they are
v_slot = _jit_here(_format.v_slot)
v_token_bytes = _jit_here(_format.v_token_bytes)
element_bits = _jit_here(_format.element_bits)


def _word_asm(pair_rotation, sign_rotation) -> str:
    """PTX of e2m1_word_fp16 for a word layout of format.py: pair k = the word rotated right
    by pair_rotation[k] (a funnel shift; none for 0), masked to the magnitudes' bits 9..11 /
    25..27; its signs from the same rotation (one AND with 0x8E008E00) or from a second one
    (AND 0x80008000, then one LOP3 (a & 0x0E000E00) | b)."""
    lines = [".reg .b32 a, b, p;"]
    for k, (rho, sigma) in enumerate(zip(pair_rotation, sign_rotation)):
        src = "$8"
        if rho:
            lines.append(f"shf.r.wrap.b32 a, $8, $8, {rho};")
            src = "a"
        if rho == sigma:
            lines.append(f"and.b32 p, {src}, 0x8E008E00;")
        else:
            lines.append(f"shf.r.wrap.b32 b, $8, $8, {sigma}; and.b32 b, b, 0x80008000;")
            lines.append(f"lop3.b32 p, {src}, b, 0x0E000E00, 0xEC;")
        lines.append(f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, p;")
    return "{\n" + "\n".join(lines) + "\n}"


K_WORD_ASM = tl.constexpr(_word_asm(WORD_PAIR_ROTATION, WORD_SIGN_ROTATION))   # 11 instructions
V_WORD_ASM = tl.constexpr(_word_asm(VWORD_PAIR_ROTATION, VWORD_SIGN_ROTATION))  # 11 as well
# the layouts' rotations for the portable decoder and the packers
KR0, KR1, KR2, KR3 = (tl.constexpr(r) for r in WORD_PAIR_ROTATION)
KS0, KS1, KS2, KS3 = (tl.constexpr(r) for r in WORD_SIGN_ROTATION)
VR0, VR1, VR2, VR3 = (tl.constexpr(r) for r in VWORD_PAIR_ROTATION)
VS0, VS1, VS2, VS3 = (tl.constexpr(r) for r in VWORD_SIGN_ROTATION)
# Factors the fp16 bit tricks leave on the decoded values (folded by callers).
E2M1_FP16_FACTOR = tl.constexpr(16384.0)  # e2m1 = decoded * 2**14
E4M3_FP16_FACTOR = tl.constexpr(256.0)  # e4m3 = decoded * 2**8


@triton.jit
def e4m3_encode(s):
    """Non-negative fp32 -> E4M3 code (uint8): round-to-nearest-even, saturating at 448."""
    s = tl.minimum(s, 448.0)
    bits = s.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 120                       # E4M3 biased exponent (bias 7)
    man = bits & 0x7FFFFF
    m3 = man >> 20
    rem = man & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((m3 & 1) == 1))
    normal = (exp << 3) + m3 + up.to(tl.int32)      # a mantissa carry bumps the exponent
    v = s * 512.0                                   # subnormals: multiples of 2**-9
    f = tl.floor(v)
    fi = f.to(tl.int32)
    d = v - f
    sub = fi + ((d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    return tl.where(exp >= 1, normal, sub).to(tl.uint8)


@triton.jit
def e4m3_decode_fp16(code):
    """E4M3 code (uint8, sign bit ignored) -> fp16 holding value * 2**-8. Exact; 0x7F -> 480."""
    return ((code.to(tl.uint16) & 0x7F) << 7).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_scale_fp16(code):
    """E4M3 scale code (uint8) -> fp16 holding value * 2**7, the row scale of ROW_FACTOR: one
    fp16 multiply by 2**15, exact (|value| * 2**7 <= 57,344 < fp16's 65,504)."""
    return e4m3_decode_fp16(code) * tl.full((), 32768.0, tl.float16)


@triton.jit
def e4m3_decode(code):
    """E4M3 code (uint8, non-negative) -> fp32 value."""
    return e4m3_decode_fp16(code).to(tl.float32) * E4M3_FP16_FACTOR


@triton.jit
def e2m1_round(a):
    """Magnitudes (fp32 >= 0 or +inf, no NaN) -> the nearest E2M1 magnitude as fp32, ties to
    the even code, saturating at 6: the value of e2m1_encode's code. fp32's own rounding does
    it: adding and subtracting c = 2**(22 + e), e = clamp(floor(log2 a), 0, 2), rounds to
    multiples of c's ulp, which is E2M1's spacing (0.5 below 2, 1 below 4, 2 above):
    7 operations where comparing against the 7 thresholds and summing takes about 20.
    Where a is a product (x * (1/scale)), compile the caller with enable_fp_fusion=False:
    an fma would round the exact product, not a, and miss ties (cache_write's note)."""
    e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000),
                   0x40800000)
    c = (e + (22 << 23)).to(tl.float32, bitcast=True)
    return tl.minimum((a + c) - c, 6.0)


@triton.jit
def e2m1_code_of(v, neg):
    """An E2M1 magnitude (e2m1_round's) and where the value is negative -> 4-bit code (int32);
    the sign only on nonzero codes. From 1 up the code is fp32's exponent and first mantissa
    bit: 1.0 (0x3F800000) -> 2 ... 6.0 (0x40C00000) -> 7."""
    mag = tl.where(v >= 1.0, (v.to(tl.int32, bitcast=True) >> 22) - 252, (v * 2.0).to(tl.int32))
    return mag | tl.where(neg & (mag > 0), 8, 0)


@triton.jit
def e2m1_encode(y):
    """fp32 (already divided by the block scale) -> 4-bit code (int32). NaN -> 0."""
    return e2m1_code_of(e2m1_round(tl.where(y == y, tl.abs(y), 0.0)), y < 0)


@triton.jit
def e2m1_decode_fp16(code):
    """4-bit codes (int) -> fp16 holding value * 2**-14 (E2M1_FP16_FACTOR)."""
    c = code.to(tl.uint16)
    return (((c & 0x8) << 12) | ((c & 0x7) << 9)).to(tl.float16, bitcast=True)


@triton.jit
def _rotr(w, r: tl.constexpr):
    """Rotate uint32 words right by r bits."""
    return (w >> r) | (w << ((32 - r) % 32))


@triton.jit
def _by_pair(k, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr):
    return tl.where(k == 0, T0, tl.where(k == 1, T1, tl.where(k == 2, T2, T3)))


@triton.jit
def _place(codes, mag_pos, sign_pos):
    """4-bit codes (uint32) -> their bits in a word: magnitude rotated left by mag_pos, sign at
    sign_pos (uint32 positions < 32)."""
    mag = codes & 7
    return (mag << mag_pos) | (mag >> ((32 - mag_pos) % 32)) | ((codes >> 3) << sign_pos)


@triton.jit
def _bit_positions(k, p, V: tl.constexpr):
    """(magnitude, sign) bit (uint32) of element 2k + p in format.py's K or V word layout."""
    if V:
        rho, sigma = _by_pair(k, VR0, VR1, VR2, VR3), _by_pair(k, VS0, VS1, VS2, VS3)
    else:
        rho, sigma = _by_pair(k, KR0, KR1, KR2, KR3), _by_pair(k, KS0, KS1, KS2, KS3)
    mag, sign = element_bits(p, rho, sigma)
    return mag.to(tl.uint32), sign.to(tl.uint32)


@triton.jit
def e2m1_pack_words(codes):
    """4-bit codes [..., 8] (int32; the 8 elements of each word in order) -> int32 K words [...]
    in format.py's K word layout: element e = 2k + p at bits (9 + 16p + WORD_PAIR_ROTATION[k])
    % 32 .. +2 (rotated in 32 bits), its sign at (15 + 16p + WORD_SIGN_ROTATION[k]) % 32."""
    e = tl.arange(0, 8)
    bits = _place(codes.to(tl.uint32), *_bit_positions(e // 2, e % 2, False))
    return tl.sum(bits, axis=len(codes.shape) - 1).to(tl.int32, bitcast=True)  # disjoint: sum = or


@triton.jit
def e2m1_pack_v_token(codes, p):
    """4-bit codes [..., 4] (int32; head-dim elements 4q .. 4q+3 of one token) and the token's
    V slot parity p (0 / 1) -> the token's bits of its V words [...] (uint32; format.py's V word
    layout: element 2k + p at (9 + 16p + VWORD_PAIR_ROTATION[k]) % 32 ..). They fill bytes 1-2
    (p = 0) or bytes 3 and 0 (p = 1) of the word."""
    bits = _place(codes.to(tl.uint32), *_bit_positions(tl.arange(0, 4), p, True))
    return tl.sum(bits, axis=len(codes.shape) - 1)                        # disjoint: sum = or


# Decoded rows hold true values * 2**-7: e2m1 * 2**-14 times an fp16 scale of e4m3 * 2**7
# (both exact in fp16, and so is their product: |e2m1 * e4m3| <= 2688 fits after * 2**-7).
ROW_FACTOR = tl.constexpr(128.0)


@triton.jit
def e2m1_word_fp16(word, V: tl.constexpr = False):
    """CUDA only. int32 data words (format.py's K word layout, or its V word layout where V)
    -> their 8 elements n0..n7 as fp16 tensors holding value * 2**-14. Pair k (n2k, n2k+1) is
    one fp16x2 register (_word_asm: 11 instructions per word in either layout, 17 for two
    nibbles per byte): natural element pairs of a token for K, one element of a token pair
    for V, what the MMA operands want."""
    if V:
        return tl.inline_asm_elementwise(
            asm=V_WORD_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[word],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(
        asm=K_WORD_ASM, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[word],
        dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _scaled_rows(vals, sc, R: tl.constexpr, G_PAD: tl.constexpr):
    """Decoded values [R, ..] of groups [R, G_PAD] (in order) times their E4M3 scales."""
    vals = tl.reshape(vals, (R, G_PAD, 16))
    return tl.reshape(vals * e4m3_scale_fp16(sc)[:, :, None], (R, G_PAD * 16))


@triton.jit
def load_page_rows(cache_ptr, page_off, row, SIDE: tl.constexpr, tmask, H: tl.constexpr,
                   N: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                   USE_ASM: tl.constexpr, G_FIRST: tl.constexpr = 0):
    """Dequantize rows of one side of paged NVFP4 pages (format.py). page_off [R] int64 byte
    offset of each row's page, row [R] = head * N + token-in-page, tmask [R] valid rows.
    Returns fp16 [R, 16 * G_PAD] in natural element order = true values * 2**-7 (ROW_FACTOR),
    zeros where masked or padded: the row's 16-value groups G_FIRST .. G_FIRST + G_PAD - 1.
    V rows must come in pairs of a page's tokens 2i, 2i + 1 (rows 2j, 2j + 1; tmask may
    differ), so each token-pair word is decoded once for both."""
    G: tl.constexpr = D // 16
    R: tl.constexpr = row.shape[0]
    side = cache_ptr + page_off + SIDE * (H * N * (D // 2 + G))
    gi = G_FIRST + tl.arange(0, G_PAD)
    gmask = tmask[:, None] & (gi < G)[None, :]
    if SIDE == 0:
        sc = tl.load((side + H * N * (D // 2) + row * G)[:, None] + gi[None, :], mask=gmask,
                     other=0)
        w = 2 * G_FIRST + tl.arange(0, G_PAD * 2)  # 32-bit words: D/2 and page offsets 4-aligned
        words = tl.load((side + row * (D // 2)).to(tl.pointer_type(tl.int32))[:, None]
                        + w[None, :], mask=tmask[:, None] & (w < D // 8)[None, :], other=0)
        return _scaled_rows(word_values(words, USE_ASM), sc, R, G_PAD)
    sc = tl.load((side + H * N * (D // 2) + (row // N) * (N * G) + v_slot(row % N))[:, None]
                 + gi[None, :] * N, mask=gmask, other=0)
    row2, _ = tl.split(tl.reshape(row, (R // 2, 2)))            # the pairs' first rows
    m0, m1 = tl.split(tl.reshape(tmask, (R // 2, 2)))
    s0, s1 = tl.split(tl.reshape(side, (R // 2, 2)))
    side2 = tl.where(m0, s0, s1)                     # a masked row's page may be a stand-in
    q = 4 * G_FIRST + tl.arange(0, G_PAD * 4)      # quads: word (q, slot // 2)
    words = tl.load((side2 + (row2 // N) * (N * (D // 2))).to(tl.pointer_type(tl.int32))[:, None]
                    + (q * (N // 2))[None, :] + (v_slot(row2 % N) // 2)[:, None],
                    mask=(m0 | m1)[:, None] & (q < D // 4)[None, :], other=0)
    vals = tl.reshape(word_values(words, USE_ASM, True), (R // 2, G_PAD * 4, 4, 2))
    vals = tl.reshape(tl.permute(vals, (0, 3, 1, 2)), (R, G_PAD * 16))  # rows (pair, parity)
    return _scaled_rows(vals, sc, R, G_PAD)


@triton.jit
def _pair_fp16(w, RHO: tl.constexpr, SIGMA: tl.constexpr):
    """Pair k of uint32 words w (RHO, SIGMA: its rotations, format.py) -> (low, high) fp16."""
    pair = (_rotr(w, RHO) & 0x0E000E00) | (_rotr(w, SIGMA) & 0x80008000)
    return ((pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
            (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def e2m1_word_fp16_portable(word, V: tl.constexpr = False):
    """e2m1_word_fp16 as a per-element formula (interpreter, any GPU): 8 fp16 tensors."""
    w = word.to(tl.uint32, bitcast=True)
    if V:
        n0, n1 = _pair_fp16(w, VR0, VS0)
        n2, n3 = _pair_fp16(w, VR1, VS1)
        n4, n5 = _pair_fp16(w, VR2, VS2)
        n6, n7 = _pair_fp16(w, VR3, VS3)
    else:
        n0, n1 = _pair_fp16(w, KR0, KS0)
        n2, n3 = _pair_fp16(w, KR1, KS1)
        n4, n5 = _pair_fp16(w, KR2, KS2)
        n6, n7 = _pair_fp16(w, KR3, KS3)
    return n0, n1, n2, n3, n4, n5, n6, n7


def _v_half_asm() -> str:
    """PTX of v_word_half_fp16 on a GPU: the lane's half r0 = bit 2 of %laneid (lane 4 r + c of
    a wgmma operand, r0 = r % 2; ptxas computes it and the rotations once per thread), pair k
    = 2 r0 + h rotated by VWORD_PAIR_ROTATION[k] (magnitudes) and VWORD_SIGN_ROTATION[k]
    (signs), both amounts VR[2 h] + r0 (VR[2 h + 2] - VR[2 h]) mod 32 in registers."""
    lines = [".reg .b32 l, r, a, b, p, m, s;", "mov.u32 l, %laneid;", "bfe.u32 r, l, 2, 1;"]
    for h in range(2):
        (m0, m1), (s0, s1) = ((rot[h], rot[h + 2]) for rot in (VWORD_PAIR_ROTATION,
                                                               VWORD_SIGN_ROTATION))
        lines += [f"mad.lo.u32 m, r, {(m1 - m0) % 32}, {m0};",
                  f"mad.lo.u32 s, r, {(s1 - s0) % 32}, {s0};",
                  "shf.r.wrap.b32 a, $4, $4, m; shf.r.wrap.b32 b, $4, $4, s;",
                  "and.b32 b, b, 0x80008000; lop3.b32 p, a, b, 0x0E000E00, 0xEC;",
                  f"mov.b32 {{${2 * h}, ${2 * h + 1}}}, p;"]
    return "{\n" + "\n".join(lines) + "\n}"


V_HALF_ASM = tl.constexpr(_v_half_asm())


@triton.jit
def _rotr_by(w, r):
    """Rotate uint32 words w right by r (uint32 tensor, < 32) bits."""
    return (w >> r) | (w << ((32 - r) % 32))


@triton.jit
def v_word_half_fp16(word, USE_ASM: tl.constexpr):
    """int32 V words [S, 4, 8, 4, 2] (format.py's V word layout; dim 2 is the lane's row r of a
    wgmma A operand, lane 4 r + c) -> elements k = 2 r0 and 2 r0 + 1 (r0 = r % 2) of each word
    (head-dim elements 4q + 2 r0 + h), both tokens: fp16 [..., 2 (h), 2 (p)] holding
    value * 2**-14 (8 instructions per word: 4 per pair). On a GPU r0 comes from the lane id,
    so the result is right only in that register layout (load_vt_mma's; tests/test_compile.py
    checks the build keeps it); the interpreter computes r0 from the index."""
    if USE_ASM:
        a, b, c, d = tl.inline_asm_elementwise(
            asm=V_HALF_ASM, constraints="=h,=h,=h,=h,r", args=[word],
            dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        r0 = (tl.arange(0, 8) % 2)[None, None, :, None, None]
        rho0 = tl.where(r0 == 0, VR0, VR2).to(tl.uint32)
        sig0 = tl.where(r0 == 0, VS0, VS2).to(tl.uint32)
        rho1 = tl.where(r0 == 0, VR1, VR3).to(tl.uint32)
        sig1 = tl.where(r0 == 0, VS1, VS3).to(tl.uint32)
        w = word.to(tl.uint32, bitcast=True)
        p0 = (_rotr_by(w, rho0) & 0x0E000E00) | (_rotr_by(w, sig0) & 0x80008000)
        p1 = (_rotr_by(w, rho1) & 0x0E000E00) | (_rotr_by(w, sig1) & 0x80008000)
        a = (p0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        b = (p0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        c = (p1 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        d = (p1 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def word_values(words, USE_ASM: tl.constexpr, V: tl.constexpr = False):
    """int32 words [...] (K layout, or V where V) -> their 8 elements as fp16 [..., 2, 2, 2]
    (element 4 e2 + 2 e1 + e0), value * 2**-14 (e2m1_word_fp16, or its portable formula)."""
    if USE_ASM:
        n0, n1, n2, n3, n4, n5, n6, n7 = e2m1_word_fp16(words, V)
    else:
        n0, n1, n2, n3, n4, n5, n6, n7 = e2m1_word_fp16_portable(words, V)
    return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                   tl.join(tl.join(n1, n5), tl.join(n3, n7)))


@triton.jit
def mma_col_to_d(k, D: tl.constexpr = 128):
    """Head-dim element held by column k of load_tile_mma's output (D = 64, 128 or 256): with
    a row's D/8 words split as word = (D/32) c + j (c: the lane quarter that loads it, j < D/32
    its register) and element e = 4 e2 + 2 e1 + e0 of the word, column
    k = 32 j + 16 e2 + 8 e1 + 4 c1 + 2 c0 + e0 holds d = (D/4) c + 8 j + e (D = 128:
    k = 64 j1 + 32 j0 + .., d = 32 c + 8 j + e). A contraction over d may run in this order
    (Q permuted alike)."""
    e = (k & 1) | (((k >> 3) & 1) << 1) | (((k >> 4) & 1) << 2)
    return (D // 4) * ((k >> 1) & 3) + 8 * ((k >> 5) & (D // 32 - 1)) + e


@triton.jit
def load_tile_mma(cache_ptr, chunk_off, row0, live, H: tl.constexpr, N: tl.constexpr,
                  W: tl.constexpr, USE_ASM: tl.constexpr, D: tl.constexpr = 128):
    """Dequantize a tile of K rows (D = 64, 128 or 256) of paged NVFP4 pages, already in the
    register layout of a Hopper wgmma A operand (W warps), so no shared-memory round trip
    after the load. The tile is C = 16 W REP tokens in chunks of 16: chunk c in the page at
    byte offset chunk_off [C] (int64) from page row row0 [C] (= head * N + token in page),
    loaded where live [C] (rows past the sequence inside a live chunk load bytes whose scores
    get masked). Each chunk's 16 rows of words and of scales are contiguous and loaded as such
    (lanes along memory: whole sectors per warp), then relabelled as tile row
    i = 16 W rep + 16 w + 8 h + r in [rep, h, w, r] order, which the MMA layout wants (warps on
    w, lanes on r and on the row's four quarters of J = D/32 words). Returns fp16 [16 W REP, D]
    = true values * 2**-7, rows i, columns in mma_col_to_d order; the permutes and reshapes
    below only relabel registers."""
    G: tl.constexpr = D // 16
    J: tl.constexpr = D // 32                          # words per lane quarter of a row
    C: tl.constexpr = chunk_off.shape[0]
    REP: tl.constexpr = C // W
    side = cache_ptr + chunk_off[:, None]
    j = tl.arange(0, 16 * (D // 8))[None, :]           # word 16 t + J c + j of the chunk
    words = tl.load(side.to(tl.pointer_type(tl.int32)) + row0[:, None] * (D // 8) + j,
                    mask=live[:, None], other=0)
    words = tl.permute(tl.reshape(words, (REP, W, 2, 8, 4, J)), (0, 2, 1, 3, 4, 5))
    g = tl.arange(0, 16 * G)[None, :]                  # scale G t + g of the chunk
    sc = tl.load(side + H * N * (D // 2) + row0[:, None] * G + g, mask=live[:, None], other=0)
    sc = tl.reshape(sc, (REP, W, 2, 8, 4, J // 2))                  # scale (J/2) c + j1
    sc = tl.permute(sc, (0, 2, 1, 3, 4, 5))
    s16 = e4m3_scale_fp16(sc)
    vals = word_values(words, USE_ASM)                             # [.., c, j, e2, e1, e0]
    vals = tl.reshape(vals, (REP, 2, W, 8, 4, J // 2, 2, 2, 2, 2))   # j -> j1, j0
    vals = vals * s16[:, :, :, :, :, :, None, None, None, None]
    vals = tl.reshape(vals, (REP, 2, W, 8, 2, 2, J, 2, 2, 2))        # c -> c1, c0
    # dims: rep h w r c1 c0 j e2 e1 e0 -> rows (rep w h r), columns (j e2 e1 c1 c0 e0)
    vals = tl.permute(vals, (0, 2, 1, 3, 6, 7, 8, 4, 5, 9))
    return tl.reshape(vals, (REP * W * 16, D))


@triton.jit
def vt_row_to_d(i, D: tl.constexpr = 128):
    """Head-dim element held by row i of load_vt_mma's V^T. D = 128: row
    i = 64 m + 16 w + 8 h + r holds d = 4 (8 w + r) + 2 m + h (quad 8 w + r, element 2 m + h);
    D = 256: i = 128 m1 + 64 m + 16 w + 8 h + r holds d = 4 (32 m1 + 8 w + r) + 2 m + h;
    D = 64: i = 16 w + 8 h + r holds d = 16 w + 2 r + h (quad 4 w + r // 2, element
    2 (r % 2) + h)."""
    if D == 64:
        d = 16 * ((i >> 4) & 3) + 2 * (i & 7) + ((i >> 3) & 1)
    else:
        d = (4 * (8 * ((i >> 4) & 3) + (i & 7)) + 2 * ((i >> 6) & 1) + ((i >> 3) & 1)
             + 128 * (i >> 7))
    return d


@triton.jit
def load_vt_mma(cache_ptr, chunk_off, chunk_tok, tok0, hi, head, H: tl.constexpr,
                N: tl.constexpr, USE_ASM: tl.constexpr, D: tl.constexpr = 128):
    """Dequantize V^T of a tile of 16 S tokens (D = 64, 128 or 256; 4 warps) from V's
    token-pair words, already in the register layout of a Hopper wgmma A operand (rows: head
    dim, contraction: tokens), so no shared-memory transpose. The tile is S chunks of 16
    tokens: chunk s starts at token tok0 + 16 s, in the page at byte offset chunk_off [S]
    (int64) at token chunk_tok [S]; chunks from hi on are not loaded, tokens >= hi inside a
    chunk must get P = 0. Thread (warp w, lane 4 r + c) decodes quad 8 w + r (and, at
    D = 256, quad 32 + 8 w + r) of V slots 4c .. 4c+3 (tokens 2c, 2c+1, 2c+8, 2c+9: two words
    and a word of scales per chunk and quad). At D = 64 a warp's 8 rows r per column quarter c
    outnumber its 4 quads, so lanes 4 r + c and 4 (r ^ 1) + c load the same words of quad
    4 w + r // 2 and keep elements 2 (r % 2) + h of it (v_word_half_fp16). Returns fp16
    [D, 16 S] = true values * 2**-7, rows in vt_row_to_d order, columns the tile's tokens in
    order."""
    S: tl.constexpr = chunk_off.shape[0]
    side = cache_ptr + chunk_off[:, None] + H * N * (D // 2 + D // 16)
    slot0 = chunk_tok[:, None]                       # the chunk's first V slot (16-aligned)
    # whole chunks holding a token; slots past hi load bytes whose tokens get p = 0
    live = (tok0 + 16 * tl.arange(0, S) < hi)[:, None]
    # loaded as [chunk, 32-byte quad row piece]: lanes then run along memory, so each warp
    # reads whole sectors (the [S, w, r, c, u] pointer tensor put lanes across chunks)
    j = tl.arange(0, 2 * D)[None, :]                 # word 8 q + 2 c + u of the chunk
    words = tl.load((side + head * (N * (D // 2))).to(tl.pointer_type(tl.int32))
                    + (j // 8) * (N // 2) + slot0 // 2 + j % 8, mask=live, other=0)
    # the scales of slots 4c .. 4c+3 (= 4c + 2u + p) of group g = q // 4: the chunk's
    # D/16 groups x 16 slots as D/4 words, each read by the 4 lanes of its group's quads
    k = tl.arange(0, D // 4)[None, :]                # word 4 g + c
    sc = tl.load((side + H * N * (D // 2) + head * (N * (D // 16))).to(tl.pointer_type(tl.int32))
                 + (k // 4) * (N // 4) + slot0 // 4 + k % 4, mask=live, other=0)
    if D == 64:
        # quad 4 w + r1 (r = 2 r1 + r0) for both lanes r0: [S, w, r1, r0, c, u]
        words = tl.broadcast_to(tl.reshape(words, (S, 4, 4, 1, 4, 2)), (S, 4, 4, 2, 4, 2))
        words = tl.reshape(words, (S, 4, 8, 4, 2))                        # [S, w, r, c, u]
        sc = tl.broadcast_to(tl.reshape(sc, (S, 4, 1, 4)), (S, 4, 8, 4))  # group w: [S, w, r, c]
        s16 = _e4m3_word_fp16(sc, USE_ASM) * tl.full((), 32768.0, tl.float16)  # [.., u, p]
        vals = v_word_half_fp16(words, USE_ASM)                           # [.., u, h, p]
        vals = vals * s16[:, :, :, :, :, None, :]
        # dims: s w r c u h p -> rows (w h r), columns (s u c p)
        vt = tl.reshape(tl.permute(vals, (1, 5, 2, 0, 4, 3, 6)), (D, 16 * S))
    else:
        M1: tl.constexpr = D // 128                  # quad 32 m1 + 8 w + r
        words = tl.reshape(words, (S, M1, 4, 8, 4, 2))                    # [S, m1, w, r, c, u]
        sc = tl.broadcast_to(tl.reshape(sc, (S, M1, 4, 2, 1, 4)), (S, M1, 4, 2, 4, 4))
        sc = tl.reshape(sc, (S, M1, 4, 8, 4))                             # [S, m1, w, r, c]
        s16 = _e4m3_word_fp16(sc, USE_ASM) * tl.full((), 32768.0, tl.float16)  # [.., u, p]
        vals = word_values(words, USE_ASM, True)                          # [.., u, m, h, p]
        vals = vals * s16[:, :, :, :, :, :, None, None, :]
        # dims: s m1 w r c u m h p -> rows (m1 m w h r), columns (s u c p) = token
        # 16 s + 8 u + 2 c + p
        vt = tl.reshape(tl.permute(vals, (1, 6, 2, 7, 3, 0, 5, 4, 8)), (D, 16 * S))
    return vt


@triton.jit
def _e4m3_word_fp16(word, USE_ASM: tl.constexpr):
    """int32 words of 4 E4M3 codes (sign bits ignored) -> fp16 [..., 2, 2] (byte 2 i + j at
    [i, j]) holding value * 2**-8 (e4m3_decode_fp16). CUDA: per byte pair one PRMT that puts
    the two bytes in the two halves, then a shift and a mask."""
    if USE_ASM:
        a, b, c, d = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 x;
            prmt.b32 x, $4, 0, 0x4140; shl.b32 x, x, 7; and.b32 x, x, 0x3F803F80;
            mov.b32 {$0, $1}, x;
            prmt.b32 x, $4, 0, 0x4342; shl.b32 x, x, 7; and.b32 x, x, 0x3F803F80;
            mov.b32 {$2, $3}, x;
            }
            """,
            constraints="=h,=h,=h,=h,r", args=[word], dtype=(tl.float16,) * 4, is_pure=True,
            pack=1)
    else:
        a, b, c, d = (_e4m3_byte_fp16(word, 0), _e4m3_byte_fp16(word, 8),
                      _e4m3_byte_fp16(word, 16), _e4m3_byte_fp16(word, 24))
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _e4m3_byte_fp16(word, SHIFT: tl.constexpr):
    """The E4M3 code at bit SHIFT of int32 words -> e4m3_decode_fp16 of it."""
    return e4m3_decode_fp16(((word >> SHIFT) & 0xFF).to(tl.uint8))


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 -> dtype, round to nearest even as torch rounds (bf16 by integer ops: Triton's
    interpreter truncates a bf16 cast; on a GPU both are the same cvt.rn), NaN kept."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, r, x.to(tl.bfloat16))
    return x.to(dtype)
