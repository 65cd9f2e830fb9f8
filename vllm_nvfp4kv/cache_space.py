"""What the NVFP4 cache of one layer stores instead of the model's K/V, and what the rows that
read the cache do about it (README "Options"). Each option is a change the attention
output cannot see:

* K centering (a scales file from ``python -m vllm_nvfp4kv.calibration --center-k``, or
  online, option ``center_k``: the layer's first real batch): K is cached as K - mu, mu a
  per-channel constant [Hkv, D] (a mid-range). Every
  score of a query then moves by the same q.mu, which softmax ignores: exact, with no change
  to Q. It removes outlier channels that are a constant offset after RoPE (Qwen2's k_proj
  bias in its slowly rotating channel pairs). Not for layers with attention sinks or a
  logit soft-cap (a shift changes their result).
* K smoothing (``--smooth-k``): K is cached as K / s with s a per-channel power of two, and
  every query that reads the cache is multiplied by s, so q.k is unchanged while outlier
  channels no longer own their 16-value blocks. Powers of two: both products exact in BF16.
* Hadamard rotation of K (option ``rotate_k``): K (after centering) and those queries
  rotated alike. Not with smoothing: rotating smoothed keys undoes the smoothing. By default
  (``auto``) each layer keeps it or not from its first real batch, whichever gives the
  smaller error of that batch's scores q.k through the 4-bit cache (``rotation_helps``):
  the rotation spreads a key's outlier channels over all blocks, which helps where those
  channels carry little of the queries' weight and hurts where they carry much
  (evals/RESULTS.md, Gemma 3).
* Hadamard rotation of V (option ``rotate_v``): attention over rotated V gives the output
  rotated; H is its own inverse, so rotating the output again undoes it.

Every key of one softmax must be in the same space: the chunk's own exact keys join a cached
prefix transformed like it. Rows that attend only the step's exact K/V (an initial prefill)
need none of this. Plain torch: elementwise ops and one matmul, captured by CUDA graphs (the
tensors exist from the layer's first eager write; online centering fills k_sub in place, the
per-layer rotation choice k_rot).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_nvfp4kv.kernels.rotation import hadamard, rotate
from vllm_nvfp4kv.ops import fake_quantize


@dataclass
class CacheSpace:
    rotate_k: bool = False
    rotate_v: bool = False
    k_rot: torch.Tensor | None = None  # [D, D] H or I: rotate_k chosen per layer (choose_rotation)
    k_rot_on: torch.Tensor | None = None  # [1] int32, 1 while k_rot is H (the fused writer's flag)
    k_sub: torch.Tensor | None = None  # [Hkv, D] mu: K is cached as (K - mu) * k_mul
    k_mul: torch.Tensor | None = None  # [Hkv, D] 1 / s
    q_mul: torch.Tensor | None = None  # [Hq, D] s of each query head's KV head
    k_rot_chosen: bool | None = None  # choose_rotation's answer, once given (host side)

    def set_center(self, mu: torch.Tensor, dtype: torch.dtype) -> None:
        self.k_sub = mu.to(dtype)

    def set_smoothing(self, s: torch.Tensor, num_heads: int, dtype: torch.dtype) -> None:
        """s [Hkv, D]: K smoothing divisors (powers of two >= 1); query head h reads KV head
        h // (num_heads // Hkv), vLLM's grouping."""
        self.k_mul = (1.0 / s).to(dtype)
        self.q_mul = s.repeat_interleave(num_heads // s.shape[0], 0).to(dtype)

    def reserve_rotation_choice(self, d: int, device, dtype: torch.dtype) -> None:
        """A matrix the key and query rotations multiply by, H until choose_rotation (reserved
        before any CUDA graph captures the products), and its flag for the fused writer."""
        self.k_rot = hadamard(d, str(device), dtype).clone()
        self.k_rot_on = torch.ones(1, dtype=torch.int32, device=device)

    def choose_rotation(self, on: bool) -> None:
        self.k_rot_chosen = on
        self.k_rot_on.fill_(int(on))
        self.k_rot.copy_(hadamard(self.k_rot.shape[0], str(self.k_rot.device), self.k_rot.dtype)
                         if on else torch.eye(self.k_rot.shape[0], dtype=self.k_rot.dtype,
                                              device=self.k_rot.device))

    def k_rotation(self) -> bool | torch.Tensor:
        """K's rotation as the fused kernels take it (write_cache / put_rows): the per-layer
        flag where the choice is reserved (read at run time, so CUDA graphs captured before
        the choice follow it), else the fixed setting."""
        return self.rotate_k if self.k_rot_on is None else self.k_rot_on

    def _rotate_k(self, x: torch.Tensor) -> torch.Tensor:
        if self.k_rot is not None:
            # a layer that chose no rotation skips x @ I from then on (graphs captured before
            # the choice keep their product, which k_rot = I makes the same)
            return x if self.k_rot_chosen is False else x @ self.k_rot
        return rotate(x) if self.rotate_k else x

    def unrotated_key(self, k: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] centered and smoothed (what the outlier check looks at)."""
        k = k if self.k_sub is None else k - self.k_sub
        return k if self.k_mul is None else k * self.k_mul

    def key(self, k: torch.Tensor) -> torch.Tensor:
        """[T, Hkv, D] as the model computes it -> as the cache stores it."""
        return self._rotate_k(self.unrotated_key(k))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """[T, Hq, D] -> the query whose scores against cached keys are the model's (up to a
        per-query constant where K is centered)."""
        q = q if self.q_mul is None else q * self.q_mul
        return self._rotate_k(q)

    def value(self, v: torch.Tensor) -> torch.Tensor:
        return rotate(v) if self.rotate_v else v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output over cached values -> the model's (H is its own inverse)."""
        return rotate(o) if self.rotate_v else o


def rotation_errors(q: torch.Tensor, k: torch.Tensor, k_scale, block_scales: str,
                    max_tokens: int = 256) -> dict:
    """Squared errors the 4-bit cache causes, without and with K's rotation (q rotated alike):
    of the keys (k_plain, k_rot) and of the scores q.k (score_plain, score_rot), for queries
    q [T, Hq, D] and keys k [T, Hkv, D] (unrotated cache space) of one batch: every query
    against every key of its head group, up to max_tokens of each, evenly spaced."""
    def spaced(x):  # integer arithmetic: vLLM may set a BF16 default dtype
        m = min(max_tokens, x.shape[0])
        x = x[torch.arange(m, device=x.device) * (x.shape[0] - 1) // max(m - 1, 1)].float()
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # NaN errors decide nothing
    q, k = spaced(q), spaced(k)
    group = q.shape[1] // k.shape[1]
    out = {}
    for tag, (x, qx) in (("plain", (k, q)), ("rot", (rotate(k), rotate(q)))):
        e = fake_quantize(x, k_scale, block_scales) - x
        out[f"k_{tag}"] = float(e.pow(2).sum())
        out[f"score_{tag}"] = float(torch.einsum("thd,shd->hts", qx, e.repeat_interleave(
            group, 1)).pow(2).sum())
    return out


def rotation_helps(q: torch.Tensor, k: torch.Tensor, k_scale, block_scales: str) -> bool:
    """Whether rotating K (and q) lowers the error of one batch's scores q.k through the 4-bit
    cache (rotation_errors). K's own error does not decide it: on Gemma 3 the rotation lowers
    K's error in 14 of 18 layers but raises the score error in 6, up to 10x
    (evals/rotation_probe.py, evals/RESULTS.md)."""
    err = rotation_errors(q, k, k_scale, block_scales)
    return err["score_rot"] < err["score_plain"]
