"""Learned per-offset table (Raffel et al. 2020 without buckets; Luo et al. 2021's `b[j-i]`)."""
from __future__ import annotations

from torch import Tensor, nn

from .base import Position, init_normal


class LearnedTable(Position):
    """One learned scalar per head and offset `r ∈ [-max_distance, max_distance]`, clipped beyond.

    From "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
    Encoding" (Luo et al., NeurIPS 2021), where `b[j-i]` is a free vector; T5's bias
    without buckets ("Exploring the Limits of Transfer Learning with a Unified
    Text-to-Text Transformer", Raffel et al., JMLR 2020).

    Args:
        num_heads: H.
        max_distance: offsets beyond ±max_distance share the edge entry.
        init_std: std of the normal initialization (0 gives all zeros).
        causal: keep only the offsets `r ∈ [-max_distance, 0]` a causal model can see
            (half the parameters); future offsets `r > 0` then share the entry of `r = 0`.

    Parameter `table: [H, 2*max_distance+1]` (`[H, max_distance+1]` when causal); entry
    `max_distance + r` holds `b(r)`.
    """

    score_mod_gathers = True

    def __init__(self, num_heads: int, max_distance: int = 128, init_std: float = 0.0, causal: bool = False):
        super().__init__(num_heads)
        if not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(f"max_distance must be an int >= 0, got {max_distance!r}")
        self.max_distance = max_distance
        self.causal = causal
        width = max_distance + 1 if causal else 2 * max_distance + 1
        self.table = nn.Parameter(init_normal(num_heads, width, std=init_std))

    def finite_support(self) -> int:
        """Offsets beyond `±max_distance` share the edge entries."""
        return max(self.max_distance, 1)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        hi = 0 if self.causal else self.max_distance
        return self.table[h, r.clamp(-self.max_distance, hi) + self.max_distance]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_distance={self.max_distance}, causal={self.causal}"
