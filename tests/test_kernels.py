"""Every Triton kernel against its plain-torch oracle in ``reference``.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes
are tiny and the parametrizations cover each axis (head dim, block size, GQA ratio, dtype,
page stride, splits, ...) rather than their cross product. The same assertions run on CUDA.

Caches start as random garbage bytes, with many 0x7F / 0xFF bytes (NaN / negative-NaN as E4M3
scales); only the slots a test writes hold real data. So every test also checks that the
kernels read only what they own.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import triton
import triton.language as tl

from vllm_nvfp4kv import kernels as K
from vllm_nvfp4kv.kernels import codec
from vllm_nvfp4kv.kernels import reference as R
from vllm_nvfp4kv.kernels.rotation import hadamard
from vllm_nvfp4kv.kernels.format import E2M1_THRESHOLDS, E2M1_VALUES, kv_cache_shape, v_slot

E4M3_FINITE = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
# Triton 3.6's interpreter does not round fp32 -> bf16 to nearest even (it truncates toward
# zero) nor fp32 -> fp8 (round-half-up with a broken mantissa carry: 7.8 -> 4.0). Compiled
# kernels use the hardware round-to-nearest-even converts. Checks of rounded outputs account
# for the former and avoid the latter under the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------- helpers
from helpers import _gen, garbage  # noqa: E402


def cache_pair(nb, n, h, d, device, gen, layout="plain"):
    """Two identical garbage caches [nb, 2h, n, F] and their backing buffers: the kernel's on
    `device`, the reference's on the CPU (see ref_write). layout "pad": each cache is the view
    [:, :2h] of a [nb, 2h + 2, n, F] buffer, so pages stay contiguous but the page stride
    exceeds the page size; "offset": the view [2:2 + nb] of a buffer of nb + 3 pages (nonzero
    storage offset, pages beyond both ends)."""
    shape = list(kv_cache_shape(nb, n, h, d))
    first = 0
    if layout == "pad":
        shape[1] += 2
    elif layout == "offset":
        shape[0] += 3
        first = 2
    else:
        assert layout == "plain"
    buf_ref = garbage(shape, gen)
    buf = buf_ref.clone().to(device)
    view = (slice(first, first + nb), slice(0, 2 * h))
    return buf[view], buf_ref[view], buf, buf_ref


def ref_write(cache_ref, key, value, slots, k_scale, v_scale):
    """reference.write_cache on the CPU, the oracle of the writer tests: the format is defined
    by IEEE fp32 arithmetic, which torch's CPU ops follow, while on CUDA torch computes
    `x / 6.0` as `x * (1 / 6.0)` (see test_reference_quantize_is_device_independent)."""
    cpu = [t.cpu() if torch.is_tensor(t) else t for t in (key, value, slots, k_scale, v_scale)]
    R.write_cache(cache_ref, *cpu, "amax6")


def assert_same_bytes(buf, buf_ref):
    buf = buf.cpu()
    diff = (buf != buf_ref).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


def rand_kv(t, h, d, gen, dtype=torch.float32, device="cpu", spread=6):
    """[t, h, d] gaussian values whose magnitude varies per row by 2**[-spread, spread]."""
    mag = 2.0 ** torch.randint(-spread, spread + 1, (t, h, 1), generator=gen).float()
    return (torch.randn(t, h, d, generator=gen) * mag).to(dtype).to(device)


def fill_sequences(cache, seq_lens, n, gen, k_scale, v_scale, extra_cols=2, spread=6):
    """Give each sequence distinct random pages, write its tokens through the reference writer
    (the kernel writer is tested separately), and return an int32 block table whose entries
    beyond each sequence's pages (extra_cols more than needed) point at pages nobody owns
    (garbage). The unused slots of each sequence's last page stay garbage too. The table is a
    column slice of a wider one (row stride > width), as vLLM's persistent tables are."""
    nb, two_h, _, _ = cache.shape
    h = two_h // 2
    d = (cache.shape[3] * 16) // 9
    need = [math.ceil(s / n) for s in seq_lens]
    cols = max(need + [1]) + extra_cols
    perm = torch.randperm(nb, generator=gen)
    spare = perm[sum(need):]
    assert len(spare) > 0
    wide = spare[0].repeat(len(seq_lens), cols + 3).to(torch.int32)
    used = 0
    for b, (s, pages) in enumerate(zip(seq_lens, need)):
        own = perm[used:used + pages]
        used += pages
        wide[b, :pages] = own
        wide[b, pages:cols] = spare[torch.randint(0, len(spare), (cols - pages,), generator=gen)]
        if s:
            slots = (own[:, None] * n + torch.arange(n)).flatten()[:s].to(cache.device)
            key, value = (rand_kv(s, h, d, gen, device=cache.device, spread=spread)
                          for _ in range(2))
            R.write_cache(cache, key, value, slots, k_scale, v_scale, "amax6")
    table = wide.to(cache.device)[:, :cols]
    assert table.stride(0) == cols + 3
    return table


def assert_rounded_from(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out == the fp32 reference rounded once to out.dtype (nearest even); under the
    interpreter a bf16 element may instead be the reference truncated toward zero."""
    want = ref.to(out.dtype)
    if INTERPRETED and out.dtype == torch.bfloat16:
        trunc = (ref.contiguous().view(torch.int32) & -65536).view(torch.float32)
        ok = (out == want) | (out == trunc.to(torch.bfloat16))
        assert ok.all(), f"{int((~ok).sum())} elements differ"
    else:
        assert torch.equal(out, want)


# ---------------------------------------------------------------- codec device functions
@triton.jit
def _codec_probe(x_ptr, word_ptr, e4m3_ptr, e2m1_ptr, e4m3_dec_ptr, elems_ptr, asm_ptr,
                 packed_ptr, n, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(e4m3_ptr + i, codec.e4m3_encode(tl.abs(x)), mask=m)
    tl.store(e2m1_ptr + i, codec.e2m1_encode(x).to(tl.uint8), mask=m)
    j = tl.arange(0, 256)
    tl.store(e4m3_dec_ptr + j, codec.e4m3_decode(j.to(tl.uint8)))
    w = tl.arange(0, 64)
    words = tl.load(word_ptr + w)
    vals = codec.word_values(words, False)                            # [64, 2, 2, 2]
    tl.store(elems_ptr + tl.reshape(w[:, None] * 8 + tl.arange(0, 8)[None, :], (64, 2, 2, 2)),
             vals.to(tl.float32) * codec.E2M1_FP16_FACTOR)
    if USE_ASM:  # the inline-PTX decoder
        vals = codec.word_values(words, True)
        tl.store(asm_ptr + tl.reshape(w[:, None] * 8 + tl.arange(0, 8)[None, :], (64, 2, 2, 2)),
                 vals.to(tl.float32) * codec.E2M1_FP16_FACTOR)
    # the writer's packing: codes (element order) -> words; every code at every position
    codes = (tl.arange(0, 32)[:, None] + 5 * tl.arange(0, 8)[None, :]) % 16
    tl.store(packed_ptr + tl.arange(0, 32), codec.e2m1_pack_words(codes))


def test_codec_device_functions(device):
    """Triton's E4M3/E2M1 codecs vs the reference on every E4M3 value, every midpoint between
    neighbours and its fp32 neighbours, every E2M1 threshold and its neighbours, specials, and
    random and extreme data words for the decoders (the inline-PTX one on CUDA), and the
    writer's word packing of every code at every position."""
    e4 = E4M3_FINITE.tolist()
    pts = list(e4) + [(a + b) / 2 for a, b in zip(e4, e4[1:])]
    pts += [v * 2 ** e for v in (1.0, 1.5, 1.75) for e in range(-12, -5)]  # sub/normal edge
    pts += [500.0, 1e30, math.inf, 2.0 ** -126, 1e-45]
    x = torch.tensor(pts, dtype=torch.float32)
    x = torch.cat([x, torch.nextafter(x, torch.zeros(1)), torch.nextafter(x, x + 1)])
    ths = torch.tensor([t for t, _ in E2M1_THRESHOLDS] + list(E2M1_VALUES) + [7.0, 1e9])
    ths = torch.cat([ths, torch.nextafter(ths, torch.zeros(1)), torch.nextafter(ths, ths + 1)])
    x = torch.cat([x, ths, -ths, torch.tensor([-0.0, math.nan, -math.inf, math.inf])])
    n = x.numel()
    block = triton.next_power_of_2(n)
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(-2 ** 31, 2 ** 31, (64,), generator=gen, dtype=torch.int64)
    words[:4] = torch.tensor([0, -1, 2 ** 31 - 1, -2 ** 31])  # every int32 is a valid word
    words = words.to(torch.int32)
    outs = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2)]
    outs += [torch.empty(256, dtype=torch.float32, device=device)]
    outs += [torch.zeros(512, dtype=torch.float32, device=device) for _ in range(2)]
    outs += [torch.empty(32, dtype=torch.int32, device=device)]
    _codec_probe[(1,)](x.to(device), words.to(device), *outs, n, BLOCK=block,
                       USE_ASM=device == "cuda", num_warps=4)
    e4m3, e2m1, e4m3_dec, elems, elems_asm, packed = (o.cpu() for o in outs)
    finite = ~torch.isnan(x)
    assert torch.equal(e4m3[finite], R.e4m3_encode(x.abs()[finite]))
    assert torch.equal(e2m1, R.e2m1_encode(x))
    assert torch.equal(e4m3_dec[:127], R.e4m3_decode(torch.arange(127, dtype=torch.uint8)))
    # documented: the sign bit is ignored and 0x7F (NaN in E4M3) decodes to 480, finite
    assert float(e4m3_dec[127]) == 480.0 and torch.equal(e4m3_dec[128:], e4m3_dec[:128])
    want = R.e2m1_decode(R.unpack_codes(words.view(torch.uint8)))    # little-endian bytes
    assert torch.equal(elems, want), "e2m1_word_fp16_portable"
    if device == "cuda":
        assert torch.equal(elems_asm, want), "e2m1_word_fp16 (PTX)"
    codes = ((torch.arange(32)[:, None] + 5 * torch.arange(8)[None, :]) % 16).flatten()
    codes = codes.to(torch.uint8)
    assert torch.equal(packed.view(torch.uint8), R.pack_codes(codes)), "e2m1_pack_words"


# ---------------------------------------------------------------- writer
def _fused_qkv(t, hq, hkv, d, gen, dtype, device):
    """key/value as strided views of one fused qkv projection output [t, (hq + 2 hkv) d]."""
    qkv = rand_kv(t, hq + 2 * hkv, d, gen, dtype, device).flatten(1)
    k = qkv[:, hq * d:(hq + hkv) * d].unflatten(1, (hkv, d))
    v = qkv[:, (hq + hkv) * d:].unflatten(1, (hkv, d))
    return k, v


WRITE_CASES = [
    # head_dim, block_size, kv_heads, dtype, cache layout (see cache_pair), key/value views
    pytest.param(64, 16, 1, torch.bfloat16, "offset", "contiguous", id="d64-n16-bf16-offset"),
    pytest.param(128, 64, 2, torch.float16, "pad", "fused", id="d128-n64-fp16-pad-fused"),
    pytest.param(256, 16, 1, torch.float32, "plain", "fused", id="d256-n16-fp32-fused"),
    pytest.param(80, 16, 2, torch.bfloat16, "pad", "head-major", id="d80-n16-bf16-pad-hmajor"),
    pytest.param(96, 64, 1, torch.float32, "plain", "contiguous", id="d96-n64-fp32"),
]


@pytest.mark.parametrize("bt", [None, 8], ids=["bt-auto", "bt8"])
@pytest.mark.parametrize("d,n,h,dtype,layout,views", WRITE_CASES)
def test_write_cache_matches_reference(device, d, n, h, dtype, layout, views, bt):
    """Bit-exact vs reference.write_cache over the whole backing buffer: negative slots
    skipped, other slots' bytes (and the padding between pages) untouched; key/value may have
    more rows than slot_mapping; scales as floats or tensors. bt: tokens per writer program
    (the launcher's choice, or 8: 12 tokens end inside a program)."""
    gen = _gen(d * 7 + n)
    nb, t = 4, 12
    cache, cache_ref, buf, buf_ref = cache_pair(nb, n, h, d, device, gen, layout)
    if views == "fused":
        key, value = _fused_qkv(t + 3, 2 * h, h, d, gen, dtype, device)
        assert not key.is_contiguous()
    elif views == "head-major":  # [H, T, D] storage seen as [T, H, D]
        key, value = (rand_kv(h, t + 3, d, gen, dtype, device).transpose(0, 1)
                      for _ in range(2))
        assert key.stride(1) == (t + 3) * d
    else:
        key, value = (rand_kv(t + 3, h, d, gen, dtype, device) for _ in range(2))
    slots = torch.randperm(nb * n - 1, generator=gen)[:t]  # distinct slots
    slots[[2, 7]] = -1
    slots[5] = nb * n - 1  # last slot of the cache
    slots = slots.to(device)
    k_scale, v_scale = 0.37, torch.tensor([2.5], device=device)
    K.write_cache(cache, key, value, slots, k_scale, v_scale, "amax6", tokens_per_program=bt)
    ref_write(cache_ref, key[:t], value[:t], slots, k_scale, v_scale)
    assert_same_bytes(buf, buf_ref)


def _special_rows(d, dtype, gen):
    """Rows exercising every special case of format.py, representable in dtype."""
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    ts = [t for t, _ in E2M1_THRESHOLDS]

    def randn():
        return torch.randn(d, generator=gen)

    nan_mixed, infs, fmax_mixed, pairs = randn(), randn(), randn(), randn()
    nan_mixed[::3] = math.nan
    infs[1], infs[18] = math.inf, -math.inf
    fmax_mixed[::5] = fmax
    pairs[::2] = -pairs[1::2]  # sign symmetry within each byte
    rows = [
        torch.zeros(d),                      # all zero
        -torch.zeros(d),                     # all -0.0
        nan_mixed,                           # NaN among values
        torch.full((d,), math.nan),          # all NaN
        infs,                                # +-Inf saturate
        randn() * fmax / 4,                  # huge (some overflow to Inf in the cast)
        fmax_mixed,                          # the dtype's max among small values
        randn() * tiny,                      # scale underflows: zeros
        randn() * tiny * 2 ** -5,            # subnormal inputs
        randn() * 0.0058,                    # near the underflow boundary 6 * 2**-10
        torch.tensor([6.0] + ts + [-t for t in ts] + [-0.0]).repeat(d // 16),  # E2M1 ties
        pairs,
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_cache_special_values(device, dtype):
    """NaN / Inf / huge / zero / -0 / denormal / tie rows, bit-exact vs the reference, and the
    cache never holds an E4M3 NaN scale (0x7F / 0xFF) in any written row."""
    d, n, h = 128, 16, 1
    gen = _gen(11)
    rows = _special_rows(d, dtype, gen)
    t = rows.shape[0]
    key = rows[:, None].to(device)
    value = rows.flip(0)[:, None].to(device)
    cache, cache_ref, buf, buf_ref = cache_pair(2, n, h, d, device, gen)
    slots = torch.arange(t, device=device)
    for g, bt in ((1.0, None), (0.03125, 8), (3.3, 4)):  # bt: tokens per writer program
        K.write_cache(cache, key, value, slots, g, 1 / g, "amax6", tokens_per_program=bt)
        ref_write(cache_ref, key, value, slots, g, 1 / g)
        assert_same_bytes(buf, buf_ref)
        _, ks, _, vs = R.page_views(cache, d)
        v_slots = v_slot(torch.arange(t, device=device))
        written = torch.cat([ks[0, :, :t].flatten(), vs[0, :, :, v_slots].flatten()])
        assert not ((written & 0x7F) == 0x7F).any()
        k, v = R.gather_cache(cache, torch.tensor([[0, 1]], device=device),
                              torch.tensor([0, t], device=device),
                              torch.zeros(1, dtype=torch.long, device=device), d, g, 1 / g)
        assert torch.isfinite(k).all() and torch.isfinite(v).all()


def test_write_cache_scale_codes_exhaustive(device):
    """Group maxima at 6 g times every E4M3 value and every midpoint between neighbours (and
    their fp32 neighbours), so the kernel's bit-arithmetic E4M3 rounding is compared with the
    reference on every decision boundary, fp32 input."""
    d, n, h = 128, 64, 1
    e4 = E4M3_FINITE[1:]
    mids = (E4M3_FINITE[:-1] + E4M3_FINITE[1:]) / 2
    targets = torch.cat([e4, mids, torch.nextafter(mids, torch.zeros(1)),
                         torch.nextafter(mids, mids + 1), torch.tensor([460.0, 470.0])])
    groups = targets.numel()
    rows = math.ceil(groups / (d // 16))
    targets = torch.cat([targets, torch.ones(rows * (d // 16) - groups)])
    gen = _gen(3)
    for g in (1.0, 0.7):
        x = torch.rand(rows * d // 16, 16, generator=gen) * 2 - 1
        x[:, 5] = torch.where(torch.rand(x.shape[0], generator=gen) < 0.5, -1.0, 1.0)
        x = (x * (targets * 6 * g)[:, None]).view(rows, 1, d).to(device)
        cache, cache_ref, buf, buf_ref = cache_pair(math.ceil(rows / n), n, h, d, device, gen)
        slots = torch.arange(rows, device=device)
        K.write_cache(cache, x, -x, slots, g, g, "amax6")
        ref_write(cache_ref, x, -x, slots, g, g)
        assert_same_bytes(buf, buf_ref)


def test_reference_quantize_is_device_independent(device):
    """The oracle itself: reference.quantize on `device` gives the CPU's (IEEE fp32) bytes,
    here on the E4M3 decision boundaries, where a last-bit difference in amax / 6 / g flips
    the scale."""
    e4 = E4M3_FINITE[1:]
    mids = (E4M3_FINITE[:-1] + E4M3_FINITE[1:]) / 2
    t = torch.cat([e4, mids, torch.nextafter(mids, torch.zeros(1)),
                   torch.nextafter(mids, mids + 1)])
    x = torch.zeros(t.numel(), 16)
    for g in (1.0, 0.7, 1 / 3):
        x[:, 3] = t * 6 * g
        cpu = R.quantize(x, g, "amax6")
        dev = R.quantize(x.to(device), g, "amax6")
        assert torch.equal(dev[1].cpu(), cpu[1]), f"g={g}: {int((dev[1].cpu() != cpu[1]).sum())}"
        assert torch.equal(dev[0].cpu(), cpu[0])


def test_write_cache_no_valid_slots(device):
    d, n, h = 64, 16, 1
    gen = _gen(5)
    cache, _, buf, _ = cache_pair(2, n, h, d, device, gen)
    before = buf.clone()
    key = rand_kv(3, h, d, gen, device=device)
    K.write_cache(cache, key, key, torch.full((3,), -1, device=device), 1.0, 1.0, "amax6")
    K.write_cache(cache, key, key, torch.empty(0, dtype=torch.long, device=device), 1.0, 1.0,
                  "amax6")
    assert torch.equal(buf, before)


def test_write_cache_int32_slots(device):
    d, n, h = 64, 16, 2
    gen = _gen(6)
    cache, cache_ref, buf, buf_ref = cache_pair(3, n, h, d, device, gen)
    key, value = (rand_kv(5, h, d, gen, torch.bfloat16, device) for _ in range(2))
    slots = torch.tensor([47, -1, 0, 16, 31], dtype=torch.int32, device=device)
    K.write_cache(cache, key, value, slots, 1.0, 1.0, "amax6")
    ref_write(cache_ref, key, value, slots.long(), 1.0, 1.0)
    assert_same_bytes(buf, buf_ref)


HEAD_DIMS = (64, 80, 96, 128, 256)


@pytest.mark.parametrize("seed", range(6))
def test_write_cache_random_configs(device, seed):
    """Seeded random sweep: head dim, block size, heads, dtype, layout, slots (some negative),
    global scales; bit-exact over the whole backing buffer."""
    rng = random.Random(seed)
    d, n, h = rng.choice(HEAD_DIMS), rng.choice((16, 32, 64)), rng.choice((1, 2, 3))
    dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
    nb, t = rng.randint(1, 4), rng.randint(1, 10)
    gen = _gen(1000 + seed)
    cache, cache_ref, buf, buf_ref = cache_pair(nb, n, h, d, device, gen,
                                                rng.choice(("plain", "pad", "offset")))
    key, value = _fused_qkv(t, rng.choice((0, 4)), h, d, gen, dtype, device)
    slots = torch.randperm(nb * n, generator=gen)[:t]
    slots[torch.rand(slots.shape, generator=gen) < 0.3] = -1
    slots = slots.to(device)
    k_scale, v_scale = rng.choice((1.0, 0.01, 3.7)), rng.choice((1.0, 0.2, 96.0))
    K.write_cache(cache, key, value, slots, k_scale, v_scale, "amax6",
                  tokens_per_program=rng.choice((None, 2, 4)))
    ref_write(cache_ref, key, value, slots, k_scale, v_scale)
    assert_same_bytes(buf, buf_ref)


# ---------------------------------------------------------------- gather
GATHER_CASES = [
    # head_dim, block_size, kv_heads, out dtype, cache layout, seq_lens, seq_starts, counts
    pytest.param(64, 16, 1, torch.float32, "offset", [40, 1, 0, 23], [3, 0, 0, 17],
                 [37, 1, 0, 6], id="d64-n16-fp32-offset"),
    pytest.param(128, 64, 2, torch.bfloat16, "pad", [130, 5, 64], [60, 4, 0], [70, 1, 64],
                 id="d128-n64-bf16-pad"),
    pytest.param(256, 16, 1, torch.float16, "plain", [33, 17], [1, 16], [32, 1],
                 id="d256-n16-fp16"),
    pytest.param(80, 16, 2, torch.float32, "pad", [20, 9], [5, 0], [15, 9],
                 id="d80-n16-fp32-pad"),
    pytest.param(96, 64, 1, torch.bfloat16, "plain", [70, 2], [65, 0], [5, 2],
                 id="d96-n64-bf16"),
]


@pytest.mark.parametrize("d,n,h,dtype,layout,seq_lens,starts,counts", GATHER_CASES)
def test_gather_matches_reference(device, d, n, h, dtype, layout, seq_lens, starts, counts):
    """Tokens [seq_starts, seq_starts + count) of ragged sequences (empty, single-token, middle
    ranges) into a shared k/v workspace (k and v interleaved views with equal strides).
    fp32: bit-exact; bf16/fp16: the reference rounded once to that dtype. Workspace rows
    beyond cu_tokens[-1] untouched; pages not owned (garbage, NaN scale bytes) never read."""
    gen = _gen(d + n)
    k_scale, v_scale = 0.8125, 3.0
    nb = sum(math.ceil(s / n) for s in seq_lens) + 3
    cache, _, _, _ = cache_pair(nb, n, h, d, device, gen, layout)
    table = fill_sequences(cache, seq_lens, n, gen, k_scale, v_scale)
    cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    ss = torch.tensor(starts, dtype=torch.int32, device=device)
    total = int(cu[-1])
    ws = torch.full((total + 2, 2, h, d), 1024.0, dtype=dtype, device=device)
    k_out, v_out = ws[:, 0], ws[:, 1]
    K.gather_cache(cache, table, cu, ss, k_out, v_out, k_scale, v_scale,
                   max_tokens=max(counts) + 5)
    rk, rv = R.gather_cache(cache, table, cu, ss, d, k_scale, v_scale)
    assert torch.isfinite(rk).all() and torch.isfinite(rv).all()
    assert_rounded_from(k_out[:total], rk)
    assert_rounded_from(v_out[:total], rv)
    assert (ws[total:].float() == 1024.0).all()


@pytest.mark.parametrize("seed", range(6))
def test_gather_random_configs(device, seed):
    """Seeded random sweep: ragged batches with random [start, start + count) ranges."""
    rng = random.Random(seed)
    d, n, h = rng.choice(HEAD_DIMS), rng.choice((16, 32, 64)), rng.choice((1, 2))
    dtype = rng.choice((torch.float32, torch.bfloat16, torch.float16))
    seq_lens = [rng.choice((0, 1, rng.randint(1, 3 * n))) for _ in range(rng.randint(1, 4))]
    starts = [rng.randint(0, s) for s in seq_lens]
    counts = [rng.randint(0, s - st) for s, st in zip(seq_lens, starts)]
    gen = _gen(2000 + seed)
    k_scale, v_scale = rng.choice((1.0, 0.05)), rng.choice((1.0, 7.5))
    nb = sum(math.ceil(s / n) for s in seq_lens) + 2
    cache, _, _, _ = cache_pair(nb, n, h, d, device, gen, rng.choice(("plain", "pad", "offset")))
    table = fill_sequences(cache, seq_lens, n, gen, k_scale, v_scale)
    cu = torch.tensor([0] + counts).cumsum(0).to(torch.int32).to(device)
    ss = torch.tensor(starts, dtype=torch.int32, device=device)
    total = int(cu[-1])
    k_out = torch.full((total + 1, h, d), 3.0, dtype=dtype, device=device)
    v_out = torch.full((total + 1, h, d), 3.0, dtype=dtype, device=device)
    K.gather_cache(cache, table, cu, ss, k_out, v_out, k_scale, v_scale,
                   max_tokens=max(counts))
    rk, rv = R.gather_cache(cache, table, cu, ss, d, k_scale, v_scale)
    assert_rounded_from(k_out[:total], rk)
    assert_rounded_from(v_out[:total], rv)
    assert (k_out[total:] == 3.0).all() and (v_out[total:] == 3.0).all()


def test_gather_out_starts(device):
    """out_starts: sequence b's rows go to out_starts[b]: instead of cu_tokens[b]: (any order,
    gaps allowed); rows in the gaps are untouched."""
    d, n, h = 128, 16, 2
    gen = _gen(31)
    seq_lens, starts, counts = [40, 9, 0, 20], [5, 0, 0, 3], [35, 9, 0, 1]
    cache, _, _, _ = cache_pair(sum(math.ceil(s / n) for s in seq_lens) + 2, n, h, d, device, gen)
    table = fill_sequences(cache, seq_lens, n, gen, 0.5, 2.0)
    cu = torch.tensor([0] + counts).cumsum(0).to(torch.int32).to(device)
    ss = torch.tensor(starts, dtype=torch.int32, device=device)
    dst = [50, 2, 0, 40]  # rows 50:85, 2:11, (none), 40:41
    k_out = torch.full((90, h, d), 5.0, device=device)
    v_out = torch.full((90, h, d), 5.0, device=device)
    K.gather_cache(cache, table, cu, ss, k_out, v_out, 0.5, 2.0, max(counts),
                   out_starts=torch.tensor(dst, dtype=torch.int32, device=device))
    rk, rv = R.gather_cache(cache, table, cu, ss, d, 0.5, 2.0)
    written = torch.zeros(90, dtype=torch.bool)
    for b in range(len(seq_lens)):
        o, c0, c1 = dst[b], int(cu[b]), int(cu[b + 1])
        assert torch.equal(k_out[o:o + c1 - c0], rk[c0:c1])
        assert torch.equal(v_out[o:o + c1 - c0], rv[c0:c1])
        written[o:o + c1 - c0] = True
    assert (k_out[~written.to(device)] == 5.0).all() and (v_out[~written.to(device)] == 5.0).all()


def test_gather_refuses_a_workspace_past_2_31(device):
    """The gather's row offsets are 32-bit: a workspace of 2**31 elements or more is refused
    before launch (meta tensors: nothing is allocated)."""
    d, n, h = 128, 16, 8
    cache, _, _, _ = cache_pair(2, n, h, d, device, _gen(3))
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    ss = torch.zeros(1, dtype=torch.int32, device=device)
    big = torch.empty(2 ** 31 // (h * d), h, d, dtype=torch.bfloat16, device="meta")
    with pytest.raises(AssertionError, match="workspace too large"):
        K.gather_cache(cache, table, cu, ss, big, big, 1.0, 1.0, 4)


def test_gather_fp8_output_with_divisor(device):
    """float8_e4m3fn workspace with out_div = 8 (a power of two: the division is exact and the
    result is the reference / 8 rounded once to FP8). First with pages crafted so that every
    value / 8 is an FP8 value (power-of-two block scales: no rounding, so this part holds
    under the interpreter too), then, compiled only, writer-produced pages."""
    d, n, h = 64, 16, 1
    gen = _gen(21)
    cache, _, _, _ = cache_pair(4, n, h, d, device, gen)
    kd, ks, vd, vs = R.page_views(cache, d)
    pow2 = torch.arange(5, 16, dtype=torch.uint8) << 3  # E4M3 2**-2 .. 2**8
    for dd, sc in ((kd, ks), (vd, vs)):
        dd[1:3] = torch.randint(0, 256, dd[1:3].shape, dtype=torch.uint8, generator=gen).to(device)
        sc[1:3] = pow2[torch.randint(0, len(pow2), sc[1:3].shape, generator=gen)].to(device)
    table = torch.tensor([[2, 1, 0]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 29], dtype=torch.int32, device=device)
    ss = torch.tensor([1], dtype=torch.int32, device=device)
    k_out = torch.empty(29, h, d, dtype=torch.float8_e4m3fn, device=device)
    v_out = torch.empty_like(k_out)
    K.gather_cache(cache, table, cu, ss, k_out, v_out, 2.0, 0.5, 29, out_div=8.0)
    rk, rv = R.gather_cache(cache, table, cu, ss, d, 2.0, 0.5)
    for out, ref in ((k_out, rk), (v_out, rv)):
        want = (ref / 8).to(torch.float8_e4m3fn)
        assert torch.equal(want.float(), ref / 8), "crafted to be exact"
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    if INTERPRETED:
        return
    table = fill_sequences(cache, [30], n, gen, 1.0, 0.5)
    cu = torch.tensor([0, 30], dtype=torch.int32, device=device)
    ss = torch.zeros(1, dtype=torch.int32, device=device)
    k_out = torch.empty(30, h, d, dtype=torch.float8_e4m3fn, device=device)
    v_out = torch.empty_like(k_out)
    K.gather_cache(cache, table, cu, ss, k_out, v_out, 1.0, 0.5, 30, out_div=8.0)
    rk, rv = R.gather_cache(cache, table, cu, ss, d, 1.0, 0.5)
    assert (rk.abs() / 8).max() <= 448 and (rv.abs() / 8).max() <= 448
    assert torch.equal(k_out.view(torch.uint8), (rk / 8).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), (rv / 8).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype,d,sub,mul,rot", [
    (torch.bfloat16, 128, False, False, False), (torch.bfloat16, 128, True, False, True),
    (torch.bfloat16, 64, True, True, True), (torch.float16, 128, True, False, "flag1"),
    (torch.bfloat16, 256, True, False, "flag0"), (torch.float32, 32, True, True, False)])
def test_put_rows_matches_reference(device, dtype, d, sub, mul, rot):
    """The chunk's exact K/V into workspace rows (random order, rows beyond untouched) as the
    cache space stores them: NaN / +-Inf made finite, centered, smoothed, rotated (fixed, or a
    device flag the host never reads), each step rounded to x's dtype like the torch sequence
    it replaces; equal up to rare last-bit differences from the order of the rotation's sums."""
    gen = _gen(d + 3)
    t, h, rows_n = 37, 2, 50
    x = (torch.randn(t, h, d, generator=gen) * 3).to(dtype)
    x[3, 0, 5], x[4, 1, 7], x[5, 0, 0] = float("nan"), float("inf"), -float("inf")
    rows = torch.randperm(rows_n, generator=gen)[:t]
    s = (torch.randn(h, d, generator=gen) * 50).to(dtype) if sub else None
    m = (2.0 ** -torch.randint(0, 3, (h, d), generator=gen)).to(dtype) if mul else None
    flag = torch.tensor([int(rot[-1])], dtype=torch.int32) if isinstance(rot, str) else None
    on = bool(flag) if flag is not None else rot
    out = torch.full((rows_n, h, d), 7.0, dtype=dtype, device=device)
    K.put_rows(x.to(device), rows.to(device), out, None if s is None else s.to(device),
               None if m is None else m.to(device), rot if flag is None else flag.to(device))
    ref = torch.full((rows_n, h, d), 7.0, dtype=dtype)
    R.put_rows(x, rows, ref, s, m, hadamard(d, "cpu", dtype) if on else None)
    out = out.cpu()  # finite where the reference is (fp16: 65504 + 50 overflows in both, and
    # the rotation spreads it over the row)
    assert torch.equal(out.isfinite(), ref.isfinite()) and out.isfinite().float().mean() > 0.98
    out, ref = out.nan_to_num(), ref.nan_to_num()
    if on:
        assert (out == ref).float().mean() > 0.99
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    else:
        assert torch.equal(out, ref)


def test_put_rows_fp8_with_divisor(device):
    """An FP8 workspace: x / out_div rounded to nearest even and saturated to +-448, byte for
    byte as torch casts (the kernel encodes E4M3 with integer ops): normals, subnormals, ties,
    -0, values beyond the range."""
    gen = _gen(9)
    x = (torch.randn(9, 2, 64, generator=gen) * 30).to(torch.bfloat16)
    x[0, 0, :8] = torch.tensor([4096.0, -4096.0, -0.0, 0.0, 2 ** -9, 2 ** -8 * 1.5, 17.0, 19.0])
    rows = torch.tensor([8, 0, 3, 1, 2, 7, 6, 5, 4])
    div = torch.tensor(2.0)
    out = torch.zeros(9, 2, 64, dtype=torch.float8_e4m3fn, device=device)
    K.put_rows(x.to(device), rows.to(device), out, out_div=div.to(device))
    ref = torch.zeros(9, 2, 64, dtype=torch.float8_e4m3fn)
    R.put_rows(x, rows, ref, out_div=div)
    assert torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8))
    assert out.float().abs().max() == 448.0


def test_gather_nothing_to_do(device):
    d, n, h = 64, 16, 1
    gen = _gen(22)
    cache, _, _, _ = cache_pair(2, n, h, d, device, gen)
    out = torch.full((4, h, d), 7.0, device=device)
    out2 = out.clone()
    table = torch.zeros(2, 2, dtype=torch.int32, device=device)
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    ss = torch.zeros(2, dtype=torch.int32, device=device)
    K.gather_cache(cache, table, cu, ss, out, out2, 1.0, 1.0, max_tokens=0)
    K.gather_cache(cache, table, cu, ss, out, out2, 1.0, 1.0, max_tokens=16)  # all counts 0
    K.gather_cache(cache, table[:0], cu[:1], ss[:0], out, out2, 1.0, 1.0, max_tokens=16)
    assert (out == 7.0).all() and (out2 == 7.0).all()


# ---------------------------------------------------------------- decode
# Tolerance. K and V are decoded exactly (e2m1 * e4m3 * 2**-7 is exact in fp16); Q goes
# bf16 -> fp16, exact for |q| in fp16's normal range (randn here); QK^T sums exact fp16
# products in fp32; P is rounded to fp16 (2**-11 relative) for the P.V dot, which moves the
# output by at most 2**-11 * max|v|; accumulation is fp32; the output is rounded to bf16
# (2**-9 relative; 2**-8 under the interpreter, whose fp32 -> bf16 cast truncates). Softcap's
# tanh via exp2 and the split-KV LSE merge add fp32-level errors. So atol = rtol = 2e-2 of
# max(1, max|ref|) leaves a wide margin (measured worst case ~0.36 of it under the
# interpreter, most of it the bf16 truncation); a wrong mask, scale, sink or split merge
# moves outputs by far more.
DECODE_TOL = 2e-2


def _check_decode(out, ref, seq_lens):
    out = out.float()
    assert torch.isfinite(out).all()
    empty = torch.tensor(seq_lens, device=out.device) == 0
    assert (out[empty] == 0).all(), "empty sequences give zeros"
    tol = DECODE_TOL * max(1.0, float(ref.abs().max()))
    err = float((out - ref).abs().max())
    assert err <= tol, f"max err {err:.3g} > tol {tol:.3g}"


def _decode_case(device, d, n, hkv, qpk, seq_lens, k_scale=1.0, v_scale=1.0, layout="plain",
                 q_dtype=torch.bfloat16, seed=0, fused_q=False):
    """Cache with the sequences written (garbage elsewhere), block table, q, seq_lens.
    fused_q: q is a strided view of a fused qkv tensor [B, (Hq + 2 Hkv) D]."""
    gen = _gen(seed + d + n + hkv * 10 + qpk)
    nb = sum(math.ceil(s / n) for s in seq_lens) + 3
    cache, _, _, _ = cache_pair(nb, n, hkv, d, device, gen, layout)
    table = fill_sequences(cache, seq_lens, n, gen, k_scale, v_scale, spread=2)
    hq, b = hkv * qpk, len(seq_lens)
    q = (torch.randn(b, hq + 2 * hkv if fused_q else hq, d, generator=gen) * 2)
    q = q.to(q_dtype).to(device)[:, :hq]
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return cache, table, q, sl


def _ref_decode(q, cache, table, sl, sm_scale, k_scale, v_scale, **kw):
    cu = torch.arange(q.shape[0] + 1, device=q.device)
    return R.paged_attention(q, cache, table, cu, sl, sm_scale, k_scale, v_scale, **kw)


DECODE_CASES = [
    # head_dim, block_size, kv_heads, GQA ratio, seq_lens, num_splits, cache layout
    pytest.param(64, 16, 1, 1, [1, 40, 0, 17], 1, "offset", id="d64-n16-mha-s1-offset"),
    pytest.param(128, 64, 2, 4, [130, 0, 1, 64], 3, "pad", id="d128-n64-gqa4-s3-pad"),
    pytest.param(256, 16, 1, 8, [33, 2], 2, "plain", id="d256-n16-gqa8-s2"),
    pytest.param(128, 16, 1, 8, [70, 16], 1, "plain", id="d128-n16-gqa8-s1"),
    pytest.param(80, 16, 2, 4, [25, 1, 0], 2, "pad", id="d80-n16-gqa4-s2-pad"),
    pytest.param(96, 64, 1, 1, [65, 3], 1, "plain", id="d96-n64-mha-s1"),
    # GQA ratios that are not powers of two (SmolLM2-135M: 3, Qwen2.5-1.5B: 6)
    pytest.param(64, 16, 3, 3, [90, 5], 1, "pad", id="d64-n16-gqa3-s1-pad"),
    pytest.param(128, 16, 2, 6, [300, 17, 1], 3, "pad", id="d128-n16-gqa6-s3-pad"),
    pytest.param(128, 16, 2, 6, [700], 1, "plain", id="d128-n16-gqa6-s1"),
]


@pytest.mark.parametrize("d,n,hkv,qpk,seq_lens,splits,layout", DECODE_CASES)
def test_decode_matches_reference(device, d, n, hkv, qpk, seq_lens, splits, layout):
    k_scale, v_scale = 0.75, 1.5
    fused = layout == "pad"  # strided q and out too
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, k_scale, v_scale,
                                       layout, fused_q=fused)
    b, hq, _ = q.shape
    big = torch.full((b, hq + fused, d), math.nan, dtype=torch.bfloat16, device=device)
    out = big[:, :hq]
    sm = d ** -0.5
    K.decode_attention(q, cache, table, sl, out, sm, torch.tensor([k_scale], device=device),
                       v_scale, num_splits=splits)
    _check_decode(out, _ref_decode(q, cache, table, sl, sm, k_scale, v_scale), seq_lens)
    if fused:
        assert big[:, hq:].isnan().all(), "wrote outside out"


FEATURE_CASES = [
    # sliding_window, softcap, sinks, num_splits
    pytest.param(16, 0.0, False, 1, id="window16-s1"),
    pytest.param(33, 0.0, False, 3, id="window33-s3"),
    pytest.param(1, 0.0, False, 2, id="window1-s2"),
    pytest.param(None, 5.0, False, 1, id="softcap5-s1"),
    pytest.param(None, 30.0, False, 4, id="softcap30-s4"),
    pytest.param(None, 0.0, True, 1, id="sinks-s1"),
    pytest.param(None, 0.0, True, 3, id="sinks-s3"),
    pytest.param(20, 10.0, True, 2, id="window-softcap-sinks-s2"),
    pytest.param(21, 0.0, False, 3, id="window21-s3-d128"),  # V^T from token pairs (mma_v)
]


@pytest.mark.parametrize("window,softcap,sinks,splits", FEATURE_CASES)
def test_decode_features(device, window, softcap, sinks, splits):
    """Sliding window (keys in (pos - w, pos]), logit softcap, per-head sinks, with one and
    several splits; lengths below/at/above the window, one empty sequence, k/v scales != 1."""
    d, n, hkv, qpk = 64, 16, 1, 4
    if window == 21:  # windows starting inside a 16-token chunk of a D = 128 tile
        d, n = 128, 32
    seq_lens = [50, 16, 1, 0, 33]
    k_scale, v_scale = 1.25, 0.4
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, k_scale, v_scale,
                                       seed=int(softcap) + (window or 0))
    sink_t = None
    if sinks:
        sink_t = torch.tensor([-1.0, 0.5, 3.0, 8.0], device=device)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    sm = 2.0 * d ** -0.5  # sharper softmax so the window / softcap matter
    K.decode_attention(q, cache, table, sl, out, sm, k_scale, v_scale, sliding_window=window,
                       softcap=softcap, sinks=sink_t, num_splits=splits)
    ref = _ref_decode(q, cache, table, sl, sm, k_scale, v_scale, sliding_window=window,
                      softcap=softcap, sinks=sink_t)
    _check_decode(out, ref, seq_lens)


@pytest.mark.parametrize("mma_k", [True, False], ids=["mma", "rows"])
def test_decode_bt_ahead_window_softcap_sinks(device, mma_k):
    """Block-table entries a tile ahead (bt_ahead, 3 stages) where the first tile starts
    inside the window (HAS_WINDOW moves each split's start), with softcap, sinks and several
    splits, in the MMA layout (D = 128) and in rows."""
    d, n, hkv, qpk = 128, 32, 1, 4
    seq_lens = [700, 16, 1, 0, 200]
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, 1.25, 0.4, seed=5)
    sinks = torch.tensor([-1.0, 0.5, 3.0, 8.0], device=device)
    sm = 2.0 * d ** -0.5
    ref = _ref_decode(q, cache, table, sl, sm, 1.25, 0.4, sliding_window=400, softcap=20.0,
                      sinks=sinks)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    K.decode_attention(q, cache, table, sl, out, sm, 1.25, 0.4, sliding_window=400,
                       softcap=20.0, sinks=sinks, num_splits=2, block_n=64, mma_k=mma_k,
                       bt_ahead=True, num_stages=3)
    _check_decode(out, ref, seq_lens)


# every head size the backend accepts (multiples of 16 in [32, 512],
# NvFp4AttentionBackend.validate_configuration) that no case above covers
OTHER_HEAD_SIZES = [d for d in range(32, 513, 16) if d not in HEAD_DIMS]


@pytest.mark.parametrize("d", OTHER_HEAD_SIZES)
def test_every_supported_head_size(device, d):
    """The writer (bit-exact), the prefix gather and decode (GQA 3, 2 splits, a sink and a
    window) against the references at each other head size the backend serves."""
    gen, n, h = _gen(d), 16, 1
    cache, cache_ref, buf, buf_ref = cache_pair(4, n, h, d, device, gen, "plain")
    key, value = (rand_kv(9, h, d, gen, torch.bfloat16, device) for _ in range(2))
    slots = torch.randperm(4 * n, generator=gen)[:9].to(device)
    K.write_cache(cache, key, value, slots, 0.5, 2.0, "amax6")
    ref_write(cache_ref, key, value, slots, 0.5, 2.0)
    assert_same_bytes(buf, buf_ref)

    seq_lens = [21, 1]
    cache, table, q, sl = _decode_case(device, d, n, h, 3, seq_lens, 0.75, 1.5)
    cu = torch.tensor([0, 21, 22], dtype=torch.int32, device=device)
    ws = torch.empty(22, 2, h, d, dtype=torch.float32, device=device)
    K.gather_cache(cache, table, cu, torch.zeros(2, dtype=torch.int32, device=device),
                   ws[:, 0], ws[:, 1], 0.75, 1.5, max_tokens=21)
    rk, rv = R.gather_cache(cache, table, cu, torch.zeros(2, dtype=torch.int32, device=device),
                            d, 0.75, 1.5)
    assert torch.equal(ws[:, 0], rk) and torch.equal(ws[:, 1], rv)
    sinks = torch.tensor([0.5, -1.0, 2.0], device=device)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    kw = dict(sliding_window=15, sinks=sinks)
    K.decode_attention(q, cache, table, sl, out, d ** -0.5, 0.75, 1.5, num_splits=2, **kw)
    _check_decode(out, _ref_decode(q, cache, table, sl, d ** -0.5, 0.75, 1.5, **kw), seq_lens)


@pytest.mark.parametrize("seed", range(12))
def test_decode_random_configs(device, seed):
    """Seeded random sweep over every decode option at once: head dim, block size, GQA ratio,
    ragged/empty/single-token lengths, splits (also more than the tiles), tile size, sliding
    window, softcap, sinks, k/v scales, q dtype."""
    rng = random.Random(seed)
    d, n = rng.choice(HEAD_DIMS), rng.choice((16, 32, 64))
    hkv, qpk = rng.choice((1, 2)), rng.choice((1, 2, 3, 4, 6, 8))
    seq_lens = [rng.choice((0, 1, rng.randint(1, 4 * n))) for _ in range(rng.randint(1, 4))]
    splits, block_n = rng.choice((1, 2, 3, 5, 8)), rng.choice((None, 32, 64, 128))
    window = rng.choice((None, None, rng.randint(1, 100)))
    softcap = rng.choice((0.0, 0.0, rng.uniform(2.0, 50.0)))
    k_scale, v_scale = rng.choice((1.0, 0.3, 2.7)), rng.choice((1.0, 0.6, 4.0))
    q_dtype = rng.choice((torch.bfloat16, torch.float16))
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, k_scale, v_scale,
                                       rng.choice(("plain", "pad", "offset")), q_dtype,
                                       seed=seed, fused_q=rng.random() < 0.5)
    sinks = None
    if rng.random() < 0.4:
        sinks = (torch.randn(hkv * qpk, generator=_gen(seed)) * 3).to(device)
    sm = rng.uniform(0.5, 2.0) * d ** -0.5
    out = torch.empty(q.shape, dtype=q_dtype, device=device)
    K.decode_attention(q, cache, table, sl, out, sm, k_scale, v_scale, sliding_window=window,
                       softcap=softcap, sinks=sinks, num_splits=splits, block_n=block_n)
    ref = _ref_decode(q, cache, table, sl, sm, k_scale, v_scale, sliding_window=window,
                      softcap=softcap, sinks=sinks)
    _check_decode(out, ref, seq_lens)


def test_decode_refuses_16_token_tiles(device):
    """16-token tiles miscompiled on an H200 (Triton 3.6); the launcher refuses them."""
    cache, table, q, sl = _decode_case(device, 64, 16, 1, 1, [3], seed=1)
    with pytest.raises(ValueError, match="block_n"):
        K.decode_attention(q, cache, table, sl, torch.empty_like(q), 0.1, 1.0, 1.0,
                           block_n=16)




@pytest.mark.parametrize("d,block_n,mma_k,warps,qpk,kw", [
    (96, 32, None, 4, 1, {}), (96, 64, None, 4, 1, {}), (96, 128, None, 4, 1, {}),
    (96, None, None, 4, 1, {}), (128, 64, True, 4, 1, {}), (128, 128, True, 4, 1, {}),
    (128, 256, True, 4, 1, {}), (128, 128, False, 4, 1, {}), (128, 128, True, 8, 1, {}),
    (128, 128, None, 4, 4, {}), (128, 64, None, 4, 4, {}), (96, 64, None, 4, 4, {}),
    (64, 32, None, 4, 4, {}), (128, 128, None, 4, 4, {"mma_v": False}),
    (128, 128, None, 4, 4, {"mma_v": False, "v_halves": False}),
    (96, 64, None, 4, 4, {"v_halves": False}),
    (128, 128, True, 4, 4, {"bt_ahead": True, "num_stages": 3}),
    (128, 64, True, 4, 1, {"bt_ahead": True, "num_stages": 4}),
    (128, 128, True, 4, 4, {"bt_ahead": True, "num_stages": 3, "mma_v": False}),
    (96, 64, None, 4, 4, {"bt_ahead": True, "num_stages": 3})])
def test_decode_block_n(device, d, block_n, mma_k, warps, qpk, kw):
    """Every tile size the launcher accepts (None: its own choice), one and several splits,
    single-token and multi-page sequences; at D = 128 with K decoded straight into the MMA
    layout (codec.load_tile_mma, Q permuted alike; 4 and 8 warps) and through shared memory.
    V^T straight into the MMA operand (codec.load_vt_mma: the default at D = 128, 4 warps) or
    decoded in rows (mma_v=False) with P.V in two halves of the head dim (D = 96: the second
    half is part padding) or over the whole head dim (v_halves=False). Block-table entries
    loaded a tile ahead (bt_ahead) with a deeper load pipeline."""
    n, hkv = 16, 2
    seq_lens = [1, 40, 0, 300]
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, seed=7 + qpk)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0)
    for splits in (1, 2 if qpk == 1 else 3):
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, num_splits=splits,
                           block_n=block_n, mma_k=mma_k, num_warps=warps, **kw)
        _check_decode(out, ref, seq_lens)


MMA_HEAD_DIM_CASES = [
    # head_dim, GQA ratio, kv heads, page, seq_lens, splits, block_n (None: the launcher's),
    # sliding window, softcap, sinks
    pytest.param(64, 1, 2, 16, [1, 150, 0, 33], 2, None, None, 0.0, False, id="d64-mha-default"),
    pytest.param(64, 3, 3, 16, [90, 17], 1, 64, 40, 0.0, True, id="d64-gqa3-bn64-window-sinks"),
    # gpt-oss: 64 q / 8 kv heads, sinks, a 128-token sliding window
    pytest.param(64, 8, 1, 32, [300, 5], 3, 128, 128, 0.0, True, id="d64-gqa8-window128-sinks"),
    pytest.param(64, 16, 1, 16, [200, 1], 2, 256, None, 30.0, False, id="d64-gqa16-bn256-softcap"),
    pytest.param(256, 4, 1, 16, [130, 0, 64], 3, None, None, 0.0, False, id="d256-gqa4-default"),
    # Qwen3-Next / Qwen3.5 gated attention: 16 q / 2 kv heads at 256
    pytest.param(256, 8, 2, 16, [100, 17], 2, 64, 37, 0.0, True, id="d256-gqa8-window-sinks"),
    pytest.param(256, 1, 1, 32, [70], 1, 128, None, 20.0, True, id="d256-mha-bn128-softcap-sinks"),
    pytest.param(256, 16, 1, 16, [40, 3], 2, 64, 21, 5.0, False, id="d256-gqa16-window-softcap"),
]


@pytest.mark.parametrize("d,qpk,hkv,n,seq_lens,splits,block_n,window,softcap,sinks",
                         MMA_HEAD_DIM_CASES)
def test_decode_mma_head_dims(device, monkeypatch, d, qpk, hkv, n, seq_lens, splits, block_n,
                              window, softcap, sinks):
    """K and V^T decoded straight into the wgmma operands at D = 64 and 256 (codec.load_tile_mma
    with D/32 words per lane quarter; codec.load_vt_mma with two quads per thread at 256, and
    at 64 half a quad per lane, v_word_half_fp16): GQA ratios 1-16, 64-256-token tiles and the
    launcher's own (HOPPER_LAUNCHES: 128 at D = 64, 64 with a register cap at 256), sliding
    windows starting inside a 16-token chunk, softcap and sinks, one and several splits."""
    from vllm_nvfp4kv.kernels import decode as dec
    seen = []
    kernel = dec._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["MMA_K"], kw["MMA_V"], kw["BLOCK_N"], kw.get("maxnreg")))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(dec, "_decode_kernel", Spy())
    k_scale, v_scale = 1.25, 0.4
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, k_scale, v_scale,
                                       seed=11 + qpk)
    sink_t = (torch.randn(hkv * qpk, generator=_gen(qpk)) * 3).to(device) if sinks else None
    sm = 2.0 * d ** -0.5
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    K.decode_attention(q, cache, table, sl, out, sm, k_scale, v_scale, sliding_window=window,
                       softcap=softcap, sinks=sink_t, num_splits=splits, block_n=block_n)
    ref = _ref_decode(q, cache, table, sl, sm, k_scale, v_scale, sliding_window=window,
                      softcap=softcap, sinks=sink_t)
    _check_decode(out, ref, seq_lens)
    launch = dec.HOPPER_LAUNCHES[d]
    bn = block_n or launch.block_n
    cap = launch.maxnreg if bn == launch.block_n else None
    assert seen == [(True, True, bn, cap)]


@pytest.mark.parametrize("variant", ["d64_r96", "d64_bn64", "d64_bn256", "d256_uncapped",
                                     "cap64"])
def test_decode_head_dim_variants(device, variant):
    """The DECODE_VARIANTS launches at D = 64 and 256 (tile, register cap, split count from
    their programs per SM), and the split cap of 64 at every grid (cap64), against the
    reference."""
    from vllm_nvfp4kv.kernels import decode as dec
    kw = dec.DECODE_VARIANTS[variant]
    d = 64 if variant.startswith("d64") else 256
    seq_lens = [260, 9]
    cache, table, q, sl = _decode_case(device, d, 16, 1, 4, seq_lens, seed=5)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, max_seq_len=max(seq_lens), **kw)
    _check_decode(out, ref, seq_lens)


@pytest.mark.parametrize("window", [None, 700])
def test_decode_split_floor(device, window):
    """min_split_tiles (the floor4 variant): 16 splits of at least 4 tiles of 64 tokens leave
    the splits past each short sequence's end empty; the result matches the reference with
    and without a sliding window."""
    seq_lens = [1500, 300, 9, 0]
    cache, table, q, sl = _decode_case(device, 128, 16, 2, 2, seq_lens, seed=13)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0, sliding_window=window)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, sliding_window=window,
                       num_splits=16, block_n=64, min_split_tiles=4)
    _check_decode(out, ref, seq_lens)


def _spy_splits(monkeypatch, dec) -> list:
    """The split count (grid's third axis) of every decode launch from now on."""
    seen, kernel = [], dec._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid[2])
            return kernel[grid]

    monkeypatch.setattr(dec, "_decode_kernel", Spy())
    return seen


def test_decode_small_grid_default_128_splits(device, monkeypatch):
    """Batch 1 with one KV head on 132 SMs (D = 64): the launcher's own choice is 128 splits
    (max_splits), 64 under rule "waves_cap64" (the cap64 variant), and both match the
    reference. 300 tokens in 128-token tiles: 3 splits hold tokens, the rest (the
    reduction's whole second chunk of 64 partials) have weight 0."""
    from vllm_nvfp4kv.kernels import decode as dec
    monkeypatch.setattr(dec, "_num_sms", lambda _dev: 132)
    seen = _spy_splits(monkeypatch, dec)
    seq_lens = [300]
    cache, table, q, sl = _decode_case(device, 64, 16, 1, 4, seq_lens, seed=11)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0)
    for kw, want in (({}, 128), (dec.DECODE_VARIANTS["cap64"], 64)):
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, max_seq_len=1 << 20, **kw)
        assert seen[-1] == want
        _check_decode(out, ref, seq_lens)


def test_decode_splits_past_64(device):
    """72 splits (S_PAD 128, two chunks of 64 partials in the reduction, the second part
    masked) of 32-token tiles, with sinks: 2304 tokens fill all 72, so the second chunk
    holds 8 live partials; an empty sequence none (its output: 0, the sink's weight)."""
    seq_lens = [2304, 0]
    cache, table, q, sl = _decode_case(device, 64, 16, 1, 2, seq_lens, seed=12)
    sinks = torch.tensor([0.5, -1.0], device=device)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0, sinks=sinks)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, sinks=sinks, num_splits=72,
                       block_n=32)
    _check_decode(out, ref, seq_lens)


@pytest.mark.parametrize("num_splits,d,sinks", [(64, 256, True), (72, 64, False),
                                                 (128, 256, True), (128, 128, False)])
def test_decode_reduce_in_chunks(device, num_splits, d, sinks):
    """The split-KV reduction (decode._reduce_kernel, chunks of 64 partials) against the LSE
    merge in torch: random partials and LSEs (log2 units), some splits empty (LSE -inf, a
    NaN partial that must not be read), one (sequence, head) with every split empty, sinks.
    """
    from vllm_nvfp4kv.kernels import decode as dec
    gen = _gen(num_splits + d)
    b, hq = 2, 3
    parts = torch.randn(b, hq, num_splits, d, generator=gen)
    lse = torch.randn(b, hq, num_splits, generator=gen) * 4
    lse[torch.rand(b, hq, num_splits, generator=gen) < 0.3] = float("-inf")
    lse[1, 2] = float("-inf")
    parts[lse == float("-inf")] = math.nan
    sink = torch.randn(hq, generator=gen) if sinks else None
    m = lse.amax(-1)
    if sinks:
        m = torch.maximum(m, sink * math.log2(math.e))
    m = torch.where(m == float("-inf"), 0.0, m)
    w = torch.exp2(lse - m[..., None])
    denom = w.sum(-1) + (torch.exp2(sink * math.log2(math.e) - m) if sinks else 0)
    want = torch.einsum("bhs,bhsd->bhd", w, parts.nan_to_num())
    want = want / denom.clamp_min(1e-30)[..., None]
    out = torch.full((b, hq + 1, d), math.nan, device=device)[:, :hq]  # strided rows
    sinks_t = (sink if sinks else torch.zeros(1)).to(device)
    dec._reduce_kernel[(b, hq)](parts.to(device), lse.to(device), sinks_t, out, out.stride(0),
                                out.stride(1), num_splits,
                                **dec.reduce_constexprs(hq, d, num_splits, sinks), num_warps=4)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)
    assert (out[1, 2] == 0).all()


def test_decode_defaults_per_gpu_generation(device, monkeypatch):
    """K straight into the MMA layout is a Hopper (wgmma) default; on an Ampere/Ada GPU
    (has_wgmma False) the launcher decodes K through shared memory, an explicit choice still
    wins, and the result is the reference's either way."""
    from vllm_nvfp4kv.kernels import decode as dec
    seen = []
    kernel = dec._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["MMA_K"])
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(dec, "_decode_kernel", Spy())
    seq_lens = [70, 5]
    cache, table, q, sl = _decode_case(device, 128, 16, 2, 4, seq_lens, seed=3)
    ref = _ref_decode(q, cache, table, sl, 0.1, 1.0, 1.0)
    for wgmma, kw, want in ((True, {}, True), (False, {}, False), (False, {"mma_k": True}, True),
                            (True, {"mma_k": False}, False)):
        monkeypatch.setattr(dec, "has_wgmma", lambda _dev, w=wgmma: w)
        out = torch.empty(q.shape, dtype=q.dtype, device=device)
        K.decode_attention(q, cache, table, sl, out, 0.1, 1.0, 1.0, num_splits=2, **kw)
        assert seen[-1] == want
        _check_decode(out, ref, seq_lens)


def test_decode_fp16_query_small_tiles_default_splits(device):
    """fp16 q and output, BLOCK_N 32 (two pages per tile), the default split choice and
    the one before 2026-12-06 (split_rule "per_sm8": other split count and tile size)."""
    d, n, hkv, qpk = 128, 16, 2, 1
    seq_lens = [47, 3]
    cache, table, q, sl = _decode_case(device, d, n, hkv, qpk, seq_lens, 0.5, 2.0,
                                       q_dtype=torch.float16)
    ref = _ref_decode(q, cache, table, sl, 0.1, 0.5, 2.0)
    for kw in ({"block_n": 32, "num_splits": 2}, {}, {"split_rule": "per_sm8"}):
        out = torch.empty(q.shape, dtype=torch.float16, device=device)
        K.decode_attention(q, cache, table, sl, out, 0.1, 0.5, 2.0, **kw)
        _check_decode(out, ref, seq_lens)


def test_decode_all_empty_and_zero_batch(device):
    d, n = 64, 16
    cache, table, q, _ = _decode_case(device, d, n, 1, 4, [5, 9])
    sl = torch.zeros(2, dtype=torch.int32, device=device)
    for splits, sinks in ((1, None), (2, None), (2, torch.zeros(4, device=device))):
        out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device=device)
        K.decode_attention(q, cache, table, sl, out, 0.125, 1.0, 1.0, sinks=sinks,
                           num_splits=splits)
        assert (out == 0).all()
    empty = torch.empty(0, 4, d, dtype=torch.bfloat16, device=device)
    K.decode_attention(empty, cache, table[:0], sl[:0], empty.clone(), 0.125, 1.0, 1.0)


def test_garbage_pages_never_leak(device):
    """A cache that is all 0x7F / 0xFF / random bytes except the owned slots: block-table
    entries past each sequence's pages, and the rest of its last page, point at garbage. No
    kernel output may become non-finite, and each still equals its reference."""
    d, n, hkv = 64, 16, 1
    gen = _gen(99)
    for fill in (0x7F, 0xFF, None):
        seq_lens = [18, 1, 0, 31]
        nb = 8
        cache, _, buf, _ = cache_pair(nb, n, hkv, d, device, gen)
        if fill is not None:
            buf.fill_(fill)
        table = fill_sequences(cache, seq_lens, n, gen, 1.0, 1.0, extra_cols=3)
        q = torch.randn(len(seq_lens), 4, d, generator=gen).to(torch.bfloat16).to(device)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        for splits in (1, 2):
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            K.decode_attention(q, cache, table, sl, out, 0.125, 1.0, 1.0, num_splits=splits)
            _check_decode(out, _ref_decode(q, cache, table, sl, 0.125, 1.0, 1.0), seq_lens)
        cu = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        k_out = torch.empty(int(cu[-1]), hkv, d, device=device)
        v_out = torch.empty_like(k_out)
        ss = torch.zeros(len(seq_lens), dtype=torch.int32, device=device)
        K.gather_cache(cache, table, cu.to(device), ss, k_out, v_out, 1.0, 1.0, max(seq_lens))
        assert torch.isfinite(k_out).all() and torch.isfinite(v_out).all()
        rk, rv = R.gather_cache(cache, table, cu.to(device), ss, d, 1.0, 1.0)
        assert torch.equal(k_out, rk) and torch.equal(v_out, rv)


def test_write_then_decode_end_to_end(device):
    """The kernel writer feeding the kernel decoder (vLLM's order: write this step's token,
    then attend over the cache), against the reference over the reference-written cache."""
    d, n, hkv, qpk = 128, 16, 1, 4
    gen = _gen(7)
    seq_lens = [20, 5]
    cache, cache_ref, buf, buf_ref = cache_pair(5, n, hkv, d, device, gen)
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device)
    slots = torch.cat([(table[b, torch.arange(s, device=device) // n].long() * n
                        + torch.arange(s, device=device) % n) for b, s in enumerate(seq_lens)])
    key, value = (rand_kv(sum(seq_lens), hkv, d, gen, torch.bfloat16, device) for _ in range(2))
    K.write_cache(cache, key, value, slots, 0.5, 0.25, "amax6")
    ref_write(cache_ref, key, value, slots, 0.5, 0.25)
    assert_same_bytes(buf, buf_ref)
    q = torch.randn(2, hkv * qpk, d, generator=gen).to(torch.bfloat16).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    K.decode_attention(q, cache, table, sl, out, d ** -0.5, 0.5, 0.25, num_splits=2)
    _check_decode(out, _ref_decode(q, cache, table, sl, d ** -0.5, 0.5, 0.25), seq_lens)


def test_choose_num_splits(monkeypatch):
    dev = torch.device("cpu")
    for batch, heads, max_len in ((1, 1, 10), (1, 8, 100000), (64, 8, 4096), (2, 1, 300)):
        s = K.choose_num_splits(batch, heads, max_len, dev)
        assert 1 <= s <= 64
        assert s <= max(1, math.ceil(max_len / 256))
    assert K.choose_num_splits(1, 1, 10, dev) == 1
    assert K.choose_num_splits(1, 1, 10 ** 6, dev) == K.choose_num_splits(1, 1, 10 ** 7, dev)
    # Hopper's rule (the interpreter follows Hopper), D = 128: one wave of resident programs
    # where it gives each head 4 or more splits, never a partly filled second wave
    from vllm_nvfp4kv.kernels.decode import (HOPPER_PROGRAMS_PER_SM, _num_sms,
                                             choose_block_n)
    sms = _num_sms(dev)
    wave = HOPPER_PROGRAMS_PER_SM * sms
    for batch, heads in ((1, 1), (1, 2), (2, 2), (1, 5), (1, wave // 4)):
        s = K.choose_num_splits(batch, heads, 10 ** 6, dev)
        assert s * batch * heads <= wave < (s + 1) * batch * heads or s == 64
        assert s >= 4 and choose_block_n(s, dev) == 128
    # fewer than 4 splits per head in one wave: about 8 programs per SM instead
    for programs in (wave // 4 + 1, wave, 3 * wave):
        assert K.choose_num_splits(programs, 1, 10 ** 6, dev) == math.ceil(8 * sms / programs)
    # other head sizes with a wgmma decoder: their launch's tile and programs per SM
    from vllm_nvfp4kv.kernels.decode import HOPPER_LAUNCHES, HopperLaunch
    for d, launch in HOPPER_LAUNCHES.items():
        s = K.choose_num_splits(1, 3, 10 ** 6, dev, head_dim=d)
        assert s == min(64, launch.programs_per_sm * sms // 3)
        assert choose_block_n(s, dev, head_dim=d) == launch.block_n
    other = {64: HopperLaunch(64, 6)}
    assert K.choose_num_splits(1, 3, 10 ** 6, dev, head_dim=64, launches=other) == 6 * sms // 3
    assert choose_block_n(8, dev, head_dim=64, launches=other) == 64
    # head sizes without one (80, 96): the older rule
    assert choose_block_n(32, dev, head_dim=96) == 64 and choose_block_n(8, dev, head_dim=96) == 128
    assert K.choose_num_splits(1, 2, 10 ** 6, dev, head_dim=96) == math.ceil(8 * sms / 2)
    # the older rule by name (NVFP4KV_DECODE_VARIANT=per_sm8)
    assert K.choose_num_splits(1, 2, 10 ** 6, dev, rule="per_sm8") == math.ceil(8 * sms / 2)
    assert choose_block_n(32, dev, rule="per_sm8") == 64
    # head sizes without a Hopper launch: smaller tiles as D grows (decode.LARGE_HEAD_DIM)
    assert [choose_block_n(4, dev, head_dim=d) for d in (96, 160, 288, 512)] == [128, 64, 32, 32]
    # 132 SMs (H100 SXM, H200): grids that 64 splits fill at most half a wave of take up to
    # 128 (max_splits): batch x KV heads <= 3 at D = 128 and 256, <= 4 at D = 64. Every other
    # grid, and every tile, as under the cap of 64 everywhere (rule "waves_cap64", the cap64
    # variant); at least 256 tokens per split still
    from vllm_nvfp4kv.kernels import decode as dec
    monkeypatch.setattr(dec, "_num_sms", lambda _dev: 132)
    for d, launch in HOPPER_LAUNCHES.items():
        wave = launch.programs_per_sm * 132
        small = []
        for programs in range(1, 100):
            for batch, heads in ((programs, 1), (1, programs)):
                new, old = (K.choose_num_splits(batch, heads, 10 ** 6, dev, d, rule=r)
                            for r in ("waves", "waves_cap64"))
                assert old == min(64, wave // programs)
                assert new == (min(128, wave // programs) if 128 * programs <= wave else old)
                assert choose_block_n(new, dev, d) == choose_block_n(old, dev, d, "waves_cap64")
            small += [programs] if new > 64 else []
        assert small == list(range(1, 5 if d == 64 else 4)), (d, small)
        assert K.choose_num_splits(1, 1, 20000, dev, d) == 79  # ceil(20000 / 256)
        assert K.choose_num_splits(1, 1, 10 ** 6, dev, d, rule="per_sm8") == 64


@pytest.mark.parametrize("d,dtype,sub,rot,bt", [
    (128, torch.bfloat16, True, True, None), (128, torch.bfloat16, False, True, 4),
    (128, torch.float16, True, False, None), (64, torch.float32, True, True, 8),
    (256, torch.bfloat16, True, True, None), (128, torch.bfloat16, True, "flag1", 4),
    (128, torch.bfloat16, True, "flag0", None)])
def test_write_cache_transforms_k_as_cache_space(device, d, dtype, sub, rot, bt, monkeypatch):
    """k_sub / rotate_k in the writer: the same cache as the torch path it replaces
    (cache_space.CacheSpace.key: rotate(key - k_sub), each rounded to key's dtype, then
    reference.write_cache), up to a rare last-bit difference from the order of fp32 sums that
    can move a value across an E2M1 rounding threshold. K carries Qwen-like offset channels
    (~350) that the subtraction removes; V is written as usual. "flagN": rotate_k given as a
    device flag (the per-layer choice, read at run time) holding N, which the host never
    reads (bool() of it would sync, and CUDA graph capture fails: found on an H100). bt:
    tokens per writer program (45 tokens end inside a program of 4 or 8)."""
    flag = None
    if isinstance(rot, str):
        flag = torch.tensor([int(rot[-1])], dtype=torch.int32, device=device)
        rot = bool(int(rot[-1]))
        host_bool = torch.Tensor.__bool__

        def no_host_read(x):
            assert x is not flag, "write_cache read the rotation flag on the host"
            return host_bool(x)
        monkeypatch.setattr(torch.Tensor, "__bool__", no_host_read)
    from vllm_nvfp4kv.kernels.rotation import rotate
    n, h, nb = 16, 2, 3
    gen = _gen(d + 5)
    t = nb * n - 3
    mu = torch.randn(h, d, generator=gen) * 2
    mu[:, 3], mu[:, 70 % d] = 350.0, -200.0
    key = (torch.randn(t + 2, h, d, generator=gen) + mu).to(dtype)
    value = torch.randn(t + 2, h, d, generator=gen).to(dtype)
    k_sub = mu.to(dtype) if sub else None
    slots = torch.randperm(nb * n, generator=gen)[:t]
    slots[4] = -1
    cache = torch.zeros(kv_cache_shape(nb, n, h, d), dtype=torch.uint8, device=device)
    K.write_cache(cache, key.to(device), value.to(device), slots.to(device), 1.5, 0.5,
                  block_scales="4over6", k_sub=None if k_sub is None else k_sub.to(device),
                  rotate_k=rot if flag is None else flag, tokens_per_program=bt)
    k_cached = key[:t] - k_sub if sub else key[:t]
    k_cached = rotate(k_cached) if rot else k_cached
    ref = torch.zeros_like(cache, device="cpu")
    R.write_cache(ref, k_cached, value[:t], slots, 1.5, 0.5, block_scales="4over6")
    got = cache.cpu()
    assert (got == ref).float().mean() > 0.998
    for a, b in zip(R.dequantize_pages(got, d, 1.5, 0.5), R.dequantize_pages(ref, d, 1.5, 0.5)):
        assert (a - b).abs().max() <= 0.5 * b.abs().max() / 6  # at most one E2M1 step


def _write_past_2_31(device: str) -> bool:
    """A 3-token step whose K/V rows sit 2**30 elements apart (views of one 4 GiB buffer, of
    which only the rows are touched), so the last row starts at element 2**31: the rows a
    step of ~350K tokens reaches at Llama-8B's qkv row stride (6,144). The writer, plain and
    with K's transforms, against the reference: True where every byte matches (with the
    transforms, where every value is within one E2M1 step, as
    test_write_cache_transforms_k_as_cache_space allows for the order of fp32 sums)."""
    from vllm_nvfp4kv.kernels.rotation import rotate
    h, d, n, stride = 2, 64, 16, 2 ** 30
    buf = torch.empty(2 * stride + 2 * h * d, dtype=torch.bfloat16, device=device)
    key = buf.as_strided((3, h, d), (stride, d, 1))
    value = buf.as_strided((3, h, d), (stride, d, 1), h * d)
    gen = _gen(31)
    for t in range(3):
        key[t], value[t] = (torch.randn(2, h, d, generator=gen) * 2).to(device)
    mu = torch.randn(h, d, generator=gen).bfloat16()
    slots = torch.tensor([3, 17, 30])
    ok = True
    for sub, rot in ((None, False), (mu, True)):
        cache = torch.zeros(kv_cache_shape(2, n, h, d), dtype=torch.uint8, device=device)
        K.write_cache(cache, key, value, slots.to(device), 1.0, 1.0, "amax6",
                      k_sub=None if sub is None else sub.to(device), rotate_k=rot)
        k = key.cpu() - sub if sub is not None else key.cpu()
        want = torch.zeros_like(cache, device="cpu")
        R.write_cache(want, rotate(k) if rot else k, value.cpu(), slots, 1.0, 1.0, "amax6")
        if sub is None:
            ok &= torch.equal(cache.cpu(), want)
            continue
        for a, b in zip(R.dequantize_pages(cache.cpu(), d, 1.0, 1.0),
                        R.dequantize_pages(want, d, 1.0, 1.0)):
            ok &= bool((a - b).abs().max() <= 0.5 * b.abs().max() / 6)
    return ok


def test_write_cache_row_offsets_past_2_31(device):
    """K/V row offsets are 64-bit in the writer: with 32-bit ones the last row's address
    wraps (in the interpreter a segfault, hence the subprocess)."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_kernels as t; "
            f"sys.exit(0 if t._write_past_2_31({device!r}) else 1)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"


@pytest.mark.parametrize("rule,bt", [("4over6", None), ("search", None), ("search", 4)])
def test_write_cache_block_scales(device, rule, bt):
    """The block-scale rules that try several scales (format.BLOCK_SCALE_RULES): the writer
    matches reference.quantize_codes except at near-ties (the squared-error sums are
    accumulated in different orders), never has a larger block error than amax -> 6 (nor,
    for search, than 4over6, whose two candidates it also tries), and improves a good share
    of blocks. bt: tokens per writer program."""
    d, n, h = 128, 16, 2
    nb = 3 if device == "cuda" or rule == "4over6" else 2  # search: 4 encodings per block
    gen = _gen(21)
    x = torch.randn(nb * n, h, d, generator=gen) * torch.rand(nb * n, h, 1, generator=gen) * 4
    k, v = x.to(torch.bfloat16), (-0.5 * x).to(torch.bfloat16)
    slots = torch.arange(nb * n)
    cache = torch.zeros(kv_cache_shape(nb, n, h, d), dtype=torch.uint8, device=device)
    K.write_cache(cache, k.to(device), v.to(device), slots.to(device), 0.7, 1.3,
                  block_scales=rule, tokens_per_program=bt)
    refs = {}
    for r in ("amax6", "4over6", rule):
        refs[r] = torch.zeros(kv_cache_shape(nb, n, h, d), dtype=torch.uint8)
        R.write_cache(refs[r], k, v, slots, 0.7, 1.3, block_scales=r)
    got = cache.cpu()
    assert (got == refs[rule]).float().mean() > 0.999
    for side, (x_in, g) in enumerate(((k, 0.7), (v, 1.3))):
        want = x_in.float().view(nb, n, h, d).transpose(1, 2).unflatten(-1, (-1, 16))

        def block_err(c):
            deq = R.dequantize_pages(c, d, 0.7, 1.3)[side]
            return ((deq.unflatten(-1, (-1, 16)) - want) ** 2).sum(-1)
        e_got, e_ref = block_err(got), block_err(refs[rule])
        e_plain, e_46 = block_err(refs["amax6"]), block_err(refs["4over6"])
        assert (e_got <= e_plain * (1 + 1e-5) + 1e-12).all()
        assert (e_got <= e_46 * (1 + 1e-5) + 1e-12).all()
        torch.testing.assert_close(e_got.sum(), e_ref.sum(), rtol=1e-5, atol=0)
        assert (e_got < e_plain * (1 - 1e-6)).float().mean() > 0.1
        if rule == "search":
            assert (e_got < e_46 * (1 - 1e-6)).float().mean() > 0.1
