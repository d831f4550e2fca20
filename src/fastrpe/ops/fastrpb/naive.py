"""FastRPB's additive term `W·v` with `W_ij = w(j - i)`, by materializing W (the reference)."""
from __future__ import annotations

from torch import Tensor

from ..common import causal_offset_mask
from ..toeplitz.naive import toeplitz_matmul_naive


def fastrpb_naive(w_coeff: Tensor, v: Tensor, Lq: int, *, causal: bool = False, q_offset: int = 0) -> Tensor:
    """`[B, H, Lq, Dv]`: `Σ_j w(j - i)·v_j` with `w_coeff: [H, Lq+Lk-1]` in offset order
    `-(Lq-1+q_offset) .. Lk-1-q_offset`; causal zeroes `r > 0`. Not normalized."""
    if causal:
        w_coeff = w_coeff * causal_offset_mask(Lq, v.shape[2], q_offset, device=w_coeff.device).to(w_coeff.dtype)
    return toeplitz_matmul_naive(w_coeff, v, Lq)
