"""Multi-process vLLM on the CPU engine with the NVFP4 cache: tensor parallel 2 (the tiny
Llama's 2 KV heads split, one per rank) and pipeline parallel 2 (one layer per rank) start,
give TP=1's greedy tokens, and size each rank's cache as the format says.

The weights are a seeded random checkpoint (helpers.write_sharp_tiny_llama): dummy weights are
drawn per rank shard, so TP=2 would not be the same model as TP=1, and they leave every
greedy pick at a near-tie."""
import json
import os

import pytest
import torch

from helpers import CPU_BLOCK_SIZE, write_sharp_tiny_llama

vllm = pytest.importorskip("vllm")
from vllm_nvfp4kv import compat  # noqa: E402
pytestmark = pytest.mark.vllm

KV_BYTES = 32 << 20
# nats between TP=1's top two choices below which a flip is a near-tie: with BF16 caches too,
# TP=2 flips this model's first token of the third prompt (top two 0.41 nats apart) on 0.26
# and 0.32 alike, from the ranks' bf16 partial sums
MARGIN = 1.0
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-tiny-llama"))


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(3, 900, (n,), generator=g).tolist()}
            for n in (7, 90, 40)]


def _run(model, tp=1, pp=1):
    """Greedy tokens and the cache blocks vLLM gave each rank, in a fresh process per engine
    (workers are spawned processes; the engine runs in its own too)."""
    import subprocess
    import sys
    code = f"""
import json
from vllm import LLM, SamplingParams
llm = LLM(model={str(model)!r}, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
          max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
          kv_cache_memory_bytes={KV_BYTES}, kv_cache_dtype="nvfp4", seed=0,
          block_size={CPU_BLOCK_SIZE}, tensor_parallel_size={tp}, pipeline_parallel_size={pp},
          distributed_executor_backend="mp" if {tp * pp} > 1 else None)
outs = llm.generate({_prompts()!r}, SamplingParams(max_tokens=10, temperature=0,
                                                   detokenize=False, logprobs=2))
cfg = llm.llm_engine.vllm_config.cache_config
print("RESULT", json.dumps(dict(
    tokens=[list(o.outputs[0].token_ids) for o in outs], blocks=cfg.num_gpu_blocks,
    top2=[[sorted((v.logprob for v in lp.values()), reverse=True)[:2]
           for lp in o.outputs[0].logprobs] for o in outs])))
"""
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn")
    if tp * pp > 1:  # one core per rank: vLLM's CPU workers bind to NUMA nodes by default
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(cores[i % len(cores)]) for i in range(tp * pp))
    run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         timeout=600, env=env)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return (json.loads(line[len("RESULT "):]) if line else None), run.stdout + run.stderr


def _expected_blocks(kv_heads_per_rank: int, layers_per_rank: int) -> int:
    from vllm_nvfp4kv.kernels import format as fmt
    page = fmt.page_bytes(CPU_BLOCK_SIZE, kv_heads_per_rank, 64)
    return KV_BYTES // (page * layers_per_rank)


@pytest.fixture(scope="module")
def tp1(checkpoint):
    got, log = _run(checkpoint)
    assert got is not None, log[-4000:]
    return got, log


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parallel_matches_single_process(checkpoint, tp1, tp, pp):
    ref, _ = tp1
    assert ref["blocks"] == _expected_blocks(2, 2)
    if pp > 1 and compat.has_layout_api():
        # vLLM 0.32's CPU model runner fails pipeline parallelism with any cache dtype (BF16
        # too: README, limits): ours must fail there the same way, in vLLM's runner
        got, log = _run(checkpoint, tp, pp)
        assert got is None and "assert self.intermediate_tensors is not None" in log, log[-3000:]
        pytest.xfail("vLLM >= 0.32's CPU engine cannot run pipeline parallel (upstream)")
    got, log = _run(checkpoint, tp, pp)
    assert got is not None, log[-4000:]
    assert "Using AttentionBackendEnum.CUSTOM" in log or "NVFP4 KV cache (vllm-nvfp4kv)" in log
    # each rank holds 1 of the 2 KV heads (TP) or 1 of the 2 layers (PP): twice the blocks
    assert got["blocks"] == _expected_blocks(2 // tp, 2 // pp)
    # the same greedy tokens, up to a near-tie of TP=1's run, where the ranks' other order of
    # floating-point sums may pick its second choice (as BF16 caches do); not after it
    for want, have, top2 in zip(ref["tokens"], got["tokens"], ref["top2"]):
        i = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if i is not None:
            assert top2[i][0] - top2[i][1] < MARGIN, (i, want, have, top2[i])
