"""Positional terms: Toeplitz structure, the family formulas, known T5 buckets and ALiBi
slopes, constraints that training cannot break, gradients, and FlexAttention's score_mod."""
from __future__ import annotations

import math

import pytest
import torch

from fastrpe import positions as P
from fastrpe.testing import assert_close

H = 3


def _formula(name, pos, r: int, h: int) -> float:
    a = abs(r)
    if name == "alibi":
        return -pos.slopes[h].item() * a
    if name in ("kerple_power", "kerple_power_p1"):
        return -pos.r1[h].item() * a ** pos.p[h].item()
    if name == "kerple_log":
        return -pos.r1[h].item() * math.log1p(pos.r2[h].item() * a)
    if name == "kerple_log3":
        return -pos.r1[h].item() * math.log1p(pos.r2[h].item() * a ** pos.p[h].item())
    if name == "kerple_bias_weight":
        return -pos.r1[h].item() * math.log1p(pos.r2[h].item() * a)
    if name == "learned":
        return pos.table[h, max(-pos.max_distance, min(pos.max_distance, r)) + pos.max_distance].item()
    if name == "t5":
        return pos.embedding[_t5_ref(r, pos.bidirectional, pos.num_buckets, pos.max_distance), h].item()
    raise KeyError(name)


def _t5_ref(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """HF T5's _relative_position_bucket on a Python int (relative = memory - context)."""
    ret = 0
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


def _random_params(pos, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in pos.parameters():
            prm.add_(0.5 * torch.randn(prm.shape, generator=g))
    return pos


NAMES = list(P.NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("Lq,Lk,off", [(1, 1, 0), (5, 9, 0), (9, 5, 0), (7, 7, 3), (63, 100, 0)],
                         ids=lambda x: str(x))
def test_materialize_is_toeplitz_and_matches_formula(name, Lq, Lk, off):
    pos = _random_params(P.make(name, H, max_len=64))
    M = pos.materialize(Lq, Lk, q_offset=off).detach()
    assert M.shape == (H, Lq, Lk)
    # Toeplitz: constant along diagonals
    assert torch.equal(M[:, 1:, 1:], M[:, :-1, :-1])
    for h in range(H):
        for i in {0, Lq // 2, Lq - 1}:
            for j in {0, Lk // 2, Lk - 1}:
                r = j - (i + off)
                assert M[h, i, j].item() == pytest.approx(_formula(name, pos, r, h), rel=1e-5, abs=1e-6), (h, i, j)


@pytest.mark.parametrize("name", NAMES)
def test_log_coefficients_order(name):
    pos = _random_params(P.make(name, H, max_len=64))
    Lq, Lk, off = 6, 9, 2
    lc = pos.log_coefficients(Lq, Lk, off).detach()
    assert lc.shape == (H, Lq + Lk - 1)
    r = torch.arange(-(Lq - 1 + off), Lk - off)
    for idx in (0, 5, Lq + Lk - 2):
        assert lc[1, idx].item() == pytest.approx(_formula(name, pos, int(r[idx]), 1), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidir", "causal"])
@pytest.mark.parametrize("nb,md", [(32, 128), (16, 64), (8, 20)])
def test_t5_buckets_match_reference(bidirectional, nb, md):
    r = torch.arange(-300, 301)
    got = P.t5_bucket(r, bidirectional, nb, md)
    want = torch.tensor([_t5_ref(int(x), bidirectional, nb, md) for x in r])
    assert torch.equal(got, want)


def test_t5_known_values():
    # HF T5 defaults (32 buckets, 128 max distance), bidirectional; relative = key - query
    b = lambda r: int(P.t5_bucket(torch.tensor(r), True, 32, 128))  # noqa: E731
    assert [b(0), b(-1), b(-7), b(-8), b(-12), b(-127), b(-1000)] == [0, 1, 7, 8, 9, 15, 15]
    assert [b(1), b(7), b(8), b(1000)] == [17, 23, 24, 31]
    c = lambda r: int(P.t5_bucket(torch.tensor(r), False, 32, 128))  # noqa: E731
    assert [c(0), c(5), c(-1), c(-15), c(-16), c(-1000)] == [0, 0, 1, 15, 16, 31]


def test_alibi_slopes_known():
    assert P.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    assert P.alibi_slopes(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    s12 = P.alibi_slopes(12)
    assert s12[:8] == [2 ** (-(i + 1)) for i in range(8)]
    assert s12[8:] == pytest.approx([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5])
    assert P.ALiBi(5).slopes.shape == (5,)


@pytest.mark.parametrize("name", ["kerple_power", "kerple_log", "kerple_log3", "kerple_bias_weight"])
def test_constraints_survive_huge_steps(name):
    pos = P.make(name, H)
    opt = torch.optim.SGD(pos.parameters(), lr=1e4)
    for sign in (1.0, -1.0, 1.0):
        opt.zero_grad()
        (sign * pos.materialize(20, 20).sum()).backward()
        opt.step()
        for attr in ("r1", "r2", "r3"):
            if hasattr(pos, attr):
                assert bool((getattr(pos, attr) >= 0).all()), attr
        if hasattr(pos, "p"):
            assert bool(((pos.p >= 0) & (pos.p <= 2)).all())
        assert torch.isfinite(pos.materialize(20, 20)).all() or name == "kerple_power"


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_log_coefficients(name):
    pos = _random_params(P.make(name, 2, max_len=8)).double()
    params = [p for p in pos.parameters()]
    if not params:
        pytest.skip("no learnable parameters")

    # autograd against central finite differences, entry by entry
    lc = pos.log_coefficients(4, 5, 1)
    w = torch.randn_like(lc)
    grads = torch.autograd.grad((lc * w).sum(), params, allow_unused=True)
    for prm, g in zip(params, grads):
        g = torch.zeros_like(prm) if g is None else g
        for idx in range(min(prm.numel(), 4)):
            flat = prm.data.view(-1)
            old = flat[idx].item()
            flat[idx] = old + 1e-6
            up = (pos.log_coefficients(4, 5, 1) * w).sum().item()
            flat[idx] = old - 1e-6
            dn = (pos.log_coefficients(4, 5, 1) * w).sum().item()
            flat[idx] = old
            assert g.view(-1)[idx].item() == pytest.approx((up - dn) / 2e-6, rel=1e-5, abs=1e-7)


def test_power_gradient_finite_at_zero_offset():
    pos = P.KerplePower(2, p=0.5)
    pos.materialize(5, 5).sum().backward()
    assert torch.isfinite(pos.raw_p.grad).all() and torch.isfinite(pos.raw_r1.grad).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("off", [0, 3])
def test_score_mod_equals_materialize_via_flex(name, off):
    from fastrpe.ops.softmax.flex import flex_available, softmax_attention_flex
    from fastrpe.ops.softmax.naive import softmax_attention_naive

    if not flex_available():
        pytest.skip("FlexAttention is not in this PyTorch")
    pos = _random_params(P.make(name, H, max_len=64))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, 8, generator=g) for n in (17, 23, 23))
    with torch.no_grad():
        out = softmax_attention_flex(q, k, v, pos.score_mod(off))
        ref = softmax_attention_naive(q, k, v, pos.materialize(17, 23, off), weight=pos.materialize_weight(17, 23, off))
    assert_close(out, ref, torch.float32)


def test_make_refuses_unknown_name():
    with pytest.raises(ValueError, match="position: unknown name 'kerple'"):
        P.make("kerple", 2)
