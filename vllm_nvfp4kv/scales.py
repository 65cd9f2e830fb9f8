"""The layer's FP32 global scales (format.py's ``g``): the seam for calibration.

The scales live in vLLM's own ``layer._k_scale`` / ``layer._v_scale`` tensors: loaded from
ModelOpt NVFP4/FP8 checkpoints (k_scale / v_scale), 1.0 otherwise, and overwritten in place
(CUDA graphs hold their addresses) by ``calibration.py`` before the layer's first real KV
write: a scales file (``NVFP4KV_SCALES_FILE``) or online calibration
(``NVFP4KV_CALIBRATE=online``). Pages already written keep the scale they were written with,
so a scale never changes once real data used it. Also the checks on what a layer writes:
scales that would corrupt the cache, K channels that 4-bit blocks cannot hold.
"""
from __future__ import annotations

import math

import torch


def global_scales(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) fp32 tensors of one element on the layer's device (no host sync)."""
    return layer._k_scale.reshape(1), layer._v_scale.reshape(1)


def check_scales(layer_name: str, k_scale: float, v_scale: float) -> None:
    """Refuse scales that would silently corrupt the cache (zero, negative, NaN, Inf)."""
    for side, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(
                f"NVFP4 KV cache: layer {layer_name} has {side}={s}; a global KV scale must be "
                "a finite positive number. Fix the checkpoint's scales, or drop them so that "
                "1.0 is used.")


# Max / median of a KV head's per-channel |K| amax (RoPE pairs merged) above which one
# channel owns its 16-value blocks: measured on one GSM8K text, SmolLM2 6, Gemma 3 270M 25,
# Qwen2.5-Coder-1.5B 85 (k_proj bias; NVFP4 perplexity x2,000 there, evals/RESULTS.md).
K_OUTLIER_RATIO = 48.0


def k_outlier_ratio(key: torch.Tensor, slot_mapping: torch.Tensor) -> float | None:
    """The largest max/median channel-amax ratio over the KV heads of this batch's real rows
    of key [T, H, D] (before any rotation); None without real rows. One host read."""
    k = key[slot_mapping >= 0].float().abs()
    if k.shape[0] == 0:
        return None
    a = rope_pair_amax(k.amax(0))
    return float((a.amax(-1) / a.median(-1).values.clamp_min(1e-30)).max())


def rope_pair_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-channel amax [..., D] -> per RoPE pair (i, i + D/2) [..., D/2]: RoPE rotates a
    pair's two channels into each other, so only the pair's magnitude is position-free."""
    half = amax.shape[-1] // 2
    return torch.maximum(amax[..., :half], amax[..., half:])


def k_smoothing_factors(k_amax: torch.Tensor) -> torch.Tensor:
    """Per-channel K divisors [H, D] from a layer's per-channel |K| amax [H, D] (calibration):
    each RoPE pair's amax over the head's median pair amax, at least 1, rounded to the nearest
    power of two (K / s and q * s stay exact in BF16). Outlier channels come down to the
    median's level; the others keep s = 1 (ratios below sqrt(2))."""
    a = rope_pair_amax(k_amax.float())
    ratio = a / a.median(-1, keepdim=True).values.clamp_min(1e-30)
    return torch.exp2(torch.round(torch.log2(ratio.clamp_min(1.0)))).repeat(1, 2)


def k_center_and_smoothing(hi: torch.Tensor, lo: torch.Tensor, center: bool, smooth: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a layer's per-channel K max / min [H, D] (calibration): (mu, s, amax) [H, D] each,
    mu the centering offsets (mid-range; zeros without centering), s the smoothing divisors
    of the centered amax (ones without smoothing), amax that of (K - mu) / s."""
    hi, lo = hi.float(), lo.float()
    mu = (hi + lo) / 2 if center else torch.zeros_like(hi)
    a = torch.maximum(hi - mu, mu - lo)  # |K - mu| amax per channel
    s = k_smoothing_factors(a) if smooth else torch.ones_like(a)
    return mu, s, a / s
