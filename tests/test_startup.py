"""adapt_at_startup (vllm_nvfp4kv/startup.py): the first-batch choices come from the engine's
own start-up request, so two engines that serve different first requests cache the same
tokens the same way; with it off they follow the first request (the traffic)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import CPU_BLOCK_SIZE
from vllm_nvfp4kv import startup
from vllm_nvfp4kv.config import NvFp4KVConfig

MODEL = str(Path(__file__).resolve().parents[1] / "evals" / "models" / "tiny-llama")


class _VllmConfig(SimpleNamespace):
    pass  # weak-referenceable, as config.for_engine keeps its engines


def _core_config(dtype="nvfp4", runner="generate", dp=1, max_model_len=100, **options):
    mc = SimpleNamespace(runner_type=runner, skip_tokenizer_init=True,
                         get_vocab_size=lambda: 500, max_model_len=max_model_len)
    return _VllmConfig(cache_config=SimpleNamespace(cache_dtype=dtype), model_config=mc,
                       parallel_config=SimpleNamespace(data_parallel_size=dp),
                       additional_config={"nvfp4kv": options})


@pytest.mark.parametrize("kw, cfg, reason", [
    ({}, {}, None),
    ({"dtype": "fp8"}, {}, None),  # run() leaves other dtypes alone before asking
    ({}, {"adapt_at_startup": False}, "adapt_at_startup is off"),
    ({}, {"calibrate": "collect"}, "calibrate=collect"),
    ({"runner": "pooling"}, {}, "pooling"),
    ({"dp": 2}, {}, "data parallel"),
])
def test_when_the_startup_request_runs(kw, cfg, reason):
    got = startup.skip_reason(_core_config(**kw), NvFp4KVConfig(**cfg))
    assert got == reason if reason is None else reason in got


def test_token_ids_without_a_tokenizer_are_fixed():
    mc = SimpleNamespace(skip_tokenizer_init=True, get_vocab_size=lambda: 1000)
    a, b = startup.token_ids(mc, 100), startup.token_ids(mc, 100)
    assert a == b and len(a) == 100 and all(0 <= t < 1000 for t in a)
    assert len(set(a)) > 50  # not one repeated token


class _FakeCore:
    """What run() uses of vLLM's EngineCore: a request finishes after `steps` steps."""

    def __init__(self, steps, config):
        self.vllm_config, self.steps, self.calls = config, steps, []
        self.scheduler = SimpleNamespace(has_requests=lambda: self.steps > 0)

    def add_request(self, request):
        self.calls.append(("add", request.request_id, list(request.prompt_token_ids)))

    def step_fn(self):
        self.steps -= 1
        self.calls.append(("step",))
        return {}, True

    def post_step(self, executed):
        self.calls.append(("post_step", executed))

    def abort_requests(self, ids):
        self.calls.append(("abort", ids))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def test_run_steps_the_request_to_the_end_and_leaves_no_prefix():
    pytest.importorskip("vllm")
    core = _FakeCore(3, _core_config())
    startup.run(core)
    add, *rest = core.calls
    assert add[:2] == ("add", startup.REQUEST_ID) and len(add[2]) == 99  # max_model_len - 1
    assert rest == [("step",), ("post_step", True)] * 3 + [("reset_prefix_cache",)]
    for cfg in (_core_config("fp8"), _core_config(adapt_at_startup=False)):
        idle = _FakeCore(3, cfg)
        startup.run(idle)
        assert idle.calls == []


def test_run_refuses_a_request_that_never_finishes():
    pytest.importorskip("vllm")
    core = _FakeCore(10 ** 9, _core_config())
    with pytest.raises(RuntimeError, match="did not finish"):
        startup.run(core)
    assert core.calls[-1] == ("abort", [startup.REQUEST_ID])


def test_a_failing_startup_request_does_not_stop_the_engine(monkeypatch):
    """The EngineCore wrapper logs the start-up request's failure and lets the engine start."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.core import EngineCore

    class Core(EngineCore):
        def __init__(self):  # what the wrapper calls first, without building an engine
            self.aborted = []

        def abort_requests(self, ids):
            self.aborted.append(ids)

    monkeypatch.setattr(EngineCore, "__init__", Core.__init__)
    startup.patch_engine_core()  # wraps the stand-in constructor
    monkeypatch.setattr(startup, "run", lambda core: 1 / 0)
    warned = []
    monkeypatch.setattr(startup.logger, "warning", lambda msg, *a: warned.append(msg % a))
    core = Core.__new__(Core)
    EngineCore.__init__(core)
    assert core.aborted == [[startup.REQUEST_ID]]
    assert len(warned) == 1 and "start-up request failed (ZeroDivisionError" in warned[0]


# ---------------------------------------------------------------- through the CPU engine
def _first_batch_state(first_prompt, adapt_at_startup: bool) -> dict:
    """K centering offsets and global scales of every layer after an engine served
    first_prompt, then a probe (center_k 1: every layer centered from its first real batch;
    calibrate online: scales from it too). Runs in this process (see _state_in_subprocess)."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
              kv_cache_memory_bytes=16 << 20, kv_cache_dtype="nvfp4", seed=0,
              block_size=CPU_BLOCK_SIZE,
              additional_config={"nvfp4kv": {"center_k": "1", "calibrate": "online",
                                             "adapt_at_startup": adapt_at_startup}})
    sp = SamplingParams(max_tokens=4, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": first_prompt}], sp, use_tqdm=False)
    probe = llm.generate([{"prompt_token_ids": list(range(10, 90))}], sp, use_tqdm=False)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layers = [m for m in runner.model.modules() if hasattr(m, "impl")]
    return dict(k_sub=[m.impl.space.k_sub.float().flatten().tolist() for m in layers],
                scales=[[m._k_scale.item(), m._v_scale.item()] for m in layers],
                probe=list(probe[0].outputs[0].token_ids))


def _state_in_subprocess(first_prompt, adapt_at_startup: bool) -> dict:
    """_first_batch_state in a fresh process: vLLM 0.32's CPU worker scans every loaded
    module at start and fails on some that other tests import (llvmlite's
    '_lib_fn_wrapper' object has no attribute 'get')."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                      os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, __file__, json.dumps([first_prompt, adapt_at_startup])],
                         capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("STATE ")), None)
    assert line is not None, run.stderr[-3000:]
    return json.loads(line[len("STATE "):])


@pytest.mark.vllm
def test_first_batch_choices_do_not_depend_on_the_first_request():
    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(3, 900, (n,), generator=g).tolist() for n in (40, 120))
    fixed = [_state_in_subprocess(p, True) for p in (a, b)]
    follows = [_state_in_subprocess(p, False) for p in (a, b)]
    for s in fixed + follows:
        assert all(any(x != 0 for x in k) for k in s["k_sub"])  # centered: offsets were set
    # start-up request: the same offsets, scales and outputs whatever came first
    assert fixed[0] == fixed[1]
    # without it they follow the first request (so the test above can tell)
    assert follows[0]["k_sub"] != follows[1]["k_sub"]


if __name__ == "__main__":  # one engine's state (_state_in_subprocess)
    prompt, adapt = json.loads(sys.argv[1])
    print("STATE " + json.dumps(_first_batch_state(prompt, adapt)))
