"""Positional terms: objects that know their per-head, per-offset coefficients.

Notation: `H` heads, `Lq` queries at positions `q_offset + 0..Lq-1`, `Lk` keys
at `0..Lk-1`, offset `r = j - i` (key position minus query position).

Two kinds:
* `Position` (multiplicative in kernelized attention, additive to the logits in
  softmax): log-coefficients `b_h(r)`; kernelized attention weighs pairs by
  `c_h(r) = exp(b_h(r))`, softmax adds `b_h(r)` to the score.
* `AdditiveTerm`: a term added to the attention output or to its numerator and
  denominator (FastRPB `W·V`, Shaw vectors).

Terms hold parameters and compute their coefficients; they never call `fastrpe.ops` (the
ops take the coefficients as tensors). Index arithmetic comes from the leaf `fastrpe._index`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

# index arithmetic from the leaf module shared with the ops (positions never import fastrpe.ops)
from .._index import offsets, toeplitz_index  # noqa: F401  (re-exported: fastrpe.positions.offsets)


def compute_dtype(t: Tensor) -> torch.dtype:
    """The dtype a term computes `b(r)` in: its parameters' dtype, at least float32. A term
    cast to bf16 with its model would otherwise round the offsets themselves (bf16 holds
    integers exactly only up to 256: ALiBi's `-m·|r|` was off by tens of nats at 64k)."""
    return torch.promote_types(t.dtype, torch.float32)


class Position(nn.Module):
    """Base class of the log-coefficient positional terms `b_h(r)`.

    Subclasses implement `bias(h, r)`: elementwise torch ops on broadcastable
    integer tensors of head indices and offsets (so the same code serves
    `log_coefficients`, `materialize` and FlexAttention's `score_mod`).
    """

    #: True for terms that only make sense as a softmax bias (KERPLE bias+weight).
    softmax_only: bool = False
    #: Human readable reason a kernelized backend gives for refusing this term.
    kernelized_refusal: str | None = None
    #: True for terms whose `b_h(r)` reads a table entry per (query, key) pair (T5 buckets,
    #: learned tables, 2D grids): FlexAttention then needs smaller tiles on an H100
    #: (`fastrpe.ops.softmax.flex.GATHER_KERNEL_OPTIONS`).
    score_mod_gathers: bool = False

    def __init__(self, num_heads: int):
        super().__init__()
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads

    def bias(self, h: Tensor, r: Tensor) -> Tensor:  # pragma: no cover - abstract
        """`b_h(r)` for broadcastable int tensors `h` (head) and `r` (offset)."""
        raise NotImplementedError

    #: positional logit weight `w_h(r)` (softmax only; see KerpleBiasWeight), or None
    weight = None

    def geometric_decay(self) -> Tensor | None:
        """`[H]` decays γ if `exp(b_h(r)) = γ_h^|r|` exactly (linear-time causal backends), else None."""
        return None

    def finite_support(self) -> int | None:
        """`W >= 1` if `b_h(r) = b_h(-W)` for every `r <= -W` and `b_h(r) = b_h(W)` for every
        `r >= W` (an exact band plus constant tails: the `band` backend, linear time), else None."""
        return None

    def _param_device(self) -> torch.device:
        for t in list(self.parameters()) + list(self.buffers()):
            return t.device
        return torch.device("cpu")

    def log_coefficients(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq+Lk-1]`: `b_h(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset`."""
        dev = self._param_device()
        r = offsets(Lq, Lk, q_offset, device=dev)
        h = torch.arange(self.num_heads, device=dev)[:, None]
        return self.bias(h, r[None, :]).expand(self.num_heads, r.numel())

    def materialize(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq, Lk]` dense bias `b_h(j - i)`. For tests and debugging only."""
        lc = self.log_coefficients(Lq, Lk, q_offset)
        idx = toeplitz_index(Lq, Lk, device=lc.device)
        return lc[:, idx]

    def materialize_weight(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor | None:
        """`[H, Lq, Lk]` logit weight `w_h(j - i)` for terms that have one, else None."""
        if self.weight is None:
            return None
        dev = self._param_device()
        r = offsets(Lq, Lk, q_offset, device=dev)
        h = torch.arange(self.num_heads, device=dev)[:, None]
        w = self.weight(h, r[None, :]).expand(self.num_heads, r.numel())
        return w[:, toeplitz_index(Lq, Lk, device=dev)]

    def score_mod(self, q_offset: int = 0) -> Callable:
        """A FlexAttention `score_mod(score, b, h, q_idx, kv_idx)` adding `b_h(kv_idx - q_idx - q_offset)`
        (and multiplying by the logit weight first, for terms that have one)."""
        weighted = self.weight is not None

        def mod(score, b, h, q_idx, kv_idx):
            r = kv_idx - q_idx - q_offset
            if weighted:
                score = score * self.weight(h, r).to(score.dtype)
            return score + self.bias(h, r).to(score.dtype)

        return mod

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


class AdditiveTerm(nn.Module):
    """Base class of terms added outside the Toeplitz product (FastRPB, Shaw). They hold
    parameters only; the ops (`fastrpe.ops.kernelized`) apply them."""

    def __init__(self, num_heads: int):
        super().__init__()
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads


def init_normal(*shape: int, std: float) -> torch.Tensor:
    """`N(0, std²)` entries, or zeros without drawing from the global generator when
    `std == 0`: switching on a zero-initialized term must not change any other weight
    that the same seed initializes."""
    return torch.randn(*shape) * std if std else torch.zeros(*shape)
