"""Plugin registration and backend selection, with the real vLLM code of the installed line
(CPU build: 0.26 or 0.32; CI runs both)."""
import importlib
import importlib.metadata
import math
import sys
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode  # noqa: E402

from vllm_nvfp4kv import compat, plugin  # noqa: E402
from vllm_nvfp4kv.backend import NvFp4AttentionBackend  # noqa: E402


def _cuda_platform_module():
    """vllm.platforms.cuda, importable on a CPU machine once its compiled extension (not
    needed by the selection code under test) is stubbed."""
    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    return importlib.import_module("vllm.platforms.cuda")


def test_entry_point_registers_custom_backend():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.value == "vllm_nvfp4kv.plugin:register"]
    assert len(ours) == 1 and ours[0].name == "nvfp4kv"
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is NvFp4AttentionBackend
    assert NvFp4AttentionBackend.get_name() == "CUSTOM"
    plugin.register()  # idempotent
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_PATH


def _selector(dtype="nvfp4", head_size=128, **kw):
    return AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16,
                                   kv_cache_dtype=dtype, block_size=16, **kw)


@pytest.fixture
def cuda_platform(monkeypatch):
    cu = _cuda_platform_module()
    plugin.register()
    plugin._patch_cuda_priorities()

    def with_capability(major, minor=0):
        monkeypatch.setattr(cu.CudaPlatformBase, "get_device_capability",
                            classmethod(lambda cls, device_id=0: DeviceCapability(major, minor)))
        return cu.CudaPlatformBase
    return cu, with_capability


@pytest.mark.parametrize("dtype", list(compat.NVFP4_CACHE_DTYPES))
@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (8, 9), (12, 0)])
def test_auto_selects_custom_for_nvfp4_without_upstream_path(cuda_platform, capability, dtype):
    """Ours wherever upstream has no nvfp4 path or only FlashInfer's software one (SM80-SM90
    from 0.32); SM120 from 0.32 reads FP4 in hardware and stays upstream's."""
    _, with_capability = cuda_platform
    if dtype not in _cache_dtypes():
        pytest.skip(f"vLLM {vllm.__version__} has no kv_cache_dtype {dtype}")
    platform = with_capability(*capability)
    if compat.upstream_serves_nvfp4(DeviceCapability(*capability)):
        assert capability == (12, 0) and compat.has_layout_api()
        assert AttentionBackendEnum.CUSTOM not in \
            _cuda_platform_module()._get_backend_priorities(False, DeviceCapability(12, 0),
                                                            32, dtype)
        return
    assert platform.get_attn_backend_cls(None, _selector(dtype), 32) == plugin.BACKEND_PATH


def _cache_dtypes() -> tuple[str, ...]:
    import typing

    from vllm.config.cache import CacheDType
    return typing.get_args(CacheDType)


def test_other_dtypes_and_sm100_untouched(cuda_platform):
    cu, with_capability = cuda_platform
    for dtype in ("auto", "fp8", "int4_per_token_head"):
        prio = cu._get_backend_priorities(False, DeviceCapability(9, 0), 32, dtype)
        assert AttentionBackendEnum.CUSTOM not in prio
    prio = cu._get_backend_priorities(False, DeviceCapability(10, 0), 32, "nvfp4")
    assert AttentionBackendEnum.CUSTOM not in prio
    # on SM100 the user can still ask for ours explicitly
    platform = with_capability(10, 0)
    assert platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(), 32) \
        == plugin.BACKEND_PATH


def test_refusals_name_the_reason(cuda_platform):
    _, with_capability = cuda_platform
    platform = with_capability(9, 0)
    with pytest.raises(ValueError, match="head_size"):
        platform.get_attn_backend_cls(None, _selector(head_size=72), 32)
    with pytest.raises(ValueError, match="compute capability"):
        with_capability(7, 5).get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(),
                                                   32)


def test_cpu_platform_selects_custom_for_nvfp4_only():
    from vllm.platforms.cpu import CpuPlatform
    plugin.register()
    plugin._patch_cpu_selection()
    assert CpuPlatform.get_attn_backend_cls(None, _selector(), 32) == plugin.BACKEND_PATH
    assert CpuPlatform.get_attn_backend_cls(None, _selector("auto"), 32) \
        == AttentionBackendEnum.CPU_ATTN.get_path()


@pytest.mark.parametrize("head_size,block_size,reason", [
    (128, 8, r"multiple of 16 .*got 8 "),
    (128, 24, r"multiple of 16 .*got 24 "),
    (16, 16, r"head_size to be a multiple of 16 in \[32, 512\], got 16"),
    (528, 16, r"head_size to be a multiple of 16 in \[32, 512\], got 528"),
    (72, 16, r"head_size to be a multiple of 16 in \[32, 512\], got 72"),
    (64, 256, None), (512, 48, None), (32, 16, None), (80, 128, None),
])
def test_cpu_selection_refuses_what_cuda_refuses(cuda_platform, head_size, block_size, reason):
    """vLLM's CPU selection does not run the backend's validate_configuration; the plugin's
    CPU path does, and refuses (CPU_ATTN cannot read nvfp4 pages) with the same reason and
    way out as the automatic selection on CUDA (SM90 here). Block sizes that 16 divides are
    accepted on both (vLLM cuts them into kernel blocks of 16-128 tokens)."""
    from vllm.platforms.cpu import CpuPlatform
    _, with_capability = cuda_platform
    plugin._patch_cpu_selection()
    cfg = AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16,
                                  kv_cache_dtype="nvfp4", block_size=block_size)
    platforms = (CpuPlatform, with_capability(9, 0))
    if reason is None:
        for platform in platforms:
            assert platform.get_attn_backend_cls(None, cfg, 32) == plugin.BACKEND_PATH
        return
    with pytest.raises(ValueError, match=r"vllm-nvfp4kv\) cannot serve this layer on the CPU: .*"
                       + reason + r".*--kv-cache-dtype fp8"):
        CpuPlatform.get_attn_backend_cls(None, cfg, 32)
    with pytest.raises(ValueError, match=reason + r".*--kv-cache-dtype fp8"):
        platforms[1].get_attn_backend_cls(None, cfg, 32)


@pytest.mark.parametrize("capability,served", [((9, 0), True), ((10, 0), True),
                                               ((8, 0), False), ((8, 9), False),
                                               ((12, 0), False)])
def test_sinks_need_flash_attention_with_sinks(cuda_platform, capability, served):
    """gpt-oss's sink logits: prefill attends through vLLM's FlashAttention, and only FA3
    (Hopper) and FA4 (Blackwell) take them. On 8.x and 12.x (FA2) the layer is refused at
    engine start with the reason, where it would crash at the first prefill; the CPU's torch
    references have sinks and serve them."""
    from vllm.platforms.cpu import CpuPlatform
    _, with_capability = cuda_platform
    plugin._patch_cpu_selection()
    reasons = NvFp4AttentionBackend.validate_configuration(
        **_selector(head_size=64, has_sink=True)._asdict(),
        device_capability=DeviceCapability(*capability))
    if served:
        assert reasons == []
    else:
        assert len(reasons) == 1 and "sinks" in reasons[0] and "FlashAttention 2" in reasons[0] \
            and "--kv-cache-dtype fp8" in reasons[0]
    assert NvFp4AttentionBackend.validate_configuration(
        **_selector(head_size=64)._asdict(), device_capability=DeviceCapability(*capability)) \
        == []
    assert CpuPlatform.get_attn_backend_cls(None, _selector(head_size=64, has_sink=True), 32) \
        == plugin.BACKEND_PATH


def _nvfp4_spec(block_size, heads, head_size):
    """vLLM's spec of an nvfp4 layer, as the attention layer builds it (with our packing from
    0.32 on, where the backend publishes it)."""
    spec = FullAttentionSpec(block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode("nvfp4"))
    return NvFp4AttentionBackend.customize_spec(spec) if compat.has_layout_api() else spec


@pytest.mark.parametrize("block_size,heads,head_size",
                         [(16, 8, 128), (16, 1, 256), (64, 3, 64), (32, 2, 96)])
def test_page_size_equals_vllm_spec(block_size, heads, head_size):
    spec = _nvfp4_spec(block_size, heads, head_size)
    shape = NvFp4AttentionBackend.get_kv_cache_shape(7, block_size, heads, head_size, "nvfp4")
    assert math.prod(shape[1:]) == spec.page_size_bytes
    assert shape[0] == 7
    if compat.has_layout_api():  # vLLM's own [B, H, N, C] bytes of the page: the same shape
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
        assert compute_layer_kv_cache_shape_bytes(spec, 7) == shape
    if head_size == 128:
        assert spec.page_size_bytes // (block_size * heads) == 144  # bytes per token per head


@pytest.mark.skipif(compat.has_layout_api(), reason="vLLM 0.26's stride-order interface")
def test_cross_layer_layout_keeps_each_layers_pages_whole():
    """KV offloading allocates all layers in one buffer ordered by
    get_kv_cache_stride_order(include_num_layers_dimension=True) and gives each layer the
    permuted view (kv_connector_model_runner_mixin.allocate_uniform_kv_caches): a layer's page
    must stay one contiguous run of bytes (the kernels take only a page stride), and one block
    of every layer must be one contiguous run (what the offloader copies per block)."""
    layers, nb, n, h, d = 3, 5, 16, 2, 64
    shape = (layers, *NvFp4AttentionBackend.get_kv_cache_shape(nb, n, h, d, "nvfp4"))
    order = NvFp4AttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    buf = torch.arange(math.prod(shape)).view(tuple(shape[i] for i in order))
    per_layer = buf.permute(*[order.index(i) for i in range(len(order))])
    page = math.prod(shape[2:])
    assert buf.shape[0] == nb and buf[2].is_contiguous()  # a block: every layer's page
    for layer in range(layers):
        view = per_layer[layer]
        assert view.shape == shape[1:] and view.stride(0) == layers * page
        assert all(view[b].is_contiguous() for b in range(nb))
        assert int(view[4, 0, 0, 0]) == (4 * layers + layer) * page


@pytest.mark.skipif(not compat.has_layout_api(), reason="the KVCacheLayout interface (>= 0.32)")
def test_every_declared_layout_keeps_each_layers_pages_whole():
    """From 0.32 vLLM resolves one layout for the model from the backends' declarations and
    views one flat buffer per layer through it (create_kv_cache_views). For each layout we
    declare, and for the layouts we leave out, whether a layer's page is one contiguous run of
    bytes at the block stride the kernels take (view.stride(0))."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layers, nb, n, h, d = 3, 5, 16, 2, 64
    spec = _nvfp4_spec(n, h, d)
    page = spec.page_size_bytes
    declared = NvFp4AttentionBackend.supported_kv_cache_layouts()
    assert declared[0] == KVCacheLayout.LBHNC
    for layout in KVCacheLayout:
        layer_major = layout.is_layer_compact
        tensor = KVCacheTensor(size=layers * nb * page, layers=[f"l{i}" for i in range(layers)],
                               layer_stride=nb * page if layer_major else page,
                               block_stride=page if layer_major else layers * page)
        raw = torch.zeros(layers * nb * page, dtype=torch.int8)
        try:
            views = create_kv_cache_views(raw, spec, nb, layout, tensor)
        except (AssertionError, RuntimeError, ValueError):
            assert layout not in declared
            continue
        whole = all(v[b].is_contiguous() and v.stride(0) == tensor.block_stride
                    for v in views for b in range(nb))
        assert whole == (layout in declared), layout
        if whole:  # block 4 of layer i where the tensor says it is
            for i, v in enumerate(views):
                assert v[4].data_ptr() - raw.data_ptr() == \
                    i * tensor.layer_stride + 4 * tensor.block_stride
