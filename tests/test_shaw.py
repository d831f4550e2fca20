"""Shaw relative vectors (Scaleformer's linear-time form): `shaw_num_den_linear` against the
materializing `shaw_num_den_naive` (outputs and every gradient), the dense softmax logits,
the `ShawRelative` module, causality and memory."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.common import safe_divide
from fastrpe.ops.kernelized import shaw_logit_bias
from fastrpe.ops.shaw.linear import shaw_num_den_linear
from fastrpe.ops.shaw.naive import clipped_index, shaw_logits, shaw_num_den_naive
from fastrpe.positions.shaw import ShawRelative
from fastrpe.testing import assert_close, assert_lowp_close

# (Lq, Lk, q_offset): n=1, awkward sizes, Lq != Lk both ways, decoding with a cache, offsets
SHAPES = [(1, 1, 0), (63, 63, 0), (100, 63, 0), (63, 100, 0), (20, 257, 237), (257, 257, 0), (40, 5, 3), (5, 40, 12)]
KS = [0, 1, 3, 300]  # 300: larger than every length


def _sid(s):
    return f"Lq{s[0]}-Lk{s[1]}-off{s[2]}"


def _inputs(Lq, Lk, k, *, B=2, H=3, F=8, Dv=5, dtype=torch.float64, seed=0, pad=True, grad=True):
    g = torch.Generator().manual_seed(seed)
    phi = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64).to(dtype)  # features are >= 0
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64).to(dtype)
    rp = torch.randn(H, 2 * k + 1, F, generator=g, dtype=torch.float64).to(dtype)  # signed: S can be < 0
    kpm = None
    if pad:
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[-1, Lk // 2:] = True  # last batch row: the last half of the keys are padding
        kpm[0, 1::7] = True  # first: scattered padding
    if grad:
        for t in (phi, v, rp):
            t.requires_grad_()
    return phi, v, rp, kpm


def _both(phi, v, rp, Lk, causal, off, kpm):
    kw = {"Lk": Lk, "causal": causal, "q_offset": off, "key_padding_mask": kpm}
    return shaw_num_den_naive(phi, v, rp, **kw), shaw_num_den_linear(phi, v, rp, **kw)


def _weights(ref, seed=1):
    """Fixed random cotangents for the outputs (so a test does not depend on the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) for t in ref]


def _grads(outs, params, w):
    return torch.autograd.grad(sum((t * u.to(t.dtype)).sum() for t, u in zip(outs, w)), params)


def _check_grads(ref, out, params):
    w = _weights(ref)
    for name, a, b in zip(("phi_q", "v", "rp"), _grads(out, params, w), _grads(ref, params, w)):
        assert_close(a, b, msg=f"grad {name}")


# ----------------------------------------------------------------------------- linear vs naive


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("k", KS, ids=[f"k{k}" for k in KS])
@pytest.mark.parametrize("shape", SHAPES, ids=[_sid(s) for s in SHAPES])
def test_linear_matches_naive_float64(shape, k, causal, pad):
    Lq, Lk, off = shape
    phi, v, rp, kpm = _inputs(Lq, Lk, k, pad=pad)
    ref, out = _both(phi, v, rp, Lk, causal, off, kpm)
    assert out[0].shape == (2, 3, Lq, 5) and out[1].shape == (2, 3, Lq)
    assert_close(out[0], ref[0], msg="num")
    assert_close(out[1], ref[1], msg="den")
    _check_grads(ref, out, [phi, v, rp])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(100, 63, 0), (63, 100, 0), (20, 257, 237)], ids=_sid)
def test_linear_matches_naive_wide_values(shape, causal):
    """Dv = 60 (non-power-of-two value width)."""
    Lq, Lk, off = shape
    phi, v, rp, kpm = _inputs(Lq, Lk, 3, Dv=60)
    ref, out = _both(phi, v, rp, Lk, causal, off, kpm)
    for a, b in zip(out, ref):
        assert_close(a, b)
    _check_grads(ref, out, [phi, v, rp])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("k", [1, 3, 300], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("shape", [(63, 63, 0), (100, 63, 0), (20, 257, 237), (257, 257, 0)], ids=_sid)
def test_linear_matches_naive_float32(shape, k, causal):
    """Outputs within the float32 tolerance of the naive path; outputs and gradients (sums
    of hundreds of terms, magnitudes up to ~1e3) within a small factor of the naive path's
    own float32 error against float64 (STYLE §9)."""
    Lq, Lk, off = shape
    phi, v, rp, kpm = _inputs(Lq, Lk, k, Dv=60, dtype=torch.float32)
    kw = {"Lk": Lk, "causal": causal, "q_offset": off, "key_padding_mask": kpm}
    ref, out = _both(phi, v, rp, Lk, causal, off, kpm)
    assert out[0].dtype == torch.float32
    for a, b in zip(out, ref):
        assert_close(a, b)
    p64 = [t.detach().double().requires_grad_() for t in (phi, v, rp)]
    ref64 = shaw_num_den_naive(*p64, **kw)
    for a, b, c in zip(out, ref, ref64):
        assert_lowp_close(a.detach(), b.detach(), c.detach())
    w = _weights(ref)
    for name, a, b, c in zip(("phi_q", "v", "rp"), _grads(out, [phi, v, rp], w), _grads(ref, [phi, v, rp], w),
                             _grads(ref64, p64, w)):
        assert_lowp_close(a, b, c, msg=f"grad {name}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_tiny(causal):
    phi, v, rp, _ = _inputs(4, 6, 2, B=1, H=2, F=3, Dv=2)
    kpm = torch.tensor([[False, False, True, False, False, False]])

    def f(phi, v, rp):
        return shaw_num_den_linear(phi, v, rp, Lk=6, causal=causal, q_offset=1, key_padding_mask=kpm)

    assert torch.autograd.gradcheck(f, (phi, v, rp))


# ----------------------------------------------------------------------------- definition


def test_naive_matches_the_definition():
    """A loop over pairs: `S_ij = φ(q_i)·RP[clip(i - j, -k, k) + k]`, `i` counted from q_offset."""
    Lq, Lk, off, k = 5, 9, 3, 2
    phi, v, rp, _ = _inputs(Lq, Lk, k, B=1, H=2, pad=False, grad=False)
    num = torch.zeros(1, 2, Lq, 5, dtype=torch.float64)
    den = torch.zeros(1, 2, Lq, dtype=torch.float64)
    for i in range(Lq):
        for j in range(Lk):
            t = max(-k, min(k, (i + off) - j))
            S = (phi[0, :, i] * rp[:, t + k]).sum(-1)  # (H,)
            num[0, :, i] += S[:, None] * v[0, :, j]
            den[0, :, i] += S
    n, d = shaw_num_den_naive(phi, v, rp, Lk=Lk, q_offset=off)
    assert_close(n, num)
    assert_close(d, den)


def test_sign_convention_far_past_uses_last_row():
    """`RP[+k]` (row 2k) is the vector of keys at least k positions *before* the query."""
    k = 2
    idx = clipped_index(6, 6, k, 0)
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    assert bool((idx[j <= i - k] == 2 * k).all()) and bool((idx[j >= i + k] == 0).all())
    assert bool((idx[(i - j).abs() < k] == (i - j + k)[(i - j).abs() < k]).all())


def test_den_can_be_negative_and_nothing_is_nan():
    """S is unconstrained: den < 0 is kept as is; a fully padded row gives den == 0
    exactly, which `safe_divide` maps to 0 with finite gradients."""
    phi, v, rp, _ = _inputs(30, 30, 3, pad=False)
    kpm = torch.zeros(2, 30, dtype=torch.bool)
    kpm[1] = True  # every key of the second batch row is padding
    with torch.no_grad():
        rp.copy_(-rp.abs())  # φ >= 0, RP <= 0: every S_ij <= 0
    for causal in (False, True):
        num, den = shaw_num_den_linear(phi, v, rp, Lk=30, causal=causal, key_padding_mask=kpm)
        assert bool((den[0] < 0).all())
        assert bool((den[1] == 0).all()) and bool((num[1] == 0).all())
        out = safe_divide(num, den)
        assert bool(torch.isfinite(out).all()) and bool((out[1] == 0).all())
        grads = torch.autograd.grad(out.sum(), [phi, v, rp])
        assert all(bool(torch.isfinite(g).all()) for g in grads)


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("shape", [(300, 300, 0), (40, 300, 260), (64, 100, 7)], ids=_sid)
@pytest.mark.parametrize("k", [1, 3, 300], ids=lambda k: f"k{k}")
def test_causal_never_sees_the_future(shape, k):
    """Changing values (and padding) of keys after query i leaves row i bit for bit unchanged."""
    Lq, Lk, off = shape
    phi, v, rp, kpm = (t.float() if t is not None and t.is_floating_point() else t
                       for t in _inputs(Lq, Lk, k, grad=False))
    base = shaw_num_den_linear(phi, v, rp, Lk=Lk, causal=True, q_offset=off, key_padding_mask=kpm)
    for i in (0, Lq // 2, Lq - 2):
        if i < 0:
            continue
        cut = off + i + 1  # first key after query i
        v2, kpm2 = v.clone(), kpm.clone()
        v2[:, :, cut:] = 1e4 * torch.randn_like(v2[:, :, cut:])
        kpm2[:, cut:] = ~kpm2[:, cut:]
        out = shaw_num_den_linear(phi, v2, rp, Lk=Lk, causal=True, q_offset=off, key_padding_mask=kpm2)
        for a, b in zip(out, base):
            assert torch.equal(a[:, :, : i + 1], b[:, :, : i + 1])


# ----------------------------------------------------------------------------- memory


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward, excluding the inputs'."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_linear_saves_linear_memory():
    """Backward state is O(L·(k + Dv)): the band's shifted values are views, not copies."""
    L, k, F, Dv = 2000, 8, 8, 5
    phi, v, rp, kpm = _inputs(L, L, k, B=1, H=2, F=F, Dv=Dv)
    kw = {"Lk": L, "causal": False, "key_padding_mask": kpm}
    lin = _saved_bytes(lambda: shaw_num_den_linear(phi, v, rp, **kw), phi, v, rp)
    rows = 2 * L * 8  # B·H·L float64 rows
    assert lin <= rows * ((2 * k + 1) + 5 * (Dv + 1)), lin
    naive = _saved_bytes(lambda: shaw_num_den_naive(phi, v, rp, **kw), phi, v, rp)
    assert naive >= rows * L  # the naive path keeps S: [B, H, L, L]


# ----------------------------------------------------------------------------- softmax logits


def test_logits_match_the_definition():
    B, H, Lq, Lk, D, k, off = 2, 3, 5, 8, 4, 2, 4
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    rp = torch.randn(H, 2 * k + 1, D, generator=g, dtype=torch.float64)
    ref = torch.empty(B, H, Lq, Lk, dtype=torch.float64)
    for i in range(Lq):
        for j in range(Lk):
            ref[:, :, i, j] = (q[:, :, i] * rp[None, :, max(-k, min(k, i + off - j)) + k]).sum(-1)
    assert_close(shaw_logits(q, rp, Lk, off), ref)
    term = ShawRelative(H, D, k).double()
    with torch.no_grad():
        term.rp.copy_(rp)
    assert_close(shaw_logit_bias(q, [term.vectors(D, kernelized=False)], Lk, off, scale=0.5), 0.5 * ref)


def test_kernelized_num_den_is_the_logit_term_applied_to_v():
    """Both forms share one S: `num = shaw_logits(φ(q)) @ v` with φ(q) in place of q."""
    phi, v, rp, _ = _inputs(7, 9, 2, pad=False, grad=False)
    S = shaw_logits(phi, rp, 9, 2)
    num, den = shaw_num_den_linear(phi, v, rp, Lk=9, q_offset=2)
    assert_close(num, S @ v)
    assert_close(den, S.sum(-1))


# ----------------------------------------------------------------------------- module


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_module_linear_and_naive_agree(causal):
    torch.manual_seed(0)
    term = ShawRelative(3, 8, max_distance=3, init_std=0.3).double()
    assert term.rp.shape == (3, 7, 8)
    phi, v, _, kpm = _inputs(50, 70, 3, grad=False)
    rp = term.vectors(8, kernelized=True)
    a = shaw_num_den_linear(phi, v, rp, Lk=70, causal=causal, q_offset=20, key_padding_mask=kpm)
    b = shaw_num_den_naive(phi, v, rp, Lk=70, causal=causal, q_offset=20, key_padding_mask=kpm)
    for x, y in zip(a, b):
        assert_close(x, y)
    (ga,) = torch.autograd.grad(a[0].sum() + a[1].sum(), [term.rp])
    (gb,) = torch.autograd.grad(b[0].sum() + b[1].sum(), [term.rp])
    assert_close(ga, gb)


def test_module_init_and_repr():
    torch.manual_seed(0)
    term = ShawRelative(4, 16, max_distance=5)
    assert term.rp.shape == (4, 11, 16)
    assert 0.01 < term.rp.std().item() < 0.03  # small init (std 0.02)
    assert "max_distance=5" in repr(term)
    assert ShawRelative(1, 2, 0).rp.shape == (1, 1, 2)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="max_distance"):
        ShawRelative(2, 8, -1)
    term = ShawRelative(2, 8, 2).double()
    phi, v, rp, _ = _inputs(5, 6, 2, B=1, H=2, grad=False, pad=False)
    with pytest.raises(ValueError, match="rp must be"):  # 1 head of features, 2 heads of vectors
        shaw_num_den_linear(phi[:, :1], v[:, :1], term.vectors(8, kernelized=True), Lk=6)
    with pytest.raises(ValueError, match="dim=8"):
        term.vectors(4, kernelized=False)
    with pytest.raises(ValueError, match="rp must be"):
        shaw_num_den_linear(phi, v, rp[:, :4], Lk=6)
    with pytest.raises(ValueError, match="v must be"):
        shaw_num_den_linear(phi, v, rp, Lk=7)
    with pytest.raises(ValueError, match="key_padding_mask"):
        shaw_num_den_naive(phi, v, rp, Lk=6, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))


def test_positive_vectors_keep_the_denominator_positive_and_match_dense():
    import fastrpe as fr
    from fastrpe.ops.linear.naive import kernelized_num_den_naive
    from fastrpe.positions import ShawRelative

    torch.manual_seed(0)
    H, L, D = 2, 19, 8
    t = ShawRelative(H, dim=D, max_distance=3, init_std=2.0, positive=True).double()
    q, k, v = (torch.randn(1, H, L, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    phi = fr.kernels.get_kernel("elu")
    num, den = shaw_num_den_linear(phi(q, is_query=True), v, t.vectors(D, kernelized=True), Lk=L, causal=True)
    assert bool((den > 0).all())  # elu+1 features · (elu(RP)+1) > 0
    out = fr.attention(q, k, v, kernel=phi, position=t, causal=True, backend="auto")
    # reference: materialized weights φ(q_i)·φ(k_j) + φ(q_i)·(elu(RP[clip(i-j)])+1), causal
    pq, pk = phi(q, is_query=True), phi(k, is_query=True)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    rp = torch.nn.functional.elu(t.rp) + 1  # (H, 2k+1, D)
    s = torch.einsum("bhid,hijd->bhij", pq, rp[:, (i - j).clamp(-3, 3) + 3])
    w = (pq @ pk.transpose(-1, -2) + s) * (j <= i)
    ref = (w @ v) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(out, ref)
    _, d0, _ = kernelized_num_den_naive(pq, pk, v, None, causal=True)
    assert bool((d0 + den > 0).all())
