"""FastRPB 1D (`out += W·v`, W a learned Toeplitz matrix): `fastrpb_fft` against the
materializing `fastrpb_naive` (output and every gradient), the `FastRPB1D` table, and
causality."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.fastrpb.fft import fastrpb_fft
from fastrpe.ops.fastrpb.naive import fastrpb_naive
from fastrpe.positions.fastrpb import FastRPB1D
from fastrpe.testing import assert_close, assert_lowp_close

# (Lq, Lk, q_offset): n=1, awkward sizes, Lq != Lk both ways, decoding with a cache, offsets
SHAPES = [(1, 1, 0), (63, 63, 0), (100, 63, 0), (63, 100, 0), (20, 257, 237), (257, 257, 0), (40, 5, 3), (5, 40, 12)]


def _sid(s):
    return f"Lq{s[0]}-Lk{s[1]}-off{s[2]}"


def _inputs(Lq, Lk, *, B=2, H=3, Dv=5, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64).to(dtype)
    if grad:
        w.requires_grad_()
        v.requires_grad_()
    return w, v


def _grads(out, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * u).sum(), params)


# ----------------------------------------------------------------------------- fft vs naive


@pytest.mark.parametrize("Dv", [5, 60], ids=lambda d: f"Dv{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_sid(s) for s in SHAPES])
def test_fft_matches_naive_float64(shape, causal, Dv):
    Lq, Lk, off = shape
    w, v = _inputs(Lq, Lk, Dv=Dv)
    ref = fastrpb_naive(w, v, Lq, causal=causal, q_offset=off)
    out = fastrpb_fft(w, v, Lq, causal=causal, q_offset=off)
    assert out.shape == (2, 3, Lq, Dv) and out.dtype == torch.float64
    assert_close(out, ref)
    for name, a, b in zip(("w", "v"), _grads(out, [w, v]), _grads(ref, [w, v])):
        assert_close(a, b, msg=f"grad {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(63, 63, 0), (100, 63, 0), (20, 257, 237), (257, 257, 0)], ids=_sid)
def test_fft_matches_naive_float32(shape, causal):
    """Within the float32 tolerance of the naive path, and within a small factor of its
    error against float64 (STYLE §9), outputs and gradients."""
    Lq, Lk, off = shape
    w, v = _inputs(Lq, Lk, Dv=60, dtype=torch.float32)
    ref = fastrpb_naive(w, v, Lq, causal=causal, q_offset=off)
    out = fastrpb_fft(w, v, Lq, causal=causal, q_offset=off)
    assert out.dtype == torch.float32
    assert_close(out, ref)
    w64, v64 = (t.detach().double().requires_grad_() for t in (w, v))
    ref64 = fastrpb_naive(w64, v64, Lq, causal=causal, q_offset=off)
    assert_lowp_close(out.detach(), ref.detach(), ref64.detach())
    for name, a, b, c in zip(("w", "v"), _grads(out, [w, v]), _grads(ref, [w, v]), _grads(ref64, [w64, v64])):
        assert_lowp_close(a, b, c, msg=f"grad {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bfloat16_against_float64(causal):
    """Half-precision values: the FFT runs in float32, so it is at least as accurate as the naive path."""
    w, v = _inputs(100, 100, Dv=8, grad=False)
    ref64 = fastrpb_naive(w, v, 100, causal=causal)
    vb = v.bfloat16()
    out = fastrpb_fft(w.float(), vb, 100, causal=causal)
    assert out.dtype == torch.bfloat16
    assert_lowp_close(out, fastrpb_naive(w.bfloat16(), vb, 100, causal=causal), ref64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_tiny(causal):
    w, v = _inputs(4, 6, B=1, H=2, Dv=2)
    assert torch.autograd.gradcheck(lambda w, v: fastrpb_fft(w, v, 4, causal=causal, q_offset=1), (w, v))


def test_naive_matches_the_definition():
    """`y_i = Σ_j w(j - i)·v_j`, w indexed from `r = -(Lq-1+q_offset)`; causal drops `r > 0`."""
    Lq, Lk, off = 4, 7, 2
    w, v = _inputs(Lq, Lk, grad=False)
    for causal in (False, True):
        ref = torch.zeros(2, 3, Lq, 5, dtype=torch.float64)
        for i in range(Lq):
            for j in range(Lk):
                r = j - (i + off)
                if causal and r > 0:
                    continue
                ref[:, :, i] += w[None, :, r + Lq - 1 + off, None] * v[:, :, j]
        assert_close(fastrpb_naive(w, v, Lq, causal=causal, q_offset=off), ref)


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("shape", [(300, 300, 0), (40, 300, 260), (64, 100, 7)], ids=_sid)
def test_causal_never_sees_the_future(shape):
    """Changing the values of keys after query i leaves row i bit for bit unchanged (the
    causal FFT path never lets a later value into an earlier row, even through round-off)."""
    Lq, Lk, off = shape
    w, v = (t.float() for t in _inputs(Lq, Lk, Dv=8, grad=False))
    base = fastrpb_fft(w, v, Lq, causal=True, q_offset=off)
    for i in (0, Lq // 2, Lq - 2):
        cut = off + i + 1  # first key after query i
        v2 = v.clone()
        v2[:, :, cut:] = 1e6 * torch.randn_like(v2[:, :, cut:])
        out = fastrpb_fft(w, v2, Lq, causal=True, q_offset=off)
        assert torch.equal(out[:, :, : i + 1], base[:, :, : i + 1])


# ----------------------------------------------------------------------------- module


def _apply(t, v, Lq, q_offset=0, causal=False):
    """The term applied as the backends apply it: its coefficients for this call, by FFT."""
    return fastrpb_fft(t.coefficients(Lq, v.shape[2], q_offset), v, Lq, causal=causal, q_offset=q_offset)


def _module(H=3, max_len=6, std=1.0):
    torch.manual_seed(0)
    return FastRPB1D(H, max_len, init_std=std).double()


@pytest.mark.parametrize("shape", [(5, 5, 0), (4, 9, 5), (9, 4, 2), (3, 20, 0)], ids=_sid)
def test_coefficients_and_materialize_follow_the_table(shape):
    Lq, Lk, off = shape
    t = _module(max_len=6)
    c = t.coefficients(Lq, Lk, off)
    assert c.shape == (3, Lq + Lk - 1)
    M = t.materialize(Lq, Lk, off)
    for i in range(Lq):
        for j in range(Lk):
            r = j - (i + off)
            expect = t.w[:, r + 5] if abs(r) < 6 else torch.zeros(3, dtype=torch.float64)  # 0 beyond the table
            assert torch.equal(M[:, i, j], expect)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 1, 0), (30, 30, 0), (10, 41, 31), (41, 10, 0)], ids=_sid)
def test_forward_is_materialized_W_times_v(shape, causal):
    Lq, Lk, off = shape
    t = _module(max_len=20)
    v = torch.randn(2, 3, Lk, 5, dtype=torch.float64, requires_grad=True)
    W = t.materialize(Lq, Lk, off)
    if causal:
        W = W * (torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + off)
    ref = W @ v
    out = _apply(t, v, Lq, off, causal)
    assert_close(out, ref)
    params = [v, t.w]
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        assert_close(a, b)


def test_module_gradcheck_tiny():
    t = _module(H=2, max_len=4)
    v = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda v, w, c=causal: _apply(t, v, 5, 1, c), (v, t.w))


def test_module_defaults_dtypes_and_errors():
    t = FastRPB1D(4, max_len=16)
    assert t.w.shape == (4, 31)
    assert bool((t.w == 0).all())  # starts switched off: plain attention at initialization
    v = torch.randn(2, 4, 10, 3)
    assert bool((_apply(t, v, 10) == 0).all())
    assert "max_len=16" in repr(t)
    # float64 parameters with float32 values: the result follows the values
    assert _apply(_module(H=4), v, 10, causal=True).dtype == torch.float32
    with pytest.raises(ValueError, match="w_coeff must be"):
        _apply(t, torch.randn(2, 3, 10, 3), 10)
    with pytest.raises(ValueError, match="max_len"):
        FastRPB1D(2, 0)
    with pytest.raises(ValueError, match="w_coeff must be"):
        fastrpb_fft(torch.randn(4, 18), v, 10)
    with pytest.raises(ValueError, match="w_coeff must be"):
        fastrpb_naive(torch.randn(3, 19), v, 10)
