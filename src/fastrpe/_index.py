"""Offset and grid index arithmetic, shared by `fastrpe.positions` and `fastrpe.ops`.

A leaf module (it imports torch only) so that neither package imports the other: positional
terms compute their coefficients with it, ops index their inputs with it. The ops-facing
names are re-exported by `fastrpe.ops.common`.

Notation: `Lq` queries at positions `q_offset + 0..Lq-1`, `Lk` keys at `0..Lk-1`, offset
`r = j - i` (key minus query); a grid `(Hg, Wg)` of `P = Hg·Wg` patches flattened row-major,
optionally preceded by one class token (index 0), `N = cls + P` tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["offsets", "toeplitz_index", "CLS_TO_PATCH", "PATCH_TO_CLS", "CLS_TO_CLS", "check_grid",
           "grid_offset_index", "materialize_grid"]

#: order of the class-token entries in a `[H, 3]` tensor ("x → y": query x attends to key y)
CLS_TO_PATCH, PATCH_TO_CLS, CLS_TO_CLS = 0, 1, 2


def offsets(Lq: int, Lk: int, q_offset: int = 0, device=None) -> Tensor:
    """The `Lq + Lk - 1` offsets `r = -(Lq-1+q_offset) .. Lk-1-q_offset`, as int64."""
    return torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, device=device)


def toeplitz_index(Lq: int, Lk: int, device=None) -> Tensor:
    """`[Lq, Lk]` index into an offsets vector: entry `(i, j)` holds `j - i + Lq - 1`."""
    i = torch.arange(Lq, device=device)[:, None]
    j = torch.arange(Lk, device=device)[None, :]
    return j - i + (Lq - 1)


def check_grid(grid) -> tuple[int, int]:
    """`grid` as a validated `(Hg, Wg)` pair of positive ints."""
    try:
        Hg, Wg = grid
    except (TypeError, ValueError):
        raise ValueError(f"grid must be a pair (Hg, Wg), got {grid!r}") from None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (Hg, Wg)):
        raise ValueError(f"grid must be a pair of positive ints, got {grid!r}")
    return Hg, Wg


def grid_offset_index(grid, device=None) -> tuple[Tensor, Tensor]:
    """Two `[P, P]` int64 indices into a `[.., 2Hg-1, 2Wg-1]` table: entry `(i, j)` holds
    `Δrow + Hg - 1` and `Δcol + Wg - 1` for query patch i and key patch j (row-major)."""
    Hg, Wg = check_grid(grid)
    p = torch.arange(Hg * Wg, device=device)
    row, col = p // Wg, p % Wg
    return row[None, :] - row[:, None] + (Hg - 1), col[None, :] - col[:, None] + (Wg - 1)


def materialize_grid(table: Tensor, grid, cls_coeff: Tensor | None = None) -> Tensor:
    """`[H, N, N]` dense matrix from a 2D table and optional class-token coefficients.

    Args:
        table: `[H, 2Hg-1, 2Wg-1]`, the value of offset `(Δrow, Δcol)` at `[Δrow+Hg-1, Δcol+Wg-1]`.
        grid: `(Hg, Wg)`.
        cls_coeff: `[H, 3]` (cls → patch, patch → cls, cls → cls), or None for no class token.

    Returns:
        `[H, N, N]` with `N = Hg·Wg (+1)`; entry `(i, j)` for query i, key j.
    """
    Hg, Wg = check_grid(grid)
    if table.shape[-2:] != (2 * Hg - 1, 2 * Wg - 1):
        raise ValueError(f"table must be [H, {2 * Hg - 1}, {2 * Wg - 1}] for grid {(Hg, Wg)}, "
                         f"got {list(table.shape)}")
    dr, dc = grid_offset_index(grid, device=table.device)
    patch = table[:, dr, dc]  # (H, P, P)
    if cls_coeff is None:
        return patch
    H, P = table.shape[0], Hg * Wg
    cc = cls_coeff.to(table.dtype)
    top = torch.cat([cc[:, CLS_TO_CLS, None], cc[:, CLS_TO_PATCH, None].expand(H, P)], dim=-1)  # (H, N)
    rest = torch.cat([cc[:, PATCH_TO_CLS, None, None].expand(H, P, 1), patch], dim=-1)  # (H, P, N)
    return torch.cat([top[:, None], rest], dim=1)  # (H, N, N)
