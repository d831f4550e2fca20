"""ALiBi (Press et al., "Train Short, Test Long: Attention with Linear Biases Enables
Input Length Extrapolation", ICLR 2022)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import Position, compute_dtype


def alibi_slopes(n: int) -> list[float]:
    """The official slopes: geometric from 2^(-8/n) for a power of two; otherwise the
    closest power of two's slopes plus every other slope of the next power of two."""

    def power_of_2(m: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


class ALiBi(Position):
    """ALiBi: `b_h(r) = -m_h·|r|` with fixed, not learned, per-head slopes `m_h`.

    From "Train Short, Test Long: Attention with Linear Biases Enables Input Length
    Extrapolation" (Press et al., ICLR 2022); slopes from the official `get_slopes`
    (`alibi_slopes`): `1/2, 1/4, ..., 1/256` for 8 heads. The paper uses the causal half
    (`r <= 0`); `|r|` makes the bias symmetric for bidirectional attention. It is
    `GeometricDecay(num_heads, gamma=exp(-slopes))` with the official slopes.

    Args:
        num_heads: H.

    Buffer `slopes: [H]` (float32, moves and casts with the module, not trained).
    """

    def __init__(self, num_heads: int):
        super().__init__(num_heads)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads), dtype=torch.float32))

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.slopes[h] * r.abs().to(compute_dtype(self.slopes))

    def geometric_decay(self) -> Tensor:
        """Kernelized form: `c(r) = γ^|r|` with `γ_h = exp(-m_h)` (`[H]`, float64: the linear-time
        ops take `log γ` in the call's dtype, so a float64 call gets the dense path's `-m_h`
        exactly; rounding γ to float32 first put 5e-8 between backends)."""
        return torch.exp(-self.slopes.to(torch.float64))
