"""T5 relative position buckets (Raffel et al., "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer", JMLR 2020)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import Position


def t5_bucket(r: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's `_relative_position_bucket` of `r = key − query` (the same sign as T5's
    `memory_position − context_position`), elementwise and FlexAttention-safe."""
    buckets = torch.zeros_like(r)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (r > 0).to(r.dtype) * num_buckets
        n = r.abs()
    else:
        n = (-r).clamp_min(0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.clamp_min(1).float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(r.dtype)
    large = large.clamp_max(num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class T5Bias(Position):
    """T5's bucketed relative bias: a learned scalar per head and bucket.

    Args:
        num_heads: H.
        num_buckets: buckets in all (split in two halves when bidirectional).
        max_distance: offsets at or beyond this share the last bucket.
        bidirectional: False for causal self-attention (future offsets fall in bucket 0).

    Parameter `embedding: [num_buckets, H]` (T5's layout).
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__(num_heads)
        half = num_buckets // 2 if bidirectional else num_buckets
        if half < 2 or max_distance <= half // 2:
            raise ValueError(f"T5Bias: need num_buckets >= {4 if bidirectional else 2} and max_distance > "
                             f"{half // 2}, got num_buckets={num_buckets}, max_distance={max_distance}")
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.embedding = nn.Parameter(torch.zeros(num_buckets, num_heads))

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return self.embedding[t5_bucket(r, self.bidirectional, self.num_buckets, self.max_distance), h]

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")
