"""The FFT Toeplitz ops against their naive references."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.linear.fft import causal_segments, fft_block_size, kernelized_num_den_fft
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.ops.toeplitz.fft import toeplitz_matmul_fft
from fastrpe.ops.toeplitz.naive import toeplitz_matmul_naive
from fastrpe.testing import assert_close, assert_lowp_close

SHAPES = [(1, 1, 0), (1, 9, 8), (63, 63, 0), (63, 100, 0), (100, 63, 0), (257, 257, 0), (100, 300, 200), (257, 257, 5)]


def _ids(s):
    return f"Lq{s[0]}-Lk{s[1]}-off{s[2]}"


def _true(res):
    num, den, ls = res
    return num * ls.exp()[None, :, :, None], den * ls.exp()[None]


def _inputs(Lq, Lk, H=3, F=8, Dv=5, dtype=torch.float64, seed=0, lc_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(2, H, Lq, F, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    pk = torch.rand(2, H, Lk, F, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(2, H, Lk, Dv, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    lc = (lc_scale * torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    return pq, pk, v, lc


@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(s) for s in SHAPES])
def test_toeplitz_fft_matches_naive(shape):
    Lq, Lk, _ = shape
    g = torch.Generator().manual_seed(0)
    c = torch.randn(3, Lq + Lk - 1, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, Lk, 7, generator=g, dtype=torch.float64, requires_grad=True)
    a, b = toeplitz_matmul_naive(c, x, Lq), toeplitz_matmul_fft(c, x, Lq)
    assert_close(b, a)
    u = torch.randn_like(a)
    for p, q in zip(torch.autograd.grad((b * u).sum(), [c, x]), torch.autograd.grad((a * u).sum(), [c, x])):
        assert_close(p, q)


@pytest.mark.parametrize("budget", [None, 1], ids=["one-block", "per-feature"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(s) for s in SHAPES])
def test_kernelized_fft_matches_naive(shape, causal, budget):
    Lq, Lk, off = shape
    pq, pk, v, lc = _inputs(Lq, Lk)
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, ::3] = True
    kw = dict(causal=causal, q_offset=off, key_padding_mask=kpm)
    a = _true(kernelized_num_den_naive(pq, pk, v, lc, **kw))
    b = _true(kernelized_num_den_fft(pq, pk, v, lc, memory_budget_bytes=budget, **kw))
    for x, y in zip(b, a):
        assert_close(x, y)
    w = [torch.randn_like(t) for t in a]
    params = [pq, pk, v, lc]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip(a, w)), params)
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip(b, w)), params)
    for x, y in zip(gb, ga):
        assert_close(x, y)


def test_block_size_follows_budget():
    assert fft_block_size(1, 1, 65536, 65536, 64, 64, memory_budget_bytes=1) == 1
    assert fft_block_size(1, 1, 64, 64, 64, 64) == 64
    mid = fft_block_size(1, 1, 4096, 4096, 64, 64, memory_budget_bytes=256 << 20)
    assert 1 < mid < 64


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_minus_inf_coefficients_never_nan(causal):
    pq, pk, v, lc = _inputs(40, 40)
    lc = lc.detach().clone()
    lc[0] = float("-inf")  # a head with no admissible key at all
    lc[1, ::2] = float("-inf")
    lc.requires_grad_()
    num, den, ls = kernelized_num_den_fft(pq, pk, v, lc, causal=causal)
    assert torch.isfinite(num).all() and torch.isfinite(den).all() and torch.isfinite(ls).all()
    assert bool((den[:, 0] == 0).all())
    ref = _true(kernelized_num_den_naive(pq, pk, v, lc, causal=causal))
    assert_close(_true((num, den, ls))[0], ref[0])
    grads = torch.autograd.grad(num.sum() + den.sum(), [pq, pk, v, lc])
    assert all(torch.isfinite(g).all() for g in grads)


def test_gradcheck_tiny():
    for causal in (False, True):
        pq, pk, v, lc = _inputs(5, 4, H=2, F=2, Dv=2)
        assert torch.autograd.gradcheck(
            lambda *t: _true(kernelized_num_den_fft(*t, causal=causal, q_offset=1, memory_budget_bytes=1)),
            (pq, pk, v, lc), fast_mode=True)


@pytest.mark.parametrize("Lq,Lk", [(300, 300), (100, 300)])
def test_causal_op_is_bitwise_blind_to_the_future(Lq, Lk):
    pq, pk, v, lc = (t.detach().float() for t in _inputs(Lq, Lk))
    off = Lk - Lq
    base = kernelized_num_den_fft(pq, pk, v, lc, causal=True, q_offset=off)
    for i in (0, 77, Lq - 2):
        pk2, v2 = pk.clone(), v.clone()
        pk2[:, :, off + i + 1:] *= 1e3
        v2[:, :, off + i + 1:] = 1e4 * torch.randn_like(v2[:, :, off + i + 1:])
        got = kernelized_num_den_fft(pq, pk2, v2, lc, causal=True, q_offset=off)
        for a, b in zip(got[:2], base[:2]):
            assert torch.equal(a[:, :, : i + 1], b[:, :, : i + 1])


def test_causal_segments_cover_each_pair_once():
    for Lq, Lk, off in [(37, 37, 0), (10, 300, 290), (300, 120, 0), (1, 1, 0), (129, 129, 0)]:
        count = torch.zeros(Lq, Lk, dtype=torch.int64)
        for kind, qa, qb, ka, kb in causal_segments(Lq, Lk, off, leaf=16):
            i = torch.arange(qa, qb)[:, None] + off
            j = torch.arange(ka, kb)[None, :]
            if kind == "cross":
                assert bool((j < i).all())  # strictly earlier keys only
            count[qa:qb, ka:kb] += (j <= i).long()
        want = (torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + off).long()
        assert torch.equal(count, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_low_precision_against_float64(dtype):
    pq, pk, v, lc = (t.detach() for t in _inputs(257, 257, lc_scale=1.0))
    ref = _true(kernelized_num_den_naive(pq, pk, v, lc, causal=True))
    ref_out = ref[0] / ref[1][..., None]
    low = [t.to(dtype) for t in (pq, pk, v, lc)]
    n = _true(kernelized_num_den_naive(*low, causal=True))
    f = _true(kernelized_num_den_fft(*low, causal=True))
    assert_lowp_close(f[0] / f[1][..., None], n[0] / n[1][..., None], ref_out)
