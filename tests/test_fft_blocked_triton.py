"""The blocked product's Triton kernels (`ops/linear/fft/triton_blocked.py`): each kernel against
the torch path's own intermediate (the same sums over frequency-major copies and lag matrices),
and the whole `blocked_product` with the kernels forced (`blocked.KERNEL = "always"`) against the
torch path and against the dense formula in float64.

The reference is Luo et al. 2021's sum (Eq. 10) restricted to the pairs the blocked product
owns: `y_i = Σ_m φq_im Σ_{j: chunk(j) < chunk(i)} c(i-j) φk_jm [v_j, 1]`, the coefficient of
query position `off + i` and key j read from the table, written here with no code from the
path under test. Without CUDA the kernels run under Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

_CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.common import causal_offset_mask  # noqa: E402
from fastrpe.ops.linear.fft import blocked as bl  # noqa: E402
from fastrpe.ops.linear.fft import triton_blocked as tb  # noqa: E402
from fastrpe.ops.linear.fft.scale import row_scale  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import assert_close, assert_lowp_close  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


@pytest.fixture
def route(monkeypatch):
    """`route("always" | "never")`: the blocked product's kernel switch for the rest of the test."""
    return lambda setting: monkeypatch.setattr(bl, "KERNEL", setting)


# ---- each kernel against the torch path's intermediate ----------------------------------------

# (B, H, T, fc, b0, nb, na): the chunks' layout as `chunk_layout` makes it (b0 > 0: queries after
# cached keys, so nb != na and some lags are not seen)
KERNEL_CASES = [(1, 1, 4, 1, 0, 2, 1), (2, 3, 8, 5, 2, 4, 5), (1, 2, 16, 3, 1, 5, 3), (2, 1, 8, 7, 3, 3, 5)]


def _kid(c):
    return "B{}-H{}-T{}-fc{}-b0{}-nb{}-na{}".format(*c)


def _spectra(case, seed=0):
    B, H, T, fc, b0, nb, na = case
    g = torch.Generator().manual_seed(seed)
    lag, valid, lo = bl._lags(b0, nb, na, DEV)
    P, lags = T + 1, b0 + nb - lo

    def cplx(*shape):
        return torch.randn(*shape, 2, generator=g).mul_(torch.rand(*shape[:-1], 1, 1, generator=g) * 4)

    ks = torch.view_as_complex(cplx(H, lags, P)).to(DEV)
    W = torch.rand(H, nb, na, generator=g).to(DEV)
    xs = torch.view_as_complex(cplx(B, H * na, fc, P)).to(DEV)
    zs = torch.view_as_complex(cplx(B, H * nb, fc, P)).to(DEV)
    return ks, W, lag, valid, xs, zs


def _torch_intermediates(ks, W, lag, valid, xs, zs, H):
    """The torch path's forward sums and energies, adjoint and lag correlations (blocked.py)."""
    B, nb, na = xs.shape[0], W.shape[1], W.shape[2]
    mats = bl._LagMatrices(ks, lag, valid, W)
    (_, _, m), = list(mats)
    xf, zf = bl._to_freq_major(xs, H, na), bl._to_freq_major(zs, H, nb)
    part = torch.matmul(m.m, xf)
    e2 = torch.linalg.vector_norm(torch.view_as_real(part), dim=(1, -1)).square() + bl._pair_energy(m, xf)
    pairs = ks.new_zeros(H, ks.shape[-1], nb, na)
    bl._add_pair_correlations(pairs, zf, xf)
    corr = torch.zeros_like(ks)
    bl._lag_correlations(corr, pairs, torch.where(valid, W, torch.zeros_like(W)), lag)
    return (bl._from_freq_major(part, B), e2, bl._from_freq_major(torch.matmul(m.adjoint, zf), B), corr)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_kid)
def test_each_kernel_gives_the_torch_paths_intermediate(case):
    H = case[1]
    ks, W, lag, valid, xs, zs = _spectra(case)
    sums = tb.LagSums(ks, W, lag, valid)
    with tb.count_traffic() as t:
        out, e2 = sums.forward(xs)
        out_only, none = sums.forward(xs, energy=False)
        got = (out, e2, sums.adjoint(zs), sums.correlations(zs, xs))
    assert t.launches == 4 and 0 < t.lower <= t.upper
    assert none is None and torch.equal(out_only, out)
    for name, a, b in zip(("out", "e2", "back", "corr"), got, _torch_intermediates(ks, W, lag, valid, xs, zs, H)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close(a, b, dtype=torch.float32, msg=name)


# ---- the whole product -------------------------------------------------------------------------

def _inputs(B, H, Lq, Lk, F, Dv, off, seed=0):
    """float64 leaves `(φq, φk, [v, 1], lc)`, `lc` masked causally (`-inf` for later keys)."""
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64)
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    r = torch.arange(-(Lq - 1 + off), Lk - off, dtype=torch.float64)
    lc = -0.1 * r.abs() + torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)
    lc = lc.masked_fill(~causal_offset_mask(Lq, Lk, off), float("-inf"))
    return [t.to(DEV) for t in (pq, pk, vv, lc)]


def _formula(pq, pk, vv, lc, off, T):
    """Eq. 10 over the pairs across chunks, in true units: query i (position off + i) and key j
    with `j // T < (off + i) // T`, coefficient `exp(lc[Lq-1-i+j])`."""
    Lq, Lk = pq.shape[2], pk.shape[2]
    i = torch.arange(Lq, device=pq.device)[:, None]
    j = torch.arange(Lk, device=pq.device)[None, :]
    c = torch.exp(lc[:, Lq - 1 - i + j])  # (H, Lq, Lk)
    c = torch.where(j // T < (off + i) // T, c, torch.zeros_like(c))
    return (torch.einsum("bhif,bhjf->bhij", pq, pk) * c) @ vv


# (B, H, Lq, Lk, q_offset, F, Dv, T), with the chunks it makes (nb, na)
CASES = [
    (1, 1, 32, 32, 0, 2, 4, 8),  # nb 4, na 3
    (2, 3, 20, 36, 16, 3, 2, 8),  # queries after 16 cached keys: nb 3, na 4
    (1, 2, 17, 19, 2, 2, 2, 4),  # nb 5, na 4, the last chunk short
    (2, 2, 9, 30, 21, 1, 6, 16),  # one query chunk boundary: nb 2, na 1
]


def _id(c):
    return "B{}-H{}-Lq{}-Lk{}-off{}-F{}-Dv{}-T{}".format(*c)


def _run(ins, off, T, block, wrt):
    pq, pk, vv, lc = ins
    Lq, Lk = pq.shape[2], pk.shape[2]
    y, err = bl.blocked_product(pq, pk, vv, lc, row_scale(lc.detach(), Lq, Lk), off, T, block)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)
    grads = torch.autograd.grad((y * g).sum(), wrt)
    return y, err, grads


@pytest.mark.parametrize("block", [(1, 2), 2, 64], ids=["channel-parts", "two-features", "whole"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_kernels_give_the_torch_paths_product_and_the_formulas(case, block, route):
    B, H, Lq, Lk, off, F, Dv, T = case
    ref = [t.requires_grad_() for t in _inputs(B, H, Lq, Lk, F, Dv, off)]
    f32 = [t.detach().float().requires_grad_() for t in ref]
    scale = row_scale(ref[3].detach(), Lq, Lk)
    want = _formula(*ref, off, T) * torch.exp(-scale)[None, :, :, None]
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    want_grads = torch.autograd.grad((want * g).sum(), ref)
    route("never")
    y0, err0, grads0 = _run(f32, off, T, block, f32)
    route("always")
    with tb.count_traffic() as t:
        y, err, grads = _run(f32, off, T, block, f32)
    assert t.launches > 0  # the kernels ran: forward, out, adjoint and correlations a block
    assert_close(y, y0, msg="y")
    assert_close(err, err0, msg="err")
    assert_lowp_close(y, y0, want, msg="y")
    assert ((y.double() - want).abs() <= err.double() + 1e-12).all()  # the round-off bound holds
    for name, a, a0, w in zip(("phi_q", "phi_k", "vv", "log_coeff"), grads, grads0, want_grads):
        assert_close(a, a0, msg=f"grad {name}")
        assert_lowp_close(a, a0, w, msg=f"grad {name}")


def test_a_frozen_table_and_a_values_only_gradient_take_the_kernels(route):
    """Backward without the coefficients' gradient (no correlations) and with only `vv`'s (no
    forward sum: the adjoint alone) give the torch path's gradients."""
    B, H, Lq, Lk, off, F, Dv, T = CASES[1]
    pq, pk, vv, lc = (t.float() for t in _inputs(B, H, Lq, Lk, F, Dv, off))
    for wrt in ([pq, pk, vv], [vv]):
        ins = [t.detach().requires_grad_(any(t is w for w in wrt)) for t in (pq, pk, vv, lc)]
        got = {}
        for setting in ("never", "always"):
            route(setting)
            with tb.count_traffic() as t:
                got[setting] = _run(ins, off, T, 2, [x for x in ins if x.requires_grad])
            assert (t.launches > 0) == (setting == "always")
        for a, b in zip(got["always"][2], got["never"][2]):
            assert_close(a, b)


def test_no_later_key_reaches_an_earlier_query_through_the_kernels(route):
    """Keys from position 41 on changed by orders of magnitude: every query whose chunk's
    pairs across chunks end before 40 (positions < 48, chunks of 8) gets bitwise the same
    output, and its keys' gradient from those queries is exactly zero."""
    route("always")
    B, H, L, F, Dv, T = 1, 2, 64, 3, 2, 8
    pq, pk, vv, lc = (t.float() for t in _inputs(B, H, L, L, F, Dv, 0))
    scale = row_scale(lc, L, L)
    base, _ = bl.blocked_product(pq, pk, vv, lc, scale, 0, T, 2)
    pk2, vv2 = pk.clone(), vv.clone()
    pk2[:, :, 41:] *= 1e3
    vv2[:, :, 41:, :-1] = 1e4 * torch.randn_like(vv2[:, :, 41:, :-1])
    pk2.requires_grad_()
    y, _ = bl.blocked_product(pq, pk2, vv2, lc, scale, 0, T, 2)
    assert torch.equal(y[:, :, :48], base[:, :, :48])
    assert not torch.equal(y[:, :, 48:], base[:, :, 48:])
    (g,) = torch.autograd.grad(y[:, :, :48].sum(), pk2)
    assert (g[:, :, 40:] == 0).all() and (g[:, :, :40] != 0).any()


# ---- refusals and the count --------------------------------------------------------------------

def test_the_kernels_refuse_what_they_cannot_take_and_the_torch_path_runs(route, monkeypatch):
    ks = torch.zeros(1, 2, 5, dtype=torch.complex64, device=DEV)
    assert tb.unsupported(torch.zeros(1, device=DEV), ks, 2, 3) == []
    why = tb.unsupported(torch.zeros(1, dtype=torch.float64, device=DEV), ks.to(torch.complex128), 2, 3)
    assert len(why) == 1 and "float32" in why[0]
    assert "grid" in tb.unsupported(torch.zeros(1, device=DEV), ks, 1, 70000)[0]
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert tb.unsupported(torch.zeros(1, device=DEV), ks, 2, 3) == []  # the sums: no atomics
    assert "deterministic" in tb.unsupported(torch.zeros(1, device=DEV), ks, 2, 3, corr=True)[0]
    monkeypatch.undo()
    with FakeTensorMode():  # shapes only: nothing to launch on
        assert any("fake" in w for w in tb.unsupported(torch.zeros(1, device=DEV), ks, 2, 3))

    route("always")
    B, H, Lq, Lk, off, F, Dv, T = CASES[1]
    ins = [t.requires_grad_() for t in _inputs(B, H, Lq, Lk, F, Dv, off)]
    with tb.count_traffic() as t:  # float64: the torch path
        y, _, grads = _run(ins, off, T, 2, ins)
    assert t.launches == 0
    route("never")
    y0, _, grads0 = _run(ins, off, T, 2, ins)
    assert torch.equal(y, y0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))

    # under deterministic algorithms the forward takes the kernels, a backward that needs the
    # coefficients' gradient the torch path
    route("always")
    f32 = [t.detach().float().requires_grad_() for t in ins]
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with tb.count_traffic() as t:
        y, _ = bl.blocked_product(*f32, row_scale(f32[3].detach(), Lq, Lk), off, T, 2)
        n_forward = t.launches
        grads = torch.autograd.grad(y.sum(), f32)
    assert n_forward > 0 and t.launches == n_forward
    monkeypatch.undo()
    route("never")
    y0, _ = bl.blocked_product(*f32, row_scale(f32[3].detach(), Lq, Lk), off, T, 2)
    for a, b in zip(grads, torch.autograd.grad(y0.sum(), f32)):
        assert_close(a, b)

    route("sometimes")
    with pytest.raises(FastRPEError, match="KERNEL"):
        bl.blocked_product(*f32, row_scale(f32[3].detach(), Lq, Lk), off, T, 2)


def test_the_count_follows_the_formula_and_simulating_launches_nothing():
    case = KERNEL_CASES[1]
    B, H, T, fc, b0, nb, na = case
    ks, W, lag, valid, xs, zs = _spectra(case)
    sums = tb.LagSums(ks, W, lag, valid)
    with tb.count_traffic(simulate=True) as t:
        out, e2 = sums.forward(xs)
        sums.correlations(zs, xs)
    P, lags = T + 1, ks.shape[1]
    lo = [tb.traffic(k, B, H, nb, na, fc, P, lags) for k in ("forward", "corr")]
    assert (t.launches, t.lower, t.upper) == (2, lo[0][0] + lo[1][0], lo[0][1] + lo[1][1])
    spectra = 8 * B * H * (nb + na) * fc * P
    assert lo[1][0] > spectra and lo[0][0] > spectra  # each reads and writes its spectra once at least
    assert out.shape == (B, H * nb, fc, P) and e2.shape == (H, nb, B * fc)


def test_the_benchmark_counts_both_routes_at_scale_under_fake_tensors():
    """`benchmarks/fft_blocked_traffic.py --at-scale`: the bench's call at 16,384 tokens (shapes
    only) moves fewer bytes with the kernels, which it counts from their shapes (the chunks' own
    pairs by the recursion: tiled, the plan takes one chunk there, and no sum over chunks)."""
    from _benchmarks import load_benchmark

    (r,) = load_benchmark("fft_blocked_traffic").at_scale_rows([16384], local=False)
    assert r["kernel_launches"] > 0 and 0 < r["kernel_gib_lower"] <= r["kernel_gib_upper"]
    assert r["kernels_gib_upper"] < r["torch_gib"] and r["kernels_launches"] < r["torch_launches"]
    assert bl.KERNEL == "never" and not tb._COUNTERS  # restored


def test_use_kernel_sets_the_route_inside_the_block_only():
    with bl.use_kernel("always"):
        assert bl.KERNEL == "always"
    assert bl.KERNEL == "never"
    with pytest.raises(FastRPEError, match="KERNEL"), bl.use_kernel("sometimes"):
        pass
    assert bl.KERNEL == "never"


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_blocked_lag_kernels_match_the_torch_path_realistic(route):
    """The bench's heads and widths (B = 1, H = 8, F = 32, Dv = 64) in 16 chunks of 512: the
    kernels' product, round-off estimate and gradients against the torch path's, float32."""
    B, H, L, F, Dv, T = 1, 8, 8192, 32, 64, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    pq, pk = (torch.rand(B, H, L, F, device="cuda", generator=g) for _ in range(2))
    vv = torch.cat([torch.randn(B, H, L, Dv, device="cuda", generator=g), torch.ones(B, H, L, 1, device="cuda")], -1)
    lc = torch.randn(H, 2 * L - 1, device="cuda", generator=g) * 0.3
    lc = lc.masked_fill(~causal_offset_mask(L, L, 0, device=lc.device), float("-inf"))
    ins = [t.requires_grad_() for t in (pq, pk, vv, lc)]
    got = {}
    for setting in ("never", "always"):
        route(setting)
        y, err, grads = _run(ins, 0, T, 8, ins)
        got[setting] = (y, err, *grads)
    for name, a, b in zip(("y", "err", "phi_q", "phi_k", "vv", "log_coeff"), got["always"], got["never"]):
        assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)
