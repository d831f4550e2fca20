"""Toeplitz-block-Toeplitz matrix (a 2D relative-position table on a grid) times a batch
of vectors by 2D FFT (the naive reference is `naive.toeplitz2d_matmul_naive`).

Notation: H heads, grid `(Hg, Wg)`, `P = Hg·Wg` patches flattened row-major, C channels,
`(N1, N2)` FFT size. Table entry `[Δrow + Hg - 1, Δcol + Wg - 1]` is the coefficient of
offset `(Δrow, Δcol)` = key − query, so

    y_(a,b) = Σ_(c,d) table[c - a + Hg - 1, d - b + Wg - 1] · x_(c,d).

That is a 2D cross-correlation: with `K = flip(table)` (both axes),
`y_(a,b) = (K * x)[a + Hg - 1, b + Wg - 1]`, and a circular convolution of size
`N1 >= 2Hg - 1`, `N2 >= 2Wg - 1` (the table embedded in a 2D circulant) leaves the rows
we keep free of wrap-around.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import check_grid
from .fft import fft_dtype_for
from .naive import check_grid_table


def fft_good_size(n: int) -> int:
    """Smallest `2^a·3^b·5^c >= n`: fast for every FFT library and, in 2D, up to ~4x
    fewer points than rounding both axes to powers of two."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


def fft2d_size(grid) -> tuple[int, int]:
    """`(N1, N2)`: the 2D circulant size used for `grid`, each axis `>= 2·side - 1`."""
    Hg, Wg = check_grid(grid)
    return fft_good_size(2 * Hg - 1), fft_good_size(2 * Wg - 1)


def table_spectrum(table: Tensor, size: tuple[int, int]) -> Tensor:
    """`rfft2(flip(table))`: `[..., 2Hg-1, 2Wg-1] -> [..., N1, N2//2+1]` complex."""
    return torch.fft.rfft2(table.flip(-2, -1), s=size)


def apply_spectrum2d(tf: Tensor, x: Tensor, grid, size: tuple[int, int]) -> Tensor:
    """The 2D Toeplitz product given the flipped table's spectrum.

    Args:
        tf: `[H, N1, N2//2+1]` or `[B, H, N1, N2//2+1]` (from `table_spectrum`).
        x: `[B, H, K, Hg, Wg]` channels-first grids (real, FFT dtype).

    Returns:
        `[B, H, K, Hg, Wg]`.
    """
    Hg, Wg = grid
    xf = torch.fft.rfft2(x, s=size)  # (B, H, K, N1, N2//2+1)
    y = torch.fft.irfft2(xf * tf.unsqueeze(-3), s=size)  # (B, H, K, N1, N2)
    return y[..., Hg - 1: 2 * Hg - 1, Wg - 1: 2 * Wg - 1]


def toeplitz2d_matmul_fft(table: Tensor, x: Tensor, grid, *, fft_dtype: torch.dtype | None = None) -> Tensor:
    """Same signature and result as `toeplitz2d_matmul_naive`, by a 2D real FFT in
    O(P log P) per channel.

    Args:
        table: `[H, 2Hg-1, 2Wg-1]` or `[B, H, 2Hg-1, 2Wg-1]`.
        x: `[B, H, Hg·Wg, C]`.
        grid: `(Hg, Wg)`.
        fft_dtype: float32 or float64 (default: float64 for float64 inputs, else float32).

    Returns:
        `[B, H, Hg·Wg, C]` in x's dtype.
    """
    Hg, Wg = check_grid_table(table, x, grid)
    dt = fft_dtype or fft_dtype_for(x.dtype)
    size = fft2d_size(grid)
    tf = table_spectrum(table.to(dt), size)
    xg = x.to(dt).transpose(-1, -2).unflatten(-1, (Hg, Wg))  # (B, H, C, Hg, Wg)
    y = apply_spectrum2d(tf, xg, (Hg, Wg), size)  # (B, H, C, Hg, Wg)
    return y.flatten(-2).transpose(-1, -2).to(x.dtype)  # (B, H, P, C)
