"""The non-causal linear-time backend against the materialized reference (float64, forward
and every gradient), with additive terms, padding and Lq != Lk; and `auto` picks it."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe.ops.linear.bidirectional import kernelized_num_den_bidirectional
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.testing import assert_close, qkv

SHAPES = [(1, 1), (63, 63), (17, 40), (40, 17)]


@pytest.mark.parametrize("Lq,Lk", SHAPES, ids=[f"Lq{a}-Lk{b}" for a, b in SHAPES])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
def test_op_matches_naive_with_gradients(Lq, Lk, padding):
    g = torch.Generator().manual_seed(1)
    pq = torch.rand(2, 3, Lq, 12, generator=g, dtype=torch.float64).requires_grad_()
    pk = torch.rand(2, 3, Lk, 12, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 3, Lk, 10, generator=g, dtype=torch.float64).requires_grad_()
    kpm = (torch.rand(2, Lk, generator=g) < 0.3) if padding else None
    got = kernelized_num_den_bidirectional(pq, pk, v, key_padding_mask=kpm)
    want = kernelized_num_den_naive(pq, pk, v, None, causal=False, key_padding_mask=kpm)
    for a, b in zip(got, want):
        assert_close(a, b)
    w = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in got[:2]]
    ga = torch.autograd.grad(sum((t * x).sum() for t, x in zip(got[:2], w)), [pq, pk, v])
    gb = torch.autograd.grad(sum((t * x).sum() for t, x in zip(want[:2], w)), [pq, pk, v])
    for a, b in zip(ga, gb):
        assert_close(a, b)


@pytest.mark.parametrize("additive", ["none", "shaw", "fastrpb"])
@pytest.mark.parametrize("kernel", ["elu", "nprf"])
def test_backend_matches_dense(kernel, additive):
    H = 2
    q, k, v = qkv(1, H, 21, 30, 8, requires_grad=True, seed=2)
    kern = fr.kernels.get_kernel(kernel, head_dim=8, num_features=16)
    kern = kern.double() if isinstance(kern, torch.nn.Module) else kern
    F = kern.num_features(8)  # Shaw's vectors pair with φ(q) (Scaleformer Eq. 10)
    terms = {"none": [], "shaw": [fr.positions.ShawRelative(H, F, max_distance=4)],
             "fastrpb": [fr.positions.FastRPB1D(H, max_len=64)]}[additive]
    torch.manual_seed(0)
    for t in terms:
        t.double()
        with torch.no_grad():
            for prm in t.parameters():
                prm.normal_(0, 0.3)
    out = fr.attention(q, k, v, kern, terms, backend="bidirectional")
    ref = fr.attention(q, k, v, kern, terms, backend="dense")
    assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(ref.sum(), [q, k, v])):
        assert_close(a, b)


def test_refuses_causal_and_positional_terms_with_reasons():
    q, k, v = qkv(1, 2, 8, 8, 4)
    with pytest.raises(fr.FastRPEError, match="non-causal only"):
        fr.attention(q, k, v, "elu", causal=True, backend="bidirectional")
    with pytest.raises(fr.FastRPEError, match="multiplicative positional term"):
        fr.attention(q, k, v, "elu", fr.positions.ALiBi(2), backend="bidirectional")


def test_auto_picks_it_for_long_non_causal_linear_attention():
    q, k, v = qkv(1, 8, 4096, 4096, 64, dtype=torch.float32)
    assert fr.explain(q, k, v, "elu").chosen == "bidirectional"
