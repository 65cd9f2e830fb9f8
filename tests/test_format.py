"""Properties of the NVFP4 format and its plain-torch reference (reference.quantize/dequantize).

Pure torch on the CPU, so hypothesis can afford many examples. The oracles here are
independent of the reference: E4M3 and E2M1 value tables built from their bit definitions and
brute-force nearest-even searches in exact rational arithmetic.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from vllm_nvfp4kv.kernels import format as F
from vllm_nvfp4kv.kernels import reference as R

FP32_MAX = float(torch.finfo(torch.float32).max)
UNDERFLOW = 6 * 2.0 ** -10  # blocks with amax < UNDERFLOW * g flush to zero (format.py)
SAT = 6 * 448.0             # blocks with amax beyond SAT * g saturate (format.py)


# ---------------------------------------------------------------- independent oracles
def _e4m3_value(code: int) -> float:
    """E4M3 (fn) value of a non-negative code 0..126 from the bit definition (bias 7)."""
    e, m = code >> 3, code & 7
    return m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3_VALUES = [_e4m3_value(c) for c in range(127)]  # 0x7F is NaN in E4M3fn
assert E4M3_VALUES[-1] == 448.0 and E4M3_VALUES[1] == 2.0 ** -9
E4M3_FRACS = [Fraction(v) for v in E4M3_VALUES]


def brute_e4m3(v: float) -> int:
    """Nearest of the 127 non-negative finite E4M3 values, ties to the even code, saturating."""
    if v >= 448.0:
        return 126
    fv = Fraction(v)
    dists = [abs(fv - t) for t in E4M3_FRACS]
    best = min(dists)
    cands = [c for c, d in enumerate(dists) if d == best]
    assert len(cands) <= 2
    return min(cands, key=lambda c: c & 1)


E2M1_FRACS = [Fraction(v) for v in F.E2M1_VALUES]


def brute_e2m1(y: float) -> int:
    """4-bit code of the nearest E2M1 value, ties to the even code, saturating; NaN -> 0."""
    if math.isnan(y):
        return 0
    a = abs(y)
    if a >= 6.0:
        mag = 7
    else:
        fa = Fraction(a)
        dists = [abs(fa - t) for t in E2M1_FRACS]
        best = min(dists)
        mag = min((c for c, d in enumerate(dists) if d == best), key=lambda c: c & 1)
    return mag | (8 if (y < 0 and mag > 0) else 0)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def codes_of(data: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., D/2] -> codes [..., D] in element order."""
    return R.unpack_codes(data)


def halfgap(y: float) -> float:
    """Half the spacing of the E2M1 grid around |y| <= 6 (spacing .5 up to 2, 1 to 4, 2 to 6)."""
    return 0.25 if y <= 2 else (0.5 if y <= 4 else 1.0)


# ---------------------------------------------------------------- strategies
f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
# global scales: fp32-exact, spanning many binades, including 1.0 and awkward values
g_scales = st.one_of(
    st.sampled_from([1.0, 0.5, 2.0, f32(1 / 3), f32(0.0173), f32(7.3), 2.0 ** -12, 4096.0]),
    st.floats(min_value=2.0 ** -20, max_value=2.0 ** 20, width=32))


@st.composite
def blocks(draw, n_groups=st.integers(1, 3), allow_nan=False):
    """[n*16] fp32 values: arbitrary fp32 (edge-heavy), or gaussian blocks of random magnitude
    (the realistic case), optionally sprinkled with zeros/-0.0/NaN."""
    n = draw(n_groups) * F.GROUP_SIZE
    kind = draw(st.integers(0, 2))
    if kind == 0:
        x = draw(st.lists(f32s, min_size=n, max_size=n))
        x = torch.tensor(x, dtype=torch.float32)
    else:
        seed = draw(st.integers(0, 2 ** 31 - 1))
        mag = draw(st.floats(min_value=-40, max_value=40))
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=gen) * 2.0 ** mag
        if kind == 2:  # outlier in each group
            x[::F.GROUP_SIZE] *= 50
    special = draw(st.lists(st.tuples(st.integers(0, n - 1),
                                      st.sampled_from([0.0, -0.0] + [math.nan] * allow_nan)),
                            max_size=4))
    for i, v in special:
        x[i] = v
    return x


SETTINGS = settings(max_examples=400, deadline=None)


# ---------------------------------------------------------------- scalar codecs
@SETTINGS
@given(v=st.floats(min_value=0.0, max_value=1e6, width=32))
@example(v=0.0)
@example(v=2.0 ** -10)      # half the smallest subnormal: tie -> 0
@example(v=2.0 ** -10 * (1 + 2 ** -20))
@example(v=448.0)
@example(v=464.0)           # halfway to the (absent) next value: still saturates to 448
@example(v=1e30)
def test_e4m3_encode_matches_brute_force(v):
    assert int(R.e4m3_encode(torch.tensor([v]))[0]) == brute_e4m3(v)


def test_e4m3_encode_every_value_and_midpoint():
    """Exhaustive: every E4M3 value, every midpoint between neighbours (ties to even) and the
    fp32 neighbours of each midpoint, plus +Inf (saturates)."""
    pts = list(E4M3_VALUES) + [math.inf]
    for a, b in zip(E4M3_VALUES, E4M3_VALUES[1:]):
        mid = torch.tensor((a + b) / 2, dtype=torch.float32)
        pts += [float(mid), float(torch.nextafter(mid, torch.tensor(0.0))),
                float(torch.nextafter(mid, torch.tensor(math.inf)))]
    got = R.e4m3_encode(torch.tensor(pts, dtype=torch.float32)).tolist()
    want = [brute_e4m3(v) for v in pts]
    assert got == want


def test_e4m3_decode_all_codes():
    got = R.e4m3_decode(torch.arange(127, dtype=torch.uint8))
    assert got.tolist() == E4M3_VALUES


def test_e2m1_decode_all_codes():
    got = R.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got[:8] == list(F.E2M1_VALUES)
    assert got[8:] == [-v for v in F.E2M1_VALUES]


@pytest.mark.parametrize("t,tie_up", F.E2M1_THRESHOLDS)
def test_e2m1_ties_to_even_at_thresholds(t, tie_up):
    i = sum(1 for v in F.E2M1_VALUES if v < t) - 1  # t lies between codes i and i+1
    assert t == (F.E2M1_VALUES[i] + F.E2M1_VALUES[i + 1]) / 2
    winner = i + 1 if tie_up else i
    assert winner % 2 == 0, "format.py: at a tie the even code wins"
    tt = torch.tensor(t, dtype=torch.float32)
    below = float(torch.nextafter(tt, torch.tensor(0.0)))
    above = float(torch.nextafter(tt, torch.tensor(math.inf)))
    y = torch.tensor([t, below, above, -t, -below, -above], dtype=torch.float32)
    sgn = 8 if winner > 0 else 0
    want = [winner, i, i + 1, winner | sgn, i | (8 if i else 0), (i + 1) | 8]
    assert R.e2m1_encode(y).tolist() == want
    assert want == [brute_e2m1(v) for v in y.tolist()]


def test_e2m1_ties_through_quantize():
    """With g = 1 and amax = 6 the block scale is exactly 1, so the thresholds reach the E2M1
    rounding unchanged: one block holds 6, every threshold, its negation and 0."""
    ts = [t for t, _ in F.E2M1_THRESHOLDS]
    x = torch.tensor([6.0] + ts + [-t for t in ts] + [0.0])
    data, s = R.quantize(x, 1.0, "amax6")
    assert s.tolist() == [brute_e4m3(1.0)]
    assert codes_of(data).tolist() == [brute_e2m1(v) for v in x.tolist()]


@SETTINGS
@given(y=st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_e2m1_encode_matches_brute_force(y):
    assert int(R.e2m1_encode(torch.tensor([y], dtype=torch.float32))[0]) == brute_e2m1(y)


# ---------------------------------------------------------------- quantize / dequantize
@SETTINGS
@given(x=blocks(), g=g_scales)
def test_quantize_error_bound(x, g):
    """Per element, with scale = e4m3(s) * g:
    * |x|/scale <= 6: the error is at most half the E2M1 grid spacing around |x|/scale times
      scale (0.25, 0.5 or 1 x scale in [0,2], (2,4], (4,6]);
    * |x|/scale > 6 (the scale rounded down, or saturated at 448): decodes to exactly +-6 scale;
    * scale byte 0 (underflow, amax < 6 * 2**-10 * g up to rounding): decodes to 0.
    Slack: x * (1/scale) is fp32, which can move a value across a rounding threshold by
    about 2**-23 relative."""
    data, s = R.quantize(x, g, "amax6")
    deq = R.dequantize(data, s, g).double()
    codes = codes_of(data)
    assert not (codes == 8).any(), "-0 code never written"
    xb = x.double().view(-1, F.GROUP_SIZE)
    amax = xb.abs().amax(-1)
    for k in range(xb.shape[0]):
        sb = int(s[k])
        assert sb == brute_e4m3(f32(f32(float(amax[k]) / 6) / g)), "scale = e4m3(amax/6/g)"
        scale = E4M3_VALUES[sb] * g
        row = deq.view(-1, F.GROUP_SIZE)[k]
        if sb == 0:
            assert float(amax[k]) <= UNDERFLOW * g * (1 + 2 ** -20)
            assert (row == 0).all()
            continue
        for xv, dv in zip(xb[k].tolist(), row.tolist()):
            y = abs(xv) / scale
            slack = (abs(xv) + 6 * scale) * 2.0 ** -21
            if y > 5 * (1 + 2 ** -20):
                assert abs(abs(dv) - 6 * scale) <= 6 * scale * 2.0 ** -22
                assert dv == 0 or math.copysign(1, dv) == math.copysign(1, xv)
            else:
                assert abs(xv - dv) <= halfgap(y) * scale + slack, (xv, dv, scale)
        # E4M3 rounding of a normal scale costs at most 2**-4 relative, so a block that is
        # neither saturated nor subnormal keeps its max within 6.4 scale
        if E4M3_VALUES[sb] >= 2.0 ** -6 and float(amax[k]) <= SAT * g:
            assert float(amax[k]) <= 6 * scale * (1 + 2.0 ** -4) * (1 + 2 ** -20)


def test_block_scale_rules_lower_the_error():
    """The rules that try more scales keep the block's smallest squared error, so per block
    search <= 4over6 <= amax6 (each tries the previous one's candidates), and on Gaussian
    blocks the relative squared errors are format.py's 0.0091 / 0.0076 / 0.0068."""
    x = torch.randn(20000, 128, generator=torch.Generator().manual_seed(0))
    err = {}
    for rule in F.BLOCK_SCALE_RULES:
        code, s = R.quantize_codes(x, 1.0, rule)
        deq = R.dequantize_codes(code, s, 1.0)
        err[rule] = ((deq - x) ** 2).unflatten(-1, (-1, F.GROUP_SIZE)).sum(-1)
    assert (err["4over6"] <= err["amax6"]).all() and (err["search"] <= err["4over6"]).all()
    rel = {r: float(e.sum() / (x ** 2).sum()) for r, e in err.items()}
    assert [round(rel[r], 4) for r in F.BLOCK_SCALE_RULES] == [0.0091, 0.0076, 0.0068], rel


@SETTINGS
@given(n=st.integers(1, 4), g=g_scales, neg=st.lists(st.booleans(), min_size=64, max_size=64))
def test_all_zero_blocks(n, g, neg):
    x = torch.tensor([-0.0 if b else 0.0 for b in neg[:n * 16]])
    data, s = R.quantize(x, g, "amax6")
    assert (s == 0).all() and (data == 0).all()
    deq = R.dequantize(data, s, g)
    assert (deq == 0).all() and not torch.signbit(deq).any()


@SETTINGS
@given(frac=st.lists(st.floats(min_value=-1, max_value=1), min_size=16, max_size=16), g=g_scales)
def test_underflow_flushes_to_zero(frac, g):
    """amax < 6 * 2**-10 * g: the scale underflows E4M3, the block is stored as zeros."""
    thr = UNDERFLOW * g
    x = torch.tensor([f * thr for f in frac], dtype=torch.float32)
    x = torch.where(x.double().abs() < thr, x, torch.zeros_like(x))
    data, s = R.quantize(x, g, "amax6")
    assert int(s[0]) == 0 and (data == 0).all()
    assert (R.dequantize(data, s, g) == 0).all()


@pytest.mark.parametrize("g", [1.0, 0.25, f32(1 / 3), f32(3.7e-3), 1024.0])
def test_underflow_boundary(g):
    """Just below 6 * 2**-10 * g flushes; exactly there (when representable) is a tie that
    rounds to the even code 0; just above gets the smallest subnormal scale 2**-9."""
    thr = torch.tensor(UNDERFLOW * g, dtype=torch.float32)
    below = torch.nextafter(thr, torch.tensor(0.0))
    above = thr * (1 + 2.0 ** -20)
    cases = [(below, 0), (above, 1)]
    if float(thr) == UNDERFLOW * g:  # 6 g is exact in fp32: amax / 6 / g is exactly the tie
        cases.append((thr, 0))
    for amax, want in cases:
        x = torch.zeros(16)
        x[3] = -amax
        x[7] = amax / 2
        data, s = R.quantize(x, g, "amax6")
        assert int(s[0]) == want
        assert ((data == 0).all()) == (want == 0)


@SETTINGS
@given(x=blocks(n_groups=st.just(1)), g=g_scales, i=st.integers(0, 15),
       big=st.floats(min_value=1.0 + 2 ** -20, max_value=1e30))
def test_saturation(x, g, i, big):
    """A value beyond 6 * 448 * g saturates the scale at 448 (0x7E) and decodes to exactly
    +-6 * 448 * g; the rest of the block is quantized with that scale."""
    v = f32(SAT * g * big)
    assume(math.isfinite(v) and v > SAT * g)
    x = x.clone()
    x[i] = -v if i % 2 else v
    data, s = R.quantize(x, g, "amax6")
    assert int(s[0]) == 0x7E
    deq = R.dequantize(data, s, g)
    lim = float(torch.tensor(SAT) * torch.tensor(g, dtype=torch.float32))
    assert float(deq[i]) == (-lim if i % 2 else lim)
    assert float(deq.abs().max()) == lim
    # elements beyond the range all saturate
    over = x.double().abs() > 5 * 448 * g * (1 + 2 ** -20)
    assert (deq.abs()[over] == lim).all()


@SETTINGS
@given(x=blocks(), g=g_scales, sign=st.lists(st.booleans(), min_size=48, max_size=48))
def test_infinities_saturate(x, g, sign):
    """+-Inf: scale 448, the Inf decodes to +-6 * 448 * g; the block is quantized exactly as
    if the Inf were the largest finite fp32 value."""
    x = x.clone()
    idx = torch.arange(0, x.numel(), 5)
    sg = torch.tensor([1.0 if b else -1.0 for b in sign[:len(idx)]])
    xi, xf = x.clone(), x.clone()
    xi[idx] = sg * math.inf
    xf[idx] = sg * FP32_MAX
    di, si = R.quantize(xi, g, "amax6")
    df, sf = R.quantize(xf, g, "amax6")
    assert torch.equal(di, df) and torch.equal(si, sf)
    assert (si[idx // 16] == 0x7E).all()
    deq = R.dequantize(di, si, g)
    lim = float(torch.tensor(SAT) * torch.tensor(g, dtype=torch.float32))
    assert torch.equal(deq[idx], sg * lim)
    assert torch.isfinite(deq).all()


@SETTINGS
@given(x=blocks(), g=g_scales, nan_at=st.lists(st.integers(0, 47), min_size=1, max_size=10))
def test_nan_stored_as_zero_and_ignored_by_amax(x, g, nan_at):
    x = x.clone()
    nan_at = [i % x.numel() for i in nan_at]
    xn, xz = x.clone(), x.clone()
    xn[nan_at] = math.nan
    xz[nan_at] = 0.0
    dn, sn = R.quantize(xn, g, "amax6")
    dz, sz = R.quantize(xz, g, "amax6")
    assert torch.equal(dn, dz) and torch.equal(sn, sz)
    assert (codes_of(dn)[nan_at] == 0).all()
    assert torch.isfinite(R.dequantize(dn, sn, g)).all()


def test_all_nan_block():
    data, s = R.quantize(torch.full((16,), math.nan), 1.0, "amax6")
    assert int(s[0]) == 0 and (data == 0).all()


@SETTINGS
@given(x=blocks(allow_nan=True), g=g_scales)
def test_negative_zero_and_round_to_zero_stored_as_plus_zero(x, g):
    """Code 8 (-0) is never written: -0.0, tiny negatives and NaN all give code 0."""
    data, s = R.quantize(x, g, "amax6")
    codes = codes_of(data)
    assert not (codes == 8).any()
    assert (codes[torch.signbit(x) & (x == 0)] == 0).all()
    data0, s0 = R.quantize(torch.where(x == 0, torch.zeros_like(x), x), g, "amax6")
    assert torch.equal(data, data0) and torch.equal(s, s0)


@SETTINGS
@given(x=blocks(allow_nan=True), g=g_scales)
def test_sign_symmetry(x, g):
    """quantize(-x) has the same scales and flips exactly the sign bits of nonzero codes."""
    d1, s1 = R.quantize(x, g, "amax6")
    d2, s2 = R.quantize(-x, g, "amax6")
    assert torch.equal(s1, s2)
    c1, c2 = codes_of(d1), codes_of(d2)
    want = torch.where((c1 & 7) != 0, c1 ^ 8, c1)
    assert torch.equal(c2, want)


@SETTINGS
@given(x=blocks(), g=g_scales, dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_inputs_quantize_as_their_fp32_value(x, g, dtype):
    xl = x.to(dtype)
    a, b = R.quantize(xl, g, "amax6"), R.quantize(xl.float(), g, "amax6")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_word_layout():
    """Word j (little-endian bytes 4j..4j+3) holds elements 8j..8j+7: element e's magnitude
    code at bits WORD_MAG_BITS[e].. (rotating), its sign at WORD_SIGN_BITS[e]; every bit of a
    word belongs to exactly one element. Written out by hand for three elements."""
    x = torch.zeros(32)
    x[0], x[3], x[16], x[13] = 6.0, -3.0, 1.0, -1.0
    data, s = R.quantize(x, 1.0, "amax6")
    # element 0: code 7 (6.0) at bits 9..11; element 3: code 5 (3.0) at 28..30, sign at 23
    assert data[:4].tolist() == [0x00, 0x0E, 0x80, 0x50]
    # element 13 (word 1, e = 5): code 2 = 1.0 at bits 31, 0, 1 -> bit 0; sign at bit 5
    assert data[4:8].tolist() == [0x21, 0x00, 0x00, 0x00]
    # element 16 (word 2, e = 0): 1.0 / (1/6 scale) = 6 -> code 7 at bits 9..11
    assert data[8:12].tolist() == [0x00, 0x0E, 0x00, 0x00]
    assert s.tolist() == [brute_e4m3(1.0), brute_e4m3(1 / 6)]
    for mag_bits, sign_bits in ((F.WORD_MAG_BITS, F.WORD_SIGN_BITS),
                                (F.VWORD_MAG_BITS, F.VWORD_SIGN_BITS)):
        bits = [((mag_bits[e] + i) % 32) for e in range(8) for i in range(3)]
        assert sorted(bits + list(sign_bits)) == list(range(32))
    # V words: the even token's elements (e = 2k) fill bits 8..23, the odd one's the rest
    even = [(F.VWORD_MAG_BITS[e] + i) % 32 for e in range(0, 8, 2) for i in range(3)]
    assert sorted(even + list(F.VWORD_SIGN_BITS[0::2])) == list(range(8, 24))
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(R.unpack_codes(R.pack_codes(codes)), codes)


def test_v_slots_and_token_pair_words():
    """v_slot permutes each 16 tokens; the V slot pair of tokens
    2c, 2c+1, 2c+8, 2c+9 is 2c, 2c+1 (one lane's 8-byte load); two tokens' bytes of a word
    never overlap and unpack back to their codes."""
    t = torch.arange(128)
    sl = F.v_slot(t)
    assert torch.equal(sl.sort().values, t) and torch.equal(sl // 16, t // 16)
    assert [F.v_slot(x) // 2 for x in (0, 1, 8, 9, 6, 7, 14, 15)] == [0, 0, 1, 1, 6, 6, 7, 7]
    codes = torch.randint(0, 16, (2, 5, 64), dtype=torch.uint8)   # [token parity, .., D]
    own = R.pack_v_token(codes, torch.tensor([[0], [1]]))          # [2, 5, 16, 2]
    words = torch.zeros(5, 16, 4, dtype=torch.uint8)
    words[..., 1], words[..., 2] = own[0, ..., 0], own[0, ..., 1]
    words[..., 3], words[..., 0] = own[1, ..., 0], own[1, ..., 1]
    for p in (0, 1):
        assert torch.equal(R.unpack_v_token(words, torch.full((5,), p)), codes[p])


# ---------------------------------------------------------------- page geometry
@pytest.mark.parametrize("block_size", F.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("heads", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128, 256])
def test_page_bytes_and_shape(block_size, heads, head_dim):
    rb = head_dim // 2 + head_dim // 16
    assert F.row_bytes(head_dim) == rb
    assert F.page_bytes(block_size, heads, head_dim) == block_size * heads * 2 * rb
    shape = F.kv_cache_shape(5, block_size, heads, head_dim)
    assert shape == (5, 2 * heads, block_size, rb)
    assert math.prod(shape) == 5 * F.page_bytes(block_size, heads, head_dim)
    lay = F.PageLayout(block_size, heads, head_dim)
    assert lay.page_bytes == F.page_bytes(block_size, heads, head_dim)
    # the (side, head, token) data and scale bytes tile the page exactly once
    cover = torch.zeros(lay.page_bytes, dtype=torch.int32)
    for side in (0, 1):
        for h in range(heads):
            for t in range(block_size):
                cover[lay.data_offsets(side, h, t)] += 1
                cover[lay.scale_offsets(side, h, t)] += 1
    assert (cover == 1).all()
    # order: [K data | K scales | V data | V scales], head-major; K token-major
    side_data = heads * block_size * head_dim // 2
    assert lay.data_offsets(0, 0, 0)[0] == 0
    assert lay.scale_offsets(0, 0, 0)[0] == side_data
    assert lay.data_offsets(0, 1 % heads, 1)[0] == ((1 % heads) * block_size + 1) * head_dim // 2
    # V: token 0 owns bytes 1-2 of word (0, 0), token 1 bytes 3 and 0 of it, token 2 (slot 4)
    # bytes 1-2 of word (0, 2); group g of token 8 (slot 2) at byte g * block_size + 2
    v = lay.page_bytes // 2
    assert lay.data_offsets(1, 0, 0)[:4] == [v + 1, v + 2, v + 4 * (block_size // 2) + 1,
                                             v + 4 * (block_size // 2) + 2]
    assert lay.data_offsets(1, 0, 1)[:2] == [v + 3, v]
    assert lay.data_offsets(1, 0, 2)[:2] == [v + 9, v + 10]
    assert lay.scale_offsets(1, 0, 8) == [v + side_data + g * block_size + 2
                                          for g in range(head_dim // 16)]


def test_page_bytes_at_d128():
    assert F.row_bytes(128) == 72
    assert F.page_bytes(1, 1, 128) == 144  # per token per kv head, K and V
    assert F.page_bytes(16, 8, 128) == 16 * 8 * 144


@pytest.mark.parametrize("head_dim", [0, -16, 8, 72, 100])
def test_bad_head_dim_rejected(head_dim):
    with pytest.raises(ValueError):
        F.check_head_dim(head_dim)


def test_reference_write_cache_uses_the_documented_layout():
    """reference.write_cache puts the quantized bytes at PageLayout's offsets and nowhere else:
    K rows as quantize() packs them, V as each token's two bytes per token-pair word
    (pack_v_token, checked bit by bit against VWORD_*_BITS here)."""
    n, h, d = 16, 2, 64
    gen = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 256, F.kv_cache_shape(3, n, h, d), dtype=torch.uint8, generator=gen)
    before = cache.clone()
    key, val = torch.randn(2, h, d, generator=gen), torch.randn(2, h, d, generator=gen)
    slots = torch.tensor([21, -1])                  # page 1, token 5: V slot 9 (odd)
    R.write_cache(cache, key, val, slots, 0.5, 3.0, "amax6")
    lay = F.PageLayout(n, h, d)
    page, before_page = cache[1].flatten(), before[1].flatten().clone()
    kdata, ks = R.quantize(key[0], 0.5, "amax6")
    vcodes, vs = R.quantize_codes(val[0], 3.0, "amax6")
    assert F.v_slot(5) == 9
    for hh in range(h):
        for side, data, s in ((0, kdata[hh], ks[hh]), (1, None, vs[hh])):
            o = lay.data_offsets(side, hh, 5)
            if side == 1:  # bytes 3 and 0 of each word (q, 4) hold elements 4q .. 4q+3
                word = torch.zeros(d // 4, dtype=torch.int64)
                for e in range(d):
                    c = int(vcodes[hh, e])
                    k, mag_at = e % 4, F.VWORD_MAG_BITS[2 * (e % 4) + 1]
                    for i in range(3):
                        word[e // 4] |= ((c >> i) & 1) << ((mag_at + i) % 32)
                    word[e // 4] |= (c >> 3) << F.VWORD_SIGN_BITS[2 * k + 1]
                data = torch.stack(((word >> 24) & 0xFF, word & 0xFF), -1).flatten()
                assert ((word >> 8) & 0xFFFF).eq(0).all(), "the odd token owns bytes 3 and 0"
            assert torch.equal(page[o], data.to(torch.uint8))
            before_page[o] = page[o]
            o = lay.scale_offsets(side, hh, 5)
            assert torch.equal(page[o], s)
            before_page[o] = s
    assert torch.equal(page, before_page)
    assert torch.equal(cache[0], before[0]) and torch.equal(cache[2], before[2])
    # and the reference gather reads it back as dequantize()
    k, v = R.gather_cache(cache, torch.tensor([[0, 1, 2]]), torch.tensor([0, 1]),
                          torch.tensor([21]), d, 0.5, 3.0)
    assert torch.equal(k[0], R.dequantize(kdata, ks, 0.5))
    assert torch.equal(v[0], R.dequantize_codes(vcodes, vs, 3.0))
