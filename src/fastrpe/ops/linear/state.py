"""Decode states: what a causal layer keeps between `step` calls, one class per kind.

* `KVCache`: the keys and values so far (exact for every term and kernel; grows with L).
* `LinearState`: `Σ_j γ^(t-j) φ(k_j) ⊗ [v_j, 1]`, constant size (no term, geometric decays).
* `BandState`: a finite-support term's constant tail sum and its last W keys (exact).
* `SoEState`: K geometric states of the sum-of-exponentials fit and its last W-1 keys.

Notation: B batch, H heads, S keys so far, D head dim, F features, C = Dv + 1, K terms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from .soe import SoEPlan


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, `[B, H, S, D]` each (empty: None).

    Exact for every positional term and kernel: each step attends to the whole
    cache with the queries at positions `S_before .. S_before + L - 1`."""

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def select(self, index: Tensor) -> KVCache:
        """The cache of batch rows `index` (beam search reorders with it)."""
        return self if self.k is None else KVCache(self.k[index], self.v[index])

    def nbytes(self) -> int:
        return _nbytes(self.k, self.v)


@dataclass
class LinearState:
    """Constant-size decode state of causal kernelized attention with a geometric decay
    (or none): `S = Σ_j γ^(t-j) φ(k_j) ⊗ [v_j, 1]`, `[B, H, F, Dv+1]`, after `length` tokens."""

    S: Tensor
    length: int

    def select(self, index: Tensor) -> LinearState:
        return LinearState(self.S[index], self.length)

    def nbytes(self) -> int:
        return _nbytes(self.S)


@dataclass
class BandState:
    """Constant-size decode state of a finite-support term (`b(r) = b(-W)` for `r <= -W`) after
    `length` tokens: the tail sum of every key at least W before the next token,
    `S: [B, H, F, Dv+1]`, and the features and values of the last `<= W` tokens,
    `keys: [B, H, <=W, F]`, `values: [B, H, <=W, Dv]`. Exact."""

    S: Tensor
    keys: Tensor
    values: Tensor
    window: int
    length: int

    def select(self, index: Tensor) -> BandState:
        return BandState(self.S[index], self.keys[index], self.values[index], self.window, self.length)

    def nbytes(self) -> int:
        return _nbytes(self.S, self.keys, self.values)


@dataclass
class SoEState:
    """Constant-size decode state of the sum-of-exponentials form after `length` tokens:
    one geometric state per term, `S: [B, H, K, F, Dv+1]`, and the features and values of
    the last `W - 1` tokens for the exact band, `keys: [B, H, <W, F]`, `values: [B, H, <W, Dv+1]`."""

    S: Tensor
    keys: Tensor
    values: Tensor
    plan: SoEPlan
    length: int

    def select(self, index: Tensor) -> SoEState:
        return SoEState(self.S[index], self.keys[index], self.values[index], self.plan, self.length)

    def nbytes(self) -> int:
        return _nbytes(self.S, self.keys, self.values)
