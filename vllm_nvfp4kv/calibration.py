"""Per-layer global scales (format.py's ``g``) calibrated from K/V statistics.

Where a layer's (k_scale, v_scale) come from, first match wins (README "Options",
``calibrate``; the options are ``config.NvFp4KVConfig``'s, environment variables in brackets):

1. **checkpoint**: the scales vLLM loaded (ModelOpt/compressed-tensors ``k_scale``/``v_scale``),
   i.e. anything other than vLLM's default 1.0. ``checkpoint_scales="ignore"``
   (``NVFP4KV_CHECKPOINT_SCALES``) skips them.
2. **file**: ``scales_file`` (``NVFP4KV_SCALES_FILE``), JSON ``{layer_name: [k_scale,
   v_scale]}`` written by ``python -m vllm_nvfp4kv.calibration`` (offline calibration over a
   set of texts).
3. **online**: ``calibrate="online"`` (``NVFP4KV_CALIBRATE``) fixes each side of each layer
   from the first batch that writes real tokens into that layer's cache, before that batch is
   written.
4. **default**: 1.0 (the seed).

The scales in force are checked when the layer's source is resolved (its first eager write):
zero, negative or non-finite ones are refused (scales.check_scales).

The rule (both calibrations): ``g = 2 ** ceil(log2(headroom * amax / (6 * 448)))``, amax the
largest finite |K| (|V|) seen. ``6 * 448 * g`` is the largest value a block can hold, so the
largest block seen gets an E4M3 scale of at most 448 / headroom, and K/V up to ``headroom``
times larger than anything seen still fit. A power of two only shifts the E4M3 exponent: a
block whose scale is a normal E4M3 number at g = 1 encodes to the same codes and decodes to
the same values at any power-of-two g, so calibration changes nothing but which blocks
saturate (above the range) or lose precision (E4M3 subnormals, below it). Measured on
SmolLM2's K/V the quantization error is flat in g once the range fits (``evals/fidelity.py
--variants calibration``), so a wide headroom is free: 64 online (one token's amax was up to
12.6x below the layer's over 16 texts), 8 offline (the max over the calibration set).

Online calibration and vLLM's dummy runs: the profile run happens before the KV cache exists
(no write), and every dummy/warm-up/capture batch has all slots -1 (vLLM pads with
PAD_SLOT_ID), so only a batch with a slot >= 0 counts, and only its rows with slots >= 0.
Until the layer is calibrated each eager write reads one flag back (a host sync); afterwards
the check is a Python attribute, no sync. CUDA graphs: a full decode graph captured before
calibration carries a one-program guard kernel (kernels/global_scale.py) that returns at once
when the layer's device flag is set, and calibrates from the replayed batch if a graph replay
is the first real write (a first batch of one-token prompts). Pages keep the scale they were
written with; the scale never changes once set.

``calibrate="collect"`` records the running amax of every layer's K/V (and each K
channel's max and min) on the device (no sync) for the offline command, which reads it back
with ``LLM.apply_model``.

K centering and smoothing (``--center-k``, ``--smooth-k``; README "Options"): the
offline command also writes, per layer, a per-channel offset mu [Hkv, D] (the mid-range
(max + min) / 2, under ``"_k_center"``) and per-channel power-of-two divisors s [Hkv, D]
(``scales.k_smoothing_factors`` of the centered amax, under ``"_k_smooth"``); the K global
scale is the rule applied to the amax of (K - mu) / s. Layers named there cache (K - mu) / s
and multiply the queries that read the cache by s (``cache_space.py``), whatever the source
of their global scales.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import re
from pathlib import Path

import torch

from .config import SECTION, NvFp4KVConfig
from .kernels.format import E2M1_MAX, E4M3_MAX
from .kernels.global_scale import calibrate_global_scales
from .ops import masked_amax, scale_from_amax  # the rule, in plain torch
from .scales import check_scales, k_center_and_smoothing

RANGE = E2M1_MAX * E4M3_MAX        # 2688: the largest |value| a block can hold at g = 1
ONLINE_HEADROOM = 64.0
OFFLINE_HEADROOM = 8.0
_ATTR = "_nvfp4kv_calibration"     # per-layer state, set on the attention layer
_logged: set[str] = set()


def log_once(key: str, msg: str, *args, level: str = "info") -> None:
    """Once per key and process, to the backend's logger (under "vllm": vLLM's config)."""
    if key in _logged:
        return
    _logged.add(key)
    getattr(logging.getLogger("vllm.nvfp4kv"), level)(msg, *args)


# ------------------------------------------------------------------ the rule
def scale_from_amax_float(amax: float, headroom: float) -> float:
    """Host version of :func:`scale_from_amax` (offline files)."""
    return float(scale_from_amax(torch.tensor([amax], dtype=torch.float32), headroom)[0])


# ------------------------------------------------------------------ files
def load_scales_file(path: str, config: NvFp4KVConfig | None = None
                     ) -> dict[str, tuple[float, float]]:
    """{layer_name: (k_scale, v_scale)}; keys starting with '_' are metadata. config: the
    options the file is used with (a warning where its rotation options differ from the
    calibration run's)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"scales_file (NVFP4KV_SCALES_FILE) {path}: no such file (write "
                                "one with python -m vllm_nvfp4kv.calibration)") from None
    out = {}
    for name, val in raw.items():
        if name.startswith("_"):
            continue
        if not (isinstance(val, (list, tuple)) and len(val) == 2):
            raise ValueError(f"{path}: {name}: expected [k_scale, v_scale], got {val!r}")
        k, v = float(val[0]), float(val[1])
        if not all(math.isfinite(s) and s > 0 for s in (k, v)):
            raise ValueError(f"{path}: {name}: global scales must be finite and positive, "
                             f"got {val!r}")
        out[name] = (k, v)
    meta = raw.get("_meta", {})
    for opt, now in rotation_meta(config).items() if config is not None else ():
        if opt == "NVFP4KV_ROTATE_K" and (raw.get("_k_smooth") or raw.get("_k_center")):
            continue  # calibrated unrotated on purpose (centering offsets need raw K)
        want = meta.get(opt)
        if want is not None and want != now:
            log_once("rot" + opt, "NVFP4 KV: %s was calibrated with %s=%s but runs with %s; K/V "
                     "magnitudes differ with and without rotation, recalibrate", path, opt, want,
                     now, level="warning")
    return out


def rotation_meta(config: NvFp4KVConfig) -> dict[str, str]:
    """The rotation options as a scales file's _meta records them (their environment names
    and values)."""
    return {"NVFP4KV_ROTATE_K": config.rotate_k, "NVFP4KV_ROTATE_V": str(int(config.rotate_v))}


def load_k_transform(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """{layer_name: {"center": mu, "smooth": s}} ([Hkv, D] fp32 each, either may be absent)
    of a scales file (none: {})."""
    raw = json.loads(Path(path).read_text())
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, what in (("_k_center", "center"), ("_k_smooth", "smooth")):
        for name, vals in raw.get(key, {}).items():
            t = torch.tensor(vals, dtype=torch.float32)
            ok = t.dim() == 2 and bool(torch.isfinite(t).all())
            if not ok or (what == "smooth" and not (t >= 1).all()):
                raise ValueError(f"{path}: {key}[{name}]: expected [kv_heads][head_size] "
                                 "finite values (divisors >= 1)")
            out.setdefault(name, {})[what] = t
    return out


_files: dict[str, dict] = {}
_transforms: dict[str, dict] = {}


def _file_scales(path: str, config: NvFp4KVConfig) -> dict[str, tuple[float, float]]:
    if path not in _files:
        _files[path] = load_scales_file(path, config)
    return _files[path]


def k_transform(layer, device, config: NvFp4KVConfig
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The layer's K centering offsets and smoothing divisors ([Hkv, D] each, on device, or
    None) from config.scales_file. Read at the layer's first eager write (a host-to-device
    copy: never while capturing)."""
    path = config.scales_file
    if not path:
        return None, None
    if path not in _transforms:
        _file_scales(path, config)  # the file's checks and messages first
        _transforms[path] = load_k_transform(path)
    t = _transforms[path].get(getattr(layer, "layer_name", "?"), {})
    return tuple(t[w].to(device) if w in t else None for w in ("center", "smooth"))


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_scales_file(path: str, amax: dict[str, list[float]], headroom: float,
                      meta: dict | None = None,
                      k_range: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                      center: bool = False, smooth: bool = False) -> dict:
    """Scales from per-layer [amax_k, amax_v] by the rule; written as JSON and returned.
    k_range {layer: (max, min)} per K channel [Hkv, D] (unrotated K), with center / smooth:
    also K centering / smoothing, and the K scales from the amax of (K - mu) / s."""
    out: dict = {}
    amax = {k: list(v) for k, v in amax.items()}
    mus, divs = {}, {}
    for name, (hi, lo) in (k_range or {}).items() if center or smooth else ():
        if hi.numel() == 0:  # the layer saw no token: nothing to center or smooth
            continue
        mu, s, a = k_center_and_smoothing(hi, lo, center, smooth)
        amax[name][0] = float(a.max())
        if center:
            mus[name] = mu
        if smooth:
            divs[name] = s
    for name in sorted(amax, key=_natural):
        ak, av = amax[name]
        out[name] = [scale_from_amax_float(ak, headroom) if ak > 0 else 1.0,
                     scale_from_amax_float(av, headroom) if av > 0 else 1.0]
    out["_meta"] = {"rule": "2**ceil(log2(headroom * amax / (6 * 448)))", "headroom": headroom,
                    "amax": {k: amax[k] for k in sorted(amax, key=_natural)}, **(meta or {})}
    if mus:
        out["_meta"]["k_center_rule"] = "per channel of each KV head: (max + min) / 2"
        out["_k_center"] = {k: mus[k].tolist() for k in sorted(mus, key=_natural)}
    if divs:
        out["_meta"]["k_smooth_rule"] = ("per RoPE pair of each KV head: 2**round(log2(max(1, "
                                         "amax / median amax))) of K - mu")
        out["_k_smooth"] = {k: divs[k].tolist() for k in sorted(divs, key=_natural)}
    if mus or divs:
        out["_meta"]["amax_k_note"] = "amax of (K - mu) / s"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    return out


# ------------------------------------------------------------------ per-layer state
class LayerCalibration:
    """Where one layer's global scales come from, and (online) whether they are fixed yet."""

    def __init__(self, source: str, device, online: bool, collect: bool, headroom: float):
        self.source = source
        self.headroom = headroom
        self.done = not (online or collect)   # host: nothing left to do at a write
        self.online = online
        # device flags [k, v]: 1 once that side's scale is fixed (online)
        self.flag = torch.zeros(2, dtype=torch.int32, device=device) if online else None
        # device running amax [k, v] and real tokens seen (collect)
        self.amax = torch.zeros(2, dtype=torch.float32, device=device) if collect else None
        self.tokens = torch.zeros((), dtype=torch.int64, device=device) if collect else None
        self.k_max = self.k_min = None  # [H, D] running per-channel max / min of K (collect)


def _host_scales(layer) -> tuple[float, float]:
    k, v = getattr(layer, "_k_scale_float", None), getattr(layer, "_v_scale_float", None)
    if k is None or v is None:  # not a vLLM Attention layer (tests): read the tensors
        return float(layer._k_scale), float(layer._v_scale)
    return float(k), float(v)


def _set_scales(layer, k: float | None = None, v: float | None = None) -> None:
    """In place (CUDA graphs hold the tensors' addresses), with vLLM's host copies."""
    for side, s in (("k", k), ("v", v)):
        if s is None:
            continue
        getattr(layer, f"_{side}_scale").fill_(s)
        if hasattr(layer, f"_{side}_scale_float"):
            setattr(layer, f"_{side}_scale_float", s)
        cpu = getattr(layer, f"_{side}_scale_cpu", None)
        if isinstance(cpu, torch.Tensor):
            cpu.fill_(s)


def init_layer(layer, device, config: NvFp4KVConfig) -> LayerCalibration:
    """Resolve the layer's scale source (precedence above) at its first KV write, which must
    run eagerly: file scales are copied in here, and the scales in force are read and
    checked."""
    name = getattr(layer, "layer_name", "?")
    path, collect = config.scales_file, config.calibrate == "collect"
    k, v = _host_scales(layer)
    from_checkpoint = not (k == 1.0 and v == 1.0)
    online = False
    if from_checkpoint and config.checkpoint_scales == "prefer":
        source = "checkpoint"
    else:
        if from_checkpoint:  # told to ignore them: start from the seed's 1.0
            _set_scales(layer, 1.0, 1.0)
        scales = _file_scales(path, config) if path else {}
        if name in scales:
            _set_scales(layer, *scales[name])
            source = "file"
        else:
            if path:
                log_once("missing" + name, "NVFP4 KV: layer %s is not in the scales file %s; it "
                         "uses %s", name, path, "online calibration"
                         if config.calibrate == "online" else "1.0", level="warning")
            online = config.calibrate == "online"
            source = "online" if online else "default"
    check_scales(name, *_host_scales(layer))
    log_once("settings" if source != "default" or path or collect else "settings0",
             "NVFP4 KV global scales: checkpoint scales %s, scales_file=%s, calibrate=%s "
             "(layer %s: %s)", config.checkpoint_scales, path or "-", config.calibrate, name,
             source, level="info" if source != "default" or path or collect else "debug")
    st = LayerCalibration(source, device, online, collect, config.calibrate_headroom)
    setattr(layer, _ATTR, st)
    return st


def state(layer) -> LayerCalibration | None:
    return getattr(layer, _ATTR, None)


def prepare_write(layer, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                  config: NvFp4KVConfig) -> None:
    """Called right before the layer's K/V [T, H, D] (as cached: rotated where rotation is
    on) are written at slot_mapping [T]. At the layer's first eager write, resolves (and
    checks) its scales (init_layer); fixes them in place (layer._k_scale / _v_scale) if this
    is the layer's first real batch under online calibration."""
    st = getattr(layer, _ATTR, None)
    if st is not None and st.done:
        return
    capturing = key.is_cuda and torch.cuda.is_current_stream_capturing()
    if st is None:
        if capturing:
            if config.calibrate != "off" or config.scales_file:
                raise RuntimeError(
                    "NVFP4 KV options calibrate / scales_file (NVFP4KV_CALIBRATE / "
                    "NVFP4KV_SCALES_FILE) need one eager forward before CUDA graph capture "
                    "(vLLM normally runs warm-up batches first); set "
                    "compilation_config={'cudagraph_num_of_warmups': 1} or enforce_eager")
            return  # default scales: nothing to set up
        st = init_layer(layer, key.device, config)
        if st.done:
            return
    if slot_mapping.shape[0] == 0:
        return
    if capturing:  # a full CUDA graph: the guard kernel decides at each replay
        if st.online:
            guard_update(layer, st, key, value, slot_mapping)
        return
    valid = slot_mapping >= 0
    if st.amax is not None:  # collect: device-side running max, no sync
        torch.maximum(st.amax, torch.stack((masked_amax(key, valid), masked_amax(value, valid))),
                      out=st.amax)
        st.tokens += valid.sum()
        hi, lo = _channel_range(key, valid)
        st.k_max = hi if st.k_max is None else torch.maximum(st.k_max, hi)
        st.k_min = lo if st.k_min is None else torch.minimum(st.k_min, lo)
    if not st.online:
        return
    flag_k, flag_v, n = torch.cat((st.flag, valid.sum().reshape(1).int())).tolist()  # sync
    if n == 0:  # dummy, profile, warm-up or padding-only batch: not data
        if flag_k and flag_v:  # fixed by a graph replay meanwhile
            st.done = True
        return
    amax = torch.stack((masked_amax(key, valid), masked_amax(value, valid)))
    ak, av = amax.tolist()  # sync (once per side and layer)
    new = scale_from_amax(amax, st.headroom)
    fixed = []
    for i, (side, a, f) in enumerate((("k", ak, flag_k), ("v", av, flag_v))):
        if not f and a > 0:  # an all-zero side waits: zeros decode to 0 at any scale
            _set_scales(layer, **{side: float(new[i])})
            st.flag[i] = 1
            fixed.append(f"{side}_scale={float(new[i]):g} (amax {a:.4g})")
    st.done = bool(st.flag.all())
    if fixed:
        log_once("online", "NVFP4 KV: online calibration fixed global scales from the first real "
                 "batch (%d tokens), e.g. layer %s: %s", n, getattr(layer, "layer_name", "?"),
                 ", ".join(fixed))
        log_once("online " + getattr(layer, "layer_name", "?"), "NVFP4 KV online scales %s: %s",
                 getattr(layer, "layer_name", "?"), ", ".join(fixed), level="debug")


def _channel_range(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, min) per channel [H, D] over the rows of x [T, H, D] where valid, NaN/Inf
    ignored; -inf / +inf where a channel has no finite valid value, so that a batch without
    data (vLLM's warm-up and capture batches: every slot -1) leaves the running range as it
    was (a 0 there would pull every channel's range to 0 and halve its mid-range)."""
    x = x.detach().float()
    keep = torch.isfinite(x) & valid[:, None, None]
    inf = torch.tensor(float("inf"), device=x.device)
    return torch.where(keep, x, -inf).amax(0), torch.where(keep, x, inf).amin(0)


def _seen(t: torch.Tensor) -> torch.Tensor:
    """A channel that never saw a value: range [0, 0] (nothing to center)."""
    return torch.where(torch.isfinite(t), t, 0.0)


def k_mid_range(key: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Online K centering's offsets [H, D] fp32 (the backend): the offline rule
    (scales.k_center_and_smoothing) over the rows of key [T, H, D] with a slot."""
    hi, lo = _channel_range(key, slot_mapping >= 0)
    return k_center_and_smoothing(_seen(hi), _seen(lo), center=True, smooth=False)[0]


# ------------------------------------------------------------------ CUDA-graph guard
def guard_update(layer, st: LayerCalibration, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """The online rule as one single-program kernel without host reads (what a CUDA graph
    captures): calibrates the sides whose device flag is 0 from this batch's real rows
    (kernels/global_scale.py)."""
    calibrate_global_scales(key, value, slot_mapping, layer._k_scale, layer._v_scale, st.flag,
                            st.headroom)


# ------------------------------------------------------------------ offline command
def collected(model) -> dict[str, list]:
    """For ``LLM.apply_model``: {layer_name: [amax_k, amax_v, tokens, K channel max [H][D],
    K channel min [H][D]]} of collect mode."""
    out = {}
    for mod in model.modules():
        st = getattr(mod, _ATTR, None)
        if st is not None and st.amax is not None:
            rng = [[], []] if st.k_max is None else [_seen(st.k_max).tolist(),
                                                     _seen(st.k_min).tolist()]
            out[getattr(mod, "layer_name", "?")] = st.amax.tolist() + [int(st.tokens), *rng]
    return out


def calibrate(model: str, texts: list[str], out: str, headroom: float = OFFLINE_HEADROOM,
              max_model_len: int = 2048, center_k: bool = False, smooth_k: bool = False,
              **llm_kwargs) -> dict:
    """Run texts through the model (kv_cache_dtype nvfp4, each text prefilled in one piece, so
    attention sees exact K/V), record every layer's K/V amax, write the scales file.
    center_k / smooth_k: also per-channel K centering / smoothing (K recorded unrotated: the
    offsets and divisors apply before any rotation; smoothed layers do not rotate K).
    llm_kwargs: for vLLM's LLM; an additional_config["nvfp4kv"] there gives the other options
    (the environment's otherwise)."""
    extra = dict(llm_kwargs.pop("additional_config", None) or {})
    # collect, no scales file, K recorded as the model computes it (unrotated where centering
    # or smoothing is wanted: the offsets and divisors apply before any rotation)
    options = {**extra.get(SECTION, {}), "calibrate": "collect", "scales_file": None,
               "center_k": "0", **({"rotate_k": "0"} if center_k or smooth_k else {})}
    config = NvFp4KVConfig.from_sources(options)  # what the engine runs with
    # vLLM's own switch for apply_model's callable (not an option of this package)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, kv_cache_dtype="nvfp4", max_model_len=max_model_len,
              max_num_batched_tokens=max_model_len, enable_prefix_caching=False,
              enforce_eager=True, additional_config={**extra, SECTION: options}, **llm_kwargs)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(t)["input_ids"][:max_model_len - 1]} for t in texts]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    per_rank = llm.apply_model(collected)
    amax: dict[str, list[float]] = {}
    k_range: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    tokens = 0
    for rank in per_rank:  # tensor parallel: each rank holds its own heads
        for name, (ak, av, n, hi, lo) in rank.items():
            old = amax.get(name, [0.0, 0.0])
            amax[name] = [max(old[0], ak), max(old[1], av)]
            tokens = max(tokens, n)
            hi, lo = torch.tensor(hi), torch.tensor(lo)
            if name in k_range:
                hi, lo = torch.cat([k_range[name][0], hi]), torch.cat([k_range[name][1], lo])
            k_range[name] = (hi, lo)
    if not amax:
        raise RuntimeError("no layer recorded K/V: is the model served by the NVFP4 backend?")
    meta = {"model": model, "texts": len(texts), "tokens": tokens,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            **rotation_meta(config)}
    del llm
    return write_scales_file(out, amax, headroom, meta, k_range, center_k, smooth_k)


def read_texts(path: str) -> list[str]:
    """.jsonl (a string, or an object with "text") per line, or plain text one per line."""
    lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    if path.endswith(".jsonl"):
        rows = [json.loads(x) for x in lines]
        return [r if isinstance(r, str) else r["text"] for r in rows]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m vllm_nvfp4kv.calibration",
        description="Offline calibration of the NVFP4 KV cache's per-layer global scales: run "
                    "texts through the model, write {layer_name: [k_scale, v_scale]} JSON for "
                    "the option scales_file (NVFP4KV_SCALES_FILE).")
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", required=True, help=".jsonl or .txt, one text per line")
    ap.add_argument("--out", required=True)
    ap.add_argument("--headroom", type=float, default=OFFLINE_HEADROOM)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--center-k", action="store_true",
                    help="also per-channel K centering (models whose K has outlier channels, "
                         "e.g. Qwen2's k_proj bias; the backend warns about them)")
    ap.add_argument("--smooth-k", action="store_true",
                    help="also per-channel K smoothing (measured worse than centering alone "
                         "on Qwen2.5, evals/RESULTS.md)")
    args = ap.parse_args(argv)
    res = calibrate(args.model, read_texts(args.texts), args.out, args.headroom,
                    args.max_model_len, args.center_k, args.smooth_k,
                    tensor_parallel_size=args.tensor_parallel_size)
    print(f"wrote {args.out}: {describe(res)}")


def describe(res: dict) -> str:
    """One line on a scales file: layers, tokens, headroom, K centering / smoothing."""
    layers = len([k for k in res if not k.startswith("_")])
    meta = res["_meta"]
    return (f"{layers} layers, {meta['tokens']} tokens, headroom {meta['headroom']:g}"
            + "".join(f", K {w}" for k, w in (("_k_center", "centering"),
                                               ("_k_smooth", "smoothing")) if k in res))


if __name__ == "__main__":
    main()
