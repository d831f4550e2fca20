"""Learned per-offset table (Raffel et al. 2020 without buckets; Luo et al. 2021's `b[j-i]`)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Position


class LearnedTable(Position):
    """One learned scalar per head and offset `r ∈ [-max_distance, max_distance]`, clipped beyond.

    From "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
    Encoding" (Luo et al., NeurIPS 2021), where `b[j-i]` is a free vector.

    Args:
        num_heads: H.
        max_distance: offsets beyond ±max_distance share the edge entry.
        init_std: std of the normal initialization (0 gives all zeros).

    Parameter `table: [H, 2*max_distance+1]`, entry `max_distance + r` holds `b(r)`.
    """

    def __init__(self, num_heads: int, max_distance: int = 128, init_std: float = 0.0):
        super().__init__(num_heads)
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.max_distance = int(max_distance)
        self.table = nn.Parameter(torch.randn(num_heads, 2 * max_distance + 1) * init_std)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return self.table[h, r.clamp(-self.max_distance, self.max_distance) + self.max_distance]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_distance={self.max_distance}"
