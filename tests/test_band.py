"""Finite-support terms (T5 buckets, clipped learned tables) exactly in linear time: the
band op against the dense naive op, and the `band` backend against `dense`."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.ops.linear.band import kernelized_num_den_band
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.positions.t5 import t5_bucket
from fastrpe.testing import assert_close, qkv

# (Lq, Lk, q_offset, W, T): L below and above the band, Lq != Lk, decoding offsets, T > W
CASES = [(1, 1, 0, 3, 4), (63, 63, 0, 5, 8), (100, 100, 0, 7, 4), (20, 300, 280, 9, 16), (63, 100, 37, 13, 16),
         (100, 63, 0, 4, 8), (10, 10, 0, 40, 8), (50, 40, 60, 4, 8)]


def _true(res):
    return res[0] * res[2].exp()[None, :, :, None], res[1] * res[2].exp()[None]


def _finite_lc(Lq, Lk, off, W, H, seed):
    """A random table on `r = -W..W`, constant beyond, with a `-inf` entry and a large one
    (per-row scaling must keep every row's weights finite). Returns the table (a leaf:
    gradients are compared on it; the op reads entries beyond ±W as b(±W)) and `[H, Lq+Lk-1]`."""
    g = torch.Generator().manual_seed(seed)
    tab = 3 * torch.randn(H, 2 * W + 1, generator=g, dtype=torch.float64)
    tab[0, W - 1] = float("-inf")
    tab[-1, 0] = 50.0
    tab.requires_grad_()
    r = torch.arange(-(Lq - 1 + off), Lk - off)
    return tab, tab[:, r.clamp(-W, W) + W]


@pytest.mark.parametrize("case", CASES, ids=[f"Lq{a}-Lk{b}-off{c}-W{d}-T{e}" for a, b, c, d, e in CASES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_band_matches_naive(case, causal):
    Lq, Lk, off, W, T = case
    H = 3
    g = torch.Generator().manual_seed(0)
    pq = torch.rand(2, H, Lq, 6, generator=g, dtype=torch.float64, requires_grad=True)
    pk = torch.rand(2, H, Lk, 6, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, H, Lk, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tab, lc = _finite_lc(Lq, Lk, off, W, H, 1)
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, ::3] = True
    a = _true(kernelized_num_den_naive(pq, pk, v, lc, causal=causal, q_offset=off, key_padding_mask=kpm))
    b = _true(kernelized_num_den_band(pq, pk, v, lc, window=W, causal=causal, q_offset=off, key_padding_mask=kpm,
                                      chunk_size=T))
    for x, y in zip(b, a):
        assert torch.isfinite(x).all()
        assert_close(x, y)
    w = [torch.randn_like(t) for t in a]
    params = [pq, pk, v, tab]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip(a, w)), params, retain_graph=True)
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip(b, w)), params)
    for x, y in zip(gb, ga):
        assert torch.isfinite(x).all()
        assert_close(x, y)


def test_initial_state_is_keys_in_the_tail():
    """An initial state of keys before position 0 (W or more away) = those keys passed as keys;
    its gradient too."""
    H, W, n0, Lk, off = 2, 5, 17, 30, 9
    g = torch.Generator().manual_seed(3)
    pq = torch.rand(1, H, Lk - off, 4, generator=g, dtype=torch.float64)
    pk = torch.rand(1, H, n0 + Lk, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, n0 + Lk, 3, generator=g, dtype=torch.float64)
    lc_all = _finite_lc(Lk - off, n0 + Lk, n0 + off, W, H, 4)[1].detach()
    ref = _true(kernelized_num_den_naive(pq, pk, v, lc_all, causal=True, q_offset=n0 + off))
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    s0 = torch.einsum("bhjf,bhjc->bhfc", pk[:, :, :n0], vv[:, :, :n0]).requires_grad_()
    lc = lc_all[:, lc_all.shape[1] - (Lk - off + Lk - 1):]  # this call's offsets
    out = _true(kernelized_num_den_band(pq, pk[:, :, n0:], v[:, :, n0:], lc, window=W, q_offset=off,
                                        initial_state=s0, chunk_size=4))
    for x, y in zip(out, ref):
        assert_close(x, y)
    u = torch.randn_like(out[1])
    (gs,) = torch.autograd.grad((out[1] * u).sum(), [s0])
    # d den_i / d S0[f, Dv] = c_tail_i · φq_i[f]; den's other channels do not reach it
    c_tail = torch.exp(lc_all[:, 0])  # b(-W) = b at the most negative offset
    expect = torch.einsum("bhi,bhif->bhf", u * c_tail[None, :, None], pq)
    assert_close(gs[..., -1], expect)
    assert torch.count_nonzero(gs[..., :-1]) == 0


def test_initial_state_needs_the_band_as_keys():
    x = torch.rand(1, 1, 3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="q_offset >= window"):
        kernelized_num_den_band(x, x, x, torch.zeros(1, 5, dtype=torch.float64), window=4, q_offset=0,
                                initial_state=torch.zeros(1, 1, 2, 3, dtype=torch.float64))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_t5_finite_support_is_the_first_distance_of_the_last_bucket(bidirectional, num_buckets, max_distance):
    W = P.T5Bias(2, num_buckets, max_distance, bidirectional).finite_support()
    r = torch.arange(-4 * max_distance, 4 * max_distance)
    b = t5_bucket(r, bidirectional, num_buckets, max_distance)
    at = {x: int(t5_bucket(torch.tensor([x]), bidirectional, num_buckets, max_distance)) for x in (-W, W, 1 - W)}
    assert (b[r <= -W] == at[-W]).all() and (b[r >= W] == at[W]).all()
    assert at[1 - W] != at[-W]  # the smallest such W
    assert 1 <= W <= max_distance


def test_learned_table_finite_support():
    assert P.LearnedTable(2, max_distance=40).finite_support() == 40
    assert P.LearnedTable(2, max_distance=0).finite_support() == 1
    assert P.KerpleLog(2).finite_support() is None and P.ALiBi(2).finite_support() is None


def _term(name, causal, H):
    torch.manual_seed(0)
    if name == "t5":
        t = P.T5Bias(H, num_buckets=16, max_distance=40, bidirectional=not causal)
    else:
        t = P.LearnedTable(H, max_distance=23, causal=causal)
    with torch.no_grad():
        for prm in t.parameters():
            prm.normal_(0, 1.0)
    return t.double()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name", ["t5", "learned"])
@pytest.mark.parametrize("Lq,Lk", [(150, 150), (37, 150), (150, 29)], ids=["L150", "Lq37-Lk150", "Lq150-Lk29"])
def test_backend_matches_dense_with_every_gradient(name, causal, Lq, Lk):
    H, D = 3, 8
    q, k, v = qkv(2, H, Lq, Lk, D, requires_grad=True)
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[0, -5:] = True
    pos = _term(name, causal, H)
    kw = dict(kernel="nprf", position=pos, causal=causal, key_padding_mask=kpm)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=8).double()
    kw["kernel"] = kern
    ref = fr.attention(q, k, v, backend="dense", **kw)
    out = fr.attention(q, k, v, backend="band", **kw)
    assert_close(out, ref)
    params = [q, k, v, *pos.parameters()]
    u = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
        assert_close(x, y)


def test_band_never_sees_the_future():
    H, D = 2, 8
    q, k, v = qkv(1, H, 200, 200, D, dtype=torch.float32)
    pos = _term("t5", True, H).float()
    with torch.no_grad():
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="band")
        for i in (0, 63, 64, 150, 198):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, i + 1:] *= 10
            v2[:, :, i + 1:] = 1e3
            o2 = fr.attention(q, k2, v2, kernel="elu", position=pos, causal=True, backend="band")
            assert torch.equal(o2[:, :, : i + 1], out[:, :, : i + 1])


def test_auto_picks_band_for_long_t5_and_band_refuses_infinite_support():
    q = torch.zeros(1, 2, 4096, 16)
    for causal in (True, False):
        t5 = P.T5Bias(2, bidirectional=not causal)
        assert fr.explain(q, q, q, kernel="elu", position=t5, causal=causal).chosen == "band"
    with pytest.raises(fr.FastRPEError, match="not constant beyond a finite distance"):
        fr.attention(q[:, :, :8], q[:, :, :8], q[:, :, :8], kernel="elu", position=P.KerpleLog(2), backend="band")
    with pytest.raises(fr.FastRPEError, match="only kernelized"):
        fr.attention(q[:, :, :8], q[:, :, :8], q[:, :, :8], position=P.T5Bias(2), backend="band")
