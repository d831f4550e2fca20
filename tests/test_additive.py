"""FastRPB (W·v) and Shaw relative vectors: fast ops against their naive references, and
through fr.attention with every backend that takes them."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.ops.fastrpb.fft import fastrpb_fft
from fastrpe.ops.fastrpb.naive import fastrpb_naive
from fastrpe.ops.shaw.linear import shaw_num_den_linear
from fastrpe.ops.shaw.naive import shaw_num_den_naive
from fastrpe.testing import assert_close, qkv

SHAPES = [(1, 1, 0), (63, 63, 0), (100, 63, 0), (63, 100, 0), (20, 257, 237), (257, 257, 0)]


def _ids(s):
    return f"Lq{s[0]}-Lk{s[1]}-off{s[2]}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(s) for s in SHAPES])
@pytest.mark.parametrize("k", [0, 1, 3, 300])
def test_shaw_linear_matches_naive(shape, causal, k):
    Lq, Lk, off = shape
    g = torch.Generator().manual_seed(0)
    phi = torch.rand(2, 3, Lq, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 3, Lk, 5, generator=g, dtype=torch.float64).requires_grad_()
    rp = torch.randn(3, 2 * k + 1, 8, generator=g, dtype=torch.float64).requires_grad_()
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, Lk // 2:] = True
    a = shaw_num_den_naive(phi, v, rp, Lk=Lk, causal=causal, q_offset=off, key_padding_mask=kpm)
    b = shaw_num_den_linear(phi, v, rp, Lk=Lk, causal=causal, q_offset=off, key_padding_mask=kpm)
    for x, y in zip(b, a):
        assert_close(x, y)
    w = [torch.randn_like(t) for t in a]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip(a, w)), [phi, v, rp])
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip(b, w)), [phi, v, rp])
    for x, y in zip(gb, ga):
        assert_close(x, y)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[_ids(s) for s in SHAPES])
def test_fastrpb_fft_matches_naive(shape, causal):
    Lq, Lk, off = shape
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 3, Lk, 5, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(3, Lq + Lk - 1, generator=g, dtype=torch.float64).requires_grad_()
    a = fastrpb_naive(w, v, Lq, causal=causal, q_offset=off)
    b = fastrpb_fft(w, v, Lq, causal=causal, q_offset=off)
    assert_close(b, a)
    u = torch.randn_like(a)
    for x, y in zip(torch.autograd.grad((b * u).sum(), [v, w]), torch.autograd.grad((a * u).sum(), [v, w])):
        assert_close(x, y)


def test_fastrpb_module_table_and_gradcheck():
    t = P.FastRPB1D(2, max_len=4, init_std=1.0).double()
    M = t.materialize(6, 6)
    assert torch.equal(M[:, 1:, 1:], M[:, :-1, :-1])
    assert bool((M[:, 0, 4:] == 0).all()) and bool((M[:, 0, :4] != 0).all())  # |r| >= max_len is 0
    v = torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, w: fastrpb_fft(t.coefficients(6, 6), v, 6, causal=True), (v, t.w))


def _terms(kind, H, dim):
    torch.manual_seed(0)
    if kind == "fastrpb":
        return P.FastRPB1D(H, max_len=50, init_std=0.3).double()
    return P.ShawRelative(H, dim, max_distance=4, init_std=0.3).double()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["fastrpb", "shaw"])
@pytest.mark.parametrize("backend,kernel", [("sdpa", "softmax"), ("fft", "elu"), ("fft", "relu")])
def test_attention_with_additive_terms(backend, kernel, kind, causal):
    H, D = 3, 8
    q, k, v = qkv(2, H, 30, 41, D, 5, requires_grad=True)
    term = _terms(kind, H, D)
    pos = [P.KerpleLog(H).double(), term]
    ref = fr.attention(q, k, v, kernel=kernel, position=pos, causal=causal, backend="dense")
    out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=causal, backend=backend)
    assert_close(out, ref)
    params = [q, k, v, *term.parameters()]
    u = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
        assert_close(x, y)


def test_shaw_width_mismatch_is_clear():
    q, k, v = qkv(1, 2, 5, 5, 8)
    with pytest.raises(ValueError, match="ShawRelative has dim=3"):
        fr.attention(q, k, v, kernel="elu", position=P.ShawRelative(2, 3, 2).double())


def test_flex_refuses_shaw():
    q, k, v = qkv(1, 2, 5, 5, 8)
    with pytest.raises(fr.FastRPEError, match="Shaw vectors depend on q"):
        fr.attention(q, k, v, position=P.ShawRelative(2, 8, 2).double(), backend="flex")


@pytest.mark.parametrize("kind", ["fastrpb", "shaw"])
@pytest.mark.parametrize("backend,kernel", [("dense", "elu"), ("fft", "elu"), ("sdpa", "softmax")])
def test_additive_terms_never_see_the_future(kind, backend, kernel):
    H, D = 2, 8
    q, k, v = (t.float() for t in qkv(1, H, 300, 300, D))
    term = _terms(kind, H, D).float()
    pos = [P.KerpleLog(H), term]
    with torch.no_grad():
        out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=True, backend=backend)
        for i in (0, 150, 298):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, i + 1:] *= 30
            v2[:, :, i + 1:] = 1e3 * torch.randn_like(v2[:, :, i + 1:])
            out2 = fr.attention(q, k2, v2, kernel=kernel, position=pos, causal=True, backend=backend)
            assert torch.equal(out2[:, :, : i + 1], out[:, :, : i + 1])
