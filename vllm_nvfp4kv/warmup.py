"""Every build of the NVFP4 cache's Triton kernels that the engine can launch, compiled while
the engine starts (option ``compile_at_startup``), so no request waits on a compilation and
vLLM's JIT monitor ("Triton kernel JIT compilation during inference") stays silent.

Triton compiles a kernel once per distinct tuple of its constexprs, of the specialisation of
its int arguments (value 1, multiple of 16) and of its pointers' 16-byte alignment. The kernels
specialise on nothing that varies with the traffic but the few per-step choices below, and
mark the int arguments that do vary ``do_not_specialize`` (token counts, the split count, the
block table's row stride). What remains per layer: its shapes and options (head size, heads,
page size, window, soft-cap, sinks, block-scale rule, cache space, workspace dtype, decode
variant), and per step the writer's tokens per program (``cache_write.write_sizes``) and the
decode's split count through whether it splits, its tile and its reduction
(``decode.launch_splits``). evals/RESULTS.md, "No compilation after startup", has the table.

``run`` is called at the end of vLLM's kernel warm-up (``kernel_warmup`` in
``Worker.compile_or_warm_up_model``, wrapped by ``register``): on every worker, after the KV
cache is allocated and bound, before CUDA graphs are captured and the JIT monitor is switched
on, and before the engine's start-up request (``startup.py``). For each layer this backend
serves, ``NvFp4AttentionImpl.warm_up`` writes padded tokens (which write nothing) and runs the
forward of a few tiny steps of its metadata builder (``warmup_batches``), through the code
that serves requests. Where Triton's on-disk cache holds the builds this costs a few
launches per layer. A no-op on vLLM's CPU engine (the torch references) and with
``compile_at_startup=false``.
"""
from __future__ import annotations

import functools
import logging
import sys
import time
import weakref

import torch

from vllm_nvfp4kv import config, ops, startup
from vllm_nvfp4kv.kernels.cache_write import write_sizes

logger = logging.getLogger("vllm.nvfp4kv")
WORKER_MODULE = "vllm.v1.worker.gpu_worker"  # whose kernel_warmup is wrapped
_builders: weakref.WeakSet = weakref.WeakSet()  # NvFp4MetadataBuilders of this process


def register(builder) -> None:
    """An NvFp4MetadataBuilder, created in a worker before vLLM's warm-up: warmed up by
    ``run``, which wraps the worker module's kernel_warmup (if it is loaded: a GPU worker)."""
    _builders.add(builder)
    module = sys.modules.get(WORKER_MODULE)
    original = getattr(module, "kernel_warmup", None)
    if original is None or getattr(original, "_nvfp4kv", False):
        return

    @functools.wraps(original)
    def kernel_warmup(worker, *args, **kwargs):
        original(worker, *args, **kwargs)
        run(worker.vllm_config)

    kernel_warmup._nvfp4kv = True
    module.kernel_warmup = kernel_warmup


def run(vllm_config) -> None:
    """Compile (or load from Triton's cache) every kernel build of the engine's NVFP4 layers
    on this worker, launching each on dummy inputs (module docstring). A failure is logged,
    not raised: the builds then compile at their first use."""
    builders = [b for b in list(_builders) if b.vllm_config is vllm_config]
    if not builders or not ops.on_triton(device := builders[0].device):
        return
    cfg = config.for_engine(vllm_config)
    if not cfg.compile_at_startup:
        logger.info("NVFP4 KV cache: kernels compile at their first use (compile_at_startup "
                    "is off)")
        return
    start = time.perf_counter()
    layers = vllm_config.compilation_config.static_forward_context
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    # a layer choosing K's rotation writes its first real batch again: the start-up
    # request's text where that runs (startup.py), else any step
    first = (min(tokens, startup.MAX_TOKENS) if startup.skip_reason(vllm_config, cfg) is None
             else tokens)
    done: set[str] = set()
    try:
        with torch.inference_mode():
            for b in builders:
                steps = b.warmup_batches()
                sizes = write_sizes(tokens, b.num_kv_heads)
                rewrites = write_sizes(first, b.num_kv_heads)
                for name in b.layer_names:
                    if name in done:  # one builder per micro-batch (DBO) has the same layers
                        continue
                    layer = layers[name]
                    layer.impl.warm_up(layer, layer.kv_cache, steps, sizes, rewrites,
                                       vllm_config.model_config.dtype)
                    done.add(name)
        if device.type == "cuda":  # errors of the launches surface here, not at capture
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - never keep an engine from starting
        logger.warning("NVFP4 KV cache: the kernel warm-up failed (%s: %s); kernels compile at "
                       "their first use", type(e).__name__, e)
        return
    logger.info("NVFP4 KV cache: kernel builds of %d layers compiled or loaded in %.1f s "
                "(compile_at_startup)", len(done), time.perf_counter() - start)
