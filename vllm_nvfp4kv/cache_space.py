"""What the NVFP4 cache of one layer stores instead of the model's K/V, and what the rows that
read the cache do about it (README "Accuracy options"). Each option is a change of basis that
attention cannot see:

* K smoothing (a scales file from ``python -m vllm_nvfp4kv.calibration --smooth-k``): K is
  cached as K / s with s a per-channel power of two [Hkv, D], and every query that reads the
  cache is multiplied by s, so q.k is unchanged while outlier channels (Qwen2's k_proj bias)
  no longer own their 16-value blocks. Powers of two: both products are exact in BF16.
* Hadamard rotation of K (``NVFP4KV_ROTATE_K``): K and those queries rotated alike.
* Hadamard rotation of V (``NVFP4KV_ROTATE_V``): attention over rotated V gives the output
  rotated; H is its own inverse, so rotating the output again undoes it.

Rows that attend the step's exact K/V without reading the cache (an initial prefill) need
none of this. Plain torch: elementwise products and one matmul, captured by CUDA graphs
(the tensors are fixed at the layer's first eager write).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nvfp4kv.kernels.rotation import rotate


@dataclass
class CacheSpace:
    rotate_k: bool = False
    rotate_v: bool = False
    k_mul: torch.Tensor | None = None  # [Hkv, D] 1 / s: K is cached as K * k_mul
    q_mul: torch.Tensor | None = None  # [Hq, D] s of each query head's KV head

    def set_smoothing(self, s: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """s [Hkv, D]: K smoothing divisors (powers of two >= 1); query head h reads KV head
        h // (num_heads // Hkv), vLLM's grouping."""
        self.k_mul = (1.0 / s).to(dtype)
        self.q_mul = s.repeat_interleave(num_heads // s.shape[0], 0).to(dtype)

    def smoothed_key(self, k: torch.Tensor) -> torch.Tensor:
        return k if self.k_mul is None else k * self.k_mul

    def key(self, k: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] as the model computes it -> as the cache stores it."""
        k = self.smoothed_key(k)
        return rotate(k) if self.rotate_k else k

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """[T, Hq, D] -> the query whose dot product with cached keys is the model's q.k."""
        q = q if self.q_mul is None else q * self.q_mul
        return rotate(q) if self.rotate_k else q

    def value(self, v: torch.Tensor) -> torch.Tensor:
        return rotate(v) if self.rotate_v else v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output over cached values -> the model's (H is its own inverse)."""
        return rotate(o) if self.rotate_v else o
