"""What the NVFP4 cache of one layer stores instead of the model's K/V, and what the rows that
read the cache do about it (README "Accuracy options"). Each option is a change the attention
output cannot see:

* K centering (a scales file from ``python -m vllm_nvfp4kv.calibration --center-k``, or
  online, ``NVFP4KV_CENTER_K``: the layer's first real batch): K is cached as K - mu, mu a
  per-channel constant [Hkv, D] (a mid-range). Every
  score of a query then moves by the same q.mu, which softmax ignores: exact, with no change
  to Q. It removes outlier channels that are a constant offset after RoPE (Qwen2's k_proj
  bias in its slowly rotating channel pairs). Not for layers with attention sinks or a
  logit soft-cap (a shift changes their result).
* K smoothing (``--smooth-k``): K is cached as K / s with s a per-channel power of two, and
  every query that reads the cache is multiplied by s, so q.k is unchanged while outlier
  channels no longer own their 16-value blocks. Powers of two: both products exact in BF16.
* Hadamard rotation of K (``NVFP4KV_ROTATE_K``): K (after centering) and those queries
  rotated alike. Not with smoothing: rotating smoothed keys undoes the smoothing.
* Hadamard rotation of V (``NVFP4KV_ROTATE_V``): attention over rotated V gives the output
  rotated; H is its own inverse, so rotating the output again undoes it.

Every key of one softmax must be in the same space: the chunk's own exact keys join a cached
prefix transformed like it. Rows that attend only the step's exact K/V (an initial prefill)
need none of this. Plain torch: elementwise ops and one matmul, captured by CUDA graphs (the
tensors exist from the layer's first eager write; online centering fills k_sub in place).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nvfp4kv.kernels.rotation import rotate


@dataclass
class CacheSpace:
    rotate_k: bool = False
    rotate_v: bool = False
    k_sub: torch.Tensor | None = None  # [Hkv, D] mu: K is cached as (K - mu) * k_mul
    k_mul: torch.Tensor | None = None  # [Hkv, D] 1 / s
    q_mul: torch.Tensor | None = None  # [Hq, D] s of each query head's KV head

    def set_center(self, mu: torch.Tensor, dtype: torch.dtype) -> None:
        self.k_sub = mu.to(dtype)

    def set_smoothing(self, s: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """s [Hkv, D]: K smoothing divisors (powers of two >= 1); query head h reads KV head
        h // (num_heads // Hkv), vLLM's grouping."""
        self.k_mul = (1.0 / s).to(dtype)
        self.q_mul = s.repeat_interleave(num_heads // s.shape[0], 0).to(dtype)

    def unrotated_key(self, k: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] centered and smoothed (what the outlier check looks at)."""
        k = k if self.k_sub is None else k - self.k_sub
        return k if self.k_mul is None else k * self.k_mul

    def key(self, k: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] as the model computes it -> as the cache stores it."""
        k = self.unrotated_key(k)
        return rotate(k) if self.rotate_k else k

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """[T, Hq, D] -> the query whose scores against cached keys are the model's (up to a
        per-query constant where K is centered)."""
        q = q if self.q_mul is None else q * self.q_mul
        return rotate(q) if self.rotate_k else q

    def value(self, v: torch.Tensor) -> torch.Tensor:
        return rotate(v) if self.rotate_v else v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output over cached values -> the model's (H is its own inverse)."""
        return rotate(o) if self.rotate_v else o
