"""FastRPB 2D with the paper's single shared vector (FastRPB §3.2.2: "shared learnable
parameters {w_i}, i = -N+1..N-1, for horizontal and vertical distances"):
`W_(a,b),(c,d) = w(c − a) + w(d − b)`, against that formula written as loops, through the
FFT op and through `fastrpe.attention`, forward and gradients, square and non-square grids."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe.positions import FastRPB2D
from fastrpe.testing import assert_close

F64 = torch.float64
GRIDS = [(1, 1), (3, 3), (2, 5), (5, 2)]


def _term(grid, cls, seed=0):
    t = FastRPB2D(2, grid, cls_token=cls, shared=True).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    return t


def _reference(w, w_cls, v, grid, cls):
    """`W·v` from the formula: patches at row-major (a, b); `w: [H, 2n-1]`, `w(Δ)` at `Δ + n − 1`."""
    Hg, Wg = grid
    n = (w.shape[1] + 1) // 2
    coords = ([None] if cls else []) + [(a, b) for a in range(Hg) for b in range(Wg)]
    H, N = w.shape[0], len(coords)
    rows = []
    for h in range(H):
        W = [[None] * N for _ in range(N)]
        for i, qi in enumerate(coords):
            for j, kj in enumerate(coords):
                if qi is None and kj is None:
                    W[i][j] = w_cls[h, 2]
                elif qi is None:
                    W[i][j] = w_cls[h, 0]  # class token (query) → patch
                elif kj is None:
                    W[i][j] = w_cls[h, 1]  # patch → class token
                else:
                    W[i][j] = w[h, kj[0] - qi[0] + n - 1] + w[h, kj[1] - qi[1] + n - 1]
        rows.append(torch.stack([torch.stack(r) for r in W]))
    return torch.einsum("hij,bhjd->bhid", torch.stack(rows), v)


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", GRIDS, ids=[f"{a}x{b}" for a, b in GRIDS])
def test_shared_vector_matches_the_formula(grid, cls):
    t = _term(grid, cls)
    n = max(grid)
    assert t.w.shape == (2, 2 * n - 1) and not hasattr(t, "w_row")
    N = t.seq_len
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 2, N, 4, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(2, 2, N, 3, generator=g, dtype=F64, requires_grad=True)
    out = fr.attention(q, k, v, kernel="elu", position=t)
    base = fr.attention(q, k, v, kernel="elu", position=None, backend="dense")
    ref = base + _reference(t.w, t.w_cls, v, grid, cls)
    assert_close(out, ref)
    assert_close(t.materialize() @ v, ref - base)
    u = torch.randn_like(ref)
    params = [v, t.w] + ([t.w_cls] if cls else [])
    for a, b in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
        assert_close(a, b)


def test_shared_is_separate_with_equal_vectors():
    shared = _term((3, 5), cls=True)
    sep = FastRPB2D(2, (3, 5), cls_token=True).double()
    with torch.no_grad():
        sep.w_row.copy_(shared.w[:, 2:7])  # n = 5: Δrow in -2..2 sits at Δ + 4
        sep.w_col.copy_(shared.w)
        sep.w_cls.copy_(shared.w_cls)
    assert torch.equal(shared.materialize(), sep.materialize())
    assert sum(p.numel() for p in shared.parameters()) == 2 * 9 + 2 * 3


def test_shared_refuses_a_non_bool():
    with pytest.raises(ValueError, match="shared"):
        FastRPB2D(2, (3, 3), shared=1)
