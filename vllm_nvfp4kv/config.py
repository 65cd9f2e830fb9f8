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
    """How the writer picks each 16-value block's E4M3 scale: `search` tries the codes of
    amax/6 and amax/4 and the code just below each and keeps the one with the smallest
    squared error; `4over6` the first two; `amax6` amax/6 alone (the rule of SGLang's and
    upstream vLLM's writers). Same format and decoding whichever wrote a page; `search` gives
    the lowest next-token KL on every model measured (evals/RESULTS.md).
    `--kv-cache-dtype nvfp4_4over6` (vLLM 0.32+) means `4over6`.

    Cost: the writer tries 4 scales per block (`4over6`: 2), a few microseconds per decode
    write and under 1% of a long prefill."""

    center_k: str = field(default="1", metadata=_choices("1", "auto", "0"))
    """K centering without a scales file: each layer caches K - mu, mu the per-channel
    mid-range of its first real batch; softmax ignores the constant q.mu this adds to every
    score, and 4-bit blocks of 16 no longer spend their range on a channel's offset (a k_proj
    bias as in Qwen2, which without it collapses the model). `auto`: only once a layer's first
    batch shows K outlier channels (max / median channel amax > 48), then that layer and every
    later one, a threshold a model can sit on either side of (evals/RESULTS.md); `0`: never.
    A scales file's centering comes first; layers with sinks or a soft-cap are never centered
    (the shift would change their results).

    Cost: one subtraction on the K written (inside the writer with `fuse_transforms`)."""

    rotate_k: str = field(default="auto", metadata=_choices("auto", "1", "0"))
    """Hadamard-rotates K per head before caching, and Q with it (q.k unchanged), spreading
    outlier channels over all blocks. That helps where those channels carry little of the
    queries' weight and hurts where they carry much, so `auto` measures it per layer at its
    first real batch (the batch's q.k error through the 4-bit cache with and without) and
    keeps the smaller; power-of-two head sizes only. `1`: every layer; `0`: none.

    Cost: a [D, D] product on the K written (inside the writer with `fuse_transforms`) and on
    the Q rows that read the cache."""

    adapt_at_startup: bool = True
    """The choices made from a layer's first batch of real tokens (`center_k`'s offsets,
    `rotate_k` `auto`, `calibrate` `online`) are made while the engine starts, from one
    request of its own: a built-in text of prose, code and numbers (up to 512 tokens). So
    they are the same at every start, whatever the traffic. `false`: from the first request
    served. Not with data parallelism or `calibrate` `collect`.

    Cost: one prefill of up to 512 tokens at engine start."""

    compile_at_startup: bool = True
    """Every build of the cache's Triton kernels the engine can launch (writes, decodes at any
    batch size, prefill over a cached prefix) is compiled while the engine starts, before CUDA
    graph capture, so no request waits on a compilation. `false`: each compiles at its first
    use.

    Cost: those compilations at engine start instead of in the first requests; later starts
    load them from Triton's cache."""

    rotate_v: bool = False
    """Also rotates V, and the attention output back.

    Cost: one more of each."""

    prefill_from_cache: bool = False
    """Prefill attends over its own chunk as read back from the cache instead of the exact
    K/V, so that a later prefix-cache hit or a recompute computes exactly what the first
    request computed (identical greedy requests give identical outputs).

    Cost: accuracy (the chunk's own K/V are read at 4 bits too)."""

    workspace_dtype: str = field(default="auto", metadata=_choices("auto", "fp8"))
    """The dtype of the workspace chunked prefill dequantizes the cached prefix into.
    `auto`: the model's (BF16/FP16). `fp8`: E4M3, with FA3 attending in FP8 (Hopper only):
    half the workspace, but less accurate than the BF16 workspace and measured no faster.

    Cost: -"""

    workspace_prefix_tokens: int = 65536
    """Cached-prefix tokens the shared workspace holds in one piece; longer prefixes are
    attended in pieces merged by their log-sum-exp. The model length or a sliding window
    bound it too.

    Cost: workspace memory, rows x KV heads x head size x 4 bytes, once for all layers."""

    fuse_transforms: bool = True
    """On a GPU, K centering and K's rotation happen inside the cache writer instead of a
    subtraction kernel and a matrix product per layer and step. The same cache bytes up to
    rare last-bit differences from the order of fp32 sums. Not with K smoothing, `calibrate`
    `online` / `collect`, or head sizes that are not a power of two.

    Cost: none: it saves about 2% of a decode step's GPU time."""

    calibrate: str = field(default="off", metadata=_choices(
        "off", "online", "collect", aliases={"": "off", "0": "off", "1": "online"}))
    """Per-layer global scales. `online`: each layer's k/v scale is fixed from the first batch
    that writes real tokens into its cache (before it is written) and never changes again:
    `2^ceil(log2(h * amax / (6 * 448)))`, so values up to `h` times the batch's largest still
    fit. `collect`: record every layer's K/V amax for the offline command
    (`python -m vllm_nvfp4kv.calibration`). Scales from the checkpoint come first, then a
    scales file. A power of two only shifts E4M3's exponent: it fixes the range (scales that
    would saturate or underflow), not the 4-bit rounding."""

    calibrate_headroom: float = 64.0
    """Online calibration's headroom `h` (`calibrate`)."""

    scales_file: str | None = field(default=None, metadata={"path": True})
    """JSON `{layer_name: [k_scale, v_scale]}` written by `python -m vllm_nvfp4kv.calibration`
    (on your texts), loaded at each layer's first write. Written with `--center-k` it also
    holds per-layer K centering offsets (offsets from your texts rather than the start-up text);
    with `--smooth-k`, K smoothing divisors (q.k unchanged). Pages persisted or shared across
    engines need a file rather than online choices.

    Cost: K centering, one subtraction on the K written; K smoothing, one product on the K
    written and on the Q rows that read the cache."""

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
