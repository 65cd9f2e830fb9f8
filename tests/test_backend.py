"""The backend's attention paths on a mixed batch (decodes, a chunked-prefill extend over a
cached prefix, an initial prefill) against the torch reference. CPU: the backend's torch path;
CUDA: Triton kernels + FlashAttention."""
import math
import os
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from vllm_nvfp4kv import adaptation  # noqa: E402
from vllm_nvfp4kv.adaptation import Phase  # noqa: E402
from vllm_nvfp4kv.backend import NvFp4AttentionImpl, NvFp4Metadata  # noqa: E402
from vllm_nvfp4kv.config import NvFp4KVConfig  # noqa: E402
from vllm_nvfp4kv.kernels import kv_cache_shape, reference  # noqa: E402
from vllm_nvfp4kv.kernels.format import DEFAULT_BLOCK_SCALES  # noqa: E402
from vllm_nvfp4kv.kernels.rotation import rotate  # noqa: E402
from vllm_nvfp4kv.prefill import plan_prefill, ranges  # noqa: E402

HQ, H, D, N = 4, 2, 64, 16
# (cached context, tokens this step): two decodes, an extend, an initial prefill
REQS = [(20, 1), (35, 1), (40, 7), (0, 9)]


@pytest.fixture(autouse=True)
def _inference_mode():
    """The backend runs under inference mode, as vLLM runs the model; it also lets these
    tests share vLLM's process-wide workspace with an engine that an earlier test started."""
    with torch.inference_mode():
        yield


@pytest.fixture(autouse=True)
def _fresh_outlier_models():
    """NVFP4KV_CENTER_K=auto remembers models with K outliers per process; the impls made
    here share one model name."""
    adaptation._K_OUTLIER_MODELS.clear()
    yield
    adaptation._K_OUTLIER_MODELS.clear()


def _fp8(x, div):
    """What an E4M3 round trip with this scale leaves of x (the FP8 workspace)."""
    return (x.float() / div).clamp(-448, 448).to(torch.float8_e4m3fn).float() * div


def _run(device, capacity, window=None, softcap=0.0, with_sinks=False, rotated=False,
         from_cache=False, fp8_workspace=False, smooth=None, center=None):
    """rotated: the backend's NVFP4KV_ROTATE_K/V options; the expectation then applies the
    same rotations by hand (cached history, q, k, v, and the output back). smooth [H, D]: K
    smoothing divisors from a scales file; expected with K / s cached and q * s (each query
    head its KV head's s) wherever the cache is read. center [H, D]: K centering offsets,
    expected with K - mu cached and nothing else changed (softmax ignores the shift).
    fp8_workspace:
    NVFP4KV_WORKSPACE_DTYPE=fp8, expected with the same E4M3 roundings of the workspace
    rows and of the prefill queries (one round only)."""
    rot = rotate if rotated else (lambda x: x)
    s_k = torch.ones(H, D, device=device) if smooth is None else smooth.to(device)
    s_q = s_k.repeat_interleave(HQ // H, 0)
    mu = torch.zeros(H, D, device=device) if center is None else center.to(device)
    torch.manual_seed(0)
    nb = 40
    cache = torch.zeros(kv_cache_shape(nb, N, H, D), dtype=torch.uint8, device=device)
    perm = torch.randperm(nb)
    bt = torch.zeros(len(REQS), 4, dtype=torch.int32)
    for i in range(len(REQS)):
        bt[i] = perm[4 * i:4 * i + 4]
    bt = bt.to(device)
    k_scale, v_scale = torch.tensor(0.7, device=device), torch.tensor(1.3, device=device)
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=v_scale, layer_name="layer0")
    sinks = torch.randn(HQ, device=device) if with_sinks else None

    def slots(b, positions):
        return (bt[b, positions // N].long() * N + positions % N)

    # the cached prefixes, written earlier
    hist_k, hist_v = {}, {}
    for b, (ctx, _) in enumerate(REQS):
        if ctx:
            hist_k[b] = torch.randn(ctx, H, D, device=device)
            hist_v[b] = torch.randn(ctx, H, D, device=device)
            reference.write_cache(cache, rot((hist_k[b] - mu) / s_k), rot(hist_v[b]),
                                  slots(b, torch.arange(ctx, device=device)), k_scale, v_scale,
                                  "amax6")
    # this step
    t = sum(n for _, n in REQS)
    q = torch.randn(t, HQ, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(t, H, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(t, H, D, device=device, dtype=torch.bfloat16)
    qsl = torch.tensor([0] + [sum(n for _, n in REQS[:i + 1]) for i in range(len(REQS))])
    seq_lens = torch.tensor([c + n for c, n in REQS], dtype=torch.int32)
    slot_mapping = torch.cat([slots(b, torch.arange(c, c + n, device=device))
                              for b, (c, n) in enumerate(REQS)])
    with mock.patch.dict("os.environ",
                         {"NVFP4KV_WORKSPACE_DTYPE": "fp8" if fp8_workspace else "auto",
                          # the history above is written without online centering's offsets
                          "NVFP4KV_CENTER_K": "0",
                          "NVFP4KV_ROTATE_K": "1" if rotated else "0",
                          "NVFP4KV_ROTATE_V": "1" if rotated else "0"}), \
            mock.patch.object(adaptation, "k_transform",
                              lambda layer, dev, cfg: _on(dev, center, smooth)):
        impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, window, "nvfp4", softcap or None,
                                  sinks=sinks)
        impl.process_weights_after_loading(torch.bfloat16)
        impl.do_kv_cache_update(layer, k, v, cache, slot_mapping)
        md = NvFp4Metadata(
            num_actual_tokens=t, num_decodes=2, num_decode_tokens=2, num_prefills=2,
            seq_lens=seq_lens.to(device), block_table=bt, decode_num_splits=2,
            prefill=plan_prefill(qsl, seq_lens, 2, len(REQS), capacity, window,
                                 torch.device(device), chunk_from_cache=from_cache))
        out = torch.full((t, HQ * D), float("nan"), device=device, dtype=torch.bfloat16)
        impl.forward(layer, q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    out = out.view(t, HQ, D).float()

    # expected: decodes read the cache (their token included); prefills see the dequantized
    # prefix followed by the chunk's exact K/V
    scale = D ** -0.5
    exp = torch.zeros(t, HQ, D, device=device)
    # the step's K centered by mu as the backend stores it (BF16, the model's dtype): K - mu
    # rounds differently per key with fp32 mu (up to 0.03 in the outputs at |mu| ~ 4)
    mu = mu.bfloat16().float()
    q, k, v = rot(q * s_q), rot((k.float() - mu).bfloat16() / s_k), rot(v)
    if fp8_workspace:
        assert len(md.prefill.rounds) == 1
        q0 = int(qsl[2])
        q = torch.cat([q[:q0].float(), _fp8(q[q0:], q[q0:].float().abs().amax() / 448)])
    exp[:2] = reference.paged_attention(q[:2], cache, bt[:2], torch.arange(3, device=device),
                                        seq_lens[:2].to(device), scale, k_scale, v_scale,
                                        window, softcap, sinks)
    for b in (2, 3):
        ctx, n = REQS[b]
        q0 = int(qsl[b])
        seen = ctx + n if from_cache else ctx  # tokens read back from the cache
        if seen:
            pk, pv = reference.gather_cache(cache, bt[b:b + 1],
                                            torch.tensor([0, seen], device=device),
                                            torch.zeros(1, dtype=torch.int32, device=device),
                                            D, k_scale, v_scale)
        else:
            pk = pv = torch.zeros(0, H, D, device=device)
        if not from_cache:  # the chunk's exact K/V follow the dequantized prefix
            pk = torch.cat([pk, k[q0:q0 + n].float()])
            pv = torch.cat([pv, v[q0:q0 + n].float()])
        if fp8_workspace:  # E4M3 rows scaled by 8 * g
            pk, pv = _fp8(pk, 8 * k_scale), _fp8(pv, 8 * v_scale)
        exp[q0:q0 + n] = reference.attention(q[q0:q0 + n], pk, pv, scale,
                                             torch.arange(ctx, ctx + n, device=device),
                                             window, softcap, sinks)
    return out, rot(exp), md


@pytest.mark.parametrize("capacity", [4096, 24], ids=["one-round", "pieces-and-rounds"])
def test_mixed_batch_matches_reference(device, capacity):
    out, exp, md = _run(device, capacity)
    if capacity == 24:  # the extend's prefix (40) does not fit: attended in pieces
        assert md.prefill.long and md.prefill.long[0].pieces == [(0, 24), (24, 16)]
    else:
        assert len(md.prefill.rounds) == 1 and md.prefill.rounds[0].ws_tokens == 40 + 7 + 9
    assert not out.isnan().any()
    # bf16 output rounding (2^-9 relative) dominates; FA/Triton fp32 accumulation on CUDA
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kw", [dict(window=8), dict(softcap=3.0), dict(with_sinks=True)],
                         ids=["window", "softcap", "sinks"])
def test_mixed_batch_variants(device, kw):
    out, exp, _ = _run(device, 4096, **kw)
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("capacity", [4096, 24], ids=["one-round", "pieces-and-rounds"])
def test_mixed_batch_prefill_from_cache(device, capacity):
    out, exp, md = _run(device, capacity, from_cache=True)
    assert all(r.chunk_dst is None for r in md.prefill.rounds)
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


def test_mixed_batch_fp8_workspace(device):
    out, exp, md = _run(device, 4096, fp8_workspace=True)
    assert md.prefill.rounds[0].ws_tokens == 40 + 7 + 9
    # FA3 FP8 also rounds P to E4M3 (2^-4 relative); the CPU path keeps P in fp32
    tol = 6e-2 if device == "cuda" else 2e-2
    torch.testing.assert_close(out, exp, atol=tol, rtol=tol)


def test_fp8_workspace_long_prefix_pieces(device):
    """Pieces merged by LSE with FP8 prefix pieces: close to the exact-workspace result
    (loose: FP8 rounds Q, K, V to 3 mantissa bits)."""
    exact, _, _ = _run(device, 24)
    out, _, md = _run(device, 24, fp8_workspace=True)
    assert md.prefill.long
    assert not out.isnan().any()
    torch.testing.assert_close(out, exact, atol=0.15, rtol=0.15)
    assert (out - exact).abs().mean() < 0.02


def test_mixed_batch_with_rotated_kv(device):
    out, exp, _ = _run(device, 4096, rotated=True)
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


def test_mixed_batch_with_k_centering_and_rotation(device):
    """NVFP4KV_ROTATE_K=1 (and V) with a centering-only file: rotate(K - mu) cached."""
    center = torch.randn(H, D, generator=torch.Generator().manual_seed(6)) * 4
    out, exp, _ = _run(device, 24, rotated=True, center=center)
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kw", [dict(rotated=True, center="yes"), dict(smooth="yes"),
                                dict(fp8_workspace=True)], ids=["rot+center", "smooth", "fp8"])
def test_mixed_batch_with_put_rows_kernel(device, kw):
    """The backend's forward with the chunk's K/V put into the workspace by the put_rows
    kernel, as on CUDA (on a CPU in Triton's interpreter): the same expectation as the torch
    path's (what CUDA runs is otherwise only kernel-tested on a CPU)."""
    from vllm_nvfp4kv import prefill
    g = torch.Generator().manual_seed(8)
    if kw.get("center"):
        kw["center"] = torch.randn(H, D, generator=g) * 4
    if kw.get("smooth"):
        kw["smooth"] = torch.ones(H, D)
        kw["smooth"][0, [3, 3 + D // 2]] = 64.0
    put = prefill._put_chunk
    calls = []

    def put_with_kernel(*a, **k):
        calls.append(1)
        return put(*a, **{**k, "kernel": True})
    with mock.patch.object(prefill, "_put_chunk", put_with_kernel):
        out, exp, md = _run(device, 4096, **kw)
    assert calls and md.prefill.rounds[0].chunk_dst is not None
    tol = 6e-2 if device == "cuda" and kw.get("fp8_workspace") else 2e-2
    torch.testing.assert_close(out, exp, atol=tol, rtol=tol)


@pytest.mark.parametrize("capacity", [4096, 24], ids=["one-round", "pieces-and-rounds"])
@pytest.mark.parametrize("centered", [False, True], ids=["smooth", "center+smooth"])
def test_mixed_batch_with_k_smoothing(device, capacity, centered):
    """K smoothing (and centering) from a scales file: every path (decode, extend rounds,
    prefix pieces, initial prefill) attends as if q * s met (K - mu) / s from the cache;
    rotation of K is off."""
    smooth = torch.ones(H, D)
    smooth[0, [3, 3 + D // 2]] = 64.0
    smooth[1, 10] = smooth[1, 10 + D // 2] = 8.0
    center = torch.randn(H, D, generator=torch.Generator().manual_seed(5)) * 4 \
        if centered else None
    out, exp, md = _run(device, capacity, smooth=smooth, center=center)
    assert not out.isnan().any()
    torch.testing.assert_close(out, exp, atol=2e-2, rtol=2e-2)


def _decode_error(k, v, q, center, smooth, center_k="0", rotate_k="0", warm_up=False,
                  with_impl=False, model="?"):
    """Relative error of the backend's decode (one query over keys k written through the
    cache with K centering / smoothing from a file, or online: center_k) against exact
    attention. warm_up: an all-padding write first (what vLLM's warm-up batches do)."""
    t, nb = k.shape[0], 8
    exact = reference.attention(q, k, v, D ** -0.5, torch.tensor([t - 1]), None, 0.0, None)
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0),
                            layer_name="l0")
    with mock.patch.dict("os.environ", {"NVFP4KV_ROTATE_K": rotate_k,
                                        "NVFP4KV_CENTER_K": center_k}), \
            mock.patch.object(adaptation, "k_transform",
                              lambda layer, dev, cfg: _on(dev, center, smooth)):
        impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
        impl.adaptation.model = model  # vLLM's model name (no engine config here)
        cache = torch.zeros(kv_cache_shape(nb, N, H, D), dtype=torch.uint8)
        if warm_up:
            impl.do_kv_cache_update(layer, torch.zeros_like(k[:4]).bfloat16(),
                                    torch.zeros_like(v[:4]).bfloat16(), cache,
                                    torch.full((4,), -1))
        impl.do_kv_cache_update(layer, k.bfloat16(), v.bfloat16(), cache, torch.arange(t))
        md = NvFp4Metadata(num_actual_tokens=1, num_decodes=1, num_decode_tokens=1,
                           num_prefills=0, seq_lens=torch.tensor([t], dtype=torch.int32),
                           block_table=torch.arange(nb, dtype=torch.int32)[None],
                           decode_num_splits=1, prefill=None)
        out = torch.zeros(1, HQ * D, dtype=torch.bfloat16)
        zeros = torch.zeros(1, H * D, dtype=torch.bfloat16)
        impl.forward(layer, q.bfloat16().flatten(1), zeros, zeros, cache, md, out)
    err = float((out.view(1, HQ, D).float() - exact).norm() / exact.norm())
    if with_impl:
        return err, impl
    assert (impl.space.k_mul is None) == (smooth is None) and not impl.space.rotate_k
    assert (impl.space.k_sub is None) == (center is None)
    return err


def test_k_centering_and_smoothing_on_outlier_channels():
    """What they are for: K whose channel pair 3 / 3 + D/2 carries a large constant (a k_proj
    bias, as in Qwen2) loses its other channels in 4-bit blocks. Centering (the calibration's
    mid-range) removes the constant exactly and decode is close to exact again. Smoothing
    (K / s, q * s) rescues the other channels but keeps the outlier channel's 4-bit error, s
    times larger in q.k: it helps only where the queries do not read that channel."""
    from vllm_nvfp4kv.scales import k_smoothing_factors
    torch.manual_seed(0)
    k = torch.randn(64, H, D)
    k[:, :, [3, 3 + D // 2]] += 300.0
    v, q = torch.randn(64, H, D), torch.randn(1, HQ, D)
    q_blind = q.clone()
    q_blind[:, :, [3, 3 + D // 2]] = 0.0
    mid, s = (k.amax(0) + k.amin(0)) / 2, k_smoothing_factors(k.abs().amax(0))
    errs = {(name, blind): _decode_error(k, v, qq, c, sm)
            for name, c, sm in (("plain", None, None), ("smooth", None, s), ("center", mid, None))
            for blind, qq in ((False, q), (True, q_blind))}
    # measured (torch 2.11 CPU): plain 1.11 / 0.58, smooth 2.69 / 0.12, center 0.19 / 0.12
    assert errs["plain", False] > 0.4 and errs["plain", True] > 0.4
    assert errs["center", False] < 0.25 and errs["center", True] < 0.2
    assert errs["smooth", True] < 0.2 and errs["smooth", False] > 1.0


def _outlier_case(seed=0):
    """K whose channel pair 3 / 3 + D/2 carries a large constant (Qwen2's k_proj bias)."""
    torch.manual_seed(seed)
    k = torch.randn(64, H, D)
    k[:, :, [3, 3 + D // 2]] += 300.0
    return k, torch.randn(64, H, D), torch.randn(1, HQ, D)


def _on(dev, *ts):
    """What calibration.k_transform returns: the tensors on the layer's device."""
    return tuple(None if t is None else t.to(dev) for t in ts)


def _mid(k):
    """The per-channel mid-range of k [T, H, D] as the backend is given it (BF16) and
    stores it."""
    kb = k.bfloat16().float()
    return ((kb.amax(0) + kb.amin(0)) / 2).bfloat16().float()


@pytest.mark.parametrize("rotate_k", ["0", "1"])
def test_online_k_centering_at_the_first_real_batch(rotate_k):
    """NVFP4KV_CENTER_K=auto, no scales file: the warm-up batch (all slots -1)
    leaves mu at zero; the first real batch shows the outlier pair and sets mu to its
    mid-range in place (the tensor CUDA graphs captured), and decode is close to exact as
    with a calibrated file; with 0 the outlier stays and decode is far off."""
    k, v, q = _outlier_case()
    mid = _mid(k)
    err, impl = _decode_error(k, v, q, None, None, "auto", rotate_k, warm_up=True,
                              with_impl=True)
    torch.testing.assert_close(impl.space.k_sub.float(), mid)
    assert impl.adaptation.online_center and impl.space.rotate_k == (rotate_k == "1")
    file_err = _decode_error(k, v, q, mid, None, "auto", rotate_k, with_impl=True)[0]
    off_err, off = _decode_error(k, v, q, None, None, "0", rotate_k, with_impl=True)
    assert off.space.k_sub is None
    # measured (torch 2.11 CPU, rotation off / on, search block scales): online 0.18 / 0.14,
    # off 1.11 / 0.89
    assert err < 0.25 and abs(err - file_err) < 0.02 and off_err > 0.6


def _rotation_case(queries_read_the_outlier_block: bool, seed=0):
    """K with one large channel (0) and small others; queries that weight either the other
    channels of that channel's 16-value block (which 4-bit blocks without rotation round to
    0: the rotation helps) or only the other blocks (which without rotation keep their fine
    scales, while the rotation spreads the large channel over them: it hurts)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(64, H, D, generator=g)
    k[:, :, 0] += 40.0
    q = torch.zeros(1, HQ, D)
    cols = slice(1, 16) if queries_read_the_outlier_block else slice(16, D)
    q[:, :, cols] = torch.randn(1, HQ, D, generator=g)[:, :, cols] * 4
    return k, torch.randn(64, H, D, generator=g), q


@pytest.mark.parametrize("helps", [True, False])
def test_rotation_helps_decides_by_the_score_error(helps):
    from vllm_nvfp4kv.cache_space import rotation_helps
    k, _, q = _rotation_case(helps)
    assert rotation_helps(q, k, 1.0, DEFAULT_BLOCK_SCALES) == helps


@pytest.mark.parametrize("helps", [True, False])
def test_rotation_chosen_per_layer_at_the_first_real_batch(helps):
    """NVFP4KV_ROTATE_K=auto (the default): the warm-up batch leaves the rotation matrix at
    H; the first real batch's forward decides with its queries, and where the rotation would
    raise the score error it switches the matrix to I in place and rewrites the batch's K:
    then the cache holds exactly what NVFP4KV_ROTATE_K=0 writes, and decode gives exactly its
    output (else exactly NVFP4KV_ROTATE_K=1's)."""
    k, v, q = _rotation_case(helps)
    err, impl = _decode_error(k, v, q, None, None, "0", "auto", warm_up=True, with_impl=True)
    eye = torch.eye(D, dtype=torch.bfloat16)
    assert impl.adaptation.phase is Phase.SETTLED  # no batch left waiting for queries
    assert torch.equal(impl.space.k_rot, rotate(eye) if helps else eye)
    fixed_err = _decode_error(k, v, q, None, None, "0", "1" if helps else "0", with_impl=True)[0]
    other_err = _decode_error(k, v, q, None, None, "0", "0" if helps else "1", with_impl=True)[0]
    assert err == fixed_err and err < other_err


def test_online_k_centering_is_model_wide_once_a_layer_shows_outliers():
    """auto: a layer without outliers whose first real batch comes after one with them (the
    same model) is centered too; another model is not."""
    k, v, q = _outlier_case()
    torch.manual_seed(2)
    k2, v2, q2 = torch.randn(64, H, D), torch.randn(64, H, D), torch.randn(1, HQ, D)
    _, plain = _decode_error(k2, v2, q2, None, None, "auto", with_impl=True)
    assert (plain.space.k_sub == 0).all()
    _decode_error(k, v, q, None, None, "auto", with_impl=True)  # layer 0: outliers
    _, later = _decode_error(k2, v2, q2, None, None, "auto", with_impl=True)
    torch.testing.assert_close(later.space.k_sub.float(), _mid(k2))
    _, other = _decode_error(k2, v2, q2, None, None, "auto", with_impl=True, model="other")
    assert (other.space.k_sub == 0).all()


def test_online_k_centering_only_where_needed():
    """auto: K without outlier channels keeps mu = 0 (same output as centering off); 1:
    centered anyway; a scales file's centering comes first; never with sinks or a
    soft-cap."""
    torch.manual_seed(1)
    k, v, q = torch.randn(64, H, D), torch.randn(64, H, D), torch.randn(1, HQ, D)
    err_auto, auto = _decode_error(k, v, q, None, None, "auto", with_impl=True)
    err_off = _decode_error(k, v, q, None, None, "0", with_impl=True)[0]
    assert auto.adaptation.online_center and (auto.space.k_sub == 0).all() \
        and err_auto == err_off
    _, forced = _decode_error(k, v, q, None, None, "1", with_impl=True)
    torch.testing.assert_close(forced.space.k_sub.float(), _mid(k))
    mu = torch.full((H, D), 0.5)
    _, filed = _decode_error(k, v, q, mu, None, "1", with_impl=True)
    assert not filed.adaptation.online_center and (filed.space.k_sub == 0.5).all()
    for mode in ("1", "auto"):
        with mock.patch.dict("os.environ", {"NVFP4KV_CENTER_K": mode}), \
                mock.patch.object(adaptation, "k_transform", lambda layer, dev, cfg: (None, None)):
            for kw in ({"sinks": torch.zeros(HQ)}, {"logits_soft_cap": 30.0}):
                impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4", **kw)
                impl.adaptation.on_first_eager_write(SimpleNamespace(layer_name="l0"), k)
                assert not impl.adaptation.online_center and impl.space.k_sub is None
    with mock.patch.dict("os.environ", {"NVFP4KV_CENTER_K": "yes"}), \
            pytest.raises(ValueError, match="NVFP4KV_CENTER_K"):
        NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")


def test_rotation_defaults_follow_head_size():
    assert NvFp4AttentionImpl(HQ, 64, 0.1, H, None, None, "nvfp4").space.rotate_k  # auto, 2^k
    assert not NvFp4AttentionImpl(HQ, 80, 0.1, H, None, None, "nvfp4").space.rotate_k
    with mock.patch.dict("os.environ", {"NVFP4KV_ROTATE_K": "1"}), \
            pytest.raises(ValueError, match="power"):
        NvFp4AttentionImpl(HQ, 80, 0.1, H, None, None, "nvfp4")


def test_rotation_is_orthonormal_and_keeps_dot_products():
    x, y = torch.randn(5, 128), torch.randn(5, 128)
    torch.testing.assert_close(rotate(rotate(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((rotate(x) * rotate(y)).sum(-1), (x * y).sum(-1), atol=1e-4,
                               rtol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        rotate(torch.randn(2, 96))


def test_plan_prefill_rounds_and_window():
    qsl = torch.tensor([0, 1, 11, 31, 36])
    seq_lens = torch.tensor([50, 110, 20, 1005])
    plan = plan_prefill(qsl, seq_lens, 1, 4, capacity=120, window=None,
                        device=torch.device("cpu"))
    # req 1: 100 prefix + 10; req 2: 0 + 20 -> over 120 together, so two rounds; req 3 alone
    # (1000 + 5) does not fit: pieces of 120
    assert [(r.r0, r.r1) for r in plan.rounds] == [(1, 2), (2, 3)]
    assert plan.rounds[0].ws_tokens == 110 and plan.rounds[1].ws_tokens == 0
    assert plan.long[0].r == 3 and sum(n for _, n in plan.long[0].pieces) == 1000
    assert plan.rounds[0].chunk_dst.tolist() == list(range(100, 110))
    # a sliding window bounds the prefix gathered: only window-1 tokens before the chunk
    plan = plan_prefill(qsl, seq_lens, 3, 4, capacity=120, window=64,
                        device=torch.device("cpu"))
    rnd = plan.rounds[0]
    assert rnd.ctx_starts.tolist() == [1000 - 63] and rnd.ws_tokens == 63 + 5


@pytest.mark.parametrize("ws_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("rotation", ["chosen-on", "chosen-off", "fixed", "none"])
def test_put_chunk_kernel_matches_torch(device, ws_dtype, rotation):
    """The workspace rows of a chunk's exact K/V: the put_rows kernel branch (what CUDA runs;
    on a CPU in Triton's interpreter) against the torch sequence it replaced, for a cache space
    with centering and K's rotation (chosen per layer, fixed or none), V rotated where K's
    rotation is fixed; BF16 and FP8 workspaces. NaN / Inf in the chunk become finite."""
    from vllm_nvfp4kv.cache_space import CacheSpace
    from vllm_nvfp4kv.prefill import _put_chunk
    g = torch.Generator().manual_seed(3)
    t, h, d = 21, 2, 64
    k = (torch.randn(t, h, d, generator=g) * 4 + 40).to(torch.bfloat16).to(device)
    v = torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(device)
    k[2, 0, 1], v[3, 1, 2] = float("nan"), float("inf")
    space = CacheSpace(rotate_k=rotation == "fixed", rotate_v=rotation == "fixed")
    space.set_center((torch.randn(h, d, generator=g) + 40).to(device), torch.bfloat16)
    if rotation.startswith("chosen"):
        space.reserve_rotation_choice(d, device, torch.bfloat16)
        space.choose_rotation(rotation == "chosen-on")
    rows = torch.randperm(30, generator=g)[:t].to(device)
    fp8 = ws_dtype == torch.float8_e4m3fn
    div = torch.tensor(0.25, device=device) if fp8 else None
    outs = []
    for kernel in (True, False):
        ws_k = torch.zeros(30, h, d, dtype=ws_dtype, device=device)
        ws_v = torch.zeros_like(ws_k)
        _put_chunk(k, v, rows, ws_k, ws_v, space, div, div, kernel=kernel)
        outs.append((ws_k.float(), ws_v.float()))
    # up to one last bit (FP8: one E4M3 step) where the rotation's sums differ in order
    tol = dict(rtol=0.13, atol=0.02) if fp8 else dict(rtol=1e-2, atol=0.05)
    for got, want in zip(*outs):
        assert torch.isfinite(got).all() and (got == want).float().mean() > 0.99
        torch.testing.assert_close(got, want, **tol)


def test_rotation_choice_off_skips_the_product():
    """A layer that chose no rotation of K gives queries and keys back as they are (no x @ I
    GEMM per call); before the choice and after choosing it, x @ k_rot (H, or I)."""
    from vllm_nvfp4kv.cache_space import CacheSpace
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 4, 64, generator=g).to(torch.bfloat16)
    space = CacheSpace(rotate_k=True)
    space.reserve_rotation_choice(64, "cpu", torch.bfloat16)
    assert torch.equal(space.query(q), rotate(q))  # undecided: rotated
    space.choose_rotation(True)
    assert torch.equal(space.query(q), rotate(q)) and int(space.k_rot_on) == 1
    space.choose_rotation(False)
    assert space.query(q) is q and space.key(q) is q and int(space.k_rot_on) == 0
    assert torch.equal(q @ space.k_rot, q)  # what a graph captured before the choice computes


def test_ranges_concatenates_row_ranges():
    """The planner's workspace rows (prefill.ranges) against the per-row Python it replaced,
    empty ranges included."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 10_000, (40,), generator=g)
    counts = torch.randint(0, 50, (40,), generator=g)
    counts[::7] = 0
    expect = [s + i for s, n in zip(starts.tolist(), counts.tolist()) for i in range(n)]
    assert ranges(starts, counts).tolist() == expect
    assert ranges(torch.tensor([3]), torch.tensor([0])).numel() == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_global_scales_are_refused(device, bad):
    """A checkpoint k_scale/v_scale that is zero, negative or non-finite would corrupt every
    page silently: the first write refuses it, naming the layer and the way out."""
    impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0, device=device),
                            _v_scale=torch.tensor(bad, device=device), layer_name="model.l3")
    cache = torch.zeros(kv_cache_shape(2, N, H, D), dtype=torch.uint8, device=device)
    kv = torch.randn(3, H, D, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="model.l3 has v_scale"):
        impl.do_kv_cache_update(layer, kv, kv, cache, torch.arange(3, device=device))
    assert not cache.any()


@pytest.mark.parametrize("kw,match", [
    (dict(alibi_slopes=[0.5] * HQ), "ALiBi"),
    (dict(attn_type="encoder_decoder"), "encoder/cross"),
    (dict(kv_sharing_target_layer_name="model.l0"), "KV sharing"),
    (dict(head_size=72), "multiple of 16"),
])
def test_unsupported_layers_are_refused(kw, match):
    args = dict(num_heads=HQ, head_size=D, scale=0.1, num_kv_heads=H, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="nvfp4")
    args.update(kw)
    with pytest.raises((NotImplementedError, ValueError), match=match):
        NvFp4AttentionImpl(**args)


def test_k_outlier_channels_warn_once_per_layer():
    """A K channel pair 500x the median (Qwen2's k_proj bias) is reported at the layer's first
    real batch; dummy batches (all slots padded) are not data; ordinary K is not reported."""
    from vllm_nvfp4kv.scales import k_outlier_ratio
    with mock.patch.dict("os.environ", {"NVFP4KV_CENTER_K": "0"}):  # online centering off
        impl = NvFp4AttentionImpl(HQ, 64, 0.1, H, None, None, "nvfp4")
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    key = torch.randn(8, H, 64)
    key[:, 1, 5] += 500.0                        # one channel of head 1
    padded = torch.full((8,), -1)
    assert k_outlier_ratio(key, padded) is None
    assert k_outlier_ratio(key, torch.arange(8)) > 100
    assert k_outlier_ratio(torch.randn(8, H, 64), torch.arange(8)) < 48
    with mock.patch.object(adaptation.logger, "warning") as warn:
        impl.adaptation.on_first_real_batch(layer, key, key, padded)
        assert not warn.called and not impl.adaptation.saw_real_batch
        impl.adaptation.on_first_real_batch(layer, key, key, torch.arange(8))
        assert warn.call_count == 1 and "outlier" in warn.call_args[0][0]
        assert impl.adaptation.saw_real_batch


@pytest.mark.parametrize("rotate_k,chosen", [("0", None), ("1", None), ("auto", True),
                                             ("auto", False)])
def test_fused_k_write_gives_the_same_cache(device, rotate_k, chosen):
    """NVFP4KV_FUSE_TRANSFORMS: K centering (here online, set in place after a warm-up batch)
    and rotation done by the Triton writer give the bytes the torch transforms + reference
    writer give; with the per-layer choice (auto) also after the layer chose (here set by
    hand) to keep or drop the rotation: the writer reads the choice from a device flag. The
    option applies on a GPU only; on a CPU it is forced on after the first (warm-up) write,
    and the Triton writer runs in the interpreter."""
    k, v, _ = (x.to(device) for x in _outlier_case(seed=3))
    t, nb = k.shape[0], 8
    caches = []
    for fused in (False, True):
        layer = SimpleNamespace(_k_scale=torch.tensor(1.0, device=device),
                                _v_scale=torch.tensor(1.0, device=device),
                                layer_name="l0")
        # on a CPU (Triton's interpreter) the plain block scales: the K transforms are the
        # subject, and the default search encodes each block four times
        rule = {} if device == "cuda" else {"NVFP4KV_BLOCK_SCALES": "amax6"}
        with mock.patch.dict("os.environ", {"NVFP4KV_ROTATE_K": rotate_k,
                                            "NVFP4KV_FUSE_TRANSFORMS": str(int(fused)), **rule}):
            impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
            cache = torch.zeros(kv_cache_shape(nb, N, H, D), dtype=torch.uint8, device=device)
            impl.do_kv_cache_update(layer, torch.zeros_like(k[:4]).bfloat16(),
                                    torch.zeros_like(v[:4]).bfloat16(), cache,
                                    torch.full((4,), -1, device=device))
            assert impl.config.fuse_transforms == fused
            assert device == "cuda" or not impl.adaptation.fused_k  # decided on a GPU only
            assert (impl.space.k_rot_on is not None) == (rotate_k == "auto")
            impl.adaptation.fused_k = fused
            if chosen is not None:  # as decide_with_queries leaves it
                impl.space.choose_rotation(chosen)
            impl.do_kv_cache_update(layer, k.bfloat16(), v.bfloat16(), cache,
                                    torch.arange(t, device=device))
            assert impl.adaptation.online_center and impl.space.k_sub.abs().max() > 100
        caches.append(cache)
    assert torch.equal(caches[0], caches[1])


def test_fused_transforms_are_the_default():
    """On since 2026-12-06 (the real-model test passed with it on an H100); 0 turns it off."""
    with mock.patch.dict("os.environ"):  # restored on exit
        os.environ.pop("NVFP4KV_FUSE_TRANSFORMS", None)
        assert NvFp4KVConfig.from_env().fuse_transforms
    with mock.patch.dict("os.environ", {"NVFP4KV_FUSE_TRANSFORMS": "0"}):
        assert not NvFp4KVConfig.from_env().fuse_transforms


def test_decode_variant_option():
    """NVFP4KV_DECODE_VARIANT picks a launch variant of the decode kernel by name (the
    serving A/B of kernels.decode.DECODE_VARIANTS); unknown names are refused."""
    from vllm_nvfp4kv.kernels.decode import DECODE_VARIANTS
    impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
    assert impl.decode_variant == {}
    with mock.patch.dict("os.environ", {"NVFP4KV_DECODE_VARIANT": "v_rows"}):
        impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
    assert impl.decode_variant == DECODE_VARIANTS["v_rows"]
    assert impl.decode_variant == {"mma_v": False, "bt_ahead": False, "num_stages": 2}
    with mock.patch.dict("os.environ", {"NVFP4KV_DECODE_VARIANT": "fast"}), \
            pytest.raises(ValueError, match="NVFP4KV_DECODE_VARIANT"):
        NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")


def test_block_scales_option():
    """NVFP4KV_BLOCK_SCALES picks the writer's block-scale rule (format.BLOCK_SCALE_RULES,
    default search), and the cache holds what reference.write_cache writes with it; the
    older NVFP4KV_FOUR_OVER_SIX still means 4over6 / amax6, and is refused beside the newer
    name, as are unknown rules."""
    def impl_with(env):
        with mock.patch.dict("os.environ", env):
            return NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, None, "nvfp4")
    assert impl_with({}).block_scales == DEFAULT_BLOCK_SCALES == "search"
    for env, rule in (({"NVFP4KV_BLOCK_SCALES": "4over6"}, "4over6"),
                      ({"NVFP4KV_FOUR_OVER_SIX": "1"}, "4over6"),
                      ({"NVFP4KV_FOUR_OVER_SIX": "0"}, "amax6")):
        assert impl_with(env).block_scales == rule
    for env in ({"NVFP4KV_BLOCK_SCALES": "best"}, {"NVFP4KV_FOUR_OVER_SIX": "2"},
                {"NVFP4KV_FOUR_OVER_SIX": "1", "NVFP4KV_BLOCK_SCALES": "search"}):
        with pytest.raises(ValueError, match="NVFP4KV_"):
            impl_with(env)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(8, H, D, generator=g), torch.randn(8, H, D, generator=g)
    slots = torch.arange(8)
    caches = {}
    for rule in ("amax6", "search"):
        impl = impl_with({"NVFP4KV_BLOCK_SCALES": rule, "NVFP4KV_ROTATE_K": "0",
                          "NVFP4KV_CENTER_K": "0"})
        layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0),
                                layer_name="l0")
        caches[rule] = torch.zeros(kv_cache_shape(1, 16, H, D), dtype=torch.uint8)
        impl.do_kv_cache_update(layer, k.bfloat16(), v.bfloat16(), caches[rule], slots)
        want = torch.zeros_like(caches[rule])
        reference.write_cache(want, k.bfloat16(), v.bfloat16(), slots, 1.0, 1.0, rule)
        assert torch.equal(caches[rule], want)
    assert not torch.equal(caches["amax6"], caches["search"])


def test_rotation_choice_ignores_non_finite_values():
    """A NaN / Inf key or query in the first real batch (a request's bad numbers) does not
    decide K's rotation for the layer: the choice is the one made with those values at 0."""
    from vllm_nvfp4kv.cache_space import rotation_helps
    for helps in (True, False):
        k, _, q = _rotation_case(helps)
        q = q.repeat(4, 1, 1)
        k[5, 0, :3], k[9, 1, 7], q[2, 1, :] = math.nan, math.inf, -math.inf
        clean_k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
        clean_q = torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0)
        want = rotation_helps(clean_q, clean_k, 1.0, DEFAULT_BLOCK_SCALES)
        assert want == helps
        assert rotation_helps(q, k, 1.0, DEFAULT_BLOCK_SCALES) == want
