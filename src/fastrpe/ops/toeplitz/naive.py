"""Toeplitz (1D) and Toeplitz-block-Toeplitz (2D grid) matrices times a batch of vectors,
by materializing the matrix: the references of `fft.py` and `fft2d.py`."""
from __future__ import annotations

from torch import Tensor

from ..common import check_grid, grid_offset_index, toeplitz_index


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


def check_grid_table(table: Tensor, x: Tensor, grid) -> tuple[int, int]:
    Hg, Wg = check_grid(grid)
    if table.shape[-2:] != (2 * Hg - 1, 2 * Wg - 1):
        raise ValueError(f"table must be [.., H, {2 * Hg - 1}, {2 * Wg - 1}] for grid {(Hg, Wg)}, "
                         f"got {list(table.shape)}")
    if x.dim() != 4 or x.shape[2] != Hg * Wg:
        raise ValueError(f"x must be [B, H, Hg·Wg = {Hg * Wg}, C], got {list(x.shape)}")
    return Hg, Wg


def toeplitz2d_matmul_naive(table: Tensor, x: Tensor, grid) -> Tensor:
    """`y_(a,b) = Σ_(c,d) table[c-a+Hg-1, d-b+Wg-1]·x_(c,d)` by materializing the `[P, P]` matrix.

    Args:
        table: `[H, 2Hg-1, 2Wg-1]` (or `[B, H, 2Hg-1, 2Wg-1]`): offset `(Δrow, Δcol)` = key − query
            at `[Δrow + Hg - 1, Δcol + Wg - 1]`.
        x: `[B, H, Hg·Wg, C]`, patches row-major.
        grid: `(Hg, Wg)`.

    Returns:
        `[B, H, Hg·Wg, C]`.
    """
    check_grid_table(table, x, grid)
    dr, dc = grid_offset_index(grid, device=table.device)
    return table[..., dr, dc].to(x.dtype) @ x  # (.., H, P, P) @ (B, H, P, C)
