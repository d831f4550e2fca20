"""KERPLE positional biases (Chi et al., "KERPLE: Kernelized Relative Positional
Embedding for Length Extrapolation", NeurIPS 2022).

Constrained parameters are stored unconstrained and mapped: `r > 0` by softplus,
`0 < p < 2` by `2·sigmoid` — so no optimizer step can leave the valid set.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Position


def _inv_softplus(x: float) -> float:
    return x + math.log(-math.expm1(-x))


def _inv_2sigmoid(p: float) -> float:
    if not 0 < p < 2:
        raise ValueError(f"p must be in (0, 2), got {p}")
    return math.log(p / (2 - p))


def _per_head(value, H: int, f) -> Tensor:
    v = torch.as_tensor(value, dtype=torch.float32).flatten()
    if v.numel() == 1:
        v = v.expand(H)
    if v.numel() != H:
        raise ValueError(f"expected 1 or {H} initial values, got {v.numel()}")
    return torch.tensor([f(float(x)) for x in v])


def abs_pow(r: Tensor, p: Tensor) -> Tensor:
    """`|r|^p` with a finite gradient at `r = 0` (the value there is 0)."""
    a = r.abs().to(p.dtype)
    safe = torch.where(a > 0, a, torch.ones_like(a))
    return torch.where(a > 0, torch.exp(p * torch.log(safe)), torch.zeros_like(a))


class KerplePower(Position):
    """Power kernel: `b_h(r) = -r1_h·|r|^p_h`, `r1 > 0`, `0 < p < 2` (p = 1: ALiBi with a learned slope).

    Args:
        learn_p: False keeps p fixed at its initial value; with p = 1 the kernelized form is
            the geometric decay `exp(-r1)^|r|` that the linear-time `chunked` backend runs.
    """

    def __init__(self, num_heads: int, r1=1.0, p=1.0, learn_p: bool = True):
        super().__init__(num_heads)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_softplus))
        self.learn_p = learn_p
        if learn_p:
            self.raw_p = nn.Parameter(_per_head(p, num_heads, _inv_2sigmoid))
        else:
            if not 0 < float(p) <= 2:
                raise ValueError(f"p must be in (0, 2], got {p}")
            self.register_buffer("fixed_p", torch.full((num_heads,), float(p)))

    @property
    def r1(self) -> Tensor:
        return F.softplus(self.raw_r1)

    @property
    def p(self) -> Tensor:
        return 2 * torch.sigmoid(self.raw_p) if self.learn_p else self.fixed_p

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * abs_pow(r, self.p[h].to(self.raw_r1.dtype))

    def geometric_decay(self) -> Tensor | None:
        if self.learn_p or not bool((self.fixed_p == 1).all()):
            return None
        return torch.exp(-self.r1)


class KerpleLog(Position):
    """Logarithmic kernel: `b_h(r) = -r1_h·log(1 + r2_h·|r|)`, `r1, r2 > 0`.
    In kernelized attention: `c(r) = (1 + r2|r|)^(-r1)`, a power-law decay."""

    def __init__(self, num_heads: int, r1=1.0, r2=1.0):
        super().__init__(num_heads)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_softplus))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_softplus))

    @property
    def r1(self) -> Tensor:
        return F.softplus(self.raw_r1)

    @property
    def r2(self) -> Tensor:
        return F.softplus(self.raw_r2)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * torch.log1p(self.r2[h] * r.abs().to(self.raw_r1.dtype))


class KerpleLog3(Position):
    """Three-parameter logarithmic kernel: `b_h(r) = -r1_h·log(1 + r2_h·|r|^p_h)`,
    `r1, r2 > 0`, `0 < p < 2` (p = 1 is `KerpleLog`)."""

    def __init__(self, num_heads: int, r1=1.0, r2=1.0, p=1.0):
        super().__init__(num_heads)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_softplus))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_softplus))
        self.raw_p = nn.Parameter(_per_head(p, num_heads, _inv_2sigmoid))

    r1 = KerpleLog.r1
    r2 = KerpleLog.r2

    @property
    def p(self) -> Tensor:
        return 2 * torch.sigmoid(self.raw_p)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * torch.log1p(self.r2[h] * abs_pow(r, self.p[h]))


class KerpleBiasWeight(Position):
    """KERPLE-log bias plus a positional *weight* on the logits (softmax only):
    `score_ij = w_h(r)·scale·q_i·k_j + b_h(r)` with `b_h(r) = -r1·log(1 + r2|r|)` and
    `w_h(r) = 1 / (1 + r3·|r|)` (`r1, r2, r3 > 0`).

    The weight rescales each logit by its offset, which is not a Toeplitz reweighting of
    `φ(q)·φ(k)`: kernelized backends cannot express it and refuse it.
    """

    softmax_only = True
    kernelized_refusal = "KerpleBiasWeight multiplies the softmax logits by a positional weight; kernelized attention has no logits to weigh"

    def __init__(self, num_heads: int, r1=1.0, r2=1.0, r3=0.01):
        super().__init__(num_heads)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_softplus))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_softplus))
        self.raw_r3 = nn.Parameter(_per_head(r3, num_heads, _inv_softplus))

    r1 = KerpleLog.r1
    r2 = KerpleLog.r2

    @property
    def r3(self) -> Tensor:
        return F.softplus(self.raw_r3)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * torch.log1p(self.r2[h] * r.abs().to(self.raw_r1.dtype))

    def weight(self, h: Tensor, r: Tensor) -> Tensor:
        """Multiplier of the logit at offset r: `1 / (1 + r3|r|)`."""
        return 1.0 / (1.0 + self.r3[h] * r.abs().to(self.raw_r3.dtype))
