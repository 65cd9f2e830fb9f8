"""Triton device functions that encode and decode the NVFP4 scalars (see format.py).

Hopper has no E2M1 convert instruction, so decoding is bit arithmetic: a value's 3-bit code
moved to fp16 bits 9..11 and its sign to bit 15 is exactly ``e2m1_value * 2**-14`` as fp16
(code 1 lands on an fp16 subnormal, which fp16 arithmetic keeps). An E4M3 byte moved to fp16
bits 7..14 is ``e4m3_value * 2**-8``. The callers fold those powers of two into one scale.
Both are exact, branch-free and the same on every GPU and in Triton's interpreter. The
page's data words place those bits so that a rotation brings them there (format.py).
"""
import triton
import triton.language as tl

from .format import WORD_PAIR_ROTATION, WORD_SIGN_ROTATION

# format.py's word layout: pair k's magnitudes come to bits 9..11 / 25..27 of an fp16x2 when
# the word is rotated right by 3k, its signs to 15 / 31 when rotated by SIGN_ROT_k (6, 9 for
# pairs 2, 3: the same rotation); e2m1_word_fp16 spells the same numbers in PTX.
assert WORD_PAIR_ROTATION == (0, 3, 6, 9) and WORD_SIGN_ROTATION[2:] == (6, 9)
SIGN_ROT_0 = tl.constexpr(WORD_SIGN_ROTATION[0])
SIGN_ROT_1 = tl.constexpr(WORD_SIGN_ROTATION[1])
# Factors the fp16 bit tricks leave on the decoded values (folded by callers).
E2M1_FP16_FACTOR = tl.constexpr(16384.0) # e2m1 = decoded * 2**14
E4M3_FP16_FACTOR = tl.constexpr(256.0) # e4m3 = decoded * 2**8


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
def e2m1_encode(y):
    """fp32 (already divided by the block scale) -> 4-bit code (int32). NaN -> 0."""
    a = tl.abs(y)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | tl.where((y < 0) & (code > 0), 8, 0)


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
def e2m1_pack_words(codes):
    """4-bit codes [..., 8] (int32; the 8 elements of each word in order) -> int32 words [...]
    in format.py's word layout: element e = 2k + p at bits (9 + 16p + 3k) % 32 .. +2 (rotated
    in 32 bits), its sign at (15 + 16p + WORD_SIGN_ROTATION[k]) % 32."""
    e = tl.arange(0, 8)
    k = e // 2
    p = e % 2
    rho = 3 * k
    sigma = tl.where(k == 0, SIGN_ROT_0, tl.where(k == 1, SIGN_ROT_1, rho))
    mag_pos = ((9 + 16 * p + rho) % 32).to(tl.uint32)
    sign_pos = ((15 + 16 * p + sigma) % 32).to(tl.uint32)
    c = codes.to(tl.uint32)
    mag = c & 7
    bits = (mag << mag_pos) | (mag >> ((32 - mag_pos) % 32)) | ((c >> 3) << sign_pos)
    return tl.sum(bits, axis=len(codes.shape) - 1).to(tl.int32, bitcast=True)  # disjoint: sum = or


# Decoded rows hold true values * 2**-7: e2m1 * 2**-14 times an fp16 scale of e4m3 * 2**7
# (both exact in fp16, and so is their product: |e2m1 * e4m3| <= 2688 fits after * 2**-7).
ROW_FACTOR = tl.constexpr(128.0)


@triton.jit
def e2m1_word_fp16(word):
    """CUDA only. int32 data words (format.py's word layout) -> their 8 elements n0..n7 as fp16
    tensors holding value * 2**-14. Pair k (n2k, n2k+1) is one fp16x2 register: the word rotated
    right by 3k (a funnel shift) has the magnitudes at bits 9..11 / 25..27; pairs 2 and 3 find
    their signs at 15 / 31 in the same rotation (one AND with 0x8E008E00), pairs 0 and 1 take
    them from a second rotation (AND 0x80008000, then one LOP3 (a & 0x0E000E00) | b). 11
    instructions per word (17 for two nibbles per byte). Each register is a natural element
    pair, what the MMA operands want."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, b, p;
        shf.r.wrap.b32 b, $8, $8, 23; and.b32 b, b, 0x80008000;
        lop3.b32 p, $8, b, 0x0E000E00, 0xEC; mov.b32 {$0, $1}, p;
        shf.r.wrap.b32 a, $8, $8, 3; shf.r.wrap.b32 b, $8, $8, 24; and.b32 b, b, 0x80008000;
        lop3.b32 p, a, b, 0x0E000E00, 0xEC; mov.b32 {$2, $3}, p;
        shf.r.wrap.b32 a, $8, $8, 6; and.b32 p, a, 0x8E008E00; mov.b32 {$4, $5}, p;
        shf.r.wrap.b32 a, $8, $8, 9; and.b32 p, a, 0x8E008E00; mov.b32 {$6, $7}, p;
        }
        """,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r",
        args=[word],
        dtype=(tl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def load_page_rows(cache_ptr, page_off, row, SIDE: tl.constexpr, tmask, H: tl.constexpr,
                   N: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                   USE_ASM: tl.constexpr, G_FIRST: tl.constexpr = 0):
    """Dequantize rows of one side of paged NVFP4 pages (format.py). page_off [R] int64 byte
    offset of each row's page, row [R] = head * N + token-in-page, tmask [R] valid rows.
    Returns fp16 [R, 16 * G_PAD] in natural element order = true values * 2**-7 (ROW_FACTOR),
    zeros where masked or padded: the row's 16-value groups G_FIRST .. G_FIRST + G_PAD - 1."""
    G: tl.constexpr = D // 16
    R: tl.constexpr = row.shape[0]
    side = cache_ptr + page_off + SIDE * (H * N * (D // 2 + G))
    gi = G_FIRST + tl.arange(0, G_PAD)
    sc = tl.load((side + H * N * (D // 2) + row * G)[:, None] + gi[None, :],
                 mask=tmask[:, None] & (gi < G)[None, :], other=0)
    s16 = e4m3_scale_fp16(sc)
    w = 2 * G_FIRST + tl.arange(0, G_PAD * 2)  # 32-bit words: D/2 and page offsets are 4-aligned
    words = tl.load((side + row * (D // 2)).to(tl.pointer_type(tl.int32))[:, None] + w[None, :],
                    mask=tmask[:, None] & (w < D // 8)[None, :], other=0)
    vals = word_values(words, USE_ASM)                              # [R, W, 2, 2, 2]
    vals = tl.reshape(vals, (R, G_PAD, 16))
    return tl.reshape(vals * s16[:, :, None], (R, G_PAD * 16))


@triton.jit
def _pair_fp16(w, RHO: tl.constexpr, SIGMA: tl.constexpr):
    """Pair k of uint32 words w (RHO, SIGMA: its rotations, format.py) -> (low, high) fp16."""
    pair = (_rotr(w, RHO) & 0x0E000E00) | (_rotr(w, SIGMA) & 0x80008000)
    return ((pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True),
            (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def e2m1_word_fp16_portable(word):
    """e2m1_word_fp16 as a per-element formula (interpreter, any GPU): 8 fp16 tensors."""
    w = word.to(tl.uint32, bitcast=True)
    n0, n1 = _pair_fp16(w, 0, SIGN_ROT_0)
    n2, n3 = _pair_fp16(w, 3, SIGN_ROT_1)
    n4, n5 = _pair_fp16(w, 6, 6)
    n6, n7 = _pair_fp16(w, 9, 9)
    return n0, n1, n2, n3, n4, n5, n6, n7


@triton.jit
def word_values(words, USE_ASM: tl.constexpr):
    """int32 words [...] -> their 8 elements as fp16 [..., 2, 2, 2] (element 4 e2 + 2 e1 + e0),
    value * 2**-14 (e2m1_word_fp16, or its portable formula)."""
    if USE_ASM:
        n0, n1, n2, n3, n4, n5, n6, n7 = e2m1_word_fp16(words)
    else:
        n0, n1, n2, n3, n4, n5, n6, n7 = e2m1_word_fp16_portable(words)
    return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                   tl.join(tl.join(n1, n5), tl.join(n3, n7)))


@triton.jit
def mma_col_to_d(k):
    """Head-dim element held by column k of load_tile_mma's output (D = 128): with a row's 16
    words split as word = 4c + j (c: the lane quarter that loads it, j: its register) and element
    e = 4 e2 + 2 e1 + e0 of the word, column k = 64 j1 + 32 j0 + 16 e2 + 8 e1 + 4 c1 + 2 c0 + e0
    holds d = 32 c + 8 j + e. A contraction over d may run in this order (Q permuted alike)."""
    e = (k & 1) | (((k >> 3) & 1) << 1) | (((k >> 4) & 1) << 2)
    return 32 * ((k >> 1) & 3) + 8 * ((k >> 5) & 3) + e


@triton.jit
def _words_mma(cache_ptr, page_off, row, SIDE: tl.constexpr, tmask, H: tl.constexpr,
               N: tl.constexpr):
    """(the side's base pointers, the int32 words 4 c + j of each row [REP, 2, W, 8] and lane
    quarter c: [REP, 2, W, 8, c, j]) of a D = 128 tile."""
    D: tl.constexpr = 128
    side = cache_ptr + page_off + SIDE * (H * N * (D // 2 + D // 16))
    word = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    words = tl.load((side + row * (D // 2)).to(tl.pointer_type(tl.int32))[:, :, :, :, None, None]
                    + word[None, None, None, None, :, :], mask=tmask[:, :, :, :, None, None],
                    other=0)
    return side, words


@triton.jit
def load_tile_mma(cache_ptr, page_off, row, SIDE: tl.constexpr, tmask, H: tl.constexpr,
                  N: tl.constexpr, USE_ASM: tl.constexpr):
    """Dequantize a tile of D = 128 rows of one side of paged NVFP4 pages, already in the
    register layout of a Hopper wgmma A operand, so no shared-memory round trip.
    page_off, row, tmask: [REP, 2, W, 8] (see load_page_rows; W = num_warps) for tile row
    i = 16 W rep + 16 w + 8 h + r given as [rep, h, w, r]: Triton's default layout of the word
    load then puts warps on w, lanes on r and on the row's four 16-byte quarters, as the MMA
    wants. Returns fp16 [16 W REP, 128] = true values * 2**-7, rows i, columns in mma_col_to_d
    order; the permutes and reshapes below only relabel registers."""
    D: tl.constexpr = 128
    G: tl.constexpr = 8
    REP: tl.constexpr = row.shape[0]
    W: tl.constexpr = row.shape[2]
    side, words = _words_mma(cache_ptr, page_off, row, SIDE, tmask, H, N)
    g = tl.arange(0, G)[None, None, None, None, :]   # a row's 8 scales: one 8-byte load
    sc = tl.load((side + H * N * (D // 2) + row * G)[:, :, :, :, None] + g,
                 mask=tmask[:, :, :, :, None], other=0)
    sc = tl.reshape(sc, (REP, 2, W, 8, 4, 2))                       # group 2 c + j1
    s16 = e4m3_scale_fp16(sc)
    vals = word_values(words, USE_ASM)                             # [.., c, j, e2, e1, e0]
    vals = tl.reshape(vals, (REP, 2, W, 8, 4, 2, 2, 2, 2, 2))        # j -> j1, j0
    vals = vals * s16[:, :, :, :, :, :, None, None, None, None]
    vals = tl.reshape(vals, (REP, 2, W, 8, 2, 2, 2, 2, 2, 2, 2))     # c -> c1, c0
    # dims: rep h w r c1 c0 j1 j0 e2 e1 e0 -> rows (rep w h r), columns (j1 j0 e2 e1 c1 c0 e0)
    vals = tl.permute(vals, (0, 2, 1, 3, 6, 7, 8, 9, 4, 5, 10))
    return tl.reshape(vals, (REP * W * 16, D))


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
