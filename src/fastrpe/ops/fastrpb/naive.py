"""FastRPB's additive term `W·v` by materializing W (the references of `fft.py` and
`grid.py`): 1D `W_ij = w(j - i)`; 2D on a grid `W_ij = w_row(Δrow) + w_col(Δcol)`.

"FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks" (Zubkov &
Gavrilov, ICLR 2022 submission): `Y = Attention(Q, K, V) + W·V`, W a learned Toeplitz
matrix per head; not normalized.
"""
from __future__ import annotations

from torch import Tensor

from ..common import causal_offset_mask, check_grid, materialize_grid
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


def check_fastrpb2d_inputs(w_row: Tensor, w_col: Tensor, v: Tensor, grid, w_cls: Tensor | None) -> tuple[int, int]:
    Hg, Wg = check_grid(grid)
    N = Hg * Wg + (w_cls is not None)
    if v.dim() != 4 or v.shape[2] != N:
        raise ValueError(f"v must be [B, H, N = {N}, Dv] for grid {(Hg, Wg)}"
                         f"{' + class token' if w_cls is not None else ''}, got {list(v.shape)}")
    H = v.shape[1]
    for name, t, n in (("w_row", w_row, 2 * Hg - 1), ("w_col", w_col, 2 * Wg - 1), ("w_cls", w_cls, 3)):
        if t is not None and tuple(t.shape) != (H, n):
            raise ValueError(f"{name} must be [H, {n}] = {[H, n]}, got {list(t.shape)}")
    return Hg, Wg


def fastrpb2d_matrix(w_row: Tensor, w_col: Tensor, grid, w_cls: Tensor | None = None) -> Tensor:
    """`[H, N, N]` dense W: `w_row(Δrow) + w_col(Δcol)` between patches, `w_cls` entries for the class token."""
    table = w_row[:, :, None] + w_col[:, None, :]  # (H, 2Hg-1, 2Wg-1)
    return materialize_grid(table, grid, w_cls)


def fastrpb2d_naive(w_row: Tensor, w_col: Tensor, v: Tensor, grid, w_cls: Tensor | None = None) -> Tensor:
    """`W·v` by materializing W (the reference).

    Args:
        w_row: `[H, 2Hg-1]`, `w(Δrow)` at `Δrow + Hg - 1`; w_col: `[H, 2Wg-1]`, `w(Δcol)` at `Δcol + Wg - 1`.
        v: `[B, H, N, Dv]`, `N = Hg·Wg` (+1 with a class token at index 0), patches row-major.
        grid: `(Hg, Wg)`.
        w_cls: `[H, 3]` class-token entries (cls → patch, patch → cls, cls → cls), or None.

    Returns:
        `[B, H, N, Dv]`, not normalized.
    """
    check_fastrpb2d_inputs(w_row, w_col, v, grid, w_cls)
    return fastrpb2d_matrix(w_row, w_col, grid, w_cls).to(v.dtype) @ v
