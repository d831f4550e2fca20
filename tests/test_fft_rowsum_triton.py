"""The FFT products' row contractions in one Triton kernel (`ops/linear/fft/triton_rowsum.py`):
`add_row_sum(out, a, b, dim)` is `out += (a * b).sum(dim)`.

Each of the eight call sites' layouts (`product._FFTNumDen` forward and its three gradients,
`blocked._BlockedNumDen`'s four: strided slices of an inverse transform, a factor broadcast
along the kept axis, outputs that are transposed or strided slices) against the torch
expression; the whole FFT path (Luo et al. 2021, Eq. 10-13: causal through the recursion and
the blocked product, causal with the tiled local pairs, not causal) with the kernel against
the torch expression; the calls it declines; the shape-only count. Without CUDA the kernel
runs under Triton's interpreter (tests/conftest.py).
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

_CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear import fft as fftmod  # noqa: E402
from fastrpe.ops.linear.fft import blocked, causal, kernelized_num_den_fft, product  # noqa: E402
from fastrpe.ops.linear.fft import triton_rowsum as trs  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import assert_close  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))
F64 = torch.float64


@pytest.fixture
def route(monkeypatch):
    """`route("always" | "never")`: `ROW_SUMS` for the rest of the test."""
    return lambda setting: monkeypatch.setattr(trs, "ROW_SUMS", setting)


def _close64(a, b, msg=""):
    """float64 within 1e-12 of the largest entry (the summation order differs)."""
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * float(b.detach().abs().max().clamp_min(1e-300)), msg=msg or None)


# ---- each call site's layout -------------------------------------------------------------------

B, H, f, c, F, C, s, cs = 2, 3, 3, 5, 7, 11, 2, 3  # a block of features s..s+f-1, channels cs..cs+c-1
e, ce = s + f, cs + c
Lq, Lk, N = 37, 29, 72  # N >= Lq + Lk - 1; P = 37 positions
nb, T = 3, 37  # the blocked product's chunks (T odd here: the kernel masks any P)


def _r(*shape, dtype, g):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype).to(DEV)


def _site(name, dtype, g):
    """`(base, view, a, b, dim)` of a call site: `view(base)` is what it adds into."""
    if name.startswith("product"):
        inv = _r(B, H, f * c, N, dtype=dtype, g=g)  # an inverse transform, sliced as the site slices it
        if name == "product-forward":  # y[..., cs:ce] += Σ_f t·φq (φq's block through a transposed view)
            a = inv[..., Lk - 1: Lk - 1 + Lq].unflatten(2, (f, c))
            b = _r(B, H, Lq, F, dtype=dtype, g=g)[..., s:e].transpose(-1, -2)[:, :, :, None]
            return _r(B, H, Lq, C, dtype=dtype, g=g), lambda y: y[..., cs:ce].transpose(-1, -2), a, b, 2
        if name == "product-grad-q":  # g_q[..., s:e] += Σ_c t·gy
            a = inv[..., Lk - 1: Lk - 1 + Lq].unflatten(2, (f, c))
            b = _r(B, H, C, Lq, dtype=dtype, g=g)[:, :, None, cs:ce]
            return _r(B, H, Lq, F, dtype=dtype, g=g), lambda y: y[..., s:e].transpose(-1, -2), a, b, 3
        a = inv[..., Lq - 1: Lq - 1 + Lk].unflatten(2, (f, c))
        if name == "product-grad-k":  # g_k[..., s:e] += Σ_c g·v
            b = _r(B, H, C, Lk, dtype=dtype, g=g)[:, :, None, cs:ce]
            return _r(B, H, Lk, F, dtype=dtype, g=g), lambda y: y[..., s:e].transpose(-1, -2), a, b, 3
        b = _r(B, H, F, Lk, dtype=dtype, g=g)[:, :, s:e, None]  # g_v[..., cs:ce] += Σ_f g·φk
        return _r(B, H, Lk, C, dtype=dtype, g=g), lambda y: y[..., cs:ce].transpose(-1, -2), a, b, 2
    a = _r(B, H * nb, f * c, 2 * T, dtype=dtype, g=g)[..., :T].view(B, H, nb, f, c, T)

    def chunked(k):  # `blocked._chunks`' layout: [B, H, n, k, T], a transposed view
        return _r(B, H, nb * T, k, dtype=dtype, g=g).view(B, H, nb, T, k).transpose(-1, -2)

    if name == "blocked-forward":  # y[:, :, :, cs:ce] += Σ_f t·φq
        return _r(B, H, nb, C, T, dtype=dtype, g=g), lambda y: y[:, :, :, cs:ce], a, chunked(F)[:, :, :, s:e, None], 3
    if name == "blocked-grad-q":  # g_q (strided as qc) += Σ_c t·gy
        gt = _r(B, H, nb, C, T, dtype=dtype, g=g)
        return torch.randn_like(chunked(F)), lambda y: y[:, :, :, s:e], a, gt[:, :, :, None, cs:ce], 4
    if name == "blocked-grad-k":  # g_k += Σ_c g·v
        return torch.randn_like(chunked(F)), lambda y: y[:, :, :, s:e], a, chunked(C)[:, :, :, None, cs:ce], 4
    return torch.randn_like(chunked(C)), lambda y: y[:, :, :, cs:ce], a, chunked(F)[:, :, :, s:e, None], 3


SITES = ["product-forward", "product-grad-q", "product-grad-k", "product-grad-v",
         "blocked-forward", "blocked-grad-q", "blocked-grad-k", "blocked-grad-v"]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("site", SITES)
def test_each_call_sites_layout_gives_the_torch_expression(site, dtype, route):
    base, view, a, b, dim = _site(site, dtype, torch.Generator().manual_seed(0))
    want = base.clone()
    view(want).add_((a * b).sum(dim))  # the site's `+=` (the rest of the base untouched)
    route("always")
    with trs.count_traffic() as t:
        got = trs.add_row_sum(view(base), a, b, dim)
    assert t.launches == 1 and t.lower == (a.numel() + b.numel() + 2 * got.numel()) * a.element_size()
    assert got.data_ptr() == view(base).data_ptr()  # in place, the view returned
    if dtype == F64:
        _close64(base, want)
    else:
        assert_close(base, want)
    view(base).zero_()  # the entries it wrote are the view's only
    view(want).zero_()
    assert torch.equal(base, want)


@pytest.mark.parametrize("case", [
    # (a's shape, b's shape, dim, out's layout): one feature a block (nothing summed), b with its
    # own o axis, a broadcast factor along a leading dim of size 1, one leading dim, R = 0
    ((2, 3, 1, 5, 37), (2, 3, 1, 1, 37), 2, "contiguous"),
    ((2, 3, 4, 5, 37), (2, 3, 4, 5, 37), 3, "transposed"),
    ((1, 3, 4, 9, 70), (1, 3, 4, 1, 70), 2, "contiguous"),
    ((3, 13, 2, 300), (3, 13, 1, 300), 1, "transposed"),
    ((2, 3, 0, 5, 37), (2, 3, 0, 1, 37), 2, "contiguous"),
], ids=["R1", "b-o-axis", "lead1", "one-lead-P300", "R0"])
def test_other_layouts(case, route):
    sa, sb, dim, kind = case
    g = torch.Generator().manual_seed(1)
    a, b = _r(*sa, dtype=F64, g=g), _r(*sb, dtype=F64, g=g)
    shape = list(torch.broadcast_shapes(a.shape, b.shape))
    del shape[dim]
    out = _r(*shape, dtype=F64, g=g)
    if kind == "transposed":
        out = out.transpose(-1, -2).contiguous().transpose(-1, -2)
    want = out + (a * b).sum(dim)
    route("always")
    with trs.count_traffic() as t:
        trs.add_row_sum(out, a, b, dim)
    assert t.launches == 1
    _close64(out, want)


# ---- the whole FFT path, the kernel against the torch expression --------------------------------

def _inputs(Bq, Hq, Lq_, Lk_, F_, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(Bq, Hq, Lq_, F_, generator=g, dtype=F64)
    pk = torch.rand(Bq, Hq, Lk_, F_, generator=g, dtype=F64)
    v = torch.randn(Bq, Hq, Lk_, Dv, generator=g, dtype=F64)
    r = torch.arange(-(Lq_ - 1), Lk_, dtype=F64)
    lc = -0.05 * r.abs() + 0.5 * torch.randn(Hq, Lq_ + Lk_ - 1, generator=g, dtype=F64)
    return [t.to(DEV) for t in (pq, pk, v, lc)]


def _call(ins, causal_, budget=None):
    """num, den and the four gradients of a fixed combination of them."""
    leaves = [t.clone().requires_grad_() for t in ins]
    num, den, _ = kernelized_num_den_fft(*leaves, causal=causal_, memory_budget_bytes=budget)
    g = torch.Generator().manual_seed(1)
    loss = (num * torch.randn(num.shape, generator=g, dtype=F64).to(DEV)).sum() + (den * 0.3).sum()
    return (num, den, *torch.autograd.grad(loss, leaves))


@pytest.fixture
def sites(monkeypatch):
    """The lines of product.py and blocked.py that called `add_row_sum`, the calls passed through."""
    seen: set[tuple[str, int]] = set()

    def spy(out, a, b, dim):
        frame = sys._getframe(1)
        seen.add((frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_lineno))
        return trs.add_row_sum(out, a, b, dim)

    monkeypatch.setattr(product, "add_row_sum", spy)
    monkeypatch.setattr(blocked, "add_row_sum", spy)
    return seen


def _both_routes(run, route):
    route("never")
    with trs.count_traffic() as t:
        want = run()
    assert t.launches == 0
    route("always")
    with trs.count_traffic() as t:
        got = run()
    assert t.launches > 0
    for name, x, y in zip(("num", "den", "phi_q", "phi_k", "v", "log_coeff"), got, want):
        _close64(x, y, msg=name)
    return t.launches


@pytest.mark.parametrize("local", ["never", "always"], ids=["recursion", "tiled-local"])
def test_causal_path_with_the_kernel_gives_the_torch_expressions(local, route, sites, monkeypatch):
    """Chunks of 16 over 45 positions: the pairs across chunks by the blocked product (its four
    sites), inside the chunks by the recursion down to 4-position leaves (its cross segments:
    the FFT product's four) or by the tiled kernels (no FFT product)."""
    monkeypatch.setattr(causal, "BLOCKED", "always")
    monkeypatch.setattr(causal, "LOCAL", local)
    monkeypatch.setattr(causal, "causal_chunk", lambda *a, **k: 16)
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 4)
    ins = _inputs(1, 2, 45, 45, 3, 4)
    _both_routes(lambda: _call(ins, True), route)
    files = sorted(name for name, _ in sites)
    assert files == ["blocked.py"] * 4 + ([] if local == "always" else ["product.py"] * 4), sites


@pytest.mark.parametrize("budget", [None, 60_000], ids=["one-block", "split-channels"])
def test_not_causal_path_with_the_kernel_gives_the_torch_expressions(budget, route, sites):
    """The far offsets by the FFT product, in one block of features, or (a small budget) a
    feature at a time in parts of its channels (nothing summed forward)."""
    ins = _inputs(2, 2, 50, 43, 3, 4)
    _both_routes(lambda: _call(ins, False, budget), route)
    assert sorted(name for name, _ in sites) == ["product.py"] * 4


def test_float32_path_with_the_kernel(route):
    """float32 inputs: the kernel sums in float32, within the path's float32 tolerance."""
    ins = [t.float() for t in _inputs(1, 2, 40, 40, 3, 4)]
    route("never")
    want = _call(ins, False)
    route("always")
    got = _call(ins, False)
    for x, y in zip(got, want):
        assert_close(x, y, dtype=torch.float32)


# ---- what it declines ---------------------------------------------------------------------------

def _declined_call(out, a, b, dim):
    """`add_row_sum` with the kernel routed: the result and whether it launched."""
    want = out + (a * b).sum(dim)
    with trs.use_row_sums("always"), trs.count_traffic() as t:
        trs.add_row_sum(out, a, b, dim)
    return want, t.launches


def test_declined_calls_take_the_torch_expression():
    g = torch.Generator().manual_seed(2)
    # leading dims that do not merge (heads before the batch in memory): the torch expression
    a = _r(3, 2, 4, 5, 37, dtype=F64, g=g).transpose(0, 1)
    b = _r(2, 3, 4, 1, 37, dtype=F64, g=g)
    out = _r(2, 3, 5, 37, dtype=F64, g=g)
    assert trs.layout(out, a, b, 2) is None
    want, n = _declined_call(out, a, b, 2)
    assert n == 0 and torch.equal(out, want)
    # out's leading dims not mergeable either
    a = _r(2, 3, 4, 5, 37, dtype=F64, g=g)
    out = _r(3, 2, 5, 37, dtype=F64, g=g).transpose(0, 1)
    want, n = _declined_call(out, a, b, 2)
    assert n == 0 and torch.equal(out, want)
    # 16-bit and mixed dtypes, the summed dim last, a graph to record
    for a_, b_, o_ in ((a.half(), b.half(), _r(2, 3, 5, 37, dtype=torch.half, g=g)),
                       (a.float(), b, _r(2, 3, 5, 37, dtype=F64, g=g))):
        assert trs.declined(o_, a_, b_)
        want, n = _declined_call(o_, a_, b_, 2)
        assert n == 0 and torch.equal(o_, want)
    want, n = _declined_call(_r(2, 3, 4, 5, dtype=F64, g=g), a, b, -1)
    assert n == 0
    x = a.clone().requires_grad_()
    out = torch.zeros(2, 3, 5, 37, dtype=F64, device=DEV)
    with trs.use_row_sums("always"), trs.count_traffic() as t:
        trs.add_row_sum(out, x, b, 2)
    assert t.launches == 0 and out.requires_grad  # the graph recorded through the torch expression
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(gx, b.expand_as(a))
    # "cuda" on a CPU tensor, "never": the torch expression
    out = _r(2, 3, 5, 37, dtype=F64, g=g)
    for setting in ("never",) + (() if _CUDA else ("cuda",)):
        want = out + (a * b).sum(2)
        with trs.use_row_sums(setting), trs.count_traffic() as t:
            trs.add_row_sum(out, a, b, 2)
        assert t.launches == 0 and torch.equal(out, want)


def test_a_bad_route_says_so_in_one_line(route):
    g = torch.Generator().manual_seed(3)
    a, b, out = _r(2, 3, 4, 5, 9, dtype=F64, g=g), _r(2, 3, 4, 1, 9, dtype=F64, g=g), _r(2, 3, 5, 9, dtype=F64, g=g)
    route("sometimes")
    with pytest.raises(FastRPEError, match="ROW_SUMS") as e:
        trs.add_row_sum(out, a, b, 2)
    assert "\n" not in str(e.value)
    route("never")
    with pytest.raises(FastRPEError, match="ROW_SUMS"), trs.use_row_sums("sometimes"):
        pass
    assert trs.ROW_SUMS == "never"
    with trs.use_row_sums("always"):
        assert trs.ROW_SUMS == "always"
    assert trs.ROW_SUMS == "never"


# ---- the count ----------------------------------------------------------------------------------

def test_the_count_on_fake_tensors_launches_nothing_and_tallies_the_bytes(monkeypatch):
    """Under `FakeTensorMode` with `count_traffic(simulate=True)` (benchmarks/fft_at_scale.py):
    no launch, each call's bytes (a and b read once, out read and written) tallied; without
    `simulate`, fake tensors take the torch expression (nothing to launch on)."""
    monkeypatch.setattr(trs, "kernel", lambda: pytest.fail("launched under simulate"))
    with FakeTensorMode():
        a = torch.empty(1, 8, 2, 65, 4096, device=DEV)[..., :4000]
        b = torch.empty(1, 8, 2, 1, 4000, device=DEV)
        out = torch.empty(1, 8, 4000, 65, device=DEV).transpose(-1, -2)
        with trs.use_row_sums("always"), trs.count_traffic(simulate=True) as t:
            trs.add_row_sum(out, a, b, 2)
            trs.add_row_sum(out, a, b, 2)
        n_o = -(-65 // trs.row_sum_tiles(65, 4000)[0])
        one = 4 * (a.numel() + b.numel() + 2 * out.numel())
        assert (t.launches, t.lower, t.upper) == (2, 2 * one, 2 * (one + 4 * (n_o - 1) * b.numel()))
        with trs.use_row_sums("always"), trs.count_traffic() as t:
            trs.add_row_sum(out, a, b, 2)
        assert t.launches == 0
    assert not trs._COUNTERS and not trs._SIMULATE[0]


def test_the_benchmark_counts_the_kernel_on_shapes():
    """`benchmarks/fft_at_scale.py`'s row (the not-causal call at 4,096 tokens, shapes only):
    the kernel's bytes in the count, fewer than the torch expression's, the route restored."""
    from _benchmarks import load_benchmark

    fs = load_benchmark("fft_at_scale")
    on, off = fs.row("learned_full", 4096, "h200"), fs.row("learned_full", 4096, "h200", row_sums=False)
    assert on["rowsum_launches"] > 0 and on["rowsum_gib"] > 0 and off["rowsum_launches"] == 0
    assert on["gib_moved"] < off["gib_moved"] and on["launches"] < off["launches"]
    assert trs.ROW_SUMS == "cuda" and not trs._COUNTERS and not trs._SIMULATE[0]
