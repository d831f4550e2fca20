"""T5 relative position buckets (Raffel et al., "Exploring the Limits of Transfer
Learning with a Unified Text-to-Text Transformer", JMLR 2020)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import Position


def t5_bucket(r: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's `_relative_position_bucket` of `r = key − query` (the same sign as T5's
    `memory_position − context_position`), elementwise and FlexAttention-safe.

    Bidirectional: half the buckets for `r <= 0`, half for `r > 0`. Otherwise (causal)
    every future offset `r > 0` shares bucket 0 with `r = 0`. In each half the first
    `max_exact = half // 2` distances get their own bucket, the rest
    `max_exact + ⌊log(n / max_exact) / log(max_distance / max_exact) · (half - max_exact)⌋`
    (in float32, as T5), capped at `half - 1`.

    Args:
        r: int64 offsets, any shape.

    Returns:
        int64 bucket indices in `[0, num_buckets)`, the shape of `r`.
    """
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

    From "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
    Transformer" (Raffel et al., JMLR 2020); buckets exactly as HuggingFace's
    `T5Attention._relative_position_bucket` (`t5_bucket`): exact buckets for small
    distances, logarithmic ones up to `max_distance`, one per sign when bidirectional.

    Args:
        num_heads: H.
        num_buckets: buckets in all (split in two halves when bidirectional).
        max_distance: offsets at or beyond this share the last bucket.
        bidirectional: False for causal self-attention (future offsets fall in bucket 0).

    Parameter `embedding: [num_buckets, H]` (T5's layout).
    """

    score_mod_gathers = True

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__(num_heads)
        half = num_buckets // 2 if bidirectional else num_buckets
        if half < 2 or max_distance <= half // 2:
            raise ValueError(f"T5Bias: need num_buckets >= {4 if bidirectional else 2} and max_distance > "
                             f"{half // 2}, got num_buckets={num_buckets}, max_distance={max_distance}")
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.embedding = nn.Parameter(torch.zeros(num_buckets, num_heads))
        self._support: tuple = ((), 0)  # (configuration, finite_support())
        self.finite_support()  # computed eagerly here, not first inside a compiled graph

    def finite_support(self) -> int:
        """The first distance in the last bucket (at most `max_distance`; beyond, every offset
        shares it on either side; causal future offsets share bucket 0)."""
        # computed once per configuration: it is a function of the configuration alone, and
        # under torch.compile its tensor search (a data-dependent read) would break the graph
        key = (self.num_buckets, self.max_distance, self.bidirectional)
        if self._support[0] != key:
            self._support = (key, self._first_in_last_bucket())
        return self._support[1]

    def _first_in_last_bucket(self) -> int:
        n = torch.arange(2 * self.max_distance + 2)
        last = t5_bucket(-n, self.bidirectional, self.num_buckets, self.max_distance)
        return int(torch.nonzero(last == last[-1])[0, 0])

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return self.embedding[t5_bucket(r, self.bidirectional, self.num_buckets, self.max_distance), h]

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")
