"""FastRPB's additive 2D term `W·v` on an image grid, with a separable W: naive reference
and the fast form.

"FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks" (ICLR 2022
submission): between patches `W_ij = w_row(Δrow) + w_col(Δcol)` (Δ = key − query); with a
class token (index 0), its row and column of W are learned scalars.

Separability splits the product into two 1D Toeplitz products:

    y_(a,b) = Σ_(c,d) (w_row(c-a) + w_col(d-b))·v_(c,d)
            = Σ_c w_row(c-a)·R_c + Σ_d w_col(d-b)·K_d,

with `R_c = Σ_d v_(c,d)` (row sums) and `K_d = Σ_c v_(c,d)` (column sums): a Toeplitz
product over the Hg rows of the row sums (the same for every column b) plus one over the
Wg columns of the column sums (the same for every row a). O(N·Dv) plus two 1D FFTs.

Notation: B batch, H heads, grid `(Hg, Wg)`, `P = Hg·Wg`, `N = cls + P`, Dv value width.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import CLS_TO_CLS, CLS_TO_PATCH, PATCH_TO_CLS, check_grid, materialize_grid
from ..toeplitz.fft import fft_dtype_for, toeplitz_matmul_fft


def _check(w_row: Tensor, w_col: Tensor, v: Tensor, grid, w_cls: Tensor | None) -> tuple[int, int]:
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
    _check(w_row, w_col, v, grid, w_cls)
    return fastrpb2d_matrix(w_row, w_col, grid, w_cls).to(v.dtype) @ v


def fastrpb2d_fft(w_row: Tensor, w_col: Tensor, v: Tensor, grid, w_cls: Tensor | None = None) -> Tensor:
    """Same signature and result as `fastrpb2d_naive`, without materializing W: row and
    column sums, two 1D Toeplitz products by FFT (float32, or float64 for float64 inputs),
    and the class token's row and column added exactly."""
    Hg, Wg = _check(w_row, w_col, v, grid, w_cls)
    dt = fft_dtype_for(v.dtype)
    x = v.to(dt)
    ncls = int(w_cls is not None)
    xg = x[:, :, ncls:].unflatten(2, (Hg, Wg))  # (B, H, Hg, Wg, Dv)
    y_row = toeplitz_matmul_fft(w_row.to(dt), xg.sum(3), Hg)  # (B, H, Hg, Dv): Σ_c w_row(c-a)·R_c
    y_col = toeplitz_matmul_fft(w_col.to(dt), xg.sum(2), Wg)  # (B, H, Wg, Dv): Σ_d w_col(d-b)·K_d
    y = (y_row[:, :, :, None] + y_col[:, :, None]).flatten(2, 3)  # (B, H, P, Dv)
    if w_cls is not None:
        w = w_cls.to(dt)[None, :, :, None, None]  # (1, H, 3, 1, 1)
        v0 = x[:, :, :1]  # (B, H, 1, Dv)
        y0 = w[:, :, CLS_TO_PATCH] * xg.sum((2, 3))[:, :, None] + w[:, :, CLS_TO_CLS] * v0  # (B, H, 1, Dv)
        y = torch.cat([y0, y + w[:, :, PATCH_TO_CLS] * v0], dim=2)  # (B, H, N, Dv)
    return y.to(v.dtype)
