"""2D positional terms for images: an `Hg × Wg` grid of patches flattened row-major,
optionally preceded by one class token at index 0.

Notation: `H` heads, grid `(Hg, Wg)`, `P = Hg·Wg` patches, `N = cls + P` tokens
(self-attention only: `Lq = Lk = N`, queries and keys are the same tokens). Token
`t >= cls` is the patch `p = t - cls` at `(row, col) = (p // Wg, p % Wg)`. The offset
between a query at `(a, b)` and a key at `(c, d)` is `(Δrow, Δcol) = (c - a, d - b)`
(key minus query, as in 1D). A 2D table `[H, 2Hg-1, 2Wg-1]` holds offset
`(Δrow, Δcol)` at `[Δrow + Hg - 1, Δcol + Wg - 1]`.

The class token has no grid position; it gets its own learned coefficients per head,
`[H, 3]` in the order (cls → patch, patch → cls, cls → cls), where "x → y" means a
query x attending to a key y.

Two kinds, as in 1D:
* `GridPosition` (log-coefficients `b_h(Δrow, Δcol)`: softmax adds them to the scores,
  kernelized attention weighs by `exp(b)`): `Table2D` (Swin-style learned table).
* `FastRPB2D`: the additive `W·v` term with a separable `W`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

# index arithmetic from the leaf module shared with the ops (positions never import fastrpe.ops);
# the names stay importable from here
from .._index import (CLS_TO_CLS, CLS_TO_PATCH, PATCH_TO_CLS, check_grid, grid_offset_index,  # noqa: F401
                      materialize_grid)
from .base import AdditiveTerm, Position, init_normal



class GridTerm:
    """What every 2D term has (a small protocol the dispatcher checks with `isinstance`):
    `grid = (Hg, Wg)`, `cls_token`, and `seq_len = N`, the only length it applies to
    (non-causal self-attention, `q_offset = 0`)."""

    grid: tuple[int, int]
    cls_token: bool

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def seq_len(self) -> int:
        """`N = cls + Hg·Wg`: the only sequence length this term applies to."""
        return int(self.cls_token) + self.num_patches


class GridPosition(GridTerm, Position):
    """Base class of 2D log-coefficient terms `b_h(Δrow, Δcol)` on an `Hg × Wg` grid.

    Subclasses implement `table()` (and `cls_coefficients()` when they support a class
    token); `materialize` and `score_mod` follow from them. Being a `Position`, a grid
    term is accepted wherever one is, but it has no 1D offsets: `log_coefficients` and
    `bias` raise, and `materialize`/`score_mod` only accept the grid's own length `N`
    with `q_offset = 0` (self-attention, non-causal).

    Args:
        num_heads: H.
        grid: `(Hg, Wg)` patches.
        cls_token: one class token at index 0 precedes the patches.
    """

    softmax_only: bool = False
    kernelized_refusal: str | None = None
    score_mod_gathers = True

    def __init__(self, num_heads: int, grid, cls_token: bool = False):
        super().__init__(num_heads)
        self.grid = check_grid(grid)
        if not isinstance(cls_token, bool):
            raise ValueError(f"cls_token must be a bool, got {cls_token!r}")
        self.cls_token = cls_token

    def table(self) -> Tensor:  # pragma: no cover - abstract
        """`[H, 2Hg-1, 2Wg-1]`: `b_h(Δrow, Δcol)` at `[Δrow + Hg - 1, Δcol + Wg - 1]`."""
        raise NotImplementedError

    def cls_coefficients(self) -> Tensor | None:
        """`[H, 3]`: class-token log-coefficients (cls → patch, patch → cls, cls → cls), or None."""
        return None

    def _check_call(self, Lq: int | None, Lk: int | None, q_offset: int) -> None:
        N = self.seq_len
        if (Lq is not None and Lq != N) or (Lk is not None and Lk != N) or q_offset != 0:
            raise ValueError(
                f"{type(self).__name__} on grid {self.grid}{' with a class token' if self.cls_token else ''} "
                f"applies to self-attention over N = {N} tokens with q_offset = 0; "
                f"got Lq={Lq}, Lk={Lk}, q_offset={q_offset}")

    def log_coefficients(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        raise TypeError(f"{type(self).__name__} is a 2D term with no 1D offsets: use table() "
                        "(and cls_coefficients()) with the grid ops in fastrpe.ops.linear.grid")

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        raise TypeError(f"{type(self).__name__} is a 2D term with no 1D offsets: use table()")

    def materialize(self, Lq: int | None = None, Lk: int | None = None, q_offset: int = 0) -> Tensor:
        """`[H, N, N]` dense log-bias `b_h(Δrow, Δcol)` (class-token entries from
        `cls_coefficients()`). For tests and debugging only. `Lq`, `Lk`, `q_offset` are
        accepted for the 1D signature and must be `N`, `N`, 0."""
        self._check_call(Lq, Lk, q_offset)
        return materialize_grid(self.table(), self.grid, self.cls_coefficients())

    def score_mod(self, q_offset: int = 0) -> Callable:
        """A FlexAttention `score_mod(score, b, h, q_idx, kv_idx)` adding `b_h`; rows and
        columns come from the token indices by elementwise ops (no materialized bias)."""
        self._check_call(None, None, q_offset)
        Hg, Wg = self.grid
        tab = self.table()  # (H, 2Hg-1, 2Wg-1)
        cc = self.cls_coefficients()  # (H, 3) or None
        ncls = int(self.cls_token)

        def mod(score, b, h, q_idx, kv_idx):
            pq = (q_idx - ncls).clamp(min=0)  # patch index (the class token maps to 0, overridden below)
            pk = (kv_idx - ncls).clamp(min=0)
            dr = pk // Wg - pq // Wg + (Hg - 1)
            dc = pk % Wg - pq % Wg + (Wg - 1)
            bias = tab[h, dr, dc]
            if cc is not None:
                q_cls, k_cls = q_idx < ncls, kv_idx < ncls
                c = torch.where(q_cls & k_cls, cc[h, CLS_TO_CLS],
                                torch.where(q_cls, cc[h, CLS_TO_PATCH], cc[h, PATCH_TO_CLS]))
                bias = torch.where(q_cls | k_cls, c, bias)
            return score + bias.to(score.dtype)

        return mod

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, grid={self.grid}, cls_token={self.cls_token}"


class Table2D(GridPosition):
    """One learned scalar per head and 2D offset, `b_h(Δrow, Δcol)`, as Swin's relative
    position bias table.

    From "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows" (Liu et
    al., ICCV 2021), on a whole image grid instead of a window; used as the 2D RPE of
    kernelized attention in "Stable, Fast and Accurate: Kernelized Attention with Relative
    Positional Encoding" (Luo et al., NeurIPS 2021).

    Args:
        num_heads: H.
        grid: `(Hg, Wg)` patches, flattened row-major.
        cls_token: one class token at index 0; it gets three learned scalars per head
            (cls → patch, patch → cls, cls → cls).
        init_std: std of the normal initialization (0 gives all zeros).

    Parameters `rel_table: [H, 2Hg-1, 2Wg-1]` (offset `(Δrow, Δcol)` at
    `[Δrow + Hg - 1, Δcol + Wg - 1]`) and, with a class token, `cls_table: [H, 3]`.
    """

    def __init__(self, num_heads: int, grid, cls_token: bool = False, init_std: float = 0.0):
        super().__init__(num_heads, grid, cls_token)
        Hg, Wg = self.grid
        self.rel_table = nn.Parameter(init_normal(num_heads, 2 * Hg - 1, 2 * Wg - 1, std=init_std))
        self.cls_table = nn.Parameter(init_normal(num_heads, 3, std=init_std)) if cls_token else None

    def table(self) -> Tensor:
        return self.rel_table

    def cls_coefficients(self) -> Tensor | None:
        return self.cls_table


class FastRPB2D(GridTerm, AdditiveTerm):
    """FastRPB's additive 2D term `out += W·v` with a separable
    `W_ij = w_h^row(Δrow) + w_h^col(Δcol)`; not normalized.

    From "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks"
    (ICLR 2022 submission). Separability makes `W·v` two 1D Toeplitz products (over
    row sums and column sums, see `ops/fastrpb/grid.py`), O(N·Dv) plus two short FFTs.

    Args:
        num_heads: H.
        grid: `(Hg, Wg)` patches, flattened row-major.
        cls_token: one class token at index 0; its entries of W are three more learned
            scalars per head (cls → patch, patch → cls, cls → cls).
        init_std: normal initialization std (0: the term starts switched off).
        shared: one vector `w` for row and column offsets, `W_ij = w_h(Δrow) + w_h(Δcol)`, as
            the paper defines it (§3.2.2, "shared learnable parameters {w_i}, i = -N+1..N-1,
            for horizontal and vertical distances"); default False: separate vectors.

    Parameters `w_row: [H, 2Hg-1]` (`Δrow` at `Δrow + Hg - 1`), `w_col: [H, 2Wg-1]` or, when
    shared, `w: [H, 2n-1]` (`Δ` at `Δ + n - 1`, `n = max(Hg, Wg)`); with a class token
    `w_cls: [H, 3]`.
    """

    def __init__(self, num_heads: int, grid, cls_token: bool = False, init_std: float = 0.0, shared: bool = False):
        super().__init__(num_heads)
        if not isinstance(cls_token, bool):
            raise ValueError(f"cls_token must be a bool, got {cls_token!r}")
        if not isinstance(shared, bool):
            raise ValueError(f"shared must be a bool, got {shared!r}")
        self.grid = check_grid(grid)
        self.cls_token, self.shared = cls_token, shared
        Hg, Wg = self.grid
        if shared:
            self.w = nn.Parameter(init_normal(num_heads, 2 * max(Hg, Wg) - 1, std=init_std))
        else:
            self.w_row = nn.Parameter(init_normal(num_heads, 2 * Hg - 1, std=init_std))
            self.w_col = nn.Parameter(init_normal(num_heads, 2 * Wg - 1, std=init_std))
        self.w_cls = nn.Parameter(init_normal(num_heads, 3, std=init_std)) if cls_token else None

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """`(w_row: [H, 2Hg-1], w_col: [H, 2Wg-1], w_cls: [H, 3] or None)` (shared: slices of `w`)."""
        if not self.shared:
            return self.w_row, self.w_col, self.w_cls
        n = (self.w.shape[1] + 1) // 2
        Hg, Wg = self.grid
        return self.w[:, n - Hg: n + Hg - 1], self.w[:, n - Wg: n + Wg - 1], self.w_cls

    def table(self) -> Tensor:
        """`[H, 2Hg-1, 2Wg-1]`: the patch part of W as a 2D table, `w_row(Δrow) + w_col(Δcol)`."""
        w_row, w_col, _ = self.coefficients()
        return w_row[:, :, None] + w_col[:, None, :]

    def materialize(self, Lq: int | None = None, Lk: int | None = None, q_offset: int = 0) -> Tensor:
        """`[H, N, N]` dense W, for tests and debugging only (`Lq`, `Lk`, `q_offset` must be `N`, `N`, 0)."""
        self._check_call(Lq, Lk, q_offset, False)
        return materialize_grid(self.table(), self.grid, self.w_cls)

    def _check_call(self, Lq, Lk, q_offset, causal) -> None:
        N = self.seq_len
        if (Lq is not None and Lq != N) or (Lk is not None and Lk != N) or q_offset != 0 or causal:
            raise ValueError(
                f"FastRPB2D on grid {self.grid}{' with a class token' if self.cls_token else ''} applies to "
                f"non-causal self-attention over N = {N} tokens with q_offset = 0; "
                f"got Lq={Lq}, Lk={Lk}, q_offset={q_offset}, causal={causal}")

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, grid={self.grid}, cls_token={self.cls_token}, shared={self.shared}"
