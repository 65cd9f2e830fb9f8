"""``vllm.general_plugins`` entry point: makes ``--kv-cache-dtype nvfp4`` work where vLLM 0.26
has no NVFP4 attention path.

``register()`` runs in every vLLM process (API server, engine core, workers). It is
idempotent, cheap, and initialises no CUDA. It registers the backend as
``AttentionBackendEnum.CUSTOM`` and patches one function per platform so that automatic
selection picks it for nvfp4 layers:

* CUDA: ``vllm.platforms.cuda._get_backend_priorities`` puts CUSTOM first for nvfp4 on every
  GPU except the SM100 family, where upstream's FlashInfer path stays in charge (ask for ours
  there with ``--attention-backend CUSTOM``). Other dtypes: untouched.
* CPU: ``CpuPlatform.get_attn_backend_cls`` returns CUSTOM for nvfp4 layers (the backend then
  runs the torch references), so vLLM's CPU engine can serve and test the format. It refuses
  what the backend's ``validate_configuration`` refuses on CUDA (vLLM's CPU selection does not
  run it), since vLLM's CPU_ATTN cannot read nvfp4 pages.
"""
from __future__ import annotations

import functools

BACKEND_PATH = "vllm_nvfp4kv.backend.NvFp4AttentionBackend"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if current_platform.is_cuda():
        _patch_cuda_priorities()
    elif current_platform.is_cpu():
        _patch_cpu_selection()
    _registered = True


def upstream_serves_nvfp4(device_capability) -> bool:
    """vLLM 0.26 serves nvfp4 KV only on the SM100 family (FlashInfer trtllm-gen)."""
    return device_capability is not None and device_capability.major == 10


def _patch_cuda_priorities() -> None:
    import vllm.platforms.cuda as cuda
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = cuda._get_backend_priorities
    if getattr(original, "_nvfp4kv", False):
        return

    @functools.cache
    def priorities(use_mla, device_capability, num_heads=None, kv_cache_dtype=None,
                   use_non_causal=False):
        backends = original(use_mla, device_capability, num_heads, kv_cache_dtype,
                            use_non_causal)
        if (kv_cache_dtype == "nvfp4" and not use_mla
                and not upstream_serves_nvfp4(device_capability)
                and AttentionBackendEnum.CUSTOM.is_overridden()):
            return [AttentionBackendEnum.CUSTOM, *backends]
        return backends

    priorities._nvfp4kv = True
    cuda._get_backend_priorities = priorities


def _patch_cpu_selection() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(original, "_nvfp4kv", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.kv_cache_dtype == "nvfp4" and not attn_selector_config.use_mla:
            reasons = cpu_refusals(attn_selector_config)
            if reasons:  # CPU_ATTN cannot read nvfp4 pages: no fallback, refuse
                raise ValueError("NVFP4 KV cache (vllm-nvfp4kv) cannot serve this layer on "
                                 "the CPU: " + "; ".join(reasons))
            return AttentionBackendEnum.CUSTOM.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._nvfp4kv = True
    get_attn_backend_cls._original = original  # vLLM's own CPU selection (tests)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def cpu_refusals(attn_selector_config) -> list[str]:
    """The backend's validate_configuration, as vLLM runs it on CUDA (head size, block size,
    dtype, attention type, ...), each reason with its way out. The CPU has no compute
    capability: the backend's minimum (8.0) is passed so that check is the only one left out."""
    from vllm.platforms.interface import DeviceCapability

    from vllm_nvfp4kv.backend import NvFp4AttentionBackend

    return NvFp4AttentionBackend.validate_configuration(
        device_capability=DeviceCapability(8, 0), **attn_selector_config._asdict())

