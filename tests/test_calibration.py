"""Calibrated per-layer global scales (vllm_nvfp4kv/calibration.py): the rule, online
calibration fixed by the first real write only (dummy/padded rows ignored, never changed
afterwards), the CUDA-graph guard kernel (kernels/global_scale.py) against its plain-torch
reference and against the eager path, scales files, precedence, and a real CPU engine whose
profile/warm-up runs must not calibrate."""
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_nvfp4kv import calibration as cal
from vllm_nvfp4kv.config import NvFp4KVConfig
from vllm_nvfp4kv.kernels import kv_cache_shape, reference
from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES
from vllm_nvfp4kv.kernels.global_scale import calibrate_global_scales
from vllm_nvfp4kv.kernels.rotation import rotate

H, D, N = 2, 64, 16


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for k in ("NVFP4KV_CALIBRATE", "NVFP4KV_SCALES_FILE", "NVFP4KV_CHECKPOINT_SCALES",
              "NVFP4KV_CALIBRATE_HEADROOM"):
        monkeypatch.delenv(k, raising=False)
    cal._files.clear()
    cal._transforms.clear()


def _cfg():
    """The options as the tests' environment (monkeypatched) gives them."""
    return NvFp4KVConfig.from_env()


def _layer(name="model.layers.0.self_attn.attn", k=1.0, v=1.0, device="cpu"):
    return SimpleNamespace(_k_scale=torch.tensor(k, device=device),
                           _v_scale=torch.tensor(v, device=device), layer_name=name)


def _kv(t, device="cpu", mult=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(t, H, D, generator=g) * mult).to(device, torch.bfloat16)
    v = (torch.randn(t, H, D, generator=g) * mult * 0.1).to(device, torch.bfloat16)
    return k, v


def _pow2_rule(amax, headroom):
    """The power of two >= headroom * amax / 2688, that product taken in fp32 as on device."""
    y = float(torch.tensor(amax, dtype=torch.float32)
              * torch.tensor(headroom / 2688, dtype=torch.float32))
    m, e = math.frexp(y)
    return y if m == 0.5 else 2.0 ** e


def test_rule_is_the_next_power_of_two():
    for amax in (1e-4, 0.37, 2688 / 64, 42.0000001, 15.9, 3e4):
        for h in (1.0, 8.0, 64.0):
            want = _pow2_rule(amax, h)
            got = cal.scale_from_amax(torch.tensor(amax), h).item()
            assert got == cal.scale_from_amax_float(amax, h) == want
            assert got * 2688 >= h * amax * (1 - 1e-6) and got * 2688 < 2 * h * amax * 1.000001
            assert math.log2(got).is_integer()


def test_power_of_two_scale_only_moves_the_range():
    """Blocks whose E4M3 scale is normal at g = 1 get the same codes at g = 2**k: the rule can
    only fix blocks that saturate or underflow, not make representable ones worse."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(64, D, generator=g) * 2 - 1) * torch.logspace(0, 1.5, 64)[:, None]
    # block amax in ~[0.8, 32]: scales amax/6/g and amax/4/g normal E4M3 for g in [1/4, 4]
    d1, s1 = reference.quantize(x, 1.0, DEFAULT_BLOCK_SCALES)
    for g in (2.0 ** -2, 2.0 ** 2):
        dg, sg = reference.quantize(x, g, DEFAULT_BLOCK_SCALES)
        assert torch.equal(d1, dg)
        assert torch.equal(reference.dequantize(d1, s1, 1.0), reference.dequantize(dg, sg, g))


def test_online_first_real_write_fixes_scales(monkeypatch):
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    layer = _layer()
    # a dummy run (vLLM pads every slot with -1): huge garbage K/V must be ignored
    k, v = _kv(8, mult=1e4)
    cal.prepare_write(layer, k, v, torch.full((8,), -1), _cfg())
    st = cal.state(layer)
    assert st.source == "online" and not st.done
    assert layer._k_scale.item() == 1.0 and layer._v_scale.item() == 1.0
    # the first real batch, with two padded rows holding garbage
    k, v = _kv(10)
    k[8:], v[8:] = 1e6, float("nan")
    k[3, 1, 5] = float("inf")  # non-finite values do not count
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -1, -1])
    cal.prepare_write(layer, k, v, slots, _cfg())
    ak = k[:8].float().abs().nan_to_num(posinf=0).max().item()
    av = v[:8].float().abs().max().item()
    assert st.done and st.flag.tolist() == [1, 1]
    assert layer._k_scale.item() == _pow2_rule(ak, 64.0)
    assert layer._v_scale.item() == _pow2_rule(av, 64.0)
    # later batches, even far larger, never change them (pages keep their scale)
    before = (layer._k_scale.item(), layer._v_scale.item())
    cal.prepare_write(layer, *_kv(4, mult=1e3), torch.arange(4), _cfg())
    assert (layer._k_scale.item(), layer._v_scale.item()) == before


def test_online_all_zero_side_waits(monkeypatch):
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    monkeypatch.setenv("NVFP4KV_CALIBRATE_HEADROOM", "8")
    layer = _layer()
    k, v = _kv(4)
    cal.prepare_write(layer, k, torch.zeros_like(v), torch.arange(4), _cfg())
    st = cal.state(layer)
    assert st.flag.tolist() == [1, 0] and not st.done and layer._v_scale.item() == 1.0
    cal.prepare_write(layer, k * 4, v, torch.arange(4), _cfg())
    assert st.done
    assert layer._k_scale.item() == _pow2_rule(k.float().abs().max().item(), 8.0)
    assert layer._v_scale.item() == _pow2_rule(v.float().abs().max().item(), 8.0)


def test_backend_writes_with_the_calibrated_scales(monkeypatch):
    """Through the backend: the first real batch is written with the scales calibrated from
    it (from K as cached, i.e. rotated), and the cache equals the reference writer's."""
    pytest.importorskip("vllm")
    from vllm_nvfp4kv.backend import NvFp4AttentionImpl
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    monkeypatch.setenv("NVFP4KV_CENTER_K", "0")  # the scales alone (K as rotated, uncentered)
    impl = NvFp4AttentionImpl(4, D, D ** -0.5, H, None, None, "nvfp4")
    assert impl.space.rotate_k  # default for power-of-two head sizes
    layer = _layer()
    cache = torch.zeros(kv_cache_shape(4, N, H, D), dtype=torch.uint8)
    k, v = _kv(6, mult=0.01)  # small K/V: at g = 1 their block scales are E4M3 subnormals
    impl.do_kv_cache_update(layer, k, v, cache, torch.full((6,), -1))  # warm-up: no data
    assert torch.count_nonzero(cache) == 0 and layer._k_scale.item() == 1.0
    slots = torch.tensor([17, 18, 19, 20, 21, -1])
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    kr = rotate(k)
    gk = _pow2_rule(kr[:5].float().abs().max().item(), 64.0)
    gv = _pow2_rule(v[:5].float().abs().max().item(), 64.0)
    assert (layer._k_scale.item(), layer._v_scale.item()) == (gk, gv)
    want = torch.zeros_like(cache)
    reference.write_cache(want, kr, v, slots, gk, gv, DEFAULT_BLOCK_SCALES)
    assert torch.equal(cache, want)


def _both(key, value, slots, flag, headroom=64.0, scales=(0.75, 0.75)):
    """Run the Triton guard and its reference on copies of the same state; both results."""
    out = []
    for fn in (calibrate_global_scales, reference.calibrate_global_scales):
        ks = torch.tensor(scales[0], dtype=torch.float32, device=key.device)
        vs = torch.tensor(scales[1], dtype=torch.float32, device=key.device)
        f = torch.tensor(flag, dtype=torch.int32, device=key.device)
        fn(key, value, slots, ks, vs, f, headroom)
        out.append((ks.item(), vs.item(), f.tolist()))
    return out


def _kv_case(t, h, d, dtype, device, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows or t, 3 * h, d, generator=g)  # q|k|v: K and V are strided views
    x[:, h:2 * h] *= 5.0
    x[:, 2 * h:] *= 0.02
    x = x.to(device, dtype)
    return x[:, h:2 * h], x[:, 2 * h:]


@pytest.mark.parametrize("t,h,d,dtype", [(1, 1, 64, torch.bfloat16), (21, 2, 64, torch.bfloat16),
                                         (33, 3, 80, torch.float16), (5, 2, 128, torch.float32)])
@pytest.mark.parametrize("flag", [[0, 0], [1, 0], [0, 1], [1, 1]])
def test_global_scale_kernel_matches_reference(t, h, d, dtype, flag, device):
    """kernels/global_scale.py against reference.calibrate_global_scales, bit for bit: padded
    rows (huge values), NaN/Inf, rows past the slots, T not a multiple of the tile, a head
    size that is not a power of two, strided K/V views, every flag state."""
    k, v = _kv_case(t, h, d, dtype, device, seed=t + d, rows=t + 3)  # 3 rows past T
    k[t:], v[t:] = 1e4, 1e4  # beyond slot_mapping: never read
    k[0, 0, d - 1] = float("nan")
    v[t - 1, h - 1, 0] = float("-inf")
    slots = torch.arange(t, device=device)
    if t > 2:
        slots[1] = -1
        k[1], v[1] = 3e4, 3e4  # a padded row
    (kk, vk, fk), (kr, vr, fr) = _both(k, v, slots, flag)
    assert (kk, vk, fk) == (kr, vr, fr)
    assert fk == [1, 1] and (kk == 0.75) == bool(flag[0]) and (vk == 0.75) == bool(flag[1])
    if not flag[0]:  # the rule, from the real rows' finite values
        valid = slots >= 0
        ak = k[:t][valid].float().abs().nan_to_num(0, 0, 0).max().item()
        assert kk == _pow2_rule(ak, 64.0)


def test_global_scale_kernel_edge_cases(device):
    """Sides that must wait (all padded, all zero, only NaN/Inf, no rows), amax at the ends of
    fp32 (the clamp to [2**-120, 2**120]), exact powers of two (not rounded up)."""
    k, v = _kv_case(9, 2, 64, torch.float32, device, seed=5)
    slots = torch.arange(9, device=device)
    cases = {
        "all padded": (k, v, torch.full_like(slots, -1)),
        "zero v": (k, torch.zeros_like(v), slots),
        "nan/inf k": (torch.where(torch.arange(9, device=device)[:, None, None] % 2 == 0,
                                  float("nan"), float("inf")).expand_as(k).contiguous(), v,
                      slots),
        "no rows": (k[:0], v[:0], slots[:0]),
        "huge": (torch.full_like(k, 3e38), torch.full_like(v, -1e38), slots),
        "tiny": (torch.full_like(k, 1e-44), torch.full_like(v, 1e-30), slots),
        "exact": (torch.full_like(k, 2688.0 / 64), torch.full_like(v, 2688.0 / 64 * 2 ** -10),
                  slots),
    }
    want_flags = {"all padded": [0, 0], "zero v": [1, 0], "nan/inf k": [0, 1], "no rows": [0, 0]}
    for name, (kk, vv, ss) in cases.items():
        got, ref = _both(kk, vv, ss, [0, 0], scales=(1.0, 1.0))
        assert got == ref, name
        assert got[2] == want_flags.get(name, [1, 1]), name
    assert _both(*cases["huge"], [0, 0])[0][:2] == (2.0 ** 120, 2.0 ** 120)
    assert _both(*cases["tiny"], [0, 0])[0][:2] == (2.0 ** -120, _pow2_rule(1e-30, 64.0))
    assert _both(*cases["exact"], [0, 0])[0][:2] == (1.0, 2.0 ** -10)


def test_global_scale_kernel_first_batch_then_later(device):
    """A sequence of batches on one layer's state, kernel and reference in lockstep: a padded-
    only batch fixes nothing, a batch with V all zero fixes K only, a later (larger) batch fixes
    V and leaves K, later batches change nothing."""
    k, v = _kv_case(12, 2, 64, torch.bfloat16, device, seed=7)
    slots = torch.arange(12, device=device)
    state = []
    for fn in (calibrate_global_scales, reference.calibrate_global_scales):
        state.append((torch.ones((), device=device), torch.ones((), device=device),
                      torch.zeros(2, dtype=torch.int32, device=device), fn))
    steps = [(k, v, torch.full_like(slots, -1), [0, 0]),
             (k, torch.zeros_like(v), slots, [1, 0]),
             (k * 100, v, slots, [1, 1]),
             (k * 1e4, v * 1e4, slots, [1, 1])]
    seen = []
    for kk, vv, ss, want in steps:
        got = []
        for ks, vs, flag, fn in state:
            fn(kk, vv, ss, ks, vs, flag, 64.0)
            got.append((ks.item(), vs.item(), flag.tolist()))
        assert got[0] == got[1] and got[0][2] == want
        seen.append(got[0])
    gk = _pow2_rule(k.float().abs().max().item(), 64.0)
    gv = _pow2_rule(v.float().abs().max().item(), 64.0)
    assert seen[0][:2] == (1.0, 1.0) and seen[1][:2] == (gk, 1.0)
    assert seen[2][:2] == seen[3][:2] == (gk, gv)


def test_guard_kernel_matches_the_eager_path(monkeypatch, device):
    """What a CUDA graph captures (one Triton program, no host read) calibrates exactly like
    the eager path, skips padded rows and non-finite values, and does nothing once set."""
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    k, v = _kv(21, device=device, mult=3.0, seed=1)
    k[2, 0, 7], v[4, 1, 0] = float("nan"), float("-inf")
    k[20], v[20] = 1e5, 1e5  # a padded row
    slots = torch.arange(21, device=device)
    slots[20] = -1
    eager, graph = _layer(device=device), _layer(device=device)
    cal.prepare_write(eager, k, v, slots, _cfg())
    st = cal.init_layer(graph, k.device, _cfg())
    cal.guard_update(graph, st, k, v, slots)
    assert st.flag.tolist() == [1, 1]
    assert graph._k_scale.item() == eager._k_scale.item()
    assert graph._v_scale.item() == eager._v_scale.item()
    cal.guard_update(graph, st, k * 100, v * 100, slots)  # flag set: no change
    assert graph._k_scale.item() == eager._k_scale.item()
    dummy = _layer(device=device)
    st = cal.init_layer(dummy, k.device, _cfg())
    cal.guard_update(dummy, st, k, v, torch.full_like(slots, -1))  # a padded-only replay
    assert st.flag.tolist() == [0, 0] and dummy._k_scale.item() == 1.0


def test_scales_file_round_trip_and_precedence(monkeypatch, tmp_path):
    path = tmp_path / "scales.json"
    res = cal.write_scales_file(str(path), {"a": [10.0, 0.5], "b": [2688.0, 0.0]}, 8.0,
                                {"model": "m"})
    raw = json.loads(path.read_text())
    assert raw["a"] == [_pow2_rule(10.0, 8), _pow2_rule(0.5, 8)] == res["a"]
    assert raw["b"] == [8.0, 1.0]  # a side never seen non-zero keeps 1.0
    assert raw["_meta"]["amax"]["a"] == [10.0, 0.5] and raw["_meta"]["headroom"] == 8.0
    assert cal.load_scales_file(str(path)) == {"a": tuple(raw["a"]), "b": (8.0, 1.0)}

    monkeypatch.setenv("NVFP4KV_SCALES_FILE", str(path))
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    x = torch.zeros(1, H, D)
    # file beats online; the scales are in place before the first write
    la = _layer("a")
    cal.prepare_write(la, x, x, torch.full((1,), -1), _cfg())
    assert cal.state(la).source == "file" and cal.state(la).done
    assert (la._k_scale.item(), la._v_scale.item()) == tuple(raw["a"])
    # a layer missing from the file falls back to online
    lc = _layer("c")
    cal.prepare_write(lc, x, x, torch.full((1,), -1), _cfg())
    assert cal.state(lc).source == "online"
    # checkpoint scales (anything but vLLM's default 1.0) beat the file ...
    lck = _layer("a", k=0.25, v=0.5)
    cal.prepare_write(lck, x, x, torch.full((1,), -1), _cfg())
    assert cal.state(lck).source == "checkpoint"
    assert (lck._k_scale.item(), lck._v_scale.item()) == (0.25, 0.5)
    # ... unless told to ignore them
    monkeypatch.setenv("NVFP4KV_CHECKPOINT_SCALES", "ignore")
    lig = _layer("a", k=0.25, v=0.5)
    cal.prepare_write(lig, x, x, torch.full((1,), -1), _cfg())
    assert cal.state(lig).source == "file"
    assert (lig._k_scale.item(), lig._v_scale.item()) == tuple(raw["a"])
    lig2 = _layer("zz", k=0.25, v=0.5)
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "off")
    cal.prepare_write(lig2, x, x, torch.full((1,), -1), _cfg())
    assert cal.state(lig2).source == "default" and lig2._k_scale.item() == 1.0


def test_default_is_a_no_op(device):
    layer = _layer(device=device)
    k, v = _kv(3, device=device, mult=100)
    cal.prepare_write(layer, k, v, torch.arange(3, device=device), _cfg())
    st = cal.state(layer)
    assert st.source == "default" and st.done and st.flag is None
    assert layer._k_scale.item() == 1.0


def test_bad_files_and_options_are_refused(monkeypatch, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": [0.0, 1.0]}))
    with pytest.raises(ValueError, match="finite and positive"):
        cal.load_scales_file(str(bad))
    with pytest.raises(FileNotFoundError, match="vllm_nvfp4kv.calibration"):
        cal.load_scales_file(str(tmp_path / "missing.json"))
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "sometimes")
    with pytest.raises(ValueError, match="NVFP4KV_CALIBRATE"):
        cal.prepare_write(_layer(), *_kv(1), torch.arange(1), _cfg())


def test_collect_mode_records_amax_without_changing_scales(monkeypatch):
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "collect")
    layer = _layer()
    k1, v1 = _kv(5)
    k1[:, 0, 3] = torch.arange(5) + 300.0  # a channel that is never near 0 (Qwen2's K bias)
    k2, v2 = _kv(5, mult=2.0, seed=3)
    k2[:, 0, 3] = torch.arange(5) + 310.0
    k0 = torch.zeros_like(k1)
    # a warm-up / capture batch first (every slot -1, as vLLM pads on the GPU): no data; it
    # used to enter the per-channel range as 0 and halve the mid-range of channel 3
    cal.prepare_write(layer, k0, k0, torch.full((5,), -1), _cfg())
    cal.prepare_write(layer, k1, v1, torch.arange(5), _cfg())
    cal.prepare_write(layer, k2, v2, torch.tensor([0, 1, 2, -1, -1]), _cfg())
    model = SimpleNamespace(modules=lambda: [layer, SimpleNamespace()])
    got = cal.collected(model)[layer.layer_name]
    assert got[0] == max(k1.float().abs().max(), k2[:3].float().abs().max()).item()
    assert got[1] == max(v1.float().abs().max(), v2[:3].float().abs().max()).item()
    assert got[2] == 8 and layer._k_scale.item() == 1.0
    both = torch.cat([k1, k2[:3]]).float()
    assert torch.equal(torch.tensor(got[3]), both.amax(0))  # per channel: K centering and
    assert torch.equal(torch.tensor(got[4]), both.amin(0))  # smoothing
    assert (got[4][0][3], got[3][0][3]) == (300.0, 312.0)


def test_k_centering_and_smoothing_file_round_trip_and_backend(monkeypatch, tmp_path):
    """--center-k --smooth-k: per-channel K max/min -> mid-range offsets mu, and power-of-two
    divisors per RoPE pair of the centered amax (outliers down to the median, the rest 1);
    the K scale from the amax of (K - mu) / s. The file read back gives the backend both,
    which cache (K - mu) / s, turn K rotation off and refuse ROTATE_K=1."""
    hi, lo = torch.ones(H, D), -torch.ones(H, D)
    hi[0, 3], lo[0, 3] = 110.0, 90.0         # a constant ~100: centered to +-10, ratio 10 -> 8
    hi[1, 5 + D // 2], lo[1, 5 + D // 2] = 3.0, -3.0   # ratio 3 -> 4
    hi[1, 7] = 1.6                           # centered amax 1.3: below sqrt(2), untouched
    mu = (hi + lo) / 2
    want = torch.ones(H, D)
    want[0, [3, 3 + D // 2]] = 8.0
    want[1, [5, 5 + D // 2]] = 4.0
    from vllm_nvfp4kv.scales import k_smoothing_factors
    assert torch.equal(k_smoothing_factors(torch.maximum(hi - mu, mu - lo)), want)
    path = tmp_path / "k.json"
    raw = cal.write_scales_file(str(path), {"a": [110.0, 0.5]}, 8.0, None,
                                {"a": (hi, lo)}, center=True, smooth=True)
    assert raw["a"] == [_pow2_rule(10 / 8, 8), _pow2_rule(0.5, 8)]  # K amax: (K - mu) / s
    got = cal.load_k_transform(str(path))["a"]
    assert torch.equal(got["center"], mu) and torch.equal(got["smooth"], want)
    only_smooth = cal.write_scales_file(str(tmp_path / "s.json"), {"a": [110.0, 0.5]}, 8.0,
                                        None, {"a": (hi, lo)}, smooth=True)
    assert "_k_center" not in only_smooth and only_smooth["_k_smooth"]["a"][0][3] == 128.0
    monkeypatch.setenv("NVFP4KV_SCALES_FILE", str(path))
    c, s = cal.k_transform(_layer("a"), "cpu", _cfg())
    assert torch.equal(c, mu) and torch.equal(s, want)
    assert cal.k_transform(_layer("b"), "cpu", _cfg()) == (None, None)

    pytest.importorskip("vllm")
    from vllm_nvfp4kv.backend import NvFp4AttentionImpl
    impl = NvFp4AttentionImpl(4, D, D ** -0.5, H, None, None, "nvfp4")
    assert impl.space.rotate_k  # auto, until the file says otherwise
    layer = _layer("a")
    cache = torch.zeros(kv_cache_shape(4, N, H, D), dtype=torch.uint8)
    k, v = _kv(6)
    k[:, 0, 3] += 100.0
    slots = torch.tensor([17, 18, 19, 20, 21, -1])
    impl.do_kv_cache_update(layer, k, v, cache, slots)
    assert not impl.space.rotate_k and torch.equal(impl.space.k_mul.float(), 1 / want)
    assert torch.equal(impl.space.q_mul.float(), want.repeat_interleave(2, 0))
    expect = torch.zeros_like(cache)
    cached = (k - mu.bfloat16()) * (1 / want).bfloat16()
    reference.write_cache(expect, cached, v, slots, *raw["a"], DEFAULT_BLOCK_SCALES)
    assert torch.equal(cache, expect)
    monkeypatch.setenv("NVFP4KV_ROTATE_K", "1")
    with pytest.raises(ValueError, match="exclude"):
        NvFp4AttentionImpl(4, D, D ** -0.5, H, None, None, "nvfp4").do_kv_cache_update(
            _layer("a"), k, v, cache, slots)
    monkeypatch.delenv("NVFP4KV_ROTATE_K")
    with pytest.raises(ValueError, match="sinks or a logit soft-cap"):
        NvFp4AttentionImpl(4, D, D ** -0.5, H, None, None, "nvfp4", 30.0).do_kv_cache_update(
            _layer("a"), k, v, cache, slots)
    # centering alone keeps the automatic rotation: rotate(K - mu) is cached
    center_only = tmp_path / "c.json"
    raw_c = cal.write_scales_file(str(center_only), {"a": [110.0, 0.5]}, 8.0, None,
                                  {"a": (hi, lo)}, center=True)
    monkeypatch.setenv("NVFP4KV_SCALES_FILE", str(center_only))
    impl = NvFp4AttentionImpl(4, D, D ** -0.5, H, None, None, "nvfp4")
    impl.do_kv_cache_update(_layer("a"), k, v, cache.zero_(), slots)
    assert impl.space.rotate_k and impl.space.k_mul is None
    expect.zero_()
    reference.write_cache(expect, rotate(k - mu.bfloat16()), v, slots, *raw_c["a"],
                          DEFAULT_BLOCK_SCALES)
    assert torch.equal(cache, expect)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": [1.0, 1.0], "_k_smooth": {"a": [[0.5] * D] * H}}))
    with pytest.raises(ValueError, match="divisors"):
        cal.load_k_transform(str(bad))


# ----------------------------------------------------------------- a real engine (CPU)
MODEL = str(Path(__file__).resolve().parents[1] / "evals" / "models" / "tiny-llama")


@pytest.mark.vllm
def test_engine_profile_and_warmup_runs_do_not_calibrate(monkeypatch):
    """vLLM's CPU engine (tiny llama, dummy weights): after start-up (profile run, warm-up)
    no layer is calibrated; the first request's first batch fixes every layer's scales, from
    that batch's real K/V, before it is written; a second request changes nothing."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    # the first request's batch is the one under test, not the start-up request's
    # (test_startup.py checks that one)
    monkeypatch.setenv("NVFP4KV_ADAPT_AT_STARTUP", "0")
    from vllm import LLM, SamplingParams
    writes = []
    orig = reference.write_cache

    def spy(cache, key, value, slots, k_scale, v_scale, fos=False):
        writes.append((key.clone(), value.clone(), slots.clone(), float(k_scale),
                       float(v_scale)))
        return orig(cache, key, value, slots, k_scale, v_scale, fos)

    monkeypatch.setattr(reference, "write_cache", spy)
    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=16 << 20, kv_cache_dtype="nvfp4", seed=0, block_size=16)

    def layers():
        return [(m.layer_name, m) for m in llm.llm_engine.model_executor.driver_worker.worker
                .model_runner.model.modules() if hasattr(m, "layer_name")]

    for _, m in layers():  # start-up wrote no real slot: nothing fixed
        st = cal.state(m)
        assert st is None or not st.done
        assert m._k_scale.item() == 1.0 and m._v_scale.item() == 1.0
    startup = len(writes)
    assert all((w[2] < 0).all() for w in writes)
    sp = SamplingParams(max_tokens=3, temperature=0, detokenize=False)
    prompt = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: chunks of 32 + 8
    llm.generate([prompt], sp, use_tqdm=False)
    named = layers()
    assert len(named) == 2
    for i, (name, m) in enumerate(named):
        first = writes[startup + i]  # layers write in order; the first step's batch
        key, value, slots = first[0], first[1], first[2]
        valid = slots >= 0
        assert valid.sum() == 32
        gk = _pow2_rule(key[valid].float().abs().max().item(), 64.0)
        gv = _pow2_rule(value[valid].float().abs().max().item(), 64.0)
        assert cal.state(m).done and cal.state(m).source == "online"
        assert (m._k_scale.item(), m._v_scale.item()) == (gk, gv)
        assert first[3:] == (gk, gv)  # that batch was written with them
    fixed = [(m._k_scale.item(), m._v_scale.item()) for _, m in named]
    out1 = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert [(m._k_scale.item(), m._v_scale.item()) for _, m in layers()] == fixed
    assert all(w[3:] in fixed for w in writes[startup:])
    assert len(out1) == 3
    del llm
    # the engine's shared workspace is an inference tensor: leave none to later tests
    from vllm.v1.worker.workspace import reset_workspace_manager

    from vllm_nvfp4kv import workspace
    reset_workspace_manager()
    workspace._fallback.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_calibrates_once(monkeypatch):
    """A graph captured before calibration carries the guard: its first replay with real slots
    calibrates; later replays and eager writes leave the scales alone."""
    monkeypatch.setenv("NVFP4KV_CALIBRATE", "online")
    layer = _layer(device="cuda")
    k = torch.zeros(8, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    slots = torch.full((8,), -1, device="cuda")
    cal.prepare_write(layer, k, v, slots, _cfg())  # eager warm-up: state, no data
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        cal.prepare_write(layer, k, v, slots, _cfg())
    torch.cuda.current_stream().wait_stream(s)
    assert layer._k_scale.item() == 1.0
    graph.replay()  # padded-only replay
    assert layer._k_scale.item() == 1.0
    kk, vv = _kv(8, device="cuda", mult=5.0)
    k.copy_(kk)
    v.copy_(vv)
    slots.copy_(torch.arange(8, device="cuda"))
    slots[7] = -1
    graph.replay()
    gk = _pow2_rule(kk[:7].float().abs().max().item(), 64.0)
    assert layer._k_scale.item() == gk
    k.mul_(100)
    graph.replay()
    cal.prepare_write(layer, k, v, slots, _cfg())  # eager: reads the flag, done
    assert cal.state(layer).done and layer._k_scale.item() == gk
