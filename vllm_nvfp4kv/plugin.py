"""``vllm.general_plugins`` entry point: makes ``--kv-cache-dtype nvfp4`` work where vLLM has
no NVFP4 attention path of its own (or a slower one).

``register()`` runs in every vLLM process (API server, engine core, workers). It is
idempotent, cheap, and initialises no CUDA. On a vLLM line it does not support
(``compat.SUPPORTED_LINES``) it logs one line and changes nothing. Otherwise it registers
the backend as ``AttentionBackendEnum.CUSTOM`` and wraps one function per platform so that
automatic selection picks it for nvfp4 layers, and the engine core's constructor. Each
wrapper passes every argument through and changes only what nvfp4 engines do:

* CUDA: ``vllm.platforms.cuda._get_backend_priorities`` puts CUSTOM first for non-MLA nvfp4
  layers on GPUs where upstream has no path of its own or only FlashInfer's software one
  (``compat.upstream_serves_nvfp4``). Elsewhere upstream stays in charge; ask for ours with
  ``--attention-backend CUSTOM`` (or for upstream's with ``--attention-backend FLASHINFER``).
* Both: ``EngineCore.__init__`` ends with the NVFP4 cache's start-up request
  (``startup.py``: the first-batch choices made from a fixed text), for nvfp4 engines only.
* GPU workers: ``vllm.v1.worker.gpu_worker.kernel_warmup`` ends with the compilation of every
  kernel build the layers can launch (``warmup.py``), wrapped there by the backend's first
  metadata builder (the worker module is loaded by then; this function does not import it).
* CPU: ``CpuPlatform.get_attn_backend_cls`` returns CUSTOM for nvfp4 layers (the backend then
  runs the torch references), so vLLM's CPU engine can serve and test the format. It refuses
  what the backend's ``validate_configuration`` refuses on CUDA (vLLM's CPU selection does not
  run it), since vLLM's CPU_ATTN cannot read nvfp4 pages.
"""
from __future__ import annotations

import functools
import logging

from vllm_nvfp4kv import __version__, compat, startup

BACKEND_PATH = "vllm_nvfp4kv.backend.NvFp4AttentionBackend"
_registered = False
_refused = False


def register() -> None:
    global _registered, _refused
    if _registered or _refused:
        return
    if not compat.supported():
        _refused = True
        version = ".".join(map(str, compat.vllm_version() or ())) or "of unknown version"
        logging.getLogger("vllm.nvfp4kv").warning(
            "vllm-nvfp4kv %s supports vLLM %s; this vLLM is %s, so the plugin stays inactive "
            "(--kv-cache-dtype nvfp4 is left to vLLM itself)", __version__,
            compat.supported_text(), version)
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if current_platform.is_cuda():
        _patch_cuda_priorities()
    elif current_platform.is_cpu():
        _patch_cpu_selection()
    startup.patch_engine_core()
    _registered = True


def _is_ours(kv_cache_dtype, use_mla) -> bool:
    return kv_cache_dtype in compat.NVFP4_CACHE_DTYPES and not use_mla


def _patch_cuda_priorities() -> None:
    import vllm.platforms.cuda as cuda
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = cuda._get_backend_priorities
    if getattr(original, "_nvfp4kv", False):
        return

    @functools.wraps(original)
    def priorities(*args, **kwargs):
        backends = original(*args, **kwargs)
        a = compat.bind_arguments(original, args, kwargs)
        if (_is_ours(a.get("kv_cache_dtype"), a.get("use_mla"))
                and not compat.upstream_serves_nvfp4(a.get("device_capability"))
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

    @functools.wraps(original)
    def get_attn_backend_cls(cls, *args, **kwargs):
        config = compat.bind_arguments(original, (cls, *args), kwargs)["attn_selector_config"]
        if _is_ours(config.kv_cache_dtype, config.use_mla):
            reasons = cpu_refusals(config)
            if reasons:  # CPU_ATTN cannot read nvfp4 pages: no fallback, refuse
                raise ValueError("NVFP4 KV cache (vllm-nvfp4kv) cannot serve this layer on "
                                 "the CPU: " + "; ".join(reasons))
            return AttentionBackendEnum.CUSTOM.get_path()
        return original(cls, *args, **kwargs)

    get_attn_backend_cls._nvfp4kv = True
    get_attn_backend_cls._original = original  # vLLM's own CPU selection (tests)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def cpu_refusals(attn_selector_config) -> list[str]:
    """The backend's validate_configuration, as vLLM runs it on CUDA (head size, block size,
    dtype, attention type, ...), each reason with its way out. The CPU has no compute
    capability, and its torch references do all that FlashAttention 3 does (sinks): Hopper's
    9.0 is passed, so the capability checks are the only ones left out."""
    from vllm.platforms.interface import DeviceCapability

    from vllm_nvfp4kv.backend import NvFp4AttentionBackend

    return NvFp4AttentionBackend.validate_configuration(
        device_capability=DeviceCapability(9, 0), **attn_selector_config._asdict())
