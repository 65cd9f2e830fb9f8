"""Small helpers shared by the test modules (plain module: tests/ is on sys.path under pytest)."""
import torch


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def garbage(shape, gen) -> torch.Tensor:
    """Random bytes, a quarter of them 0x7F / 0xFF (E4M3 NaN patterns, as scales)."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    pick = torch.rand(shape, generator=gen)
    x[pick < 0.125] = 0x7F
    x[(pick >= 0.125) & (pick < 0.25)] = 0xFF
    return x
