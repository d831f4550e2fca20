"""2D grid positions (Table2D, FastRPB2D) and their ops: the FFT paths against their naive
references (forward and every gradient), the naive references against direct loops over
the formulas, the class token, padding, -inf coefficients, FlexAttention's score_mod."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.fastrpb.grid import fastrpb2d_fft
from fastrpe.ops.fastrpb.naive import fastrpb2d_naive
from fastrpe.ops.kernelized import FastRPB2DTerm, add_fastrpb
from fastrpe.ops.linear.grid import grid_fft_block_size, kernelized_num_den_grid_fft
from fastrpe.ops.linear.naive import kernelized_num_den_grid_naive, kernelized_num_den_naive
from fastrpe.ops.softmax.flex import flex_available, softmax_attention_flex
from fastrpe.ops.softmax.naive import softmax_attention_naive
from fastrpe.ops.toeplitz.fft2d import fft_good_size, toeplitz2d_matmul_fft
from fastrpe.ops.toeplitz.naive import toeplitz2d_matmul_naive
from fastrpe.positions.grid import FastRPB2D, GridPosition, GridTerm, Table2D
from fastrpe.testing import assert_close, assert_lowp_close

F64, F32 = torch.float64, torch.float32
GRIDS = [(3, 5), (4, 7), (1, 6), (5, 1), (1, 1)]
GRID_IDS = [f"G{h}x{w}" for h, w in GRIDS]
DTYPES = [F64, F32]
DTYPE_IDS = ["f64", "f32"]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand_table(H, grid, dtype=F64, scale=1.0, seed=0):
    g = _gen(seed)
    Hg, Wg = grid
    return (scale * torch.randn(H, 2 * Hg - 1, 2 * Wg - 1, generator=g, dtype=F64)).to(dtype)


def _randomize(module, scale=0.5, seed=0):
    g = _gen(seed)
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(scale * torch.randn(prm.shape, generator=g, dtype=F64))
    return module


def _coords(grid, cls):
    """`(row, col)` per token, None for the class token."""
    Hg, Wg = grid
    return ([None] if cls else []) + [(a, b) for a in range(Hg) for b in range(Wg)]


def _loop_matrix(H, grid, cls, patch_entry, cls_entry):
    """`[H, N, N]` by a direct loop: `patch_entry(h, Δrow, Δcol)`, `cls_entry(h, kind)`."""
    co = _coords(grid, cls)
    N = len(co)
    out = torch.zeros(H, N, N, dtype=F64)
    for h in range(H):
        for i, qi in enumerate(co):
            for j, kj in enumerate(co):
                if qi is None and kj is None:
                    out[h, i, j] = cls_entry(h, 2)
                elif qi is None:
                    out[h, i, j] = cls_entry(h, 0)  # cls -> patch
                elif kj is None:
                    out[h, i, j] = cls_entry(h, 1)  # patch -> cls
                else:
                    out[h, i, j] = patch_entry(h, kj[0] - qi[0], kj[1] - qi[1])  # key - query
    return out


def _true(res):
    num, den, ls = res
    return num * ls.exp()[None, :, :, None], den * ls.exp()[None]


def _kern_inputs(grid, cls, H=3, F=5, Dv=4, B=2, dtype=F64, seed=0, table_scale=1.5):
    g = _gen(seed)
    N = grid[0] * grid[1] + int(cls)
    pq = torch.rand(B, H, N, F, generator=g, dtype=F64).to(dtype).requires_grad_()
    pk = torch.rand(B, H, N, F, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(B, H, N, Dv, generator=g, dtype=F64).to(dtype).requires_grad_()
    tb = _rand_table(H, grid, dtype, table_scale, seed + 1).requires_grad_()
    cc = (table_scale * torch.randn(H, 3, generator=g, dtype=F64)).to(dtype).requires_grad_() if cls else None
    return pq, pk, v, tb, cc


def _grads(outs, params, seed=1):
    g = _gen(seed)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=F64).to(t.dtype)).sum() for t in outs)
    return torch.autograd.grad(loss, params)


# ----------------------------------------------------------------------------- 2D Toeplitz


def test_fft_good_size():
    assert [fft_good_size(n) for n in (1, 2, 3, 7, 13, 27, 31, 97)] == [1, 2, 3, 8, 15, 27, 32, 100]


@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_toeplitz2d_naive_equals_loop(grid):
    Hg, Wg = grid
    tb = _rand_table(2, grid)
    x = torch.randn(2, 2, Hg * Wg, 3, generator=_gen(1), dtype=F64)
    want = torch.zeros_like(x)
    for a in range(Hg):
        for b in range(Wg):
            for c in range(Hg):
                for d in range(Wg):
                    want[:, :, a * Wg + b] += tb[None, :, c - a + Hg - 1, d - b + Wg - 1, None] * x[:, :, c * Wg + d]
    assert_close(toeplitz2d_matmul_naive(tb, x, grid), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_toeplitz2d_fft_matches_naive(grid, dtype):
    Hg, Wg = grid
    tb = _rand_table(3, grid, dtype).requires_grad_()
    x = torch.randn(2, 3, Hg * Wg, 6, generator=_gen(1), dtype=F64).to(dtype).requires_grad_()
    a, b = toeplitz2d_matmul_naive(tb, x, grid), toeplitz2d_matmul_fft(tb, x, grid)
    assert b.dtype == dtype
    assert_close(b, a)
    for p, q in zip(_grads([b], [tb, x]), _grads([a], [tb, x])):
        assert_close(p, q)


def test_toeplitz2d_fft_batched_table():
    tb = torch.randn(2, 3, 5, 9, generator=_gen(0), dtype=F64)  # (B, H, 2Hg-1, 2Wg-1)
    x = torch.randn(2, 3, 15, 4, generator=_gen(1), dtype=F64)
    assert_close(toeplitz2d_matmul_fft(tb, x, (3, 5)), toeplitz2d_matmul_naive(tb, x, (3, 5)))


def test_toeplitz2d_fft_bf16_against_float64():
    grid = (9, 11)
    tb = _rand_table(2, grid)
    x = torch.randn(2, 2, 99, 8, generator=_gen(1), dtype=F64)
    ref = toeplitz2d_matmul_naive(tb, x, grid)
    lo_t, lo_x = tb.bfloat16(), x.bfloat16()
    fast = toeplitz2d_matmul_fft(lo_t, lo_x, grid)
    assert fast.dtype == torch.bfloat16
    assert_lowp_close(fast, toeplitz2d_matmul_naive(lo_t, lo_x, grid), ref)


# ----------------------------------------------------------------------------- Table2D


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_table2d_materialize_equals_loop(grid, cls):
    pos = _randomize(Table2D(3, grid, cls_token=cls))
    Hg, Wg = grid
    tb, cc = pos.rel_table.detach(), (pos.cls_table.detach() if cls else None)
    want = _loop_matrix(3, grid, cls, lambda h, dr, dc: tb[h, dr + Hg - 1, dc + Wg - 1], lambda h, k: cc[h, k])
    got = pos.materialize()
    assert got.shape == (3, pos.seq_len, pos.seq_len)
    assert_close(got, want)
    assert_close(pos.materialize(pos.seq_len, pos.seq_len, 0), want)


@pytest.mark.parametrize("grid", [(3, 5), (4, 7)], ids=["G3x5", "G4x7"])
def test_table2d_patch_block_is_block_toeplitz(grid):
    Hg, Wg = grid
    pos = _randomize(Table2D(2, grid, cls_token=True))
    M = pos.materialize()[:, 1:, 1:].detach().unflatten(1, (Hg, Wg)).unflatten(3, (Hg, Wg))  # (H, a, b, c, d)
    for a in range(Hg):
        for c in range(Hg):
            blk = M[:, a, :, c, :]  # (H, Wg, Wg): depends on c - a only, and is Toeplitz itself
            assert torch.equal(blk, M[:, max(0, a - c), :, max(0, c - a), :])
            for b in range(Wg):
                for d in range(Wg):
                    assert blk[:, b, d].equal(blk[:, max(0, b - d), max(0, d - b)])


@pytest.mark.parametrize("grid", [(1, 6), (5, 1)], ids=["G1x6", "G5x1"])
def test_degenerate_grid_equals_1d_toeplitz(grid):
    """A 1×W (or H×1) grid is a 1D sequence: the same numbers as the 1D op with `b(r)`, r = key − query."""
    Hg, Wg = grid
    pq, pk, v, tb, _ = _kern_inputs(grid, False)
    lc = tb[:, 0, :] if Hg == 1 else tb[:, :, 0]  # (H, 2L-1), offset r at r + L - 1
    for op in (kernelized_num_den_grid_naive, kernelized_num_den_grid_fft):
        for x, y in zip(_true(op(pq, pk, v, tb, grid)), _true(kernelized_num_den_naive(pq, pk, v, lc))):
            assert_close(x, y)


def test_table2d_attributes_and_errors():
    pos = Table2D(2, (3, 4), cls_token=True)
    assert isinstance(pos, GridPosition) and isinstance(pos, GridTerm) and not pos.softmax_only
    assert pos.kernelized_refusal is None and pos.geometric_decay() is None and pos.weight is None
    assert pos.table().shape == (2, 5, 7) and pos.cls_coefficients().shape == (2, 3)
    assert Table2D(2, (3, 4)).cls_coefficients() is None
    assert pos.seq_len == 13
    with pytest.raises(TypeError, match="table()"):
        pos.log_coefficients(13, 13)
    with pytest.raises(ValueError, match="N = 13"):
        pos.materialize(12, 12)
    with pytest.raises(ValueError, match="q_offset"):
        pos.score_mod(q_offset=1)
    for bad in [(0, 3), (3,), 5, (2.0, 3), (True, 3)]:
        with pytest.raises(ValueError, match="grid"):
            Table2D(2, bad)
    assert "grid=(3, 4)" in repr(pos)


def test_table2d_gets_gradients():
    pos = _randomize(Table2D(2, (2, 3), cls_token=True))
    (pos.materialize() * torch.randn(2, 7, 7, dtype=F64)).sum().backward()
    assert pos.rel_table.grad is not None and pos.cls_table.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- kernelized, 2D RPE


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
def test_kernelized_grid_naive_equals_formula(cls):
    grid = (3, 4)
    pq, pk, v, tb, cc = _kern_inputs(grid, cls)
    pos = Table2D(3, grid, cls_token=cls).double()
    with torch.no_grad():
        pos.rel_table.copy_(tb)
        if cls:
            pos.cls_table.copy_(cc)
    w = torch.einsum("bhif,bhjf->bhij", pq, pk) * pos.materialize().exp()  # Luo et al. Eq. 10, no shift
    num, den = _true(kernelized_num_den_grid_naive(pq, pk, v, tb, grid, cc))
    assert_close(num, w @ v)
    assert_close(den, w.sum(-1))


@pytest.mark.parametrize("budget", [None, 1], ids=["one-block", "per-feature"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_kernelized_grid_fft_matches_naive(grid, cls, padding, budget):
    pq, pk, v, tb, cc = _kern_inputs(grid, cls)
    N = pq.shape[2]
    kpm = None
    if padding:
        kpm = torch.zeros(2, N, dtype=torch.bool)
        kpm[1, ::3] = True  # masks the class token too, when there is one
    a = _true(kernelized_num_den_grid_naive(pq, pk, v, tb, grid, cc, key_padding_mask=kpm))
    b = _true(kernelized_num_den_grid_fft(pq, pk, v, tb, grid, cc, key_padding_mask=kpm, memory_budget_bytes=budget))
    for x, y in zip(b, a):
        assert_close(x, y)
    params = [t for t in (pq, pk, v, tb, cc) if t is not None]
    for x, y in zip(_grads(b, params), _grads(a, params)):
        assert_close(x, y)


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
def test_kernelized_grid_float32(cls):
    grid = (6, 9)
    pq, pk, v, tb, cc = _kern_inputs(grid, cls, F=8, Dv=6, table_scale=1.0)
    ref = _true(kernelized_num_den_grid_naive(pq, pk, v, tb, grid, cc))
    ref_out = ref[0] / ref[1][..., None]
    low = [None if t is None else t.detach().float().requires_grad_() for t in (pq, pk, v, tb, cc)]
    n = _true(kernelized_num_den_grid_naive(*low[:4], grid, low[4]))
    f = _true(kernelized_num_den_grid_fft(*low[:4], grid, low[4]))
    assert f[0].dtype == F32
    out_n, out_f = n[0] / n[1][..., None], f[0] / f[1][..., None]
    assert_close(out_f, out_n)
    assert_lowp_close(out_f, out_n, ref_out)
    params = [t for t in low if t is not None]
    for x, y in zip(_grads([out_f], params), _grads([out_n], params)):
        assert_close(x, y)


def test_kernelized_grid_bf16_inputs():
    grid = (5, 7)
    pq, pk, v, tb, cc = (t.detach() for t in _kern_inputs(grid, True, table_scale=1.0))
    ref = _true(kernelized_num_den_grid_naive(pq, pk, v, tb, grid, cc))
    low = [t.bfloat16() for t in (pq, pk, v, tb, cc)]
    n = _true(kernelized_num_den_grid_naive(*(t.float() for t in low[:4]), grid, low[4].float()))
    f = _true(kernelized_num_den_grid_fft(*low[:4], grid, low[4]))
    assert f[0].dtype == F32  # math in float32 for half inputs, as the 1D op
    assert_lowp_close(f[0] / f[1][..., None], n[0] / n[1][..., None], ref[0] / ref[1][..., None])


def test_kernelized_grid_gradcheck_tiny():
    for cls in (False, True):
        pq, pk, v, tb, cc = _kern_inputs((2, 3), cls, H=2, F=2, Dv=2, B=1)
        inputs = tuple(t for t in (pq, pk, v, tb, cc) if t is not None)

        def fn(*t):
            return _true(kernelized_num_den_grid_fft(*t[:4], (2, 3), t[4] if cls else None, memory_budget_bytes=1))

        assert torch.autograd.gradcheck(fn, inputs)


def test_kernelized_grid_minus_inf_never_nan():
    grid = (3, 4)
    pq, pk, v, tb, cc = (t.detach().clone() for t in _kern_inputs(grid, True))
    tb[0] = float("-inf")  # head 0: no patch pair admissible ...
    cc[0] = float("-inf")  # ... nor any class-token pair: every row's weights are 0
    tb[1, ::2] = float("-inf")
    cc[2, 1] = float("-inf")
    for t in (pq, pk, v, tb, cc):
        t.requires_grad_()
    res = kernelized_num_den_grid_fft(pq, pk, v, tb, grid, cc)
    assert all(torch.isfinite(t).all() for t in res)
    assert bool((res[1][:, 0] == 0).all())
    ref = _true(kernelized_num_den_grid_naive(pq, pk, v, tb, grid, cc))
    for x, y in zip(_true(res), ref):
        assert_close(x, y)
    grads = torch.autograd.grad(res[0].sum() + res[1].sum(), [pq, pk, v, tb, cc])
    assert all(torch.isfinite(g).all() for g in grads)


def test_kernelized_grid_rejects_wrong_shapes():
    pq, pk, v, tb, cc = (t.detach() for t in _kern_inputs((3, 4), True))
    with pytest.raises(ValueError, match="N = 12"):
        kernelized_num_den_grid_fft(pq, pk, v, tb, (3, 4))  # class token present, no cls_coeff
    with pytest.raises(ValueError, match="table"):
        kernelized_num_den_grid_naive(pq, pk, v, tb[:, :-1], (3, 4), cc)
    with pytest.raises(ValueError, match="cls_coeff"):
        kernelized_num_den_grid_fft(pq, pk, v, tb, (3, 4), cc[:, :2])


def test_grid_block_size_follows_budget():
    assert grid_fft_block_size(1, 1, (64, 64), 64, 64, memory_budget_bytes=1) == 1
    assert grid_fft_block_size(1, 1, (4, 4), 64, 64) == 64
    assert 1 < grid_fft_block_size(1, 8, (32, 32), 64, 64) < 64


# ----------------------------------------------------------------------------- FastRPB 2D


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_fastrpb2d_materialize_equals_loop(grid, cls):
    Hg, Wg = grid
    t = _randomize(FastRPB2D(2, grid, cls_token=cls))
    wr, wc = t.w_row.detach(), t.w_col.detach()
    wcl = t.w_cls.detach() if cls else None
    want = _loop_matrix(2, grid, cls, lambda h, dr, dc: wr[h, dr + Hg - 1] + wc[h, dc + Wg - 1],
                        lambda h, k: wcl[h, k])
    assert_close(t.materialize(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", GRIDS, ids=GRID_IDS)
def test_fastrpb2d_fast_matches_naive(grid, cls, dtype):
    t = _randomize(FastRPB2D(3, grid, cls_token=cls)).to(dtype)
    N = t.seq_len
    v = torch.randn(2, 3, N, 5, generator=_gen(2), dtype=F64).to(dtype).requires_grad_()
    wr, wc, wcl = t.coefficients()
    a = fastrpb2d_naive(wr, wc, v, grid, wcl)
    b = fastrpb2d_fft(wr, wc, v, grid, wcl)
    assert b.dtype == dtype
    assert_close(b, a)
    assert_close(add_fastrpb(torch.zeros_like(a), v, [FastRPB2DTerm(wr, wc, wcl, grid)]), a)  # as backends apply it
    assert_close(a, t.materialize().to(dtype) @ v)
    params = [p for p in (v, wr, wc, wcl) if p is not None]
    for x, y in zip(_grads([b], params), _grads([a], params)):
        assert_close(x, y)


def test_fastrpb2d_gradcheck_tiny():
    t = _randomize(FastRPB2D(2, (2, 3), cls_token=True)).double()
    v = torch.randn(1, 2, 7, 2, generator=_gen(3), dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *p: fastrpb2d_fft(p[1], p[2], p[0], (2, 3), p[3]),
                                    (v, t.w_row, t.w_col, t.w_cls))


def test_fastrpb2d_bf16_against_float64():
    t = _randomize(FastRPB2D(2, (8, 12), cls_token=True))
    v = torch.randn(2, 2, 97, 8, generator=_gen(4), dtype=F64)
    wr, wc, wcl = (p.detach() for p in t.coefficients())
    ref = fastrpb2d_naive(wr, wc, v, (8, 12), wcl)
    lo = [p.bfloat16() for p in (wr, wc, v, wcl)]
    fast = fastrpb2d_fft(lo[0], lo[1], lo[2], (8, 12), lo[3])
    assert fast.dtype == torch.bfloat16
    naive = fastrpb2d_naive(*(p.float() for p in lo[:3]), (8, 12), lo[3].float())
    assert_lowp_close(fast, naive.bfloat16(), ref)


def test_fastrpb2d_attributes_and_errors():
    t = FastRPB2D(2, (3, 4), cls_token=True)
    assert isinstance(t, GridTerm) and t.num_heads == 2 and t.seq_len == 13
    assert t.table().shape == (2, 5, 7)
    v = torch.randn(1, 2, 13, 3)
    term = [FastRPB2DTerm(*t.coefficients(), grid=t.grid)]
    assert torch.equal(add_fastrpb(torch.zeros_like(v), v, term), torch.zeros_like(v))  # init_std = 0: off
    with pytest.raises(ValueError, match="bidirectional"):
        add_fastrpb(torch.zeros_like(v), v, term, causal=True)
    with pytest.raises(ValueError, match="non-causal"):
        t.materialize(13, 13, 1)
    with pytest.raises(ValueError, match="N = 13"):
        add_fastrpb(torch.zeros(1, 2, 12, 3), torch.randn(1, 2, 12, 3), term)
    with pytest.raises(ValueError, match="w_row"):
        fastrpb2d_fft(t.w_row[:, :-1], t.w_col, v, (3, 4), t.w_cls)


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", [(3, 5), (1, 6), (5, 1)], ids=["G3x5", "G1x6", "G5x1"])
def test_softmax_with_materialized_bias(grid, cls):
    pos = _randomize(Table2D(2, grid, cls_token=cls))
    N = pos.seq_len
    g = _gen(5)
    q, k, v = (torch.randn(2, 2, N, 8, generator=g, dtype=F64) for _ in range(3))
    bias = pos.materialize().detach()
    want = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5 + bias, dim=-1) @ v
    assert_close(softmax_attention_naive(q, k, v, bias), want)


@pytest.mark.skipif(not flex_available(), reason="FlexAttention is not in this PyTorch")
@pytest.mark.parametrize("cls", [False, True], ids=["nocls", "cls"])
@pytest.mark.parametrize("grid", [(3, 5), (4, 7), (1, 6), (5, 1)], ids=["G3x5", "G4x7", "G1x6", "G5x1"])
def test_score_mod_matches_materialize(grid, cls):
    pos = _randomize(Table2D(2, grid, cls_token=cls)).float()
    N = pos.seq_len
    g = _gen(6)
    q, k, v = (torch.randn(1, 2, N, 16, generator=g) for _ in range(3))
    kpm = torch.zeros(1, N, dtype=torch.bool)
    kpm[0, 1::4] = True
    with torch.no_grad():
        want = softmax_attention_naive(q, k, v, pos.materialize(), key_padding_mask=kpm)
        got = softmax_attention_flex(q, k, v, pos.score_mod(), key_padding_mask=kpm)
    assert_close(got, want)


# --- through fastrpe.attention: the dispatcher knows 2D terms --------------------------

import fastrpe as _fr  # noqa: E402
from fastrpe import positions as _P  # noqa: E402


@pytest.mark.parametrize("grid,cls", [((3, 5), True), ((4, 7), False), ((1, 6), True)], ids=["3x5-cls", "4x7", "1x6-cls"])
def test_attention_with_grid_terms_all_backends(grid, cls):
    pos = _P.Table2D(2, grid, cls_token=cls, init_std=0.5).double()
    N = pos.seq_len
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, N, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for kernel, backend in [("elu", "grid_fft"), ("softmax", "sdpa")]:
        ref = _fr.attention(q, k, v, kernel=kernel, position=pos, backend="dense")
        out = _fr.attention(q, k, v, kernel=kernel, position=pos, backend=backend)
        torch.testing.assert_close(out, ref)
        params = [q, k, v, *pos.parameters()]
        u = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
            torch.testing.assert_close(a, b)


def test_grid_terms_refused_where_they_do_not_apply():
    pos = _P.Table2D(2, (3, 4))
    q = torch.randn(1, 2, 12, 8)
    with pytest.raises(_fr.FastRPEError, match="bidirectional"):
        _fr.attention(q, q, q, kernel="elu", position=pos, causal=True)
    with pytest.raises(_fr.FastRPEError, match="for 12 tokens"):
        _fr.attention(q[:, :, :5], q, q, position=pos)
    with pytest.raises(_fr.FastRPEError, match="needs the 2D FFT"):
        _fr.attention(q, q, q, kernel="elu", position=pos, backend="fft")


def test_fastrpb2d_through_attention():
    t = _P.FastRPB2D(2, (3, 4), cls_token=True, init_std=0.5).double()
    N = t.seq_len
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for kernel, backend in [("softmax", "sdpa"), ("elu", "fft"), ("elu", "grid_fft")]:
        pos = [t] if backend != "grid_fft" else [_P.Table2D(2, (3, 4), cls_token=True).double(), t]
        ref = _fr.attention(q, k, v, kernel=kernel, position=pos, backend="dense")
        out = _fr.attention(q, k, v, kernel=kernel, position=pos, backend=backend)
        torch.testing.assert_close(out, ref)
        base = _fr.attention(q, k, v, kernel=kernel, position=pos[:-1] or None, backend="dense")
        torch.testing.assert_close(ref - base, (t.materialize() @ v)[:, :, :, :])  # the additive W·v
        params = [v, *t.parameters()]
        u = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
            torch.testing.assert_close(a, b)
    with pytest.raises(_fr.FastRPEError, match="bidirectional"):
        _fr.attention(q, k, v, kernel="elu", position=t, causal=True)
