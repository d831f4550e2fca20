"""GeometricDecay (RetNet's `c_h(r) = γ_h^|r|`) against a reference written from the formula.

The reference forms the weights `κ(q_i, k_j)·γ_h^|j−i|` with `torch.pow` on the decays the
test chose (no positional module, no backend code) and normalizes them (kernelized: Luo
Eq. 10; softmax: `exp(scale·q·k)·γ^|r|` normalized over keys). Every backend that accepts
the term (by its own reasons) must match it in float64, forward and gradients, with the
decays fixed and learned, including γ = 1 and γ = 0.9999.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe._validate import FastRPEError
from fastrpe.testing import assert_close

H, D = 3, 8
GAMMAS = {"mixed": [0.9, 0.5, 0.97], "one_and_0.9999": [1.0, 0.9999, 0.3]}
SIZES = [(1, 1), (63, 63), (17, 40), (40, 17)]
BACKENDS = ["dense", "fft", "chunked", "auto"]


def _reference(q, k, v, gamma, kernel: str, causal: bool):
    """Eq. 10 (kernelized) / softmax with `γ^|r|` weights, queries bottom-right aligned when causal."""
    Lq, Lk = q.shape[2], k.shape[2]
    off = Lk - Lq if causal and Lq < Lk else 0
    i = torch.arange(Lq)[:, None] + off
    j = torch.arange(Lk)[None, :]
    decay = gamma[:, None, None] ** (j - i).abs().to(gamma.dtype)  # (H, Lq, Lk)
    if kernel == "softmax":
        s = torch.einsum("bhid,bhjd->bhij", q, k) * D ** -0.5
        w = torch.exp(s - s.amax(-1, keepdim=True)) * decay
    else:  # elu + 1
        fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        w = torch.einsum("bhif,bhjf->bhij", fq, fk) * decay
    if causal:
        w = w.masked_fill(j > i, 0.0)
    return (w @ v) / w.sum(-1, keepdim=True)


def _qkv(Lq, Lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, H, n, D, generator=g, dtype=torch.float64).requires_grad_() for n in (Lq, Lk, Lk)]


def _accepts(backend, q, kernel, pos, causal) -> bool:
    if backend == "auto":
        return True
    with torch.no_grad():
        ex = fr.explain(q, q, q, kernel=kernel, position=pos, causal=causal)
    return any(c.backend == backend and not c.reasons for c in ex.candidates)


CASES = [(g, kern, causal, be, learn) for g in GAMMAS for kern in ("elu", "softmax") for causal in (True, False)
         for be in BACKENDS for learn in (False, True)
         if not (be in ("fft", "chunked") and kern == "softmax") and not (be == "chunked" and not causal)]


@pytest.mark.parametrize("size", SIZES, ids=[f"Lq{a}-Lk{b}" for a, b in SIZES])
@pytest.mark.parametrize("gname,kernel,causal,backend,learnable", CASES,
                         ids=[f"{g}-{k}-{'causal' if c else 'bidir'}-{b}-{'learn' if lr else 'fixed'}"
                              for g, k, c, b, lr in CASES])
def test_every_backend_matches_the_formula(size, gname, kernel, causal, backend, learnable):
    gammas = GAMMAS[gname]
    if learnable and 1.0 in gammas:
        gammas = [min(x, 1 - 1e-6) for x in gammas]
    pos = P.GeometricDecay(H, gamma=gammas, learnable=learnable).double()
    q, k, v = _qkv(*size)
    assert _accepts(backend, q.detach(), kernel, pos, causal), f"{backend} refuses the geometric decay"
    out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=causal, backend=backend)
    # the decays as the module holds them (float32 storage, then .double())
    g = pos.gamma.detach().clone().requires_grad_()
    ref = _reference(q, k, v, g, kernel, causal)
    assert_close(out, ref)
    u = torch.randn_like(ref)
    ins = [q, k, v] + ([pos.raw_rate] if learnable else [])
    got = torch.autograd.grad((out * u).sum(), ins)
    want = torch.autograd.grad((ref * u).sum(), [q, k, v, g])
    for a, b in zip(got[:3], want[:3]):
        assert_close(a, b)
    if learnable:  # chain rule through γ = exp(−exp(raw)): dγ/draw = γ·log γ
        assert_close(got[3], want[3] * g.detach() * torch.log(g.detach()))


def test_causal_fast_paths_never_see_the_future():
    pos = P.GeometricDecay(H, gamma=[1.0, 0.9999, 0.8]).double()
    q, k, v = (t.detach() for t in _qkv(50, 50))
    out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="chunked")
    for i in (0, 24, 48):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, i + 1:] *= 20
        v2[:, :, i + 1:] = 1e3
        o2 = fr.attention(q, k2, v2, kernel="elu", position=pos, causal=True, backend="chunked")
        assert torch.equal(o2[:, :, : i + 1], out[:, :, : i + 1])


def test_alibi_is_the_special_case_gamma_exp_minus_m():
    alibi = P.ALiBi(8).double()
    geo = P.GeometricDecay(8, gamma=torch.exp(-alibi.slopes.double())).double()
    assert_close(geo.materialize(9, 13, 2), alibi.materialize(9, 13, 2))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 40, D, generator=g, dtype=torch.float64) for _ in range(3))
    for backend in ("chunked", "dense", "fft"):
        a = fr.attention(q, k, v, kernel="elu", position=alibi, causal=True, backend=backend)
        b = fr.attention(q, k, v, kernel="elu", position=geo, causal=True, backend=backend)
        assert_close(b, a)


def test_default_is_retnet_and_make_builds_it():
    pos = P.make("geometric", 4)
    assert isinstance(pos, P.GeometricDecay) and not pos.learnable
    want = [1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7, 1 - 2 ** -8]
    assert_close(pos.gamma.double(), torch.tensor(want, dtype=torch.float64), torch.float32)
    assert P.make("geometric", 2, gamma=0.5, learnable=True).learnable


def test_decays_within_1e9_of_one_keep_their_value_in_float32():
    pos = P.GeometricDecay(2, gamma=[1 - 1e-9, 1.0])
    assert pos.fixed_log_gamma.dtype == torch.float32
    assert math.isclose(float(pos.log_gamma[0]), -1e-9, rel_tol=1e-6)
    b = pos.log_coefficients(1, 1_000_001)[:, -1]  # r = 10^6
    assert math.isclose(float(b[0]), -1e-3, rel_tol=1e-5) and float(b[1]) == 0.0
    learned = P.GeometricDecay(1, gamma=1 - 1e-9, learnable=True)
    assert math.isclose(float(learned.log_gamma[0]), -1e-9, rel_tol=1e-5)


def test_learned_decays_stay_in_the_open_interval():
    pos = P.GeometricDecay(H, gamma=[0.5, 0.99, 1 - 1e-7], learnable=True)
    opt = torch.optim.SGD(pos.parameters(), lr=1e3)
    for sign in (1.0, -1.0):
        opt.zero_grad()
        (sign * pos.log_coefficients(5, 5).sum()).backward()
        opt.step()
        g = pos.gamma
        assert bool(torch.isfinite(pos.raw_rate).all()) and bool(((g >= 0) & (g <= 1)).all())
        assert bool((pos.log_gamma < 0).all())


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan"), [0.5, 0.5]])
def test_refuses_decays_outside_the_interval(bad):
    with pytest.raises(FastRPEError, match="gamma"):
        P.GeometricDecay(H, gamma=bad)


def test_learnable_one_is_refused():
    with pytest.raises(FastRPEError, match="learnable decay must be below 1"):
        P.GeometricDecay(2, gamma=1.0, learnable=True)


def test_soe_leaves_it_to_chunked_and_decoding_keeps_a_linear_state():
    pos = P.GeometricDecay(2, gamma=[0.9999, 0.7]).double()
    q = torch.zeros(1, 2, 8, 4, dtype=torch.float64)
    ex = fr.explain(q, q, q, kernel="elu", position=pos, causal=True, allow_approximate=True)
    soe = next(c for c in ex.candidates if c.backend == "soe")
    assert any("geometric decay" in r for r in soe.reasons)
    torch.manual_seed(0)
    mha = fr.nn.MultiheadAttention(16, 2, kernel="elu", position=pos, causal=True).double()
    assert mha.decode_state == "linear"
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x)
        out, state = mha.step(x[:, :5])
        outs = [out]
        for t in range(5, 19):
            out, state = mha.step(x[:, t:t + 1], state)
            outs.append(out)
    assert_close(torch.cat(outs, 1), full)


def test_float64_decays_agree_across_backends_to_roundoff():
    """γ was rounded to float32 before the linear-time ops took its log: a float64 call
    differed by 5e-8 between dense and chunked with ALiBi (whose float32 slopes are exact).
    A float32 GeometricDecay table is rounded in the dense bias itself: cast the term with
    the model (`.double()`) for float64 work."""
    import fastrpe as fr
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 200, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for pos in (fr.positions.ALiBi(8), fr.positions.GeometricDecay(8, gamma=0.5).double()):
        dense = fr.attention(q, k, v, "nprf", pos, causal=True, backend="dense")
        chunked = fr.attention(q, k, v, "nprf", pos, causal=True, backend="chunked")
        assert (dense - chunked).abs().max().item() < 1e-13, type(pos).__name__
