"""The FFT Toeplitz product against its naive reference (`ops/toeplitz/{naive,fft}.py`).

`y_i = Σ_j coeff[j - i + Lq - 1]·x_j` with `coeff: [H or B,H, Lq+Lk-1]`, `x: [B, H, Lk, C]`.
"""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.toeplitz.fft import fft_length, toeplitz_matmul_fft
from fastrpe.ops.toeplitz.naive import toeplitz_matmul_naive
from fastrpe.testing import assert_close, assert_lowp_close

# (B, H, Lq, Lk, C)
SHAPES = [(1, 3, 1, 1, 5), (2, 3, 63, 63, 60), (2, 3, 63, 100, 5), (2, 3, 100, 63, 5), (1, 3, 257, 257, 60),
          (2, 3, 1, 100, 5), (2, 3, 100, 1, 5)]


def _id(s):
    return "B{}-H{}-Lq{}-Lk{}-C{}".format(*s)


def _inputs(B, H, Lq, Lk, C, *, batched=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, Lq + Lk - 1) if batched else (H, Lq + Lk - 1)
    c = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    x = torch.randn(B, H, Lk, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return c, x


def test_naive_is_the_definition():
    c, x = _inputs(2, 3, 7, 5, 4)
    y = toeplitz_matmul_naive(c, x, 7)
    want = torch.zeros(2, 3, 7, 4, dtype=torch.float64)
    for i in range(7):
        for j in range(5):
            want[:, :, i] += c[None, :, j - i + 6, None] * x[:, :, j]
    assert_close(y, want)


@pytest.mark.parametrize("batched", [False, True], ids=["coeff-H", "coeff-BH"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_id(s) for s in SHAPES])
def test_fft_matches_naive_forward_and_grads(shape, batched):
    B, H, Lq, Lk, C = shape
    c, x = _inputs(*shape, batched=batched)
    a, b = toeplitz_matmul_naive(c, x, Lq), toeplitz_matmul_fft(c, x, Lq)
    assert b.shape == (B, H, Lq, C) and b.dtype == x.dtype
    assert_close(b, a)
    u = torch.randn_like(a)
    for gb, ga in zip(torch.autograd.grad((b * u).sum(), [c, x]), torch.autograd.grad((a * u).sum(), [c, x])):
        assert_close(gb, ga)


@pytest.mark.parametrize("shape", [(2, 3, 63, 100, 5), (1, 3, 257, 257, 60)], ids=_id)
def test_float32_matches_naive(shape):
    c, x = (t.detach().float() for t in _inputs(*shape))
    Lq = shape[2]
    # FFT round-off is relative to the largest entries (not to each entry): compare in those units
    a, b = toeplitz_matmul_naive(c, x, Lq), toeplitz_matmul_fft(c, x, Lq)
    assert b.dtype == torch.float32
    assert_close(b / (a.abs().amax() + 1), a / (a.abs().amax() + 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_inputs_run_fft_in_float32_and_cast_back(dtype):
    shape = (2, 3, 100, 63, 5)
    c64, x64 = (t.detach() for t in _inputs(*shape))
    ref = toeplitz_matmul_naive(c64, x64, 100)
    c, x = c64.to(dtype), x64.to(dtype)
    fast = toeplitz_matmul_fft(c, x, 100)
    assert fast.dtype == dtype
    assert_lowp_close(fast, toeplitz_matmul_naive(c, x, 100), ref)


def test_fft_dtype_float64_when_asked():
    c, x = (t.detach() for t in _inputs(2, 3, 63, 100, 5))
    ref = toeplitz_matmul_naive(c, x, 63)
    y32 = toeplitz_matmul_fft(c.float(), x.float(), 63)
    y64 = toeplitz_matmul_fft(c.float(), x.float(), 63, fft_dtype=torch.float64)
    assert y64.dtype == torch.float32
    assert (y64.double() - ref).abs().max() <= (y32.double() - ref).abs().max()


def test_zero_coefficients_give_exact_zeros_and_finite_grads():
    c, x = _inputs(1, 3, 20, 30, 4)
    c = torch.zeros_like(c).requires_grad_()
    y = toeplitz_matmul_fft(c, x, 20)
    assert bool((y.abs() < 1e-12).all())
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(y.sum(), [c, x]))


def test_gradcheck_tiny():
    c, x = _inputs(1, 2, 4, 3, 2)
    assert torch.autograd.gradcheck(lambda c, x: toeplitz_matmul_fft(c, x, 4), (c, x))


def test_wrong_coefficient_length_raises():
    c, x = _inputs(1, 3, 5, 6, 2)
    with pytest.raises(ValueError, match="Lq\\+Lk-1"):
        toeplitz_matmul_fft(c, x, 4)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 125, 199, 1000, 4097, 131071, 131073])
def test_fft_length_is_smallest_2_3_5_smooth(n):
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    N = fft_length(n)
    assert N >= n and smooth(N)
    assert not any(smooth(m) for m in range(n, N))
    assert N <= 1 << max(0, (n - 1).bit_length())  # never worse than the next power of two
