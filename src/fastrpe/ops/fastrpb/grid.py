"""FastRPB's additive 2D term `W·v` on an image grid, with a separable W, without
materializing W (the reference is `naive.fastrpb2d_naive`).

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

from ..common import CLS_TO_CLS, CLS_TO_PATCH, PATCH_TO_CLS
from ..toeplitz.fft import fft_dtype_for, toeplitz_matmul_fft
from .naive import check_fastrpb2d_inputs


def fastrpb2d_fft(w_row: Tensor, w_col: Tensor, v: Tensor, grid, w_cls: Tensor | None = None) -> Tensor:
    """Same signature and result as `fastrpb2d_naive`, without materializing W: row and
    column sums, two 1D Toeplitz products by FFT (float32, or float64 for float64 inputs),
    and the class token's row and column added exactly."""
    Hg, Wg = check_fastrpb2d_inputs(w_row, w_col, v, grid, w_cls)
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
