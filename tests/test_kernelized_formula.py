"""The kernelized composition against references written directly from the papers'
equations (float64, dense loops-free einsums; nothing here calls `fastrpe.backends` or
`fastrpe.ops.kernelized`): forward and gradients, Lq != Lk, causal and not.

* Luo et al. 2021, Eq. 10: `out_i = Σ_j φ(q_i)·φ(k_j)·c(j-i)·v_j / Σ_j φ(q_i)·φ(k_j)·c(j-i)`.
* Scaleformer (Favier & Dal'Maz Silva 2021), Eq. 10: `S_ij = φ(q_i)·RP[clip(i-j, -k, k)]`
  added to numerator and denominator.
* FastRPB: `out += W·v`, `W_ij = w(j-i)`; SIKF `φ(x) = exp(x)` (§3.1).
* KERPLE log: `c(r) = exp(-r1·log(1 + r2·|r|))`.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.kernels import PRF, Exp, get_kernel
from fastrpe.testing import assert_close

F64 = torch.float64


# ----------------------------------------------------------------------------- references


def prf_phi(kern: PRF, x):
    """FAVOR+ from its definition: `exp(w·x − ‖x‖²/2)/√m` on `x·input_scale` (one-sided), or
    `exp(−‖x‖²/2)/√(2m)·[exp(w·x), exp(−w·x)]` (two-sided); optionally l2-normalized first."""
    if kern.normalize:
        x = x / x.norm(dim=-1, keepdim=True)
    x = x * kern.input_scale
    w = kern.w.to(F64)
    wx = x @ w.T if w.dim() == 2 else torch.einsum("bhld,hmd->bhlm", x, w)
    sq = x.pow(2).sum(-1, keepdim=True) / 2
    if kern.two_sided:
        return torch.exp(torch.cat([wx, -wx], -1) - sq) / math.sqrt(2 * kern.m)
    return torch.exp(wx - sq) / math.sqrt(kern.m)


def eq10(phi_q, phi_k, v, c, S=None, W=None, mask=None):
    """Luo Eq. 10 (+ Scaleformer Eq. 10's S, + FastRPB's W·v): `c, S, W, mask: [.., Lq, Lk]`."""
    a = (phi_q @ phi_k.transpose(-1, -2)) * c
    if S is not None:
        a = a + S
    if mask is not None:
        a = a * mask
    out = (a @ v) / a.sum(-1, keepdim=True)
    if W is not None:
        out = out + ((W * mask) if mask is not None else W) @ v
    return out


def rel(Lq, Lk, q_offset):
    """`[Lq, Lk]` offsets `r = j - i` (key minus query position)."""
    return torch.arange(Lk)[None, :] - (torch.arange(Lq)[:, None] + q_offset)


def _qkv(B, H, Lq, Lk, D, Dv, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Lq, D, generator=g, dtype=F64) * scale).requires_grad_()
    k = (torch.randn(B, H, Lk, D, generator=g, dtype=F64) * scale).requires_grad_()
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=F64).requires_grad_()
    return q, k, v


def _grads(out, params, seed=1):
    u = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * u).sum(), params, allow_unused=True, retain_graph=True)


def _check(out, ref, params):
    assert_close(out, ref)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        assert_close(a, b)


# (Lq, Lk, causal, q_offset): Lq != Lk both ways, decoding-style offsets
CASES = [(7, 11, False, 0), (11, 7, False, 0), (7, 11, True, 4), (11, 11, True, 0), (1, 9, True, 8), (63, 40, False, 3)]


def _cid(c):
    return f"Lq{c[0]}-Lk{c[1]}-{'causal' if c[2] else 'full'}-off{c[3]}"


def _backends(causal, extra=()):
    return ["dense", "fft", *extra] + (["chunked"] if causal else [])


# ----------------------------------------------------------------------------- PRF + Shaw


@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_prf_with_shaw_is_scaleformer_eq10(case):
    """PRF at D = 16 without normalization: the key stabilizer is ~e^14; it must cancel
    against Shaw's `φ(q)·RP` too (it did not: the content term was scaled by ~e^-14)."""
    Lq, Lk, causal, off = case
    B, H, D, m, kmax = 2, 2, 16, 32, 3
    kern = PRF(D, m, seed=3).double()
    assert float(kern.key_log_shift()) > 8  # the regime where a stray shift shows
    shaw = P.ShawRelative(H, m, max_distance=kmax, init_std=0.5, positive=True).double()
    q, k, v = _qkv(B, H, Lq, Lk, D, 5)
    pq, pk = prf_phi(kern, q), prf_phi(kern, k)
    r = rel(Lq, Lk, off)
    rp = torch.nn.functional.elu(shaw.rp) + 1  # (H, 2k+1, F)
    S = torch.einsum("bhif,hijf->bhij", pq, rp[:, (-r).clamp(-kmax, kmax) + kmax])
    mask = (r <= 0).to(F64) if causal else None
    ref = eq10(pq, pk, v, 1.0, S=S, mask=mask)
    params = [q, k, v, shaw.rp]
    for backend in _backends(causal, ("prefix",) if causal else ()):
        out = fr.attention(q, k, v, kernel=kern, position=shaw, causal=causal, q_offset=off, backend=backend)
        _check(out, ref, params)


# ----------------------------------------------------------------------------- FastRPB, KERPLE


@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_fastrpb_with_kerple_is_eq10_plus_wv(case):
    Lq, Lk, causal, off = case
    B, H, D = 2, 3, 8
    kern = get_kernel("nprf", D, 48, seed=1).double()
    kerple = P.KerpleLog(H, r1=[0.5, 1.0, 2.0], r2=[0.2, 0.5, 1.5]).double()
    rpb = P.FastRPB1D(H, max_len=9, init_std=0.3).double()
    q, k, v = _qkv(B, H, Lq, Lk, D, 4, seed=2)
    pq, pk = prf_phi(kern, q), prf_phi(kern, k)
    r = rel(Lq, Lk, off)
    c = torch.exp(-kerple.r1[:, None, None] * torch.log1p(kerple.r2[:, None, None] * r.abs()))  # (H, Lq, Lk)
    W = torch.where(r.abs() < 9, rpb.w[:, (r + 8).clamp(0, 16)], torch.zeros((), dtype=F64))  # (H, Lq, Lk)
    mask = (r <= 0).to(F64) if causal else None
    ref = eq10(pq, pk, v, c, W=W, mask=mask)
    params = [q, k, v, kerple.raw_r1, kerple.raw_r2, rpb.w]
    for backend in ["dense", "fft"]:
        out = fr.attention(q, k, v, kernel=kern, position=[kerple, rpb], causal=causal, q_offset=off,
                           backend=backend)
        _check(out, ref, params)


@pytest.mark.parametrize("case", CASES[:4], ids=_cid)
def test_prf_kerple_shaw_together(case):
    """All three terms at once, unnormalized PRF (a large key shift), per-head projections."""
    Lq, Lk, causal, off = case
    B, H, D, m, kmax = 1, 2, 16, 24, 2
    kern = PRF(D, m, seed=5, num_heads=H).double()
    kerple = P.KerpleLog(H, r1=[0.7, 1.3], r2=[0.3, 0.9]).double()
    shaw = P.ShawRelative(H, m, max_distance=kmax, init_std=0.5, positive=True).double()
    q, k, v = _qkv(B, H, Lq, Lk, D, 3, seed=4)
    pq, pk = prf_phi(kern, q), prf_phi(kern, k)
    r = rel(Lq, Lk, off)
    c = torch.exp(-kerple.r1[:, None, None] * torch.log1p(kerple.r2[:, None, None] * r.abs()))
    rp = torch.nn.functional.elu(shaw.rp) + 1
    S = torch.einsum("bhif,hijf->bhij", pq, rp[:, (-r).clamp(-kmax, kmax) + kmax])
    mask = (r <= 0).to(F64) if causal else None
    ref = eq10(pq, pk, v, c, S=S, mask=mask)
    for backend in ["dense", "fft"]:
        out = fr.attention(q, k, v, kernel=kern, position=[kerple, shaw], causal=causal, q_offset=off,
                           backend=backend)
        _check(out, ref, [q, k, v, kerple.raw_r1, shaw.rp])


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=_cid)
def test_shaw_with_a_term_whose_largest_coefficient_is_not_one(case):
    """A decaying table with `b(0) = 5` (not 0 as KERPLE's): the linear-time algorithms take
    each head's largest log-coefficient out of their sums, and must say so (`log_scale`), or
    Shaw's sums, in true units, are weighed against content sums e^5 too small (`soe` was off
    by 1.9 in the output before it did)."""
    Lq, Lk, causal, off = case
    B, H, D, kmax = 1, 2, 8, 3
    L = max(Lk, off + Lq)
    pos = P.LearnedTable(H, max_distance=L - 1, causal=True).double()
    with torch.no_grad():
        d = torch.arange(L - 1, -1, -1, dtype=F64)  # the table's entries r = -(L-1)..0
        pos.table.copy_(torch.stack([5 - 2 * torch.log1p(d), 3 - torch.log1p(0.5 * d)]))
    kern = get_kernel("elu", D).double()
    shaw = P.ShawRelative(H, D, max_distance=kmax, init_std=0.5, positive=True).double()
    q, k, v = _qkv(B, H, Lq, Lk, D, 4, seed=11)
    pq, pk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    r = rel(Lq, Lk, off)
    c = torch.exp(pos.table[:, (r + L - 1).clamp(0, L - 1)])  # (H, Lq, Lk); r > 0 masked below
    S = torch.einsum("bhif,hijf->bhij", pq, (torch.nn.functional.elu(shaw.rp) + 1)[:, (-r).clamp(-kmax, kmax) + kmax])
    ref = eq10(pq, pk, v, c, S=S, mask=(r <= 0).to(F64))
    params = [q, k, v, pos.table, shaw.rp]
    for backend in ["dense", "fft", "band", "soe"]:
        out = fr.attention(q, k, v, kernel=kern, position=[pos, shaw], causal=True, q_offset=off, backend=backend)
        if backend == "soe":  # approximate beyond its exact band: within its fit's 1e-3
            assert (out - ref).abs().max().item() <= 1e-3 * ref.abs().max().item(), backend
        else:
            _check(out, ref, params)


# ----------------------------------------------------------------------------- SIKF


@pytest.mark.parametrize("case", CASES, ids=_cid)
@pytest.mark.parametrize("with_position", [False, True], ids=["nopos", "kerple"])
def test_sikf_is_exp_feature_attention(case, with_position):
    """`φ(x) = exp(x)` exactly: keys of very different maxima (a per-key shift rescaled each
    key differently: up to 0.76 off)."""
    Lq, Lk, causal, off = case
    B, H, D = 2, 2, 6
    q, k, v = _qkv(B, H, Lq, Lk, D, 3, scale=3.0, seed=6)
    with torch.no_grad():
        k[:, :, ::3] += 6.0  # every third key much larger
    pos = P.KerpleLog(H, r1=[0.5, 1.5], r2=[0.4, 0.8]).double() if with_position else None
    r = rel(Lq, Lk, off)
    c = 1.0
    if pos is not None:
        c = torch.exp(-pos.r1[:, None, None] * torch.log1p(pos.r2[:, None, None] * r.abs()))
    mask = (r <= 0).to(F64) if causal else None
    ref = eq10(torch.exp(q), torch.exp(k), v, c, mask=mask)
    backends = ["dense"] if causal else ["dense", "fft"]
    for backend in backends:
        out = fr.attention(q, k, v, kernel="exp", position=pos, causal=causal, q_offset=off, backend=backend)
        _check(out, ref, [q, k, v])


@pytest.mark.parametrize("case", CASES[:4], ids=_cid)
def test_sikf_with_shaw(case):
    """SIKF's shared (non-causal) or running (causal) key shift cancels against Shaw's `φ(q)·RP` too."""
    Lq, Lk, causal, off = case
    B, H, D, kmax = 2, 2, 5, 2
    q, k, v = _qkv(B, H, Lq, Lk, D, 3, scale=2.0, seed=9)
    with torch.no_grad():
        k[:, :, 1::4] += 5.0
    shaw = P.ShawRelative(H, D, max_distance=kmax, init_std=0.5, positive=True).double()
    r = rel(Lq, Lk, off)
    pq = torch.exp(q)
    S = torch.einsum("bhif,hijf->bhij", pq, (torch.nn.functional.elu(shaw.rp) + 1)[:, (-r).clamp(-kmax, kmax) + kmax])
    mask = (r <= 0).to(F64) if causal else None
    ref = eq10(pq, torch.exp(k), v, 1.0, S=S, mask=mask)
    for backend in ["dense"] if causal else ["dense", "fft"]:
        out = fr.attention(q, k, v, kernel="exp", position=shaw, causal=causal, q_offset=off, backend=backend)
        _check(out, ref, [q, k, v, shaw.rp])


def test_sikf_large_inputs_do_not_overflow_and_padding_does_not_set_the_shift():
    B, H, L, D = 2, 2, 13, 4
    q, k, v = _qkv(B, H, L, L, D, 3, seed=7)
    with torch.no_grad():
        k.mul_(40.0)  # exp(k) up to ~e^150: fine in float64, and the reference is direct
        q.mul_(3.0)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -3:] = True
    with torch.no_grad():
        k[0, :, -3:] = 700.0  # padding keys: exp(700) would dominate any shared shift
    mask = (~kpm)[:, None, None, :].to(F64)
    for causal in (False, True):
        if causal:
            mask_c = mask * (rel(L, L, 0) <= 0).to(F64)
        ref = eq10(torch.exp(q), torch.exp(k.masked_fill(kpm[:, None, :, None], 0.0)), v, 1.0,
                   mask=mask_c if causal else mask)
        out = fr.attention(q, k, v, kernel="exp", causal=causal, key_padding_mask=kpm, backend="dense")
        assert torch.isfinite(out).all()
        _check(out, ref, [q, v])


def test_causal_sikf_never_sees_the_future_and_linear_backends_say_why():
    B, H, L, D = 1, 2, 17, 4
    q, k, v = (x.detach() for x in _qkv(B, H, L, L, D, 3, scale=2.0, seed=8))
    out = fr.attention(q, k, v, kernel="exp", causal=True, backend="dense")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 9:] += 50.0  # later keys with a much larger maximum
    v2[:, :, 9:] = 1e6
    out2 = fr.attention(q, k2, v2, kernel="exp", causal=True, backend="dense")
    assert torch.equal(out[:, :, :9], out2[:, :, :9])  # bitwise: earlier rows never read later keys
    for backend in ("chunked", "prefix", "fft"):
        with pytest.raises(fr.FastRPEError, match="running maximum"):
            fr.attention(q, k, v, kernel="exp", causal=True, backend=backend)
    # the normalized form has a data-independent shift and runs in linear time
    a = fr.attention(q, k, v, kernel="nexp", causal=True, backend="chunked")
    qn, kn = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    assert_close(a, eq10(torch.exp(qn), torch.exp(kn), v, 1.0, mask=(rel(L, L, 0) <= 0).to(F64)))


# ----------------------------------------------------------------------------- kernels


def _unbiased(est_terms, truth, z=4.0):
    """`est_terms: [m, ...]` i.i.d. per-feature terms whose mean estimates `truth`."""
    mean = est_terms.mean(0)
    se = est_terms.std(0) / math.sqrt(est_terms.shape[0])
    assert bool(((mean - truth).abs() <= z * se + 1e-12).all()), ((mean - truth) / se).abs().max()


@pytest.mark.parametrize("two_sided", [False, True], ids=["one-sided", "two-sided"])
def test_nprf_estimates_exp_of_the_cosine(two_sided):
    """Luo §3.2: NPRF's kernel is exp(q̂·k̂), q̂·k̂ in [−1, 1], with no D^-1/4 scale."""
    D, m = 8, 200000
    kern = get_kernel("nprf2" if two_sided else "nprf", D, m, seed=11).double()
    assert kern.input_scale == 1.0 and kern.normalize and kern.two_sided == two_sided
    g = torch.Generator().manual_seed(12)
    x, y = torch.randn(2, 6, D, generator=g, dtype=F64)
    truth = torch.exp((torch.nn.functional.normalize(x, dim=-1) * torch.nn.functional.normalize(y, dim=-1)).sum(-1))
    # per-feature terms of φ(x)·φ(y), from the map's own key path: true features are phi·exp(shift)
    s = kern.key_log_shift()
    fx, fy = kern(x, is_query=False) * torch.exp(s), kern(y, is_query=False) * torch.exp(s)  # (6, F)
    F = fx.shape[-1]
    terms = (fx * fy * F).T  # (F, 6): mean over features = φ(x)·φ(y)
    if two_sided:  # the pair (w, −w) shares one draw: average it into one i.i.d. term
        terms = (terms[: F // 2] + terms[F // 2:]) / 2
    _unbiased(terms, truth)
    torch.testing.assert_close((fx * fy).sum(-1), truth, rtol=0.05, atol=0)  # and close at this many features


def test_nprf_temperature_is_explicit():
    D, m, t = 8, 200000, 1.5
    kern = PRF(D, m, normalize=True, input_scale=t, seed=13).double()
    g = torch.Generator().manual_seed(14)
    x, y = torch.nn.functional.normalize(torch.randn(2, 5, D, generator=g, dtype=F64), dim=-1)
    s = kern.key_log_shift()
    terms = (kern(x, is_query=False) * kern(y, is_query=False) * m).T * torch.exp(2 * s)  # (m, 5)
    _unbiased(terms, torch.exp(t * t * (x * y).sum(-1)))  # exp(t²·q̂·k̂)


@pytest.mark.parametrize("scale", [None, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("two_sided", [False, True], ids=["one-sided", "two-sided"])
def test_prf_key_shift_bounds_every_normalized_key(scale, two_sided):
    """The data-independent key shift is an upper bound of every key exponent, tight at
    the key along the largest projection: features never exceed 1/√F."""
    D, m = 16, 64
    kern = PRF(D, m, normalize=True, input_scale=scale, two_sided=two_sided, seed=15).double()
    F = kern.num_features(D)
    keys = torch.randn(4000, D, generator=torch.Generator().manual_seed(16), dtype=F64)
    w = kern.w.double()
    worst = w[w.norm(dim=-1).argmax()]
    keys = torch.cat([keys, worst[None], -worst[None]])
    phi = kern(keys, is_query=False)
    assert float(phi.max()) <= (1 + 1e-12) / math.sqrt(F)
    if abs(kern.input_scale) <= float(w.norm(dim=-1).max()):
        assert float(phi.max()) >= (1 - 1e-9) / math.sqrt(F)  # attained: the bound is tight


def test_two_sided_prf_is_unbiased_for_softmax_kernel():
    """FAVOR+'s positive symmetric form estimates exp(x·y) like the one-sided one."""
    D, m = 6, 30000
    kern = get_kernel("prf2", D, m, seed=17).double()
    assert kern.num_features(D) == 2 * m
    g = torch.Generator().manual_seed(18)
    x, y = torch.randn(2, 5, D, generator=g, dtype=F64) * 0.8
    xs, ys = x * kern.input_scale, y * kern.input_scale
    truth = torch.exp((xs * ys).sum(-1))
    s = kern.key_log_shift()
    fx, fy = kern(x, is_query=False) * torch.exp(s), kern(y, is_query=False) * torch.exp(s)
    terms = (fx * fy * 2 * m).T
    _unbiased((terms[:m] + terms[m:]) / 2, truth)


def test_per_head_projections_are_independent_buffers():
    H, D, m = 3, 8, 16
    kern = PRF(D, m, seed=21, num_heads=H)
    assert kern.w.shape == (H, m, D)
    assert not torch.equal(kern.w[0], kern.w[1]) and not torch.equal(kern.w[1], kern.w[2])
    assert torch.equal(kern.w, PRF(D, m, seed=21, num_heads=H).w)  # reproducible from the seed
    assert not torch.equal(kern.w, PRF(D, m, seed=22, num_heads=H).w)
    assert "w" in kern.state_dict()
    old = kern.w.clone()
    kern.redraw()
    assert kern.seed == 22 and torch.equal(kern.w, PRF(D, m, seed=22, num_heads=H).w)
    assert all(not torch.equal(old[h], kern.w[h]) for h in range(H))  # every head redrawn
    fresh = PRF(D, m, seed=0, num_heads=H)
    fresh.load_state_dict({"w": old})
    assert torch.equal(fresh.w, old)  # checkpoints carry the draw
    # each head uses its own draw: head h equals a shared map holding w[h]
    x = torch.randn(2, H, 5, D)
    phi = kern(x, is_query=False)
    for h in range(H):
        single = PRF(D, m, seed=0)
        single.w.copy_(kern.w[h])
        ref = single(x[:, h], is_query=False) * torch.exp(single.key_log_shift() - kern.key_log_shift()[h])
        torch.testing.assert_close(phi[:, h], ref)
    with pytest.raises(ValueError, match="num_heads=3"):
        kern(torch.randn(2, 2, 5, D))
    for spec in ("prf", "orf", "sphere_prf", "ntrf", "prf2"):
        assert get_kernel(spec, D, m, seed=1, num_heads=H).w.shape == (H, m, D)


def test_exp_kernel_on_its_own_is_the_paper_map():
    x = torch.randn(2, 3, 4, 5, dtype=F64) * 5
    assert torch.equal(Exp()(x, is_query=False), torch.exp(x))
    assert_close(Exp(normalize=True)(x, is_query=False) * math.e, torch.exp(torch.nn.functional.normalize(x, dim=-1)))
