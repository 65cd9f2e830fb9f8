"""Optional Hadamard rotation of K and Q per head (power-of-two head_dim): q.k is unchanged,
while the rotation spreads a key's outlier channels over all of its 16-value blocks, which
4-bit blocks quantize better. `rotate` (torch, the reference) is applied by the backend
before the writer and to the queries before attention; `fwht` is the same transform inside
Triton kernels (the writer's k_sub/rotate_k)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=8)
def hadamard(d: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Sylvester Hadamard matrix of order d, normalised."""
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=16)
def hadamard_entry(d: int, dtype: torch.dtype) -> float:
    """|H[j, k]| of hadamard(d, ..., dtype) as a host float (no device read: callable while a
    CUDA graph is being captured)."""
    return float(hadamard(d, "cpu", dtype)[0, 0])


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x @ H / sqrt(D) (orthonormal, symmetric: its own inverse): one matmul in
    x's dtype (fp32 accumulation, one rounding). In BF16 the entries +-2^-3.5 (D = 128) round
    by 1e-4, all alike: q.k scales by (1 - 1e-4)^2, far below BF16's own resolution."""
    return x @ hadamard(x.shape[-1], str(x.device), x.dtype)


@triton.jit
def fwht(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Triton: [R, D] fp32 -> the Walsh-Hadamard transform of each row (Sylvester order,
    unnormalised: y_k = sum_j x_j (-1)^popcount(j & k), so rotate(x) = fwht(x) * H[0, 0]), one
    butterfly stage per index bit."""
    R: tl.constexpr = x.shape[0]
    for i in tl.static_range(LOG2_D):
        y = tl.permute(tl.reshape(x, (R, D // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, D))
    return x
