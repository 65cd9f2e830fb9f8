"""The kernel warm-up at engine start (vllm_nvfp4kv/warmup.py): every build of a Triton kernel
that a layer's steps launch, over a spread of batch shapes and options, is one the warm-up
launched first, so none compiles while the engine serves.

A build is what Triton keys its compilations by: the kernel, its constexprs, the
specialisation of its int arguments (value 1, multiple of 16) and of its pointers' alignment,
and the compile options. The launches are recorded here, not run: each kernel's launcher
(kernels/*.py, through ops with its Triton path taken on this CPU) computes its arguments,
and Triton's own argument binder for a CUDA target gives the key."""
import importlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

from vllm_nvfp4kv import adaptation, kernels, ops, startup, warmup  # noqa: E402
from vllm_nvfp4kv.kernels import cache_write, decode, gather, global_scale  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "evals" / "models" / "tiny-llama")
HQ, H, D, N = 4, 2, 128, 16
# every kernel the launchers start (checked against the modules' *_kernel objects)
KERNELS = (decode._decode_kernel, decode._reduce_kernel, cache_write._write_kernel,
           gather._gather_kernel, gather._put_rows_kernel, global_scale._calibrate_kernel)
# vLLM's steps in its order (decodes first): (cached tokens, new tokens) per request
DECODES = [[(5 + 7 * i % 40, 1) for i in range(b)]
           for b in (1, 2, 3, 4, 7, 16, 33, 100, 333, 600)]
PREFILLS = [[(0, 9)], [(0, 2100)], [(17, 5)], [(20, 1), (35, 1), (40, 7), (0, 9)],
            [(12, 1)] * 64 + [(10, 30)], [(2400, 8)], [(3, 1), (2400, 8), (0, 2)]]


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():  # as vLLM runs the model
        yield


@pytest.fixture(autouse=True)
def _fresh_outlier_models():
    adaptation._K_OUTLIER_MODELS.clear()
    yield
    adaptation._K_OUTLIER_MODELS.clear()


def _binder(kernel):
    """Triton's argument binder of kernel for sm_90: (args, kwargs) -> (bound arguments,
    specialisation, options), as JITFunction.run computes them."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(jit.signature, jit.params,
                                          CUDABackend(GPUTarget("cuda", 90, 32)))


@pytest.fixture
def builds(monkeypatch) -> list:
    """The build key of every kernel launch from now on (launches recorded, not run)."""
    seen = []
    for kernel in KERNELS:
        binder = _binder(kernel)

        def run(*args, _name=kernel.fn.__name__, _bind=binder, **kwargs):
            del kwargs["grid"], kwargs["warmup"]  # JITFunction.run's own
            _, spec, options = _bind(*args, **kwargs)
            seen.append((_name, tuple(spec), tuple(sorted(options.items()))))
        monkeypatch.setattr(kernel, "run", run)
    return seen


@pytest.fixture
def triton_path(monkeypatch):
    """The ops take their Triton path (the launchers) on this CPU."""
    monkeypatch.setattr(ops, "on_triton", lambda device: True)


def test_the_recorded_kernels_are_all_there_are():
    found = {getattr(m, n) for m in (decode, cache_write, gather, global_scale)
             for n in dir(m) if n.endswith("_kernel")}
    assert found == set(KERNELS)


def _engine(options: dict, max_num_seqs: int = 1024):
    from vllm.config import ModelConfig, VllmConfig
    cfg = VllmConfig(model_config=ModelConfig(model=TINY, skip_tokenizer_init=True,
                                              max_model_len=2048),
                     additional_config={"nvfp4kv": options})
    cfg.model_config.max_model_len = 32768
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    cfg.scheduler_config.max_num_batched_tokens = 2304
    return cfg


def _layer(cfg, name: str, window=None, softcap=None, sinks=False):
    """The metadata builder and a layer (impl, scales, cache) of cfg's engine, registered in
    its forward context as vLLM does."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, SlidingWindowSpec,
                                            get_kv_quant_mode)

    from vllm_nvfp4kv.backend import NvFp4AttentionImpl, NvFp4MetadataBuilder
    kw = dict(num_kv_heads=H, head_size=D, dtype=torch.uint8,
              kv_quant_mode=get_kv_quant_mode("nvfp4"))
    spec = (SlidingWindowSpec(N, sliding_window=window, **kw) if window
            else FullAttentionSpec(N, **kw))
    builder = NvFp4MetadataBuilder(spec, [name], cfg, torch.device("cpu"))
    with set_current_vllm_config(cfg):
        impl = NvFp4AttentionImpl(HQ, D, D ** -0.5, H, None, window, "nvfp4", softcap,
                                  sinks=torch.randn(HQ) if sinks else None)
    impl.process_weights_after_loading(torch.bfloat16)
    layer = SimpleNamespace(impl=impl, layer_name=name, _k_scale=torch.tensor(1.0),
                            _v_scale=torch.tensor(1.0),
                            kv_cache=torch.zeros(kernels.kv_cache_shape(8, N, H, D),
                                                 dtype=torch.uint8))
    cfg.compilation_config.static_forward_context[name] = layer
    return builder, layer


def _serve(builder, layer, reqs) -> None:
    """One step of requests reqs [(cached, new)] through the builder, the KV write and the
    forward, as vLLM's model runner drives them (pages: the cache's first few, shared)."""
    new = [n for _, n in reqs]
    ends = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    t = int(ends[-1])
    pages = -(-int(seq_lens.max()) // N)
    bt = (torch.arange(pages, dtype=torch.int32) % 8).repeat(len(reqs), 1)
    cam = SimpleNamespace(
        max_query_len=max(new), num_reqs=len(reqs), num_actual_tokens=t,
        query_start_loc=ends, query_start_loc_cpu=ends, seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens, max_seq_len=int(seq_lens.max()),
        block_table_tensor=bt, causal=True)
    pos = torch.cat([torch.arange(c, c + n) for c, n in reqs])
    row = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(new))
    slots = bt[row, pos // N].long() * N + pos % N
    md = builder.build(0, cam)
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(t, heads * D, generator=g).bfloat16() for heads in (HQ, H, H))
    impl = layer.impl
    impl.do_kv_cache_update(layer, k.view(t, H, D), v.view(t, H, D), layer.kv_cache, slots)
    impl.forward(layer, q, k, v, layer.kv_cache, md, torch.empty_like(q))


CONFIGS = {
    # K centering and the per-layer rotation of K (fused into the writer, put_rows' flag),
    # and the first real batch (the start-up request's) written again without them
    "defaults": (dict(), {}),
    "first-batch-from-traffic": (dict(adapt_at_startup=False), {}),
    "sinks-window-softcap-amax6-fp8": (dict(block_scales="amax6", workspace_dtype="fp8"),
                                       dict(window=1000, softcap=30.0, sinks=True)),
    "from-cache-rotate-v-online": (dict(prefill_from_cache=True, rotate_v=True,
                                        calibrate="online"), {}),
    "no-transforms-4over6": (dict(rotate_k="0", center_k="0", block_scales="4over6"), {}),
}


@pytest.mark.parametrize("gpu", ["hopper-132", "ampere-108"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_serving_launches_only_builds_the_warmup_launched(name, gpu, builds, triton_path,
                                                          monkeypatch):
    """The engine's start-up request where it runs (its text is every layer's first real
    batch), then steps of 1 to 600 decodes, prefills with and without a cached prefix, one
    longer than the workspace (pieces), mixed steps: each kernel build they launch was
    launched by the engine's warm-up, for a Hopper (K and V^T in the wgmma layouts, one-wave
    split counts up to 128 at small grids) and an Ampere GPU (tiles by split count), per set
    of options. The first real batch drops K's rotation (and is written again)."""
    hopper, sms = gpu.split("-")
    monkeypatch.setattr(decode, "_num_sms", lambda device: int(sms))
    monkeypatch.setattr(decode, "has_wgmma", lambda device: hopper == "hopper")
    monkeypatch.setattr(adaptation, "rotation_helps", lambda *args: False)
    options, layer_kw = CONFIGS[name]
    cfg = _engine({"workspace_prefix_tokens": 32, **options})
    builder, layer = _layer(cfg, "model.layers.0.self_attn.attn", **layer_kw)
    warmup.run(cfg)
    warmed = set(builds)
    builds.clear()
    first = [[(0, startup.MAX_TOKENS)]] if options.get("adapt_at_startup", True) else []
    for reqs in first + PREFILLS[1:2] + DECODES + PREFILLS:
        _serve(builder, layer, reqs)
    served = set(builds)
    assert layer.impl.adaptation.phase is adaptation.Phase.SETTLED
    kernels_served = {b[0] for b in served}
    assert {"_write_kernel", "_decode_kernel", "_reduce_kernel", "_gather_kernel"} \
        <= kernels_served
    assert ("_put_rows_kernel" in kernels_served) == (not options.get("prefill_from_cache"))
    missing = served - warmed
    assert not missing, "\n".join(map(str, sorted(missing)))


def test_splits_and_write_sizes_cover_every_build():
    """launch_splits keeps one split count per decode build (split or not, tile, reduction)
    and write_sizes one write size per tokens-per-program of the writer."""
    cpu = torch.device("cpu")
    with mock.patch.object(decode, "has_wgmma", lambda device: False):
        assert decode.launch_splits(range(1, 129), cpu, 128) == [1, 2, 16, 65]
        assert decode.launch_splits(range(1, 129), cpu, 512) == [1, 2, 65]
    assert decode.launch_splits([1, 3, 5], cpu, 128) == [1, 3]  # Hopper's one tile at D = 128
    assert cache_write.write_sizes(8192, 8) == [1, 513]
    assert {cache_write.tokens_per_program_for(t, 8, "search") for t in (1, 513)} == {1, 2}
    assert cache_write.write_sizes(100, 8) == [1, 100]  # no step writes more


def test_warmup_is_a_noop_on_the_cpu_engine(builds):
    """On vLLM's CPU engine the backend runs the torch references: no launch, and the layers
    are left for their first write."""
    cfg = _engine({})
    builder, layer = _layer(cfg, "l0")
    warmup.run(cfg)
    assert builder in warmup._builders and builds == []
    assert layer.impl.adaptation.phase is adaptation.Phase.CONFIGURED


def test_warmup_can_be_switched_off(builds, triton_path):
    cfg = _engine({"compile_at_startup": False})
    builder, layer = _layer(cfg, "l0")
    with mock.patch.object(warmup.logger, "info") as info:
        warmup.run(cfg)
    assert builder in warmup._builders and builds == []
    assert layer.impl.adaptation.phase is adaptation.Phase.CONFIGURED
    assert "compile_at_startup is off" in info.call_args.args[0]


def test_warmup_runs_at_the_end_of_vllms_kernel_warmup(monkeypatch):
    """A metadata builder created in a GPU worker wraps the worker module's kernel_warmup
    (once): vLLM's warm-up first, then the backend's, for the worker's engine."""
    calls = []
    worker_module = SimpleNamespace(kernel_warmup=lambda worker, **kw: calls.append(("vllm", kw)))
    monkeypatch.setitem(sys.modules, warmup.WORKER_MODULE, worker_module)
    monkeypatch.setattr(warmup, "run", lambda vllm_config: calls.append(("ours", vllm_config)))
    cfg = _engine({})
    _layer(cfg, "l0")
    _layer(cfg, "l1")
    worker_module.kernel_warmup(SimpleNamespace(vllm_config=cfg), process_local_only=True)
    assert calls == [("vllm", {"process_local_only": True}), ("ours", cfg)]


def test_vllms_worker_warms_kernels_up_before_capture():
    """The patch point: vLLM's GPU worker calls its module's kernel_warmup in
    compile_or_warm_up_model before it captures CUDA graphs (and before the JIT monitor
    starts, at its end)."""
    module = importlib.import_module(warmup.WORKER_MODULE)
    assert callable(module.kernel_warmup)
    src = inspect.getsource(module.Worker.compile_or_warm_up_model)
    assert 0 <= src.index("kernel_warmup(self") < src.index("capture_model()")
