"""FastRPB's additive term `W·v` with `W_ij = w(j - i)`, by materializing W (the reference).

"FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks" (Zubkov &
Gavrilov, ICLR 2022 submission): `Y = Attention(Q, K, V) + W·V`, W a learned Toeplitz
matrix per head; not normalized.
"""
from __future__ import annotations

from torch import Tensor

from ..common import causal_offset_mask
from ..toeplitz.naive import toeplitz_matmul_naive


def check_fastrpb_inputs(w_coeff: Tensor, v: Tensor, Lq: int) -> None:
    """`w_coeff: [H, Lq+Lk-1]`, `v: [B, H, Lk, Dv]`."""
    if v.dim() != 4:
        raise ValueError(f"v must be [B, H, Lk, Dv], got {list(v.shape)}")
    H, Lk = v.shape[1], v.shape[2]
    if w_coeff.dim() != 2 or tuple(w_coeff.shape) != (H, Lq + Lk - 1):
        raise ValueError(f"w_coeff must be [H, Lq+Lk-1] = {[H, Lq + Lk - 1]}, got {list(w_coeff.shape)}")


def fastrpb_naive(w_coeff: Tensor, v: Tensor, Lq: int, *, causal: bool = False, q_offset: int = 0) -> Tensor:
    """`y_i = Σ_j w(j - i)·v_j`, by materializing W.

    Args:
        w_coeff: `[H, Lq+Lk-1]`: `w_h(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset`.
        v: `[B, H, Lk, Dv]`, keys at positions `0..Lk-1`.
        Lq: number of queries (positions `q_offset + 0..Lq-1`).
        causal: drop `r > 0` (keys after the query).
        q_offset: position of the first query (only used by causal; w_coeff already encodes it).

    Returns:
        `[B, H, Lq, Dv]` in v's dtype; not normalized.
    """
    check_fastrpb_inputs(w_coeff, v, Lq)
    if causal:
        w_coeff = w_coeff * causal_offset_mask(Lq, v.shape[2], q_offset, device=w_coeff.device).to(w_coeff.dtype)
    return toeplitz_matmul_naive(w_coeff, v, Lq)
