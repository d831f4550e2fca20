"""Geometric decay `c_h(r) = γ_h^|r|` (RetNet: Sun et al., "Retentive Network: A Successor
to Transformer for Large Language Models", 2023, Eq. 5-6 and §2.2 "γ = 1 − 2^(−5−arange(h))").

ALiBi is its special case `γ_h = e^(-m_h)` with fixed slopes; KERPLE power with `p = 1`
floors its coefficient at 0.01 and cannot reach `γ > 0.990`. This term takes any `γ_h` in
`(0, 1]`: `γ_h = 1` is no decay, and decays as close to 1 as `1 − 1e-9` keep their value,
because the term stores `log γ_h` (a fixed buffer) or `log(−log γ_h)` (a learned
parameter), never `γ_h` itself: in float32 `1 − 1e-9` rounds to 1, `log(1e-9)` does not.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._validate import FastRPEError
from .base import Position, compute_dtype

#: largest learned rate `−log γ`: `γ >= e^-80 ≈ 1.8e-35` stays a normal float32, so no
#: optimizer step can make `γ = 0` (where `|r|·log γ` would be `0·(−inf)` at `r = 0`).
MAX_RATE = 80.0


def retnet_gammas(num_heads: int) -> list[float]:
    """RetNet's per-head decays `γ_h = 1 − 2^(−5−h)`, `h = 0..H-1`."""
    return [1.0 - 2.0 ** (-5 - h) for h in range(num_heads)]


def _log_gammas(gamma, num_heads: int) -> list[float]:
    """`[H]` values of `log γ_h` (float64 arithmetic), refusing anything outside (0, 1]."""
    g = torch.as_tensor(gamma, dtype=torch.float64).detach().flatten().tolist()
    if len(g) == 1:
        g = g * num_heads
    if len(g) != num_heads:
        raise FastRPEError(f"gamma: expected 1 or {num_heads} values (one per head), got {len(g)}")
    for x in g:
        if not 0.0 < x <= 1.0:  # also refuses NaN
            raise FastRPEError(f"gamma: every decay must be in (0, 1], got {x}")
    return [math.log(x) for x in g]


class GeometricDecay(Position):
    """Geometric decay: `b_h(r) = |r|·log γ_h`, i.e. `c_h(r) = γ_h^|r|`, `γ_h ∈ (0, 1]`.

    From "Retentive Network: A Successor to Transformer for Large Language Models" (Sun et
    al., 2023): the decay of retention, here usable with any content kernel. Causal
    attention sees `r <= 0`; `|r|` makes the term symmetric for bidirectional attention.
    `geometric_decay()` returns `γ`, so every backend that runs ALiBi runs this term
    (chunked and decoding's constant-size state exactly; dense, fft, flex as a bias).

    Args:
        num_heads: H.
        gamma: decays, a number or `[H]` values in (0, 1] (default RetNet's
            `1 − 2^(−5−h)`). Pass values near 1 as floats, e.g. `1 - 1e-9`.
        learnable: learn the decays. They are stored as `raw_rate = log(−log γ)` and mapped
            by `γ = exp(−exp(min(raw_rate, log MAX_RATE)))`, so no optimizer step can leave
            `e^-80 <= γ <= 1`; a learnable `γ = 1` (rate 0, where the gradient vanishes) is
            refused: pass a value below 1 or `learnable=False`.

    Buffer `fixed_log_gamma: [H]` or parameter `raw_rate: [H]`; properties `log_gamma`, `gamma`.
    """

    def __init__(self, num_heads: int, gamma=None, learnable: bool = False):
        super().__init__(num_heads)
        logs = _log_gammas(retnet_gammas(num_heads) if gamma is None else gamma, num_heads)
        self.learnable = bool(learnable)
        if self.learnable:
            if any(x == 0.0 for x in logs):
                raise FastRPEError("gamma: a learnable decay must be below 1 (γ = 1 has no gradient); "
                                   "pass e.g. 1 - 1e-6, or learnable=False")
            if any(-x > MAX_RATE for x in logs):
                raise FastRPEError(f"gamma: a learnable decay must be >= exp(-{MAX_RATE:g})")
            self.raw_rate = nn.Parameter(torch.tensor([math.log(-x) for x in logs], dtype=torch.float32))
        else:
            self.register_buffer("fixed_log_gamma", torch.tensor(logs, dtype=torch.float32))

    @property
    def log_gamma(self) -> Tensor:
        """`[H]` values `log γ_h <= 0`."""
        if not self.learnable:
            return self.fixed_log_gamma
        return -torch.exp(self.raw_rate.to(compute_dtype(self.raw_rate)).clamp(max=math.log(MAX_RATE)))

    @property
    def gamma(self) -> Tensor:
        """`[H]` decays `γ_h` (in float32, values within 6e-8 of 1 read as 1; `log_gamma` keeps them)."""
        return torch.exp(self.log_gamma)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        lg = self.log_gamma
        return lg[h] * r.abs().to(compute_dtype(lg))

    def geometric_decay(self) -> Tensor:
        """`[H]` decays γ: the linear-time causal form `c(r) = γ^|r|` (float64, as `ALiBi`'s)."""
        return torch.exp(self.log_gamma.to(torch.float64))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, learnable={self.learnable}"
