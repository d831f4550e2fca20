"""Toeplitz matrix times a batch of vectors, by materializing the matrix (the reference)."""
from __future__ import annotations

from torch import Tensor

from ..common import toeplitz_index


def toeplitz_matmul_naive(coeff: Tensor, x: Tensor, Lq: int) -> Tensor:
    """`y_i = Σ_j coeff[j - i + Lq - 1]·x_j`.

    Args:
        coeff: `[H, Lq+Lk-1]` (or `[B, H, Lq+Lk-1]`): entry `r + Lq - 1 (+q_offset)` is the coefficient
            of offset `r = j - i`.
        x: `[B, H, Lk, C]`.
        Lq: number of output rows.

    Returns:
        `[B, H, Lq, C]`.
    """
    Lk = x.shape[2]
    T = coeff[..., toeplitz_index(Lq, Lk, device=coeff.device)]  # (.., H, Lq, Lk)
    return T.to(x.dtype) @ x
