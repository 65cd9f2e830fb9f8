"""What one layer adapts from its first batches, as one object with an explicit lifecycle.

A ``LayerAdaptation`` is created with the layer's attention impl and owns the layer's cache
space (``cache_space.CacheSpace``: what the cache stores instead of the model's K/V). It goes
through ``Phase``:

* ``CONFIGURED``: the space as the options say (K's rotation for power-of-two heads, V's).
* ``on_first_eager_write`` -> ``READY``: at the layer's first write outside CUDA graph
  capture (vLLM's warm-up runs first), K centering / smoothing from the scales file; the
  tensors that later choices fill in place are reserved here, before any graph captures
  them: zeros for online K centering, the rotation matrix and its flag for K's per-layer
  rotation choice; and whether the writer transforms K itself (``fused_k``). A first write
  inside a capture leaves the space as configured (nothing to choose).
* ``on_first_real_batch`` (the first eager write with a real slot; all-padded warm-up and
  capture batches are not data): online K centering (the batch's per-channel mid-range,
  model-wide once a layer shows K outlier channels), the outlier warning; then ``CHOOSING``
  where K's rotation is chosen per layer, else ``SETTLED``.
* ``decide_with_queries`` (that batch's forward, ``on_forward``) -> ``SETTLED``: K's rotation
  is kept where it lowers the batch's q.k error through the cache, else the identity and the
  batch's K/V are rewritten. A profiling forward (``on_profile_run``) settles with the
  rotation kept.

Every write goes through ``prepare_write`` (the hooks above, then K/V into the space and the
global scales' calibration); ``SETTLED`` layers only apply the space.
"""
from __future__ import annotations

import enum
import logging

import torch

from vllm_nvfp4kv import ops
from vllm_nvfp4kv.cache_space import CacheSpace, rotation_helps
from vllm_nvfp4kv.calibration import k_mid_range, k_transform, log_once, prepare_write
from vllm_nvfp4kv.config import NvFp4KVConfig
from vllm_nvfp4kv.scales import K_OUTLIER_RATIO, global_scales, k_outlier_ratio

logger = logging.getLogger("vllm.nvfp4kv")  # the backend's (under "vllm": vLLM's log config)
# models (vLLM's model name) where a layer's first real batch showed K outlier channels: with
# center_k "auto" every layer of such a model whose first real batch comes later is centered
_K_OUTLIER_MODELS: set[str] = set()


class Phase(enum.Enum):
    CONFIGURED = "configured"  # nothing written yet: the space as configured
    READY = "ready"            # the space set up at the first eager write; no real token yet
    CHOOSING = "choosing"      # first real batch written; its queries choose K's rotation
    SETTLED = "settled"        # nothing left to adapt


class LayerAdaptation:
    """One layer's first-batch adaptation (module docstring). ``space`` is the layer's cache
    space, changed in place only (CUDA graphs hold its tensors)."""

    def __init__(self, config: NvFp4KVConfig, block_scales: str, num_heads: int,
                 num_kv_heads: int, head_size: int, sinks_or_softcap: bool, model: str = "?"):
        """sinks_or_softcap: the layer has attention sinks or a logit soft-cap, whose results a
        shift of every score (K centering) would change. model: vLLM's model name."""
        pow2 = head_size & (head_size - 1) == 0
        if (config.rotate_k == "1" or config.rotate_v) and not pow2:
            raise ValueError(f"NVFP4 KV options rotate_k / rotate_v = 1 (NVFP4KV_ROTATE_K/V) "
                             f"need a power-of-two head_size, got {head_size}; unset them for "
                             "this model")
        self.config, self.block_scales = config, block_scales
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.sinks_or_softcap, self.model = sinks_or_softcap, model
        self.space = CacheSpace(rotate_k=config.rotate_k == "1" or (
            config.rotate_k == "auto" and pow2), rotate_v=config.rotate_v)
        self.phase = Phase.CONFIGURED
        self.online_center = False     # space.k_sub reserved (zeros) for the first real batch
        self.chooses_rotation = False  # space.k_rot reserved for the first real batch's queries
        self.fused_k = False           # K - mu and K's rotation inside the writer
        self._batch = None             # CHOOSING: that batch's (key, value, slot_mapping)

    @property
    def saw_real_batch(self) -> bool:
        return self.phase in (Phase.CHOOSING, Phase.SETTLED)

    # ------------------------------------------------------------------ the KV update
    def prepare_write(self, layer, key: torch.Tensor, value: torch.Tensor,
                      slot_mapping: torch.Tensor):
        """This step's K/V [T, Hkv, D] (as the model computes them) for the slots [T]: the
        lifecycle's hooks, then K/V into the cache space (K by the writer where fused_k),
        then calibration of the global scales (calibration.prepare_write: from K/V as
        cached). Returns (key, value, fused_k) for ops.write_cache."""
        eager = not (key.is_cuda and torch.cuda.is_current_stream_capturing())
        if self.phase is Phase.CONFIGURED:
            if eager:
                self.on_first_eager_write(layer, key)
            else:  # captured before any eager write: the space stays as the graphs saw it
                self.phase = Phase.READY
        if eager and self.phase is Phase.READY:
            self.on_first_real_batch(layer, key, value, slot_mapping)
        value = self.space.value(value)
        if not self.fused_k:  # else K - mu and its rotation happen in the writer
            key = self.space.key(key)
        # calibration may fix k/v_scale first (with fused_k it is off and reads no K)
        prepare_write(layer, key, value, slot_mapping, self.config)
        return key, value, (self.space.k_sub, self.space.k_rotation()) if self.fused_k else None

    def on_first_eager_write(self, layer, key: torch.Tensor) -> None:
        """Before any CUDA graph capture: K centering and smoothing from the scales file
        (smoothing turns the rotation of K off), the reservations for the first real batch,
        and whether the writer transforms K (fused_k)."""
        self.phase = Phase.READY
        cfg, name = self.config, getattr(layer, "layer_name", "?")
        mu, s = k_transform(layer, key.device, cfg)
        for what, t in (("centering", mu), ("smoothing", s)):
            if t is not None and t.shape != (self.num_kv_heads, self.head_size):
                raise ValueError(f"scales file {cfg.scales_file}: K {what} of layer {name} has "
                                 f"shape {tuple(t.shape)}, expected ({self.num_kv_heads}, "
                                 f"{self.head_size})")
        if mu is not None and self.sinks_or_softcap:
            raise ValueError(f"scales file {cfg.scales_file}: layer {name} has attention sinks "
                             "or a logit soft-cap, which K centering would change; calibrate "
                             "without --center-k")
        # rotating smoothed keys undoes the smoothing: the Hadamard transform gathers their
        # shared component (the bias) into a few channels again
        if s is not None:
            if cfg.rotate_k == "1":
                raise ValueError("NVFP4 KV option rotate_k=1 (NVFP4KV_ROTATE_K) and a scales "
                                 "file with K smoothing exclude each other: unset rotate_k")
            self.space.rotate_k = False
        # centering keeps the rotation as configured: rotating K - mu is as exact as rotating
        # K, and the two together measured best (Qwen2.5 KL 0.0034 vs 0.0055 without,
        # evals/RESULTS.md)
        if mu is None and cfg.center_k != "0" and not self.sinks_or_softcap:
            # reserved now, before any CUDA graph captures the subtraction; zeros until the
            # first real batch decides (on_first_real_batch)
            mu = torch.zeros(self.num_kv_heads, self.head_size, device=key.device)
            self.online_center = True
        if mu is not None:
            self.space.set_center(mu, key.dtype)
        if s is not None:
            self.space.set_smoothing(s, self.num_heads, key.dtype)
        # online calibration sets the global scales from the rotated K: the rotation stays
        reads_k = cfg.calibrate in ("online", "collect")
        self.chooses_rotation = cfg.rotate_k == "auto" and self.space.rotate_k and not reads_k
        if self.chooses_rotation:
            self.space.reserve_rotation_choice(self.head_size, key.device, key.dtype)
        self.fused_k = (cfg.fuse_transforms and ops.writer_transforms_k(key.device)
                        and self.space.k_mul is None
                        and (self.space.k_sub is not None or self.space.rotate_k)
                        and self.head_size & (self.head_size - 1) == 0  # whole-row loads
                        and not reads_k)

    def on_first_real_batch(self, layer, key: torch.Tensor, value: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
        """At an eager write until one has real tokens (warm-up and capture batches have every
        slot -1): online K centering where it is on and K (smoothed and centered by a file,
        where it is) has outlier channels that 4-bit blocks of 16 cannot hold; a warning if
        they remain (the model will lose accuracy badly); then CHOOSING (the batch kept for
        its queries) or SETTLED."""
        ratio = k_outlier_ratio(self.space.unrotated_key(key), slot_mapping)
        if ratio is None:  # dummy / warm-up batch (all slots padded)
            return
        name = getattr(layer, "layer_name", "?")
        if ratio > K_OUTLIER_RATIO:
            _K_OUTLIER_MODELS.add(self.model)
        # auto: model-wide, since layers below the outlier ratio gain as well (Qwen2.5: KL
        # 0.0033 centering every layer vs 0.0070 only those above it; evals/RESULTS.md)
        if self.online_center and (self.config.center_k == "1"
                                   or self.model in _K_OUTLIER_MODELS):
            self.space.k_sub.copy_(k_mid_range(key, slot_mapping))  # in place: graphs hold it
            before, ratio = ratio, k_outlier_ratio(self.space.unrotated_key(key), slot_mapping)
            log_once("center", "NVFP4 KV cache: K centering from the first real batch "
                     "(center_k=%s), e.g. layer %s: K outlier ratio %.0f -> %.0f",
                     self.config.center_k, name, before, ratio)
        if self.chooses_rotation:  # decided in forward, with this batch's queries
            self._batch = (key, value, slot_mapping)
            self.phase = Phase.CHOOSING
        else:
            self.phase = Phase.SETTLED
        if ratio > K_OUTLIER_RATIO:
            logger.warning(
                "NVFP4 KV cache: layer %s has K outlier channels (max/median channel amax "
                "%.0f > %.0f, e.g. a k_proj bias as in Qwen2): each 16-value block holding one "
                "rounds its other values to 0 and accuracy collapses (evals/RESULTS.md, "
                "Qwen2.5 fidelity). Calibrate K centering (python -m vllm_nvfp4kv.calibration "
                "--center-k, then the scales_file option; online centering is off with "
                "center_k=0, sinks or a soft-cap) or use --kv-cache-dtype fp8.",
                name, ratio, K_OUTLIER_RATIO)

    # ------------------------------------------------------------------ the forward
    def on_forward(self, layer, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """The layer's forward, queries q [T, Hq, D] as the model has them: where K's rotation
        waits for them (CHOOSING), decide_with_queries."""
        if self.phase is Phase.CHOOSING:
            self.decide_with_queries(layer, q, kv_cache)

    def on_profile_run(self) -> None:
        """A forward without metadata (vLLM's profiling run): no queries to decide with, the
        rotation stays."""
        if self.phase is Phase.CHOOSING:
            self._batch, self.phase = None, Phase.SETTLED

    def decide_with_queries(self, layer, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Keep K's rotation where it lowers the first real batch's q.k error through the
        cache; else switch to the identity in place (the matrix CUDA graphs hold) and rewrite
        the batch's K/V, which are all this layer's cache holds so far, before attention reads
        them."""
        key, value, slots = self._batch
        self._batch, self.phase = None, Phase.SETTLED
        k_scale, _ = global_scales(layer)
        real = slots >= 0
        on = rotation_helps(q, self.space.unrotated_key(key[real]), k_scale, self.block_scales)
        name = getattr(layer, "layer_name", "?")
        logger.debug("NVFP4 KV cache: layer %s %s the rotation of K", name,
                     "keeps" if on else "drops")
        if on:
            return
        log_once("rotation", "NVFP4 KV cache: K rotation chosen per layer from the first real "
                 "batch (rotate_k=auto); e.g. layer %s: off (it raised the q.k error)", name)
        self.space.choose_rotation(False)
        self.rewrite(layer, kv_cache, key, value, slots)

    def rewrite(self, layer, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor) -> None:
        """K/V [T, Hkv, D] as the model computes them into the cache at slots [T], written
        again in the space as it now is (the writer without K's transforms)."""
        k_scale, v_scale = global_scales(layer)
        ops.write_cache(kv_cache, self.space.key(key), self.space.value(value), slots, k_scale,
                        v_scale, self.block_scales)
