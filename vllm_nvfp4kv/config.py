"""The plugin's options: one frozen dataclass, ``NvFp4KVConfig``, built once per engine.

Each option's value comes from, first match wins:

1. vLLM's ``additional_config["nvfp4kv"]``: ``vllm serve ... --additional-config
   '{"nvfp4kv": {"block_scales": "4over6"}}'`` or ``LLM(..., additional_config={"nvfp4kv":
   {...}})``. vLLM (0.26 and 0.32-0.34) carries it to every worker and hashes it into its
   config hash;
2. the option's environment variable, ``NVFP4KV_`` + its name in capitals (the fallback, read
   here and nowhere else);
3. the default below.

Unknown keys, unknown values and a wrong type are refused, naming the option and where the
value came from. The engine logs the options in force once (``for_engine``). Fields whose
metadata says ``internal`` are benchmark knobs (``evals/``), not user options.

``python -m vllm_nvfp4kv.config --markdown`` prints README's options table
(``markdown_table``; ``tests/test_config.py`` checks README's copy).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import math
import os
import textwrap
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

from vllm_nvfp4kv.kernels.format import BLOCK_SCALE_RULES, DEFAULT_BLOCK_SCALES

SECTION = "nvfp4kv"        # the key of additional_config this package reads
ENV_PREFIX = "NVFP4KV_"
# NVFP4KV_* variables that are not options of the plugin (evals' asset cache)
OTHER_ENV = ("NVFP4KV_ASSETS",)
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
logger = logging.getLogger("vllm.nvfp4kv")


def _choices(*values: str, aliases: Mapping[str, str] | None = None) -> dict:
    """A field's metadata: the strings it takes (aliases: other spellings of them)."""
    return {"choices": values, "aliases": dict(aliases or {})}


def _decode_variants() -> tuple[str, ...]:
    from vllm_nvfp4kv.kernels.decode import DECODE_VARIANTS
    return tuple(DECODE_VARIANTS)


@dataclass(frozen=True)
class NvFp4KVConfig:
    """The NVFP4 KV cache's options (module docstring: where they come from)."""

    block_scales: str = field(default=DEFAULT_BLOCK_SCALES,
                              metadata=_choices(*BLOCK_SCALE_RULES))
    """How the writer picks each 16-value block's E4M3 scale (kernels/format.py): `search`
    tries the codes of amax/6 and amax/4 and the code just below each, and keeps the one with
    the smallest squared error; `4over6` only the first two (the default until 2026-12-05);
    `amax6` amax/6 alone (the seed). Same format and decoding. Next-token KL against 4over6
    (2-core x86 CPU, torch 2.11.0 with vLLM 0.26.0's CPU engine or transformers 5.25.0,
    2026-12-05; evals/RESULTS.md, "Block scales by search"): -13% / -16% with every K/V value
    fake-quantized (SmolLM2 / Qwen2.5 with K centering; deterministic), -7% / -10% / -6%
    through the engine (SmolLM2 / Gemma 3 / Qwen2.5, whose run-to-run noise is larger).
    `--kv-cache-dtype nvfp4_4over6` (vLLM >= 0.32) means `4over6`. The older environment
    variable `NVFP4KV_FOUR_OVER_SIX=1`/`0` means `4over6`/`amax6`.

    Cost: the writer tries each block's 4 scales (4over6: 2): 3.3 us per 16-token decode
    write, 308 us per 32K-token prefill write per layer, 0.88% of a 32K prefill over 32 layers
    (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-12-06,
    `evals/results/write_h100_bt.json.gz`; the writer before its rewrite took 3.8 and 597 us,
    4over6 3.1 and 373: evals/RESULTS.md, "Block scales by search")."""

    center_k: str = field(default="auto", metadata=_choices("auto", "1", "0"))
    """K centering without a scales file: once a layer's first real batch shows K outlier
    channels (the check below: max/median channel amax > 48), that layer and every layer of
    the model whose first real batch comes later (in practice all: Qwen2.5's layer 0 shows
    them) cache K - mu from then on, mu that layer's first-batch per-channel mid-range; the
    offsets are written in place into a zeros tensor reserved before CUDA graph capture, so
    captured graphs use them. `1`: every layer; `0`: never. A scales file's centering
    (`scales_file` written with `--center-k`) comes first; layers with sinks or a soft-cap are
    never centered.

    Cost: one subtraction kernel on the K written per layer and step, also of zeros in models
    that never trigger: 1.0% of a decode step's GPU time (NVIDIA H200, vLLM 0.26.0, torch
    2.11.0+cu130, 2026-12-04; evals/RESULTS.md, "Where a decode step's GPU time goes"); one
    host read per layer at its first real batch."""

    rotate_k: str = field(default="auto", metadata=_choices("auto", "1", "0"))
    """Hadamard-rotates K per head before caching, and Q with it (q.k unchanged): outlier
    channels are spread over all blocks. That helps where those channels carry little of the
    queries' weight and hurts where they carry much, so `auto` measures it: at the layer's
    first real batch its forward compares the batch's q.k error through the 4-bit cache with
    and without the rotation (`cache_space.rotation_helps`, up to 256 queries x 256 keys) and
    keeps the smaller; where that is "without", the rotation matrix (captured by CUDA graphs)
    becomes the identity in place and the batch's K/V, all the layer's cache holds so far, are
    rewritten. `auto` applies to power-of-two head sizes, is off for layers with K smoothing
    and on for all layers under `calibrate` `online` / `collect`; `1`: every layer (refused
    with K smoothing); `0`: none. Gemma 3 270M: KL 0.067 -> 0.025 against rotating every
    layer, Qwen2.5 0.0033 -> 0.0029, SmolLM2 0.0181 -> 0.0187 (vLLM 0.26.0 CPU engine, torch
    2.11.0, 2-core x86, 2026-12-04; evals/RESULTS.md).

    Cost: per layer one [tokens, D] x [D, D] matmul for the K written, one for the Q rows that
    read the cache (decodes, chunks after a cached prefix); where the choice is the identity,
    only in CUDA graphs captured before it (eager steps skip it); the choice itself once per
    layer (two reference quantizations of <= 256 keys); an initial prefill attends its exact
    K/V unrotated."""

    rotate_v: bool = False
    """Also rotates V, and the attention output back.

    Cost: one more of each."""

    prefill_from_cache: bool = False
    """Prefill attends over its own chunk as read back from the cache instead of the exact K/V
    (the seed design), so a later prefix-cache hit computes what the first request computed.

    Cost: accuracy: SmolLM2 perplexity 6.487 -> 6.886 (vLLM 0.26.0 CPU engine, torch 2.11.0,
    2-core x86, 2026-12-03; `evals/results/fidelity_smollm2_cpu_prefill_from_cache.json`)."""

    workspace_dtype: str = field(default="auto", metadata=_choices("auto", "fp8"))
    """The shared prefill workspace's dtype. `auto`: the model dtype (BF16/FP16). `fp8`: it
    holds the cached prefix as e2m1 x e4m3 / 8 rounded to FP8 E4M3 (the product can need 4
    mantissa bits, E4M3 has 3) and chunked prefill runs FA3 in FP8 with descales, Q quantized
    per call (FA3 only, refused otherwise).

    Cost: `fp8` halves the workspace bytes; Q and the chunk's own K/V are rounded to E4M3.
    Measured (NVIDIA H200, vLLM 0.26.0, torch 2.11.0+cu130, 2026-12-04; evals/RESULTS.md, "vLLM
    on the H200"): less accurate (SmolLM2 KL 0.0200 vs 0.0124 with BF16, worse than an FP8
    cache's 0.0158) and no faster (32K prompts in 2K chunks: 2.61 s vs 2.44 s), so the default
    is BF16."""

    workspace_prefix_tokens: int = 65536
    """Cached-prefix tokens the shared workspace holds in one piece (longer prefixes go in
    pieces merged by LSE); the model length or a sliding window bound it too.

    Cost: workspace memory: rows x KV heads x head size x 4 bytes (BF16 K and V)."""

    fuse_transforms: bool = True
    """Speed: on a GPU, K centering and the rotation of K happen inside the cache writer
    (`kernels.write_cache(..., k_sub=, rotate_k=)`: K - mu and a Walsh-Hadamard transform per
    row, each rounded to K's dtype as torch rounds it) instead of a subtraction kernel and a
    GEMM per layer and step (`false`: the torch ops; the default since 2026-12-06). The same
    cache bytes up to a rare last-bit difference from the order of fp32 sums, which can move a
    value across an E2M1 rounding threshold
    (`tests/test_kernels.py::test_write_cache_transforms_k_as_cache_space`: over 99.8% of
    bytes equal, every value within one E2M1 step;
    `tests/test_backend.py::test_fused_k_write_gives_the_same_cache`). Not with K smoothing,
    `calibrate` `online` / `collect` or a head size that is not a power of two. With
    `rotate_k` `auto` the writer reads the layer's choice from a device flag at run time, so
    CUDA graphs captured before the choice follow it. Kernel, engine and real-model tests with
    it passed on GPUs (README, Test); the accuracy table's runs predate it except MMLU's last
    3,357 questions (-0.7 ± 0.4 against BF16 there, -0.2 ± 0.2 over the 10,400 before: within
    their errors).

    Cost: decode step **-1.8% GPU time: 2,232 against 2,274 us** (16 x 8K, 8 layers; NVIDIA
    H100 80GB HBM3, vLLM 0.26.0, torch 2.11.0+cu130, commit a13a618, 2026-12-06, one hold;
    `profile_step_h100_a13a618.json` / `_unfused.json`; -1.7% on 2026-12-05): the writer
    takes 3.5 us more, the subtraction (22.4 us) and K's rotation GEMM (19.6 us) are gone.
    Prefill: the writer +2.2 us per 2K-token write, +54 us per 32K (`write_h100_bt.json.gz`),
    against two torch kernels that move K through memory twice; the 2K-chunk prefill measured
    -1.8% GPU time against FP8 with it and -3.7% without it, in different holds, the
    difference in kernels it does not touch (evals/RESULTS.md, "Where a decode step's GPU
    time goes" and "The 2K-chunk prefill with the fused writer")."""

    calibrate: str = field(default="off", metadata=_choices(
        "off", "online", "collect", aliases={"": "off", "0": "off", "1": "online"}))
    """Global scales (README "Calibrated global scales"). `online`: each layer's k/v scale is
    fixed from the first batch that writes real tokens into its cache, before that batch is
    written, and never changes afterwards. `collect`: record every layer's K/V amax for the
    offline command (`python -m vllm_nvfp4kv.calibration`, which sets it)."""

    calibrate_headroom: float = 64.0
    """Online calibration's headroom `h` (README "Calibrated global scales")."""

    scales_file: str | None = field(default=None, metadata={"path": True})
    """JSON `{layer_name: [k_scale, v_scale]}` (offline calibration: `python -m
    vllm_nvfp4kv.calibration`), loaded at each layer's first write. Written with `--center-k`,
    it also holds K centering: per layer, K is cached as K - mu with mu a per-channel
    constant of each KV head (the calibration's mid-range, (max + min) / 2): every score of a
    query moves by the same q.mu, which softmax ignores, so it is exact with no change to Q,
    and a channel that is a constant offset after RoPE (Qwen2's k_proj bias in its slowly
    rotating pairs) stops owning its 16-value blocks; refused for layers with attention sinks
    or a logit soft-cap. With `--smooth-k`, K smoothing: per layer, K is cached as K / s with
    s a power of two per RoPE channel pair and KV head (each pair's calibrated amax, after
    centering if on, over the head's median, rounded), and every query that reads the cache
    is multiplied by s (q.k unchanged): outlier channels no longer crush the other values of
    their blocks, but their own 4-bit error is s times larger in q.k (evals/RESULTS.md:
    centering is what works on Qwen2.5). Smoothing turns the rotation of K off for those
    layers (`rotate_k` `1` with it is refused); centering keeps it (rotate(K - mu) is as
    exact, and measured best).

    Cost: K centering: one subtraction on the K written; K smoothing: one elementwise product
    on the K written and on the Q rows that read the cache."""

    checkpoint_scales: str = field(default="prefer", metadata=_choices("prefer", "ignore"))
    """`ignore`: do not use the k/v scales vLLM loaded from the checkpoint."""

    decode_variant: str = field(default="default",
                                metadata={"choices": _decode_variants, "internal": True})
    """Benchmarks only: the decode kernel's launch variant by name
    (`kernels.decode.DECODE_VARIANTS`), so that a serving A/B needs no code change."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _parse(f, getattr(self, f.name),
                                                    f"NvFp4KVConfig({f.name}=...)"))

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sources(cls, section: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> NvFp4KVConfig:
        """additional_config["nvfp4kv"] (section) first, then environ (os.environ), then the
        defaults."""
        section = dict(section or {})
        environ = os.environ if environ is None else environ
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - set(names))
        if unknown:
            raise ValueError(
                f"additional_config[{SECTION!r}]: unknown option(s) {', '.join(unknown)}; the "
                f"options are {', '.join(n for n, f in names.items() if not _internal(f))}")
        values = {}
        for name, f in names.items():
            if name in section:
                values[name] = _parse(f, section[name], f"additional_config[{SECTION!r}]"
                                                        f"[{name!r}]")
                continue
            env = ENV_PREFIX + name.upper()
            raw = _legacy_block_scales(environ) if name == "block_scales" else None
            if raw is None and env in environ:
                raw = environ[env]
            if raw is not None:
                values[name] = _parse(f, raw, f"{env}={raw!r}")
        for var in sorted(environ):
            if var.startswith(ENV_PREFIX) and var[len(ENV_PREFIX):].lower() not in names \
                    and var not in OTHER_ENV + (_LEGACY,):
                _warn_once(var, "NVFP4 KV: %s is not an option of the plugin (ignored); the "
                           "options: README, 'Options'", var)
        return cls(**values)

    @classmethod
    def from_env(cls) -> NvFp4KVConfig:
        """The environment's options (a layer built outside an engine: tests, benchmarks)."""
        return cls.from_sources({}, os.environ)

    def changed(self) -> dict[str, Any]:
        """The options not at their defaults."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}


_LEGACY = "NVFP4KV_FOUR_OVER_SIX"


def _legacy_block_scales(environ: Mapping[str, str]) -> str | None:
    """NVFP4KV_FOUR_OVER_SIX=1 / 0, the older name of block_scales 4over6 / amax6."""
    old = environ.get(_LEGACY)
    if old is None:
        return None
    if "NVFP4KV_BLOCK_SCALES" in environ:
        raise ValueError(f"{_LEGACY} and NVFP4KV_BLOCK_SCALES are both set: keep "
                         "NVFP4KV_BLOCK_SCALES")
    if old not in ("0", "1"):
        raise ValueError(f"{_LEGACY}={old!r}: expected one of 0, 1 (better: "
                         "NVFP4KV_BLOCK_SCALES=4over6 / amax6)")
    return {"1": "4over6", "0": "amax6"}[old]


def _internal(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("internal"))


def _parse(f: dataclasses.Field, raw: Any, where: str) -> Any:
    """raw (a JSON value or an environment string) as field f's value; a ValueError naming
    the option and `where` (its source) otherwise."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"NVFP4 KV option {f.name} ({where}): expected {expected}")

    kind = type(f.default)
    if f.metadata.get("path"):
        if raw is None or raw == "":
            return None
        if not isinstance(raw, (str, os.PathLike)):
            raise bad("a path")
        return os.fspath(raw)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower() if isinstance(raw, (str, int)) else None
        if text not in _ON + _OFF:
            raise bad("true / false (or 1 / 0)")
        return text in _ON
    if kind in (int, float):
        try:
            val = None if isinstance(raw, bool) else kind(raw)
        except (TypeError, ValueError):
            val = None
        if val is None or not (math.isfinite(val) and val > 0) or \
                (kind is int and isinstance(raw, float) and not raw.is_integer()):
            raise bad(f"a positive {'integer' if kind is int else 'number'}")
        return val
    choices = f.metadata["choices"]
    choices = choices() if callable(choices) else choices
    if isinstance(raw, bool) and {"0", "1"} <= set(choices):  # JSON true / false
        raw = int(raw)
    val = str(raw).strip().lower() if isinstance(raw, (str, int)) else None
    val = f.metadata.get("aliases", {}).get(val, val)
    if val not in choices:
        raise bad("one of " + ", ".join(choices))
    return val


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# ------------------------------------------------------------------ once per engine
_engines: dict[int, tuple[weakref.ref, NvFp4KVConfig]] = {}


def for_engine(vllm_config) -> NvFp4KVConfig:
    """The options of the engine whose VllmConfig this is: built (and logged) at the first
    call for that VllmConfig, the same object afterwards. None (a layer built outside an
    engine: tests): the environment's, each call."""
    if vllm_config is None:
        return NvFp4KVConfig.from_env()
    known = _engines.get(id(vllm_config))
    if known is not None and known[0]() is vllm_config:
        return known[1]
    extra = vllm_config.additional_config
    section = extra.get(SECTION) if isinstance(extra, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"additional_config[{SECTION!r}] must be a JSON object of options, "
                         f"got {section!r}")
    cfg = NvFp4KVConfig.from_sources(section, os.environ)
    _engines[id(vllm_config)] = (weakref.ref(vllm_config), cfg)
    logger.info("NVFP4 KV options (vllm-nvfp4kv): %s", describe(cfg, section))
    return cfg


def describe(cfg: NvFp4KVConfig, section: Mapping[str, Any] | None = None) -> str:
    """One line: the options not at their defaults and where each came from."""
    changed = cfg.changed()
    if not changed:
        return "defaults"
    return ", ".join(f"{k}={v!r} ({'additional_config' if k in (section or {}) else 'env'})"
                     for k, v in changed.items())


# ------------------------------------------------------------------ documentation
def field_docs(cls: type = NvFp4KVConfig) -> dict[str, str]:
    """{field: its docstring} (the string literal after each field in the class body)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def markdown_table(cls: type = NvFp4KVConfig) -> str:
    """README's options table: one row per user option (internal ones left out), from the
    fields' names, defaults and docstrings ("Cost: ..." paragraphs in their own column)."""
    docs = field_docs(cls)
    rows = ["Each option comes from vLLM's `additional_config` (`vllm serve ... "
            "--additional-config '{\"nvfp4kv\": {\"block_scales\": \"4over6\"}}'`, or "
            "`LLM(..., additional_config={\"nvfp4kv\": {...}})`), else from its environment "
            "variable, else its default; unknown options and values are refused at startup, "
            "and the engine logs the options in force.", "",
            "| option (`additional_config` key / environment variable) | default | what it "
            "does | cost |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if _internal(f):
            continue
        what, _, cost = docs[f.name].partition("\n\nCost: ")
        rows.append(f"| `{f.name}` / `{ENV_PREFIX}{f.name.upper()}` | {_default_text(f.default)}"
                    f" | {_cell(what)} | {_cell(cost) or '-'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_nvfp4kv.config",
                                 description="The NVFP4 KV cache's options.")
    ap.add_argument("--markdown", action="store_true", help="print README's options table")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(), end="")
        return
    print(describe(NvFp4KVConfig.from_env()))


if __name__ == "__main__":
    main()
