"""Chunked and recurrent (decode) ops against the naive ones: outputs, the final state and
the initial state's gradient (flash-linear-attention's contract for state-passing ops).
The naive states are written from their definitions: `S = Σ_j c(t - j) φ(k_j) ⊗ [v_j, 1]`."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.linear.chunked import kernelized_num_den_chunked
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.ops.common import safe_divide
from fastrpe.ops.linear.recurrent import (band_step, divide_packed, linear_step, recurrent_naive, soe_step, soe_token,
                                          soe_token_coefficients)
from fastrpe.ops.linear.soe import kernelized_num_den_soe, soe_plan
from fastrpe.testing import assert_close

CASES = [(1, 1, 0, 4), (63, 63, 0, 16), (20, 50, 30, 8), (37, 37, 5, 7), (10, 40, 60, 16)]


def _feats(B, H, L, F, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, H, L, F, generator=g, dtype=torch.float64).requires_grad_(requires_grad)


def _vv(v):
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)


@pytest.mark.parametrize("case", CASES, ids=[f"Lq{a}-Lk{b}-off{c}-T{d}" for a, b, c, d in CASES])
def test_chunked_final_state_and_initial_state_gradient(case):
    Lq, Lk, off, T = case
    H, F, Dv = 3, 5, 4
    pq, pk, v = _feats(2, H, Lq, F, 0), _feats(2, H, Lk, F, 1), _feats(2, H, Lk, Dv, 2)
    gamma = torch.tensor([0.9, 0.6, 1.0], dtype=torch.float64, requires_grad=True)
    s0 = _feats(2, H, F, Dv + 1, 3)
    num, den, _, st = kernelized_num_den_chunked(pq, pk, v, gamma=gamma, q_offset=off, chunk_size=T,
                                                 initial_state=s0, return_state=True)
    # naive: keys j at weight γ^(p_i - j); the initial state's keys sit before position 0
    r = torch.arange(-(Lq - 1 + off), Lk - off, dtype=torch.float64)
    lc = r.abs()[None] * torch.log(gamma)[:, None]
    n0, d0, m = kernelized_num_den_naive(pq, pk, v, lc, causal=True, q_offset=off)
    p1 = torch.arange(Lq, dtype=torch.float64) + off + 1
    init = torch.einsum("bhif,bhfc->bhic", pq * (gamma[:, None] ** p1)[None, :, :, None], s0)
    n_ref, d_ref = n0 * m.exp()[None, ..., None] + init[..., :Dv], d0 * m.exp()[None] + init[..., Dv]
    dist = (Lk - 1 - torch.arange(Lk, dtype=torch.float64))
    st_ref = gamma[None, :, None, None] ** Lk * s0 + torch.einsum(
        "bhjf,bhjc->bhfc", pk * (gamma[:, None] ** dist)[None, :, :, None], _vv(v))
    for x, y in ((num, n_ref), (den, d_ref), (st, st_ref)):
        assert_close(x, y)
    w = [torch.randn_like(t) for t in (num, den, st)]
    params = [pq, pk, v, gamma, s0]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip((num, den, st), w)), params)
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip((n_ref, d_ref, st_ref), w)), params)
    for x, y in zip(ga, gb):
        assert_close(x, y)


def _plan(H, N, seed=0):
    """A differentiable SoE fit of a decaying, wiggly `b(-d)`, `d < N` (leaf: `b`)."""
    g = torch.Generator().manual_seed(seed)
    d = torch.arange(N, dtype=torch.float64)
    b = (-torch.log1p(d[None] * torch.tensor([[0.3], [1.0], [2.0]])[:H])
         + 0.2 * torch.randn(H, N, generator=g, dtype=torch.float64) * (d < 64)).requires_grad_()
    return b, soe_plan(b, window=16, num_terms=8)


def _soe_coeff(plan, N):
    """`ĉ(d)`, `d < N`: the plan's function (fitted sum of exponentials, exact band)."""
    d = torch.arange(N, dtype=torch.float64)
    c = (plan.a[:, None, :] * plan.gamma[None, None, :] ** d[None, :, None]).sum(-1)
    return c + torch.nn.functional.pad(plan.corr, (0, N - plan.window))


@pytest.mark.parametrize("case", CASES, ids=[f"Lq{a}-Lk{b}-off{c}-T{d}" for a, b, c, d in CASES])
def test_soe_final_state_and_initial_state_gradient(case):
    Lq, Lk, off, T = case
    H, F, Dv = 3, 4, 3
    b, plan = _plan(H, 200)
    K = plan.num_terms
    pq, pk, v = _feats(1, H, Lq, F, 0), _feats(1, H, Lk, F, 1), _feats(1, H, Lk, Dv, 2)
    s0 = _feats(1, H * K, F, Dv + 1, 3, requires_grad=False).view(1, H, K, F, Dv + 1).requires_grad_()
    num, den, _, st = kernelized_num_den_soe(pq, pk, v, plan=plan, q_offset=off, chunk_size=T, initial_state=s0,
                                             return_state=True)
    n0, d0 = recurrent_naive(pq, pk, v, _soe_coeff(plan, off + Lq + 1), q_offset=off)
    p1 = torch.arange(Lq, dtype=torch.float64) + off + 1
    wq = plan.a[:, :, None] * plan.gamma[None, :, None] ** p1  # (H, K, Lq): initial keys read by the fit
    init = torch.einsum("bhif,hki,bhkfc->bhic", pq, wq, s0)
    n_ref, d_ref = n0 + init[..., :Dv], d0 + init[..., Dv]
    dist = (Lk - 1 - torch.arange(Lk, dtype=torch.float64))
    st_ref = plan.gamma[None, None, :, None, None] ** Lk * s0 + torch.einsum(
        "kj,bhjf,bhjc->bhkfc", plan.gamma[:, None] ** dist, pk, _vv(v))
    for x, y in ((num, n_ref), (den, d_ref), (st, st_ref)):
        assert_close(x, y)
    w = [torch.randn_like(t) for t in (num, den, st)]
    params = [pq, pk, v, s0, b]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip((num, den, st), w)), params, retain_graph=True)
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip((n_ref, d_ref, st_ref), w)), params)
    for x, y in zip(ga, gb):
        assert_close(x, y)


SPLITS = [3, 1, 1, 5, 1, 30, 1, 1, 2, 1]  # a prompt, single tokens, chunks, past the band (W = 16)


def _decode(step, pq, pk, v, **kw):
    outs, state, t = [], None, 0
    for n in SPLITS:
        res = step(pq[:, :, t:t + n], pk[:, :, t:t + n], v[:, :, t:t + n], state, **kw)
        num, den, state = res[0], res[1], res[-1]
        if len(res) == 4:  # a log-scale per row
            ls = res[2]
            num, den = num * ls.exp()[None, ..., None], den * ls.exp()[None]
        outs.append((num, den))
        t += n
    return torch.cat([o[0] for o in outs], 2), torch.cat([o[1] for o in outs], 2), state


def test_step_ops_match_the_naive_recurrence():
    H, F, Dv, W = 3, 4, 3, 16
    L = sum(SPLITS)
    pq, pk, v = (_feats(2, H, L, n, s, requires_grad=False) for n, s in ((F, 0), (F, 1), (Dv, 2)))
    dist = torch.arange(L, dtype=torch.float64)
    vv = _vv(v)

    gamma = torch.tensor([0.9, 0.6, 1.0], dtype=torch.float64)
    num, den, st = _decode(linear_step, pq, pk, v, gamma=gamma)
    n_ref, d_ref = recurrent_naive(pq, pk, v, gamma[:, None] ** dist)
    assert_close(num, n_ref), assert_close(den, d_ref)
    assert st.length == L
    assert_close(st.S, torch.einsum("hj,bhjf,bhjc->bhfc", gamma[:, None] ** dist.flip(0), pk, vv))

    g = torch.Generator().manual_seed(5)
    b = torch.randn(H, W + 1, generator=g, dtype=torch.float64)  # b(-d), d = 0..W, constant beyond
    num, den, st = _decode(band_step, pq, pk, v, b=b, window=W)
    n_ref, d_ref = recurrent_naive(pq, pk, v, b[:, dist.long().clamp_max(W)].exp())
    assert_close(num, n_ref), assert_close(den, d_ref)
    assert st.length == L and st.keys.shape[2] == W
    assert_close(st.S, torch.einsum("bhjf,bhjc->bhfc", pk[:, :, :L - W], vv[:, :, :L - W]))  # keys >= W back

    _, plan = _plan(H, 200)
    plan = type(plan)(plan.gamma, plan.a.detach(), plan.corr.detach(), plan.window, plan.fit_length)
    num, den, st = _decode(soe_step, pq, pk, v, plan=plan)
    n_ref, d_ref = recurrent_naive(pq, pk, v, _soe_coeff(plan, L))
    assert_close(num, n_ref), assert_close(den, d_ref)
    assert st.length == L and st.keys.shape[2] == plan.window - 1
    S_ref = torch.einsum("kj,bhjf,bhjc->bhkfc", plan.gamma[:, None] ** dist.flip(0), pk, vv)
    assert_close(st.S, S_ref)


def test_soe_token_matches_the_naive_recurrence_and_soe_step():
    """`soe_token` (the layer's one-token SoE body) after a prompt by `soe_step`, on past the
    band (W = 16): the naive recurrence of the plan's coefficients, and `soe_step` token by token."""
    H, F, Dv, P, L = 3, 4, 3, 5, 40
    pq, pk, v = (_feats(2, H, L, n, s, requires_grad=False) for n, s in ((F, 0), (F, 1), (Dv, 2)))
    _, plan = _plan(H, 200)
    plan = type(plan)(plan.gamma, plan.a.detach(), plan.corr.detach(), plan.window, plan.fit_length)
    num, den, st = soe_step(pq[:, :, :P], pk[:, :, :P], v[:, :, :P], plan=plan)
    ref_st = st
    ys = [torch.cat([num, den[..., None]], -1)]
    for t in range(P, L):
        n = st.keys.shape[2] + 1
        y, st = soe_token(pq[:, :, t:t + 1], pk[:, :, t:t + 1], _vv(v[:, :, t:t + 1]), st,
                          *soe_token_coefficients(plan, n, torch.float64))
        ys.append(y)
        n_ref, d_ref, ref_st = soe_step(pq[:, :, t:t + 1], pk[:, :, t:t + 1], v[:, :, t:t + 1], ref_st, plan=plan)
        assert_close(y, torch.cat([n_ref, d_ref[..., None]], -1))
        for a, b in ((st.S, ref_st.S), (st.keys, ref_st.keys), (st.values, ref_st.values)):
            assert_close(a, b)
    y = torch.cat(ys, 2)
    n_ref, d_ref = recurrent_naive(pq, pk, v, _soe_coeff(plan, L))
    assert_close(y[..., :Dv], n_ref), assert_close(y[..., Dv], d_ref)
    assert st.length == L and st.keys.shape[2] == plan.window - 1


def test_divide_packed_is_safe_divide():
    y = _feats(2, 3, 4, 5, 0, requires_grad=False)
    y[0, 1, 2, -1] = 0.0  # an empty row, and one below the underflow threshold
    y[1, 0, 3, -1] = 1e-300
    expected = safe_divide(y[..., :-1], y[..., -1])
    with torch.no_grad():
        assert_close(divide_packed(y), expected)
    yg = y.clone().requires_grad_()
    out = divide_packed(yg)  # with autograd: safe_divide's finite gradient
    assert_close(out, expected)
    out.sum().backward()
    assert torch.isfinite(yg.grad).all() and (yg.grad[0, 1, 2] == 0).all()


def test_band_and_soe_ops_never_sync_with_the_host(monkeypatch):
    """No `.item()`, `int()`, `float()`, `bool()` or `.tolist()` on a tensor in the hot path
    (forward and backward): on a GPU each would drain the stream."""
    H, F, Dv = 2, 4, 3
    pq, pk, v = _feats(1, H, 150, F, 0), _feats(1, H, 150, F, 1), _feats(1, H, 150, Dv, 2)
    b, plan = _plan(H, 200)
    tab = torch.randn(H, 21, dtype=torch.float64, requires_grad=True)
    idx = torch.arange(-149, 150).clamp(-10, 10) + 10

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronization in the hot path")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    from fastrpe.ops.linear.band import kernelized_num_den_band

    for causal in (True, False):
        num, den, ls = kernelized_num_den_band(pq, pk, v, tab[:, idx], window=10, causal=causal, q_offset=0)
        (num.sum() + den.sum() + ls.sum()).backward()
    num, den, _, st = kernelized_num_den_soe(pq, pk, v, plan=plan, return_state=True)
    (num.sum() + den.sum() + st.sum()).backward()
    # the fit itself (refitted every call): its rates' reach and weights stay on the device
    refit = soe_plan(b, window=16, num_terms=8)
    (refit.a.sum() + refit.corr.sum()).backward()
    monkeypatch.undo()
    assert tab.grad is not None and b.grad is not None
