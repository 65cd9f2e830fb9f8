"""Optional Hadamard rotation of K and Q per head (power-of-two head_dim): q.k is unchanged,
while the rotation spreads a key's outlier channels over all of its 16-value blocks, which
4-bit blocks quantize better. Plain torch; applied by the backend before the writer and to
the queries before attention."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hadamard(d: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Sylvester Hadamard matrix of order d, normalised."""
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d ** 0.5).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x @ H / sqrt(D) (orthonormal, symmetric: its own inverse): one matmul in
    x's dtype (fp32 accumulation, one rounding). In BF16 the entries +-2^-3.5 (D = 128) round
    by 1e-4, all alike: q.k scales by (1 - 1e-4)^2, far below BF16's own resolution."""
    return x @ hadamard(x.shape[-1], str(x.device), x.dtype)
