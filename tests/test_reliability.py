"""Reliability: no silent corruption (bad numbers, layout safety, refusals at startup).

1. Bad numbers. NaN, +-Inf, huge values, all-zero / underflowing blocks and denormals go
   through the writer and the readers with the behaviour kernels/format.py
   documents, and never leak into other tokens, heads, blocks or requests. A fuzz of 2**20
   random 16-value blocks checks reference.quantize / dequantize (each block-scale rule) against
   an independent numpy oracle written here from the format's definition; a smaller fuzz checks
   the Triton writer and gather against the reference, byte for byte.
2. Layout safety: exact byte offsets of a known (side, token, head, element), through vLLM's
   own reshape of the raw KV buffer; padded (-1) slots never touch a byte; block-table entries
   past a sequence's end cannot change any output; no cross-request leakage in a mixed
   backend batch; prefix-cache reuse of another request's block; preemption + recompute on
   the real CPU engine; a KV page round trip through host memory into other block ids.
3. Refusals at startup (the plugin's, with reason and way out), and what vLLM 0.26 itself
   does where it acts first: bad checkpoint scales, VLLM_PLUGINS without this plugin.

Kernels run on CUDA when there is one, else in Triton's interpreter (tiny sizes); the oracle
of every kernel is the CPU reference (IEEE fp32, see tests/test_kernels.py::ref_write).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from vllm_nvfp4kv import kernels as K
from vllm_nvfp4kv.kernels import format as F
from vllm_nvfp4kv.kernels import reference as R

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "evals" / "models" / "tiny-llama")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


from helpers import _gen, garbage, nvfp4_spec, vllm_cache_view, write_sharp_tiny_llama  # noqa: E402,E501


def slots_of(table_row: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    return table_row[positions // n].long() * n + positions % n


# ================================================================ 1. bad numbers
# ---------------------------------------------------------------- independent oracle (numpy)
def _e4m3_values() -> np.ndarray:
    """The 127 non-negative finite E4M3 (fn) values from the bit definition (bias 7)."""
    out = []
    for c in range(127):
        e, m = c >> 3, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


E4M3 = _e4m3_values()
E2M1 = np.array(F.E2M1_VALUES)
assert E4M3[-1] == 448.0 and E4M3[1] == 2.0 ** -9 and len(E2M1) == 8


def nearest_even(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the table value nearest to v >= 0 (float64, exact), ties to the even index,
    saturating at the last entry (so +Inf -> last). NaN must be handled by the caller."""
    mids = (table[:-1] + table[1:]) / 2          # exact in float64
    i = np.searchsorted(mids, v, side="left")    # mids[i-1] < v <= mids[i]
    tie = (i < len(mids)) & (mids[np.minimum(i, len(mids) - 1)] == v)
    return np.where(tie & (i % 2 == 1), i + 1, i)


def oracle_scale(x: np.ndarray, g, target: float) -> np.ndarray:
    """Scale codes [B] mapping each block's amax (NaN ignored) to target: e4m3(amax / target
    / g) in fp32 steps."""
    f32 = np.float32
    amax = np.where(np.isnan(x), f32(0), np.abs(x)).max(axis=1)
    with np.errstate(over="ignore"):
        v = (amax / f32(target)) / g                     # fp32, IEEE (two roundings)
    return nearest_even(v.astype(np.float64), E4M3)


def oracle_encode(x: np.ndarray, g, s: np.ndarray):
    """Blocks x [B, 16] float32 with scale codes s [B] -> (s, 4-bit codes [B, 16], decoded
    [B, 16] float64 values of the stored grid, before * g rounding), by the format's
    definition: r = 1/(s*g) or 0; q = e2m1(x * r), NaN -> 0, sign only on nonzero magnitudes."""
    f32 = np.float32
    scale = (E4M3[s].astype(f32) * g).astype(f32)
    with np.errstate(divide="ignore"):
        r = np.where(scale > 0, f32(1) / scale, f32(0)).astype(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x * r[:, None]).astype(f32)
    a = np.abs(y.astype(np.float64))
    mag = np.where(np.isnan(a), 0, nearest_even(np.nan_to_num(a, nan=0.0), E2M1))
    code = (mag | np.where((y < 0) & (mag > 0), 8, 0)).astype(np.uint8)
    grid = np.where(code & 8, -1.0, 1.0) * E2M1[mag] * E4M3[s][:, None]
    return s.astype(np.uint8), code, grid


def oracle_candidates(x: np.ndarray, g, rule: str) -> list:
    """oracle_encode of every scale code the rule tries, in its order (format.py: amax6 ->
    s6; 4over6 -> s6, s4; search -> s6, s4, s6 - 1 unless s6 is 0 or saturated, s4 - 1 where
    it is above s6; a code the rule skips for a block repeats s6 there)."""
    s6 = oracle_scale(x, g, 6.0)
    codes = [s6]
    if rule != "amax6":
        s4 = oracle_scale(x, g, 4.0)
        codes.append(s4)
        if rule == "search":
            codes += [np.where((s6 >= 1) & (s6 < 0x7E), s6 - 1, s6),
                      np.where(s4 - 1 > s6, s4 - 1, s6)]
    return [oracle_encode(x, g, c) for c in codes]


def oracle_quantize(x: np.ndarray, g, rule: str, candidates=None):
    """(scale codes [B], codes [B, 16], ambiguous [B], near [B], right [C, B]): the first
    candidate with the smallest squared error. ambiguous marks blocks where another candidate
    is also right (right[c]): it decodes to the same values (e.g. 6 x 0.625 = 4 x 0.9375:
    the fp32 error sums then differ by rounding only) or (near) its squared error agrees
    with the best up to fp32 summation noise. Identical bytes are not ambiguous.
    candidates: oracle_candidates(x, g, rule), if already computed."""
    g = np.asarray(g, dtype=np.float32)  # a scalar, or one per block [B]
    cands = candidates or oracle_candidates(x, g, rule)
    s0, c0, _ = cands[0]
    if len(cands) == 1:
        none = np.zeros(len(x), bool)
        return s0, c0, none, none, none[None]
    xf = np.where(np.isfinite(x), x, 0).astype(np.float64)
    gc = g[:, None] if g.ndim else g
    errs = np.stack([((grid * gc - xf) ** 2).sum(1) for _, _, grid in cands])     # [C, B]
    best = np.argmin(errs, axis=0)                 # first of the smallest: strict improvement
    b = np.arange(len(x))
    s, code, grid_best = (np.stack(part)[best, b] for part in zip(*cands))
    e_best = errs[best, b]
    right = np.zeros((len(cands), len(x)), bool)
    near, ambiguous = np.zeros(len(x), bool), np.zeros(len(x), bool)
    for i, (si, ci, gi) in enumerate(cands):
        same_bytes = (si == s) & (ci == code).all(1)
        same_values = ~same_bytes & (gi == grid_best).all(1)
        close = (~same_bytes & ~same_values
                 & (np.abs(errs[i] - e_best) <= 1e-5 * (errs[i] + e_best)))
        right[i] = same_bytes | same_values | close
        near |= close
        ambiguous |= same_values | close
    return s, code, ambiguous, near, right


# ---------------------------------------------------------------- fuzz inputs
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-42, 1e30, -1e30,
                     3.4028235e38, -3.4028235e38, np.nan], dtype=np.float32)


def fuzz_blocks(rng: np.random.Generator, n: int, g: float) -> np.ndarray:
    """[n, 16] float32 blocks for global scale g: gaussian / uniform / one-outlier blocks with
    magnitudes from far below the E4M3 underflow (6 * 2**-10 * g) to far above saturation
    (6 * 448 * g); ~3% special elements (NaN, +-Inf, +-0, denormals, 1e30, fp32 max); ~2% whole
    special blocks (all zero, all -0, all NaN, all denormal, one value among zeros)."""
    mag = 2.0 ** rng.uniform(-16, 14, size=(n, 1)) * g
    kind = rng.integers(0, 3, size=(n, 1))
    x = np.where(kind == 0, rng.standard_normal((n, 16)),
                 np.where(kind == 1, rng.uniform(-1, 1, (n, 16)), rng.standard_normal((n, 16))))
    x[:, 0] *= np.where(kind[:, 0] == 2, 40.0, 1.0)
    x = (x * mag).astype(np.float32)
    sp = rng.random((n, 16)) < 0.03
    x[sp] = SPECIALS[rng.integers(0, len(SPECIALS), int(sp.sum()))]
    whole = rng.random(n) < 0.02
    which = rng.integers(0, 5, n)
    for k, fill in enumerate((0.0, -0.0, np.nan, 1e-40)):
        x[whole & (which == k)] = np.float32(fill)
    one = whole & (which == 4)
    x[one] = 0
    x[one, rng.integers(0, 16, int(one.sum()))] = mag[one, 0].astype(np.float32)
    return x


FUZZ_SCALES = 64   # global scales 2**U(-20, 20) with random mantissas ...
FUZZ_BLOCKS = 1 << 14  # ... times this many blocks each: 2**20 blocks in all


def _fuzz_scales(rng) -> list[float]:
    gs = 2.0 ** rng.integers(-20, 21, FUZZ_SCALES) * rng.uniform(1, 2, FUZZ_SCALES)
    gs[:4] = (1.0, 0.5, 1 / 3, 448.0)
    return [float(np.float32(v)) for v in gs]


FUZZ_CHUNK = 16  # scales per batch: 2**18 blocks per reference call, few torch launches


def test_fuzz_reference_against_independent_oracle():
    """2**20 random blocks, each block-scale rule (amax6, 4over6, search: the default):
    reference.quantize's scale bytes and codes equal the oracle's (4over6 and search: except
    blocks where another candidate's error ties the best up to fp32 summation noise, where
    the reference must still pick one of the tied candidates), and reference.dequantize
    gives e2m1 * e4m3 * g with one fp32 rounding. Plus the documented special-value
    behaviour, category by category. (The blocks of FUZZ_CHUNK global scales go through one
    call, with a per-block global-scale tensor that broadcasts as a scalar would.)"""
    rng = np.random.default_rng(20261203)
    counts = dict(near=0, between=0, blocks=0, nan=0, inf=0, zero_scale=0, saturated=0)
    moved = {rule: 0 for rule in F.BLOCK_SCALE_RULES}  # blocks where not s6's encoding wins
    scales = _fuzz_scales(rng)
    for c in range(0, len(scales), FUZZ_CHUNK):
        gs = scales[c:c + FUZZ_CHUNK]
        x = np.concatenate([fuzz_blocks(rng, FUZZ_BLOCKS, g) for g in gs])
        g = np.repeat(np.array(gs, dtype=np.float32), FUZZ_BLOCKS)        # [B], fp32-exact
        gcol, gt = g[:, None], torch.from_numpy(g).view(-1, 1, 1)
        xt = torch.from_numpy(x)
        for rule in F.BLOCK_SCALE_RULES:
            data, s = R.quantize(xt, gt, rule)
            s, data = s.numpy()[:, 0], data.numpy()
            code = R.unpack_codes(torch.from_numpy(data)).numpy().reshape(-1, 16)
            cands = oracle_candidates(x, g, rule)
            ws, wc, amb, near, right = oracle_quantize(x, g, rule, cands)
            ok = (s == ws) & (code == wc).all(1)
            # near-ties: one of the tied candidates, nothing else
            tied = np.zeros(len(x), bool)
            for (cs, cc, _), r in zip(cands, right):
                tied |= r & (s == cs) & (cc == code).all(1)
            assert tied[amb].all()
            ok |= amb
            counts["near"] += int(near.sum())
            moved[rule] += int(((s != cands[0][0]) | (code != cands[0][1]).any(1)).sum())
            bad = np.flatnonzero(~ok)
            assert bad.size == 0, (f"g={g[bad[0]]} {rule}: {bad.size} blocks "
                                   f"differ, first x={x[bad[0]].tolist()} got s={s[bad[0]]} "
                                   f"codes={code[bad[0]].tolist()} want s={ws[bad[0]]} "
                                   f"codes={wc[bad[0]].tolist()}")
            # documented special values
            assert not (code == 8).any(), "-0 is never stored"
            assert ((s & 0x7F) != 0x7F).all(), "no NaN scale byte"
            assert (code[np.isnan(x)] == 0).all(), "NaN -> 0"
            inf = np.isinf(x)
            assert (s[inf.any(1)] == 0x7E).all(), "Inf saturates the scale"
            assert ((code & 7)[inf] == 7).all() and ((code[inf] >> 3) == (x[inf] < 0)).all()
            amax = np.where(np.isnan(x), 0, np.abs(x).astype(np.float64)).max(1)
            # underflow (README): amax below 6 * 2**-10 * g with amax6; with the others the
            # amax -> 4 candidate underflows only below 4 * 2**-10 * g, and blocks in between
            # may be kept at the smallest scale (2**-9), so the guaranteed bound is 4 * 2**-10 * g
            plain = rule == "amax6"
            under = amax < (6 if plain else 4) * 2.0 ** -10 * g * (1 - 2.0 ** -20)
            assert (s[under] == 0).all() and (code[under] == 0).all(), "underflow -> zeros"
            if not plain:
                counts["between"] += int(((s != 0) & (amax < 6 * 2.0 ** -10 * g)).sum())
            assert (s[amax > 6 * 448 * g * (1 + 2.0 ** -20)] == 0x7E).all(), "huge saturates"
            # dequantize: e2m1 * e4m3 (exact) * g rounded once to fp32; finite; never -0
            deq = R.dequantize(torch.from_numpy(data), torch.from_numpy(s[:, None]), gt).numpy()
            want = (np.where(code & 8, -1.0, 1.0) * E2M1[code & 7] * E4M3[s][:, None]) \
                .astype(np.float32) * gcol
            assert np.array_equal(deq.view(np.uint32), want.astype(np.float32).view(np.uint32))
            assert np.isfinite(deq).all() and not np.signbit(deq[deq == 0]).any()
            # NaN elements decode to exactly 0; Inf to +-6 * 448 * g
            assert (deq[np.isnan(x)] == 0).all()
            assert (np.abs(deq) == np.float32(2688.0) * gcol)[inf].all()
            if plain:
                counts["blocks"] += len(x)
                counts["nan"] += int(np.isnan(x).any(1).sum())
                counts["inf"] += int(inf.any(1).sum())
                counts["zero_scale"] += int((s == 0).sum())
                counts["saturated"] += int((s == 0x7E).sum())
    assert counts["blocks"] >= 10 ** 6
    # the fuzz reaches every category in bulk (a guard against a generator that drifted)
    assert min(counts["nan"], counts["inf"], counts["zero_scale"], counts["saturated"]) > 10 ** 4
    assert counts["between"] > 0  # the 4over6 / search underflow gap is real and reached
    # the other candidates are picked often (search: more often than 4over6's one)
    assert moved["amax6"] == 0 and 0.2 * counts["blocks"] < moved["4over6"] < moved["search"]
    assert counts["near"] < 10 ** -3 * counts["blocks"]


def _kernel_oracle_write(cache_cpu, key, value, slots, k_scale, v_scale, rule="amax6"):
    cpu = [t.cpu() if torch.is_tensor(t) else t for t in (key, value, slots)]
    R.write_cache(cache_cpu, *cpu, k_scale, v_scale, rule)


def test_fuzz_triton_writer_and_gather(device):
    """1,024 K and 1,024 V blocks (2**20 each on a GPU) from the fuzz generator (specials
    included; global scales 1.0 and 0.0173) through the Triton writer: the whole cache buffer
    (garbage around, padded slots) is byte-identical to the reference writer's; 4over6 and
    search too (on 12 rows), except near-ties, where the kernel's pick still has no larger
    error than the reference's. Then the Triton gather of every written token equals the
    reference gather bit for bit (fp32), and is finite."""
    t, h, d, n = (32768 if device == "cuda" else 32), 2, 256, 16
    k_scale, v_scale = 1.0, 0.0173
    rng = np.random.default_rng(7)
    gen = _gen(7)
    key = torch.from_numpy(fuzz_blocks(rng, t * h * d // 16, k_scale)).view(t, h, d)
    value = torch.from_numpy(fuzz_blocks(rng, t * h * d // 16, v_scale)).view(t, h, d)
    nb = t // n + 2
    slots = torch.randperm(nb * n, generator=gen)[:t + 4]
    slots[torch.randperm(t + 4, generator=gen)[:4]] = -1      # padded tokens
    key = torch.cat([key, key[:4]])
    value = torch.cat([value, value[:4]])
    for rule in F.BLOCK_SCALE_RULES:
        fos = rule != "amax6"
        if fos:  # these writers encode 2 or 4 times: a third of the rows suffices
            key, value, slots = key[:12], value[:12], slots[:12]
        buf = garbage(F.kv_cache_shape(nb, n, h, d), gen)
        ref = buf.clone()
        cache = buf.to(device)
        K.write_cache(cache, key.to(device), value.to(device), slots.to(device), k_scale,
                      v_scale, block_scales=rule)
        _kernel_oracle_write(ref, key, value, slots, k_scale, v_scale, rule)
        got = cache.cpu()
        if not fos:
            assert torch.equal(got, ref), f"{int((got != ref).sum())} bytes differ"
        else:
            # rows whose bytes differ: each block the kernel stored must be a candidate
            # with an error within fp32 noise of the reference's choice
            valid = slots >= 0
            blk, off = slots[valid] // n, slots[valid] % n
            rows_got = R.dequantize_rows(got, blk, off, d, k_scale, v_scale)
            rows_ref = R.dequantize_rows(ref, blk, off, d, k_scale, v_scale)
            for x, a, ra in zip((key, value), rows_got, rows_ref):
                xf = torch.nan_to_num(x[valid].float().unflatten(-1, (-1, 16)), nan=0.0,
                                      posinf=0.0, neginf=0.0)
                e_got = ((a.unflatten(-1, (-1, 16)) - xf) ** 2).sum(-1).double()
                e_ref = ((ra.unflatten(-1, (-1, 16)) - xf) ** 2).sum(-1).double()
                assert (e_got <= e_ref * (1 + 1e-5) + 1e-30).all()
            assert (got != ref).float().mean() < 1e-3
            # bytes of slots not written are the garbage they were
            written = _row_mask(nb, n, h, d, [(int(x), hh) for x in slots[valid]
                                              for hh in range(h)])
            assert not ((got != buf).view(nb, -1) & ~written).any()
            continue
        # read back every written token with the Triton gather, one sequence per page
        pages = torch.unique(slots[slots >= 0] // n)
        table = pages[:, None].to(torch.int32)
        cu = torch.arange(len(pages) + 1, dtype=torch.int32) * n
        ss = torch.zeros(len(pages), dtype=torch.int32)
        k_out = torch.empty(len(pages) * n, h, d, device=device)
        v_out = torch.empty_like(k_out)
        K.gather_cache(cache, table.to(device), cu.to(device), ss.to(device), k_out, v_out,
                       k_scale, v_scale, n)
        rk, rv = R.gather_cache(ref, table, cu, ss, d, k_scale, v_scale)
        written = torch.zeros(len(pages), n, dtype=torch.bool)
        for i, p in enumerate(pages.tolist()):
            written[i] = torch.isin(p * n + torch.arange(n), slots)
        written = written.flatten()
        assert torch.equal(k_out.cpu()[written], rk[written])
        assert torch.equal(v_out.cpu()[written], rv[written])
        assert torch.isfinite(rk[written]).all() and torch.isfinite(rv[written]).all()


# ---------------------------------------------------------------- no leak of bad numbers
def _poison(x: torch.Tensor, rows) -> torch.Tensor:
    """x [T, H, D] with bad numbers in the given (token, head) rows: NaN / Inf / 1e30 /
    all-NaN / fp32 max."""
    x = x.clone()
    kinds = [lambda r: r.index_fill_(0, torch.arange(0, r.numel(), 3), math.nan),
             lambda r: r.index_fill_(0, torch.tensor([1, 17]), math.inf),
             lambda r: r.index_fill_(0, torch.tensor([2, 40]), -math.inf),
             lambda r: r.fill_(math.nan),
             lambda r: r.index_fill_(0, torch.tensor([5]), 1e30),
             lambda r: r.index_fill_(0, torch.tensor([0, 63]), 3.4e38)]
    for i, (t, h) in enumerate(rows):
        kinds[i % len(kinds)](x[t, h])
    return x


def _row_mask(nb, n, h, d, slot_rows) -> torch.Tensor:
    """Byte mask [nb, page_bytes] of the (side, head, token) rows slot_rows = [(slot, head)],
    from format.py's layout."""
    lay = F.PageLayout(n, h, d)
    m = torch.zeros(nb, lay.page_bytes, dtype=torch.bool)
    for slot, hh in slot_rows:
        b, t = divmod(int(slot), n)
        for side in (0, 1):
            m[b, lay.data_offsets(side, hh, t)] = True
            m[b, lay.scale_offsets(side, hh, t)] = True
    return m


def test_bad_numbers_do_not_leak(device):
    """Three requests (GQA 2 q heads per KV head); request 1 has NaN / +-Inf / huge / all-NaN
    values in some (token, KV head) rows of K and V. Against the same run with those rows
    zeroed: (a) the written bytes differ only inside the poisoned rows, for the Triton and the
    reference writer; (b) reference and Triton gathers are finite everywhere and bit-identical
    outside the poisoned rows; (c) reference and Triton decode are finite for every request,
    and bit-identical for the other requests and for request 1's q heads of the clean KV
    head; (d) a poisoned row reads back exactly as the row with NaN -> 0 and +-Inf / huge
    saturated (= reference quantize of it)."""
    n, h, d, qpk = 16, 2, 64, 2
    seq_lens = [5, 33, 2]
    gen = _gen(3)
    nb = 10
    table = torch.randperm(nb, generator=gen)[:9].view(3, 3).to(torch.int32)
    slots = torch.cat([slots_of(table[b], torch.arange(s), n) for b, s in enumerate(seq_lens)])
    tot = len(slots)
    key = torch.randn(tot, h, d, generator=gen)
    value = torch.randn(tot, h, d, generator=gen)
    off1 = seq_lens[0]
    bad_rows = [(off1 + 0, 1), (off1 + 5, 1), (off1 + 16, 1), (off1 + 30, 1), (off1 + 32, 1),
                (off1 + 20, 1)]           # only KV head 1 of request 1, incl. its last token
    pk, pv = _poison(key, bad_rows), _poison(value.flip(-1), bad_rows).flip(-1)
    ck, cv = key.clone(), value.clone()
    for t, hh in bad_rows:
        ck[t, hh] = 0
        cv[t, hh] = 0
    base = garbage(F.kv_cache_shape(nb, n, h, d), gen)
    caches = {}
    for name, (kk, vv) in {"bad": (pk, pv), "clean": (ck, cv)}.items():
        ref = base.clone()
        _kernel_oracle_write(ref, kk, vv, slots, 0.5, 2.0)
        if name == "bad":  # the Triton writer gives the same bytes
            tri = base.clone().to(device)
            K.write_cache(tri, kk.to(device), vv.to(device), slots.to(device), 0.5, 2.0, "amax6")
            assert torch.equal(tri.cpu(), ref)
        caches[name] = ref
    allowed = _row_mask(nb, n, h, d, [(slots[t], hh) for t, hh in bad_rows])
    diff = (caches["bad"] != caches["clean"]).view(nb, -1)
    assert diff.any() and not (diff & ~allowed).any(), "bytes changed outside poisoned rows"
    # (d) poisoned rows hold quantize(row) with the documented special-value rules
    kd, ks, vd, vs = R.page_views(caches["bad"], d)
    for t, hh in bad_rows:
        s = int(slots[t])
        got = R.dequantize(kd[s // n, hh, s % n], ks[s // n, hh, s % n], 0.5)
        x = pk[t, hh]
        want = R.dequantize(*R.quantize(torch.nan_to_num(x, nan=0.0, posinf=3.4e38,
                                                         neginf=-3.4e38), 0.5, "amax6"), 0.5)
        assert torch.equal(got, want) and torch.isfinite(got).all()
        assert (got[torch.isnan(x)] == 0).all()
        assert (got[torch.isinf(x)].abs() == 2688 * 0.5).all()
    # (b) gathers
    cu = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32)
    ss = torch.zeros(3, dtype=torch.int32)
    outs = {}
    for name, cache in caches.items():
        rk, rv = R.gather_cache(cache, table, cu, ss, d, 0.5, 2.0)
        k_out = torch.empty(tot, h, d, device=device)
        v_out = torch.empty_like(k_out)
        K.gather_cache(cache.to(device), table.to(device), cu.to(device), ss.to(device), k_out,
                       v_out, 0.5, 2.0, max(seq_lens))
        assert torch.equal(k_out.cpu(), rk) and torch.equal(v_out.cpu(), rv)
        assert torch.isfinite(rk).all() and torch.isfinite(rv).all()
        outs[name] = (rk, rv)
    rows = torch.ones(tot, h, dtype=torch.bool)
    for t, hh in bad_rows:
        rows[t, hh] = False
    for a, b in zip(outs["bad"], outs["clean"]):
        assert torch.equal(a[rows], b[rows])
    # (c) decode: one query per request
    q = torch.randn(3, h * qpk, d, generator=gen).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    dec = {}
    for name, cache in caches.items():
        ref = R.paged_attention(q, cache, table, torch.arange(4), sl, d ** -0.5, 0.5, 2.0)
        assert torch.isfinite(ref).all()
        tri = []
        for splits in (1, 2):
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            K.decode_attention(q.to(device), cache.to(device), table.to(device), sl.to(device),
                               out, d ** -0.5, 0.5, 2.0, num_splits=splits)
            assert torch.isfinite(out).all()
            tri.append(out.cpu())
        dec[name] = [ref] + tri
    clean_heads = torch.arange(h * qpk) < qpk            # q heads of KV head 0
    for a, b in zip(dec["bad"], dec["clean"]):
        assert torch.equal(a[[0, 2]], b[[0, 2]]), "leak into other requests"
        assert torch.equal(a[1, clean_heads], b[1, clean_heads]), "leak into other heads"
        assert not torch.equal(a[1], b[1])


# ================================================================ 2. layout safety
def test_exact_byte_offsets_through_vllm_reshape(device):
    """vLLM allocates each layer's KV cache as raw bytes and views it as the backend says
    (0.26: its shape and stride order; from 0.32: the spec it customizes, in the layout it
    declares; helpers.vllm_cache_view runs vLLM's own code on a raw buffer). One K element and one V element are written; the five nonzero
    bytes must sit at the offsets format.py defines, computed here by hand for H=3 KV heads,
    block_size 16, D=64 (page = [K data 1536 | K scales 192 | V data 1536 | V scales 192]):
      slot 37 = block 2, token 5;  page 2 starts at 2 * 3456 = 6912
      K[head 2, element 10] = -3.0, k_scale 0.5: scale e4m3(3/6/0.5 = 1.0) = 0x38, code -6:
        magnitude 7, sign. Element 10 is element e = 2 of the row's word 1 (pair 1, low half):
        magnitude at bits 12..14, sign at bit 7: word 0x00007080 at row byte 4, so
        data  bytes (2*16 + 5)*32 + 4 = 1188 -> 0x80 and 1189 -> 0x70
        scale byte 1536 + (2*16 + 5)*4 + 10//16 = 1684                             -> 0x38
      V[head 1, element 37] = 12.0, v_scale 2.0: scale 0x38, code +6 (magnitude 7). Token 5
        sits at V slot 9 (slot pair 4, odd); element 37 is k = 1 of quad 9, so e = 2k + 1 = 3
        of V word (9, 4), magnitude at bits 0..2: word 0x00000007, so
        data  byte  1728 + 1*16*32 + (9*8 + 4)*4 = 2544                             -> 0x07
        scale byte  1728 + 1536 + 1*16*4 + (37//16)*16 + 9 = 3369                   -> 0x38
    (token-major NHD would put the K word at (5*3 + 2)*32 + 4 = 548; V in rows as vLLM's
    SM100 writer keeps it would put the V word at 1728 + (1*16 + 5)*32 + 16 = 2416.) Then the
    readers: reference and Triton gathers return exactly those two values at (token 37, head,
    element) and zeros elsewhere; Triton decode over the 38 tokens gives 12/38 at element 37
    for the q heads of KV head 1 only."""
    pytest.importorskip("vllm")
    nb, n, h, d = 4, 16, 3, 64
    spec = nvfp4_spec(n, h, d)
    assert spec.page_size_bytes == 3456
    expect = {6912 + 1188: 0x80, 6912 + 1189: 0x70, 6912 + 1684: 0x38,
              6912 + 2544: 0x07, 6912 + 3369: 0x38}
    key = torch.zeros(1, h, d)
    value = torch.zeros(1, h, d)
    key[0, 2, 10] = -3.0
    value[0, 1, 37] = 12.0
    slot = torch.tensor([37])
    for writer in ("triton", "reference"):
        raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8, device=device)
        cache = vllm_cache_view(raw, spec, nb)
        assert cache.data_ptr() == raw.data_ptr() and cache.is_contiguous()
        if writer == "triton":
            K.write_cache(cache, key.to(device), value.to(device), slot.to(device), 0.5, 2.0,
                          "amax6")
        else:
            cpu = cache.cpu()
            R.write_cache(cpu, key, value, slot, 0.5, 2.0, "amax6")
            cache.copy_(cpu)
        got = raw.view(torch.uint8).cpu()
        nz = got.nonzero().flatten().tolist()
        assert {i: int(got[i]) for i in nz} == expect, writer
    # readers, on the same bytes
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 38], dtype=torch.int32)
    ss = torch.zeros(1, dtype=torch.int32)
    want_k, want_v = torch.zeros(38, h, d), torch.zeros(38, h, d)
    want_k[37, 2, 10], want_v[37, 1, 37] = -3.0, 12.0
    rk, rv = R.gather_cache(cache.cpu(), table, cu, ss, d, 0.5, 2.0)
    assert torch.equal(rk, want_k) and torch.equal(rv, want_v)
    k_out = torch.empty(38, h, d, device=device)
    v_out = torch.empty_like(k_out)
    K.gather_cache(cache, table.to(device), cu.to(device), ss.to(device), k_out, v_out, 0.5,
                   2.0, 38)
    assert torch.equal(k_out.cpu(), want_k) and torch.equal(v_out.cpu(), want_v)
    q = torch.randn(1, 2 * h, d, generator=_gen(1)).to(torch.bfloat16)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    K.decode_attention(q.to(device), cache, table.to(device),
                       torch.tensor([38], dtype=torch.int32, device=device), out, 0.125, 0.5,
                       2.0, num_splits=2)
    out = out.cpu().float()
    want = torch.zeros(1, 2 * h, d)
    want[0, 2:4, 37] = 12.0 / 38       # q heads 2, 3 <-> KV head 1; K of head 1 is all zero
    torch.testing.assert_close(out, want, atol=0, rtol=2 ** -7)


def test_padded_slots_never_touch_a_byte(device):
    """Slots -1 (padded tokens, also trailing as in a CUDA-graph batch) whose K/V rows hold
    NaN / Inf: the Triton writer, the reference writer and the backend's write change no byte
    outside the valid tokens' rows, and inside them write exactly reference.quantize."""
    from vllm_nvfp4kv import backend
    n, h, d, nb = 16, 2, 64, 3
    gen = _gen(11)
    slots = torch.tensor([5, -1, 17, -1, 40, 0, -1, -1, -1])
    t = len(slots)
    key = torch.randn(t, h, d, generator=gen)
    value = torch.randn(t, h, d, generator=gen)
    key[slots < 0] = math.nan
    value[slots < 0] = math.inf
    valid = slots >= 0
    before = garbage(F.kv_cache_shape(nb, n, h, d), gen)
    allowed = _row_mask(nb, n, h, d, [(int(s), hh) for s in slots[valid] for hh in range(h)])
    want = before.clone()
    R.write_cache(want, key[valid], value[valid], slots[valid], 0.7, 1.1, "amax6")

    def check(after):
        changed = (after.cpu() != before).view(nb, -1)
        assert not (changed & ~allowed).any(), "bytes outside valid rows changed"
        assert torch.equal(after.cpu(), want)

    tri = before.clone().to(device)
    K.write_cache(tri, key.to(device), value.to(device), slots.to(device), 0.7, 1.1, "amax6")
    check(tri)
    ref = before.clone()
    R.write_cache(ref, key, value, slots, 0.7, 1.1, "amax6")
    check(ref)
    if importlib_util_find("vllm"):
        impl = backend.NvFp4AttentionImpl(2 * h, d, d ** -0.5, h, None, None, "nvfp4")
        layer = SimpleNamespace(_k_scale=torch.tensor(0.7, device=device),
                                _v_scale=torch.tensor(1.1, device=device), layer_name="l0")
        cache = before.clone().to(device)
        impl.do_kv_cache_update(layer, key.to(device), value.to(device), cache,
                                slots.to(device))
        # the space's offsets live on the cache's device (online centering sets them there)
        kk = impl.space.key(key[valid].to(device)).cpu()
        want = before.clone()
        R.write_cache(want, kk, value[valid], slots[valid], 0.7, 1.1, impl.block_scales)
        check(cache)


def importlib_util_find(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


FILLS = {"zeros": None, "0x7F": 0x7F, "0xFF": 0xFF, "extreme": "extreme", "random": "random"}


def _fill_foreign(base: torch.Tensor, owned: torch.Tensor, fill, d, gen) -> torch.Tensor:
    """base with every byte outside `owned` [nb, page_bytes] replaced by a fill pattern;
    'extreme' = codes +6 (0x77) at scale 448 (0x7E): +2688 g everywhere."""
    nb = base.shape[0]
    if fill is None:
        c = torch.zeros_like(base)
    elif fill == "random":
        c = garbage(base.shape, gen)
    elif fill == "extreme":
        c = torch.empty_like(base)
        kd, ks, vd, vs = R.page_views(c, d)
        kd.fill_(0x77)
        six = R.pack_v_token(torch.full((2, 4), 7, dtype=torch.uint8), torch.tensor([0, 1]))
        vd[..., 1], vd[..., 2] = int(six[0, 0, 0]), int(six[0, 0, 1])   # the even token's bytes
        vd[..., 3], vd[..., 0] = int(six[1, 0, 0]), int(six[1, 0, 1])   # the odd token's
        for v in (ks, vs):
            v.fill_(0x7E)
    else:
        c = torch.full_like(base, fill)
    c.view(nb, -1)[owned] = base.view(nb, -1)[owned]
    return c


def test_pages_past_sequence_end_cannot_change_outputs(device):
    """Block-table entries past each sequence's last page point at foreign pages, and the
    last page's slots past the sequence end are unused: filled with zeros, 0x7F / 0xFF (NaN
    scale bytes), +2688 g everywhere, or random bytes, no output may change by a single bit:
    reference paged_attention, Triton decode (1 and 3 splits), reference and Triton gather,
    and the backend's decode."""
    from vllm_nvfp4kv import backend
    n, h, d, qpk = 16, 1, 64, 4
    seq_lens = [17, 1, 33, 0]
    gen = _gen(5)
    nb = 12
    perm = torch.randperm(nb, generator=gen)
    table = perm[:16].repeat(2)[:16].view(4, 4).to(torch.int32)
    table[0, :2], table[1, :1], table[2, :3] = perm[:2], perm[2:3], perm[3:6]
    table[0, 2:], table[1, 1:], table[2, 3:], table[3] = perm[6], perm[7], perm[8], perm[9]
    base = torch.zeros(F.kv_cache_shape(nb, n, h, d), dtype=torch.uint8)
    owned_rows = []
    for b, s in enumerate(seq_lens):
        if s:
            sl = slots_of(table[b], torch.arange(s), n)
            R.write_cache(base, torch.randn(s, h, d, generator=gen) * 3,
                          torch.randn(s, h, d, generator=gen), sl, 0.8, 1.25, "amax6")
            owned_rows += [(int(x), hh) for x in sl for hh in range(h)]
    owned = _row_mask(nb, n, h, d, owned_rows)
    q = torch.randn(4, h * qpk, d, generator=gen).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    cu = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32)
    ss = torch.zeros(4, dtype=torch.int32)
    impl = layer = None
    if importlib_util_find("vllm"):
        impl = backend.NvFp4AttentionImpl(h * qpk, d, d ** -0.5, h, None, None, "nvfp4")
        layer = SimpleNamespace(_k_scale=torch.tensor(0.8, device=device),
                                _v_scale=torch.tensor(1.25, device=device), layer_name="l0")
    results = {}
    for name, fill in FILLS.items():
        cache = _fill_foreign(base, owned, fill, d, gen)
        res = [R.paged_attention(q, cache, table, torch.arange(5), sl, d ** -0.5, 0.8, 1.25)]
        res += list(R.gather_cache(cache, table, cu, ss, d, 0.8, 1.25))
        dc, dt, dsl = cache.to(device), table.to(device), sl.to(device)
        for splits in (1, 3):
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            K.decode_attention(q.to(device), dc, dt, dsl, out, d ** -0.5, 0.8, 1.25,
                               num_splits=splits)
            res.append(out.cpu())
        k_out = torch.empty(int(cu[-1]), h, d, device=device)
        v_out = torch.empty_like(k_out)
        K.gather_cache(dc, dt, cu.to(device), ss.to(device), k_out, v_out, 0.8, 1.25, 33)
        res += [k_out.cpu(), v_out.cpu()]
        if impl is not None:
            res.append(_backend_decode(impl, layer, dc, dt, dsl, q.to(device)).cpu())
        assert all(torch.isfinite(r.float()).all() for r in res), name
        results[name] = res
    for name, res in results.items():
        for i, (a, b) in enumerate(zip(res, results["zeros"])):
            assert torch.equal(a, b), f"fill {name} changed output {i}"


def _backend_decode(impl, layer, cache, table, seq_lens, q):
    """One decode step through NvFp4AttentionImpl.forward (metadata as the builder makes it
    for a decode-only batch)."""
    from vllm_nvfp4kv.backend import NvFp4Metadata
    b, hq, d = q.shape
    md = NvFp4Metadata(num_actual_tokens=b, num_decodes=b, num_decode_tokens=b,
                       num_prefills=0, seq_lens=seq_lens, block_table=table,
                       decode_num_splits=2, prefill=None)
    out = torch.full((b, hq * d), math.nan, dtype=q.dtype, device=q.device)
    kv = torch.zeros(b, impl.num_kv_heads * d, dtype=q.dtype, device=q.device)
    with torch.inference_mode():  # as vLLM runs it
        impl.forward(layer, q.flatten(1), kv, kv, cache, md, out)
    return out.view(b, hq, d)


def _impl_and_layer(device, hq, h, d, k_scale=0.7, v_scale=1.3):
    from vllm_nvfp4kv.backend import NvFp4AttentionImpl
    impl = NvFp4AttentionImpl(hq, d, d ** -0.5, h, None, None, "nvfp4")
    impl.process_weights_after_loading(torch.bfloat16)
    layer = SimpleNamespace(_k_scale=torch.tensor(k_scale, device=device),
                            _v_scale=torch.tensor(v_scale, device=device), layer_name="l0")
    return impl, layer


def _step(impl, layer, cache, table, reqs, q, k, v, capacity=4096):
    """One engine step through the backend as vLLM drives it: write this step's K/V at the
    requests' slots, then forward. reqs = [(cached tokens, new tokens)], decodes (new == 1)
    first; q [T, Hq, D], k/v [T, Hkv, D]. Returns the output [T, Hq, D] (fp32)."""
    from vllm_nvfp4kv.backend import NvFp4Metadata
    from vllm_nvfp4kv.prefill import plan_prefill
    dev = cache.device
    n = cache.shape[2]
    t = sum(m for _, m in reqs)
    nd = 0
    while nd < len(reqs) and reqs[nd][1] == 1:
        nd += 1
    qsl = torch.tensor([0] + [m for _, m in reqs]).cumsum(0)
    seq_lens = torch.tensor([c + m for c, m in reqs], dtype=torch.int32)
    slots = torch.cat([slots_of(table[b].cpu(), torch.arange(c, c + m), n)
                       for b, (c, m) in enumerate(reqs)]).to(dev)
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    md = NvFp4Metadata(
        num_actual_tokens=t, num_decodes=nd, num_decode_tokens=nd,
        num_prefills=len(reqs) - nd, seq_lens=seq_lens.to(dev), block_table=table,
        decode_num_splits=2,
        prefill=plan_prefill(qsl, seq_lens, nd, len(reqs), capacity, None, torch.device(dev))
        if nd < len(reqs) else None)
    hq, d = q.shape[1], q.shape[2]
    out = torch.full((t, hq * d), math.nan, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():  # as vLLM runs it (the shared workspace, which an engine
        # test run before may have allocated, is then an inference tensor)
        impl.forward(layer, q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    return out.view(t, hq, d).float()


def test_mixed_batch_no_cross_request_leakage(device, monkeypatch):
    """A mixed step (2 decodes, an extend over a cached prefix, an initial prefill) through
    the backend; then the same step with request 3's K/V full of NaN / Inf / 1e30 and its q
    at 1e4. The other requests' outputs and cache bytes are bit-identical; request 3's own
    prefill output may be non-finite, but its cached pages decode to finite values: the next
    decode step is finite for every request and bit-identical for the others. The prefill
    attention only ever gets finite K/V: varlen FlashAttention reads K/V tiles across
    sequence boundaries, and a NaN V row there reached the neighbour's output on the H200
    (0 * NaN) before the backend sanitised them."""
    pytest.importorskip("vllm")
    from vllm_nvfp4kv import prefill
    # K's rotation and centering offsets are chosen per layer from its first real batch, all
    # requests' rows together (an engine's start-up request makes that batch): shared
    # choices by design, fixed here
    monkeypatch.setenv("NVFP4KV_ROTATE_K", "0")
    monkeypatch.setenv("NVFP4KV_CENTER_K", "0")
    attend = prefill.dense_attention

    def finite_kv_only(q, k, v, *args, **kwargs):
        for x in (k, v):
            assert torch.isfinite(x.float()).all(), "non-finite K/V reached the attention"
        return attend(q, k, v, *args, **kwargs)
    monkeypatch.setattr(prefill, "dense_attention", finite_kv_only)
    hq, h, d, n = 4, 2, 64, 16
    reqs = [(20, 1), (35, 1), (40, 7), (0, 9)]
    gen = _gen(9)
    nb = 20
    table = torch.randperm(nb, generator=gen)[:16].view(4, 4).to(torch.int32)
    base = garbage(F.kv_cache_shape(nb, n, h, d), gen)
    for b, (c, _) in enumerate(reqs):
        if c:
            R.write_cache(base, torch.randn(c, h, d, generator=gen),
                          torch.randn(c, h, d, generator=gen),
                          slots_of(table[b], torch.arange(c), n), 0.7, 1.3, "amax6")
    t = sum(m for _, m in reqs)
    q = torch.randn(t, hq, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(t, h, d, generator=gen).to(torch.bfloat16)
    r3 = slice(t - 9, t)
    bq, bk, bv = q.clone(), k.clone(), v.clone()
    bq[r3] = 1e4
    bk[r3] = _poison(bk[r3].float(), [(i, i % h) for i in range(9)]).to(torch.bfloat16)
    bv[r3] = _poison(bv[r3].float(), [(i, (i + 1) % h) for i in range(9)]).to(torch.bfloat16)
    bk[t - 1] = math.nan
    results = {}
    for name, (qq, kk, vv) in {"clean": (q, k, v), "bad": (bq, bk, bv)}.items():
        impl, layer = _impl_and_layer(device, hq, h, d)
        cache = base.clone().to(device)
        dt = table.to(device)
        out = _step(impl, layer, cache, dt, reqs, qq.to(device), kk.to(device), vv.to(device))
        # next step: every request decodes one more token
        nxt = [(c + m, 1) for c, m in reqs]
        q2 = torch.randn(4, hq, d, generator=_gen(10)).to(torch.bfloat16).to(device)
        kv2 = torch.randn(4, h, d, generator=_gen(11)).to(torch.bfloat16).to(device)
        out2 = _step(impl, layer, cache, dt, nxt, q2, kv2, kv2)
        results[name] = (out.cpu(), cache.cpu(), out2.cpu())
    (o_c, c_c, d_c), (o_b, c_b, d_b) = results["clean"], results["bad"]
    assert torch.isfinite(o_c).all() and torch.isfinite(d_c).all()
    diff = (o_b[:t - 9].float() - o_c[:t - 9].float()).abs().flatten(1).amax(1)
    assert torch.equal(o_b[:t - 9], o_c[:t - 9]), \
        f"leak into other requests' outputs: max |diff| per token {diff.tolist()}"
    own = torch.zeros(nb, dtype=torch.bool)
    own[table[3]] = True
    assert torch.equal(c_b[~own], c_c[~own]), "leak into other requests' pages"
    assert torch.isfinite(d_b).all(), "a NaN written to the cache came back"
    assert torch.equal(d_b[:3], d_c[:3])


def test_prefix_cache_reuse_of_another_requests_block(device):
    """Request A prefills 40 tokens; request B then starts with A's two full blocks in its
    block table (a prefix-cache hit) and extends by 10 tokens. B's output equals the
    reference (A's dequantized prefix + B's exact chunk) and is bit-identical to B computing
    over its own copy of the prefix in other blocks (equal K/V give equal bytes); B's step
    does not change a byte of A's blocks, and A's next decode is unchanged by it."""
    pytest.importorskip("vllm")
    from vllm_nvfp4kv.kernels.rotation import rotate
    hq, h, d, n = 4, 2, 64, 16
    gen = _gen(12)
    nb = 12
    kp = torch.randn(40, h, d, generator=gen).to(torch.bfloat16)
    vp = torch.randn(40, h, d, generator=gen).to(torch.bfloat16)
    qa = torch.randn(40, hq, d, generator=gen).to(torch.bfloat16)
    kb = torch.randn(10, h, d, generator=gen).to(torch.bfloat16)
    vb = torch.randn(10, h, d, generator=gen).to(torch.bfloat16)
    qb = torch.randn(10, hq, d, generator=gen).to(torch.bfloat16)
    qd = torch.randn(1, hq, d, generator=gen).to(torch.bfloat16)
    kd = torch.randn(1, h, d, generator=gen).to(torch.bfloat16)
    dev = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    impl, layer = _impl_and_layer(device, hq, h, d)
    base = garbage(F.kv_cache_shape(nb, n, h, d), gen).to(device)
    ta = torch.tensor([[3, 7, 1, 0]], dtype=torch.int32, device=device)
    tb = torch.tensor([[3, 7, 5, 9]], dtype=torch.int32, device=device)  # shares 3, 7
    tc = torch.tensor([[2, 4, 5, 9]], dtype=torch.int32, device=device)  # own copy
    cache = base.clone()
    _step(impl, layer, cache, ta, [(0, 40)], *dev(qa, kp, vp))
    a_pages = cache[[3, 7, 1]].clone()
    out_b = _step(impl, layer, cache, tb, [(32, 10)], *dev(qb, kb, vb))
    assert torch.equal(cache[[3, 7, 1]], a_pages), "B wrote into A's blocks"
    # A's decode after B's step == A's decode on a cache where B never ran
    solo = base.clone()
    _step(impl, layer, solo, ta, [(0, 40)], *dev(qa, kp, vp))
    da = _step(impl, layer, cache, ta, [(40, 1)], *dev(qd, kd, kd))
    assert torch.equal(da, _step(impl, layer, solo, ta, [(40, 1)], *dev(qd, kd, kd)))
    # B over its own copy of the prefix (written by itself into blocks 2, 4)
    own = base.clone()
    impl.do_kv_cache_update(layer, *dev(kp[:32], vp[:32]),
                            own, slots_of(tc[0].cpu(), torch.arange(32), n).to(device))
    assert torch.equal(own[[2, 4]], a_pages[:2]), "equal K/V must give equal bytes"
    assert torch.equal(out_b, _step(impl, layer, own, tc, [(32, 10)], *dev(qb, kb, vb)))
    # against the reference
    # the rotation the layer chose at its first real batch (NVFP4KV_ROTATE_K=auto): H or I
    rot = (lambda x: x @ impl.space.k_rot.cpu().float()) if impl.space.k_rot is not None \
        else rotate if impl.space.rotate_k else (lambda x: x)
    pk, pv = R.gather_cache(cache.cpu(), tb.cpu(), torch.tensor([0, 32]),
                            torch.zeros(1, dtype=torch.int32), d, 0.7, 1.3)
    # the chunk's exact K as the cache holds K: less the centering offsets from A's batch
    # (in the model's dtype), which shift every score of a query alike
    mu = impl.space.k_sub.cpu().float() if impl.space.k_sub is not None else 0.0
    kb_c = (kb.float() - mu).bfloat16().float()
    exp = R.attention(rot(qb.float()), torch.cat([pk, rot(kb_c)]),
                      torch.cat([pv, vb.float()]), d ** -0.5, torch.arange(32, 42))
    torch.testing.assert_close(out_b.cpu(), exp, atol=2e-2, rtol=2e-2)


def test_kv_page_round_trip_through_host(device):
    """Offloading / swapping moves whole pages as bytes: copy every page a batch uses to host
    memory (page_size_bytes each, the flat view of vLLM's raw buffer), then into different
    block ids of another cache (garbage elsewhere), remap the block table: reference and
    Triton decode, both gathers and the backend's decode give bit-identical results."""
    n, h, d, qpk = 16, 2, 64, 2
    gen = _gen(13)
    seq_lens = [30, 7, 49]
    nb = 10
    table = torch.tensor([[4, 0, 0, 0], [8, 0, 0, 0], [1, 6, 2, 9]], dtype=torch.int32)
    table[0, 1] = 5
    cache = garbage(F.kv_cache_shape(nb, n, h, d), gen)
    for b, s in enumerate(seq_lens):  # the reference writer (the Triton one is tested above)
        R.write_cache(cache, torch.randn(s, h, d, generator=gen) * 2,
                      torch.randn(s, h, d, generator=gen),
                      slots_of(table[b], torch.arange(s), n), 0.6, 1.7, "amax6")
    cache = cache.to(device)
    q = torch.randn(3, h * qpk, d, generator=gen).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    cu = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32)
    ss = torch.zeros(3, dtype=torch.int32)
    impl = layer = None
    if importlib_util_find("vllm"):
        impl, layer = _impl_and_layer(device, h * qpk, h, d, 0.6, 1.7)

    def outputs(c, t):
        res = [R.paged_attention(q, c.cpu(), t, torch.arange(4), sl, d ** -0.5, 0.6, 1.7)]
        res += list(R.gather_cache(c.cpu(), t, cu, ss, d, 0.6, 1.7))
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        K.decode_attention(q.to(device), c, t.to(device), sl.to(device), out, d ** -0.5, 0.6,
                           1.7, num_splits=2)
        k_out = torch.empty(int(cu[-1]), h, d, device=device)
        v_out = torch.empty_like(k_out)
        K.gather_cache(c, t.to(device), cu.to(device), ss.to(device), k_out, v_out, 0.6, 1.7,
                       49)
        res += [out.cpu(), k_out.cpu(), v_out.cpu()]
        if impl is not None:
            res.append(_backend_decode(impl, layer, c, t.to(device), sl.to(device),
                                       q.to(device)).cpu())
        return res

    before = outputs(cache, table)
    used = sorted({int(table[b, i]) for b, s in enumerate(seq_lens)
                   for i in range(math.ceil(s / n))})
    page_bytes = F.page_bytes(n, h, d)
    host = cache.view(nb, -1)[used].cpu()                      # device -> host
    assert host.shape == (len(used), page_bytes)
    nb2 = 16
    dst = torch.randperm(nb2, generator=gen)[:len(used)]
    assert not torch.equal(dst, torch.tensor(used))
    other = garbage(F.kv_cache_shape(nb2, n, h, d), gen).to(device)
    other.view(nb2, -1)[dst.to(device)] = host.to(device)     # host -> other block ids
    remap = torch.zeros(nb, dtype=torch.int32)
    remap[used] = dst.to(torch.int32)
    table2 = remap[table.long()]
    table2[table == 0] = 11     # unused entries point anywhere
    after = outputs(other, table2)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a, b), f"output {i} changed after the round trip"


# ---------------------------------------------------------------- the real CPU engine
def _tiny_llm(**kw):
    from vllm import LLM
    args = dict(model=TINY, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                dtype="bfloat16", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
                kv_cache_dtype="nvfp4", seed=0, enable_prefix_caching=True, block_size=16)
    args.update(kw)
    return LLM(**args)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    """tiny-llama's architecture with seeded random weights large enough that attention and
    the output distribution are not flat, written as a real checkpoint. (With
    load_format="dummy" the weights are ~1e-3: every next-token distribution is uniform to
    1e-6, and shuffling the cached V rows of every request leaves the greedy tokens
    unchanged, so an engine test on dummy weights cannot see a corrupted cache. With these
    weights the same shuffle changes them.)"""
    return str(write_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-tiny-llama")))


def _greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                        detokenize=False, logprobs=0)
    outs = llm.generate(prompts, sp)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs])


PREEMPT_PROMPTS = (50, 30, 80, 40, 65, 90)  # prompt tokens; + PREEMPT_NEW generated each
PREEMPT_NEW = 24
PREEMPT_BLOCKS = 16  # 256 tokens of KV for ~500: the scheduler must preempt


def _preemption_run(sharp_model, prefill_from_cache: bool):
    """(tokens of all requests run together, with preemption; tokens of the same requests run
    two at a time, where nothing is preempted; preemptions counted; mean logprob)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    per_token = 2 * 2 * 2 * F.row_bytes(64)        # layers x sides x KV heads x row bytes
    with mock.patch.dict("os.environ",  # read when the engine builds its attention
                         {"NVFP4KV_PREFILL_FROM_CACHE": "1" if prefill_from_cache else "0"}):
        # a request of the longest length must fit the 16 blocks (from vLLM 0.32 one block
        # less: the null block is counted); every request here is <= 114 tokens
        llm = _tiny_llm(model=sharp_model, load_format="auto", max_num_batched_tokens=128,
                        max_model_len=224,
                        kv_cache_memory_bytes=PREEMPT_BLOCKS * 16 * per_token)
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == PREEMPT_BLOCKS
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 900, (m,), generator=g).tolist()}
               for m in PREEMPT_PROMPTS]
    preempted = []
    orig = Scheduler._preempt_request

    def count(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return orig(self, request, *args, **kwargs)

    with mock.patch.object(Scheduler, "_preempt_request", count):
        llm.reset_prefix_cache()
        together, logprobs = _greedy(llm, prompts, PREEMPT_NEW)
        n_preempted = len(preempted)
        apart = []
        for i in range(0, len(prompts), 2):      # two requests need at most 20 blocks
            llm.reset_prefix_cache()
            apart += _greedy(llm, prompts[i:i + 2], PREEMPT_NEW)[0]  # <= 14 blocks
    assert len(preempted) == n_preempted, "a request was preempted in the run without"
    del llm
    return together, apart, n_preempted, float(np.mean([np.mean(lp) for lp in logprobs]))


def test_preemption_and_recompute_match_unpreempted_run(sharp_model):
    """vLLM's CPU engine with a KV cache of 24 blocks (384 tokens) and six requests of 40-120
    prompt tokens + 40 generated (~710 tokens): the scheduler must preempt (counted) and
    recompute, with prefix caching on (a recompute may hit the request's own freed blocks)
    and chunked prefill (128-token steps). Every request's greedy tokens equal those of the
    same requests run two at a time on the same engine (prefix cache reset before each),
    where nothing is preempted.

    Run with NVFP4KV_PREFILL_FROM_CACHE=1 (patched in). With the default, prefill attends
    over the step's own exact K/V while every later step reads the quantized copy, so a
    token's logits depend on whether its K/V were still exact when it was computed: a
    recomputed request prefills in one pass what it first built token by token (or hits its
    own cached blocks), and a greedy pick at a near-tie can flip. Recompute is therefore not
    output-invariant by design in the default mode (README, "Guarantees and limits")."""
    pytest.importorskip("vllm")
    together, apart, n_preempted, mean_logprob = _preemption_run(sharp_model, True)
    assert n_preempted > 0, "the test did not force a preemption"
    assert all(len(t) == PREEMPT_NEW for t in together)
    # the model is not flat (uniform over 1000 tokens would be -6.9 per token)
    assert mean_logprob > -4.0
    assert together == apart


# ================================================================ 3. refusals at startup
def test_head_size_v_different_from_head_size_is_refused():
    """The page format has one head size for K and V. vLLM 0.26 sizes a page with head_size_v
    (FullAttentionSpec) and then creates the metadata builder from the layer's spec before it
    allocates the KV cache; from 0.32 the backend publishes the page's packing
    (customize_spec), when the layer builds its spec. Each refuses such layers with the
    reason and the way out. (Without that, vLLM 0.26's own reshape of the raw buffer fails
    with a bare 'shape ... is invalid' RuntimeError, checked here too. In vLLM 0.26 the models
    with head_size_v != head_size, MiMo-V2 and openPangu, pick a *_DIFFKV backend themselves.)"""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm_nvfp4kv import compat
    from vllm_nvfp4kv.backend import NvFp4AttentionBackend as B
    from vllm_nvfp4kv.backend import NvFp4MetadataBuilder
    cfg = VllmConfig(model_config=ModelConfig(model=TINY, skip_tokenizer_init=True,
                                              max_model_len=256))
    refusal = r"head_size {} and head_size_v {}\b.*--kv-cache-dtype fp8 or auto"
    for hs, hsv in ((64, 128), (128, 64), (64, 64)):
        spec = FullAttentionSpec(16, num_kv_heads=2, head_size=hs, head_size_v=hsv,
                                 dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode("nvfp4"))
        if compat.has_layout_api():
            if hs != hsv:
                with pytest.raises(ValueError, match=refusal.format(hs, hsv)):
                    B.customize_spec(spec)
                continue
            spec = B.customize_spec(spec)
        raw = torch.zeros(3 * spec.page_size_bytes, dtype=torch.int8)
        if hs == hsv:
            NvFp4MetadataBuilder(spec, ["l0"], cfg, torch.device("cpu"))
            vllm_cache_view(raw, spec, 3)
            continue
        with pytest.raises(ValueError, match=refusal.format(hs, hsv)):
            NvFp4MetadataBuilder(spec, ["model.layers.0.self_attn.attn"], cfg,
                                 torch.device("cpu"))
        with pytest.raises(RuntimeError, match="invalid"):
            vllm_cache_view(raw, spec, 3)


def test_decode_variant_sets_the_split_rule():
    """The metadata builder picks each step's split-KV count by the decode variant's rule
    (NVFP4KV_DECODE_VARIANT=per_sm8: the count before 2026-12-06), so the kernel's tile
    size and the count it is launched with come from the same rule."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm_nvfp4kv.backend import NvFp4MetadataBuilder
    from vllm_nvfp4kv.kernels.decode import DEFAULT_SPLIT_RULE
    spec = FullAttentionSpec(16, num_kv_heads=2, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("nvfp4"))

    def rule(**extra):  # a new engine's config each time: the options are read once per engine
        cfg = VllmConfig(model_config=ModelConfig(model=TINY, skip_tokenizer_init=True,
                                                  max_model_len=256), additional_config=extra)
        return NvFp4MetadataBuilder(spec, ["l0"], cfg, torch.device("cpu")).split_rule
    assert rule() == DEFAULT_SPLIT_RULE == "waves"
    with mock.patch.dict("os.environ", {"NVFP4KV_DECODE_VARIANT": "per_sm8"}):
        assert rule() == "per_sm8"
    assert rule(nvfp4kv={"decode_variant": "per_sm8"}) == "per_sm8"  # what evals pass


def test_decode_splits_of_sliding_window_layers_are_sized_by_the_window():
    """A decode of a sliding-window layer reads at most `window` keys (the kernel's splits
    start at the window), so its split-KV count is sized from min(max_model_len, window):
    at least 256 keys per split (kernels.decode.clamp_splits), not 256 of max_model_len's."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, SlidingWindowSpec,
                                            get_kv_quant_mode)
    from vllm_nvfp4kv.backend import NvFp4MetadataBuilder
    from vllm_nvfp4kv.kernels.decode import choose_num_splits
    cfg = VllmConfig(model_config=ModelConfig(model=TINY, skip_tokenizer_init=True,
                                              max_model_len=2048))
    kw = dict(num_kv_heads=1, head_size=128, dtype=torch.uint8,
              kv_quant_mode=get_kv_quant_mode("nvfp4"))
    cpu = torch.device("cpu")
    full = NvFp4MetadataBuilder(FullAttentionSpec(16, **kw), ["l0"], cfg, cpu)
    local = NvFp4MetadataBuilder(SlidingWindowSpec(16, sliding_window=512, **kw), ["l1"], cfg,
                                 cpu)
    # one decode (a duck-typed CommonAttentionMetadata: what a decode-only build reads)
    step = SimpleNamespace(max_query_len=1, num_reqs=1, num_actual_tokens=1,
                           query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
                           seq_lens=torch.tensor([2000], dtype=torch.int32),
                           block_table_tensor=torch.zeros(1, 128, dtype=torch.int32))
    splits = [b.build(0, step).decode_num_splits for b in (full, local)]
    # batch 1 on a CPU (8 "SMs"): the rule wants 64 splits, 2048 keys allow 8, 512 only 2
    assert splits == [choose_num_splits(1, 1, n, cpu, 128) for n in (2048, 512)] == [8, 2]


def test_engine_refuses_bad_head_size_and_block_size(sharp_model):
    """vLLM's CPU engine (LLM(...), in this process) with kv_cache_dtype nvfp4 fails at
    startup, before serving anything, with the plugin's reason and way out: head_dim 72 (a
    model config copied from tiny-llama), block_size 8 (tests/test_plugin.py covers the
    selection alone: head sizes 16, 528, block size 24, ...).
    block_size 256 is not refused: the backend's kernel block sizes are 16-128 and vLLM
    accepts any block size they divide, cutting each 256-token block into 128-token kernel
    blocks (the cache the backend is handed, checked); the greedy tokens then equal
    the block_size 16 run's (the sharp model, where a misread cache shows)."""
    pytest.importorskip("vllm")
    import json
    import tempfile
    from vllm import SamplingParams
    from vllm_nvfp4kv.backend import NvFp4AttentionImpl
    with tempfile.TemporaryDirectory() as tmp:
        cfg = json.loads((Path(TINY) / "config.json").read_text())
        cfg["head_dim"] = 72
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=r"multiple of 16 in \[32, 512\], got 72.*"
                           r"--kv-cache-dtype fp8"):
            _tiny_llm(model=tmp, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match=r"block size .*got 8 .*--kv-cache-dtype fp8"):
        _tiny_llm(block_size=8, kv_cache_memory_bytes=8 << 20)
    g = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(3, 900, (m,), generator=g).tolist()}
               for m in (300, 20)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    toks, shapes = {}, {}
    update = NvFp4AttentionImpl.do_kv_cache_update
    for bs in (256, 16):
        with mock.patch.object(NvFp4AttentionImpl, "do_kv_cache_update", autospec=True,
                               side_effect=update) as m:
            llm = _tiny_llm(model=sharp_model, load_format="auto", block_size=bs,
                            kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=512,
                            enable_prefix_caching=False)
            toks[bs] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        # the kernel block size: tokens per page of the cache the backend is handed
        shapes[bs] = {c.args[4].shape[2] for c in m.call_args_list}
        del llm
    assert shapes == {256: {128}, 16: {16}}
    assert toks[256] == toks[16]


def _vllm_0_26() -> bool:
    try:
        from vllm_nvfp4kv import compat
        return not compat.has_layout_api()
    except ImportError:
        return False


def _cuda_platform_module():
    """vllm.platforms.cuda on a CPU machine (its compiled extension is not needed by the
    selection code; stubbed as in tests/test_plugin.py)."""
    import importlib
    import types
    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    return importlib.import_module("vllm.platforms.cuda")


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1)])
def test_old_gpus_are_refused_in_automatic_selection(monkeypatch, capability):
    """No --attention-backend (automatic selection, CUSTOM first for nvfp4): on compute
    capability < 8.0 no backend is chosen and the one error vLLM raises carries the
    plugin's reason and way out (tests/test_plugin.py covers an explicit CUSTOM on 7.5)."""
    pytest.importorskip("vllm")
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm_nvfp4kv import plugin
    cu = _cuda_platform_module()
    plugin.register()
    plugin._patch_cuda_priorities()
    monkeypatch.setattr(cu.CudaPlatformBase, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(*capability)))
    cfg = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="nvfp4",
                                  block_size=16)
    with pytest.raises(ValueError, match=r"needs compute capability >= 8\.0.*"
                       r"--kv-cache-dtype fp8"):
        cu.CudaPlatformBase.get_attn_backend_cls(None, cfg, 32)


@pytest.mark.parametrize("k,v,outcome", [
    (math.inf, 1.0, "plugin refuses k_scale"),
    (1.0, math.inf, "plugin refuses v_scale"),
    (math.nan, 1.0, "vLLM asserts at load"),
    (0.0, 1.0, "vLLM asserts at load"),
    (-2.0, 0.5, "vLLM asserts at load"),
    (1.0, 0.0, "vLLM uses k_scale for both"),
    (1.0, -2.0, "vLLM uses k_scale for both"),
    (1.0, math.nan, "vLLM uses k_scale for both"),
    (-1.0, -1.0, "vLLM uses 1.0 (no scales)"),
    (0.25, 4.0, "used as given"),
])
def test_checkpoint_scales(k, v, outcome):
    """A checkpoint's k_scale / v_scale go through vLLM's BaseKVCacheMethod (what a ModelOpt
    checkpoint's attention layers use) and then the backend's first write. Whatever the
    values, either startup fails before any byte is written, or the scales in force are
    finite and positive and every written value decodes finite. What happens, per case:
    vLLM itself rejects a zero / negative / NaN k_scale with a bare AssertionError, replaces
    a bad v_scale by k_scale when k_scale is valid (its 'one scale given' rule), treats two
    negative scales as 'none given' (1.0); Inf passes vLLM and the plugin refuses it."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    layer = torch.nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    layer.kv_cache_dtype, layer.calculate_kv_scales, layer.layer_name = "nvfp4", False, "l7"
    method = BaseKVCacheMethod(None)
    method.create_weights(layer)
    layer.k_scale.data.fill_(k)
    layer.v_scale.data.fill_(v)
    impl, _ = _impl_and_layer("cpu", 4, 2, 64)
    cache = torch.zeros(F.kv_cache_shape(2, 16, 2, 64), dtype=torch.uint8)
    kv = torch.randn(3, 2, 64).to(torch.bfloat16)
    if outcome == "vLLM asserts at load":
        with pytest.raises(AssertionError):
            method.process_weights_after_loading(layer)
        return
    method.process_weights_after_loading(layer)
    if outcome.startswith("plugin refuses"):
        with pytest.raises(ValueError, match=f"l7 has {outcome.split()[-1]}=inf"):
            impl.do_kv_cache_update(layer, kv, kv, cache, torch.arange(3))
        assert not cache.any()
        return
    impl.do_kv_cache_update(layer, kv, kv, cache, torch.arange(3))
    ks, vs = float(layer._k_scale), float(layer._v_scale)
    want = {"vLLM uses k_scale for both": (k, k), "vLLM uses 1.0 (no scales)": (1.0, 1.0),
            "used as given": (k, v)}[outcome]
    assert (ks, vs) == want
    rk, rv = R.gather_cache(cache, torch.tensor([[0]]), torch.tensor([0, 3]),
                            torch.zeros(1, dtype=torch.int32), 64, ks, vs)
    assert torch.isfinite(rk).all() and torch.isfinite(rv).all() and rv.abs().sum() > 0


@pytest.mark.skipif(not _vllm_0_26(), reason="from vLLM 0.32 the CPU engine serves any "
                    "quantized cache dtype with CPU_ATTN's FP8 path, nvfp4 included")
def test_nvfp4_without_the_plugin_fails_loudly(monkeypatch):
    """kv_cache_dtype nvfp4 with VLLM_PLUGINS naming only another plugin (ours not loaded) on
    vLLM's CPU platform must fail, not serve with another dtype. The steps vLLM takes, each
    with its own code: (1) plugin loading skips ours; (2) its CPU selection picks CPU_ATTN,
    which ignores nvfp4; (3) KV-cache allocation views the buffer sized for nvfp4 pages with
    CPU_ATTN's 16-bit shape, which fails with a bare "shape ... is invalid" RuntimeError.
    The engine run itself (VLLM_PLUGINS=other, LLM(tiny-llama, kv_cache_dtype="nvfp4"); a
    ~30 s subprocess, so not run here) dies the same way before serving anything:
    "RuntimeError: shape '[1820, 2, 16, 128]' is invalid for input of size 4193280"."""
    pytest.importorskip("vllm")
    from vllm import envs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache
    from vllm_nvfp4kv import plugin
    monkeypatch.setattr(envs, "VLLM_PLUGINS", ["some_other_plugin"], raising=False)
    assert "nvfp4kv" not in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    monkeypatch.setattr(envs, "VLLM_PLUGINS", None, raising=False)
    assert "nvfp4kv" in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)  # the control
    plugin.register()
    plugin._patch_cpu_selection()
    vllm_selection = CpuPlatform.get_attn_backend_cls.__func__._original
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="nvfp4",
                                  block_size=16)
    path = vllm_selection(CpuPlatform, None, cfg, 4)
    assert path == AttentionBackendEnum.CPU_ATTN.get_path() != plugin.BACKEND_PATH
    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_class()
    spec = FullAttentionSpec(16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=get_kv_quant_mode("nvfp4"))
    nb = 8
    raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8)
    shape = cpu_attn.get_kv_cache_shape(nb, 16, 2, 64, cache_dtype_str="nvfp4")
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        _reshape_attention_kv_cache(raw, spec, shape, tuple(range(len(shape))), nb, None)
