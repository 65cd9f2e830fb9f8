"""The first real batch, made the same at every engine start.

Some of the cache's choices are made from each layer's first batch of real tokens
(``adaptation.LayerAdaptation``: K centering and K's rotation with ``auto``, global scales with
``calibrate="online"``). Left to the traffic, they depend on whichever request a server
happens to see first, so two restarts can cache the same tokens differently. With
``adapt_at_startup`` (the default) the engine core runs one request of its own before it
serves: ``TEXT`` below (prose, code, numbers and a table), its first token sampled and
discarded. Every layer of every rank sees that batch first, so the choices are fixed by the
model and this text alone. The request leaves nothing behind: its pages are freed and the
prefix cache reset.

Other cache dtypes are left alone. Skipped, with one log line: ``adapt_at_startup=false``; ``calibrate=
"collect"`` (it records the user's texts); pooling models; data parallelism (ranks step in
lockstep, which one rank's extra step would break).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import random

from vllm_nvfp4kv import compat

logger = logging.getLogger("vllm.nvfp4kv")
REQUEST_ID = "vllm-nvfp4kv-startup"
MAX_TOKENS = 512  # of TEXT, and at most max_model_len - 1
MAX_STEPS = 1024  # a 512-token prompt in chunks of at least one token, and its sampled token

TEXT = """\
The committee met on Tuesday, 14 March, to review the quarterly figures. Revenue rose 7.4% to
$18.2 million, while operating costs fell from $11.9 million to $11.1 million; the board
asked why shipping delays in the northern region had doubled since January.

Question: A train leaves at 09:40 and travels 312 km at an average of 96 km/h. When does it
arrive? Answer: 312 / 96 = 3.25 hours, so it arrives at 12:55.

def merge_intervals(intervals):
    \"\"\"Merge overlapping [start, end] pairs.\"\"\"
    intervals.sort(key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

| city      | population | area (km2) |
|-----------|-----------:|-----------:|
| Lyon      |    522,250 |      47.87 |
| Porto     |    231,800 |      41.42 |
| Krakow    |    804,237 |     326.80 |

In the old harbour town the fishermen still mend their nets by hand, and on summer evenings
the square fills with music. Ask anyone the way to the lighthouse and they will tell you a
story about the storm of 1953 instead.

User: Can you translate "Where is the station?" into French and German?
Assistant: French: "Où est la gare ?" German: "Wo ist der Bahnhof?"
"""


def token_ids(model_config, limit: int) -> list[int]:
    """TEXT as the model's tokenizer encodes it (special tokens included), at most limit
    tokens; without a tokenizer (skip_tokenizer_init), a fixed pseudo-random sequence."""
    if not getattr(model_config, "skip_tokenizer_init", False):
        from vllm.tokenizers import cached_tokenizer_from_config
        ids = list(cached_tokenizer_from_config(model_config).encode(TEXT))
    else:
        vocab = model_config.get_vocab_size()
        rng = random.Random(0)
        ids = [rng.randrange(vocab) for _ in range(MAX_TOKENS)]
    return ids[:limit]


def skip_reason(vllm_config, cfg) -> str | None:
    """Why this engine runs no start-up request (None: it runs one)."""
    if not cfg.adapt_at_startup:
        return "adapt_at_startup is off"
    if cfg.calibrate == "collect":
        return "calibrate=collect records the user's texts"
    if getattr(vllm_config.model_config, "runner_type", "generate") != "generate":
        return "a pooling model"
    if vllm_config.parallel_config.data_parallel_size > 1:
        return "data parallel ranks step in lockstep"
    return None


def run(engine_core) -> None:
    """One request of TEXT through engine_core before it serves (module docstring)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_nvfp4kv import config

    vllm_config = engine_core.vllm_config
    if vllm_config.cache_config.cache_dtype not in compat.NVFP4_CACHE_DTYPES:
        return
    cfg = config.for_engine(vllm_config)
    reason = skip_reason(vllm_config, cfg)
    if reason is not None:
        logger.info("NVFP4 KV cache: no start-up request (%s); the first-batch choices follow "
                    "the first request served", reason)
        return
    ids = token_ids(vllm_config.model_config,
                    min(MAX_TOKENS, vllm_config.model_config.max_model_len - 1))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    engine_core.add_request(Request(REQUEST_ID, ids, params, None, block_hasher=getattr(
        engine_core, "request_block_hasher", None)))
    for _ in range(MAX_STEPS):
        if not engine_core.scheduler.has_requests():
            break
        _, executed = engine_core.step_fn()
        engine_core.post_step(executed)
    else:
        engine_core.abort_requests([REQUEST_ID])
        raise RuntimeError(f"NVFP4 KV cache: the start-up request did not finish in "
                           f"{MAX_STEPS} steps")
    engine_core.reset_prefix_cache()
    logger.info("NVFP4 KV cache: first-batch choices made from the start-up text (%d tokens; "
                "adapt_at_startup)", len(ids))


def patch_engine_core() -> None:
    """EngineCore.__init__ runs ``run`` once the engine is built (KV caches allocated, CUDA
    graphs captured), before it takes requests; every argument passes through, and a failure
    of the start-up request is logged, not raised."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.__init__
    if getattr(original, "_nvfp4kv", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            run(self)
        except Exception as e:  # noqa: BLE001 - never keep an engine from starting
            logger.warning("NVFP4 KV cache: the start-up request failed (%s: %s); the "
                           "first-batch choices follow the first request served",
                           type(e).__name__, e)
            with contextlib.suppress(Exception):
                self.abort_requests([REQUEST_ID])

    __init__._nvfp4kv = True
    EngineCore.__init__ = __init__
