"""Finite-support terms exactly in linear time by the fused Triton kernel
(`ops/linear/triton_band.py`, backend `triton_band`), against a dense reference written here
from Luo et al. 2021 Eq. 10: `num_i = Σ_{j <= p_i} exp(b(j - p_i))·(φq_i·φk_j)·v_j`, `den_i`
the same without `v_j`, with `b(r) = b(-W)` for every `r <= -W`.

On CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1).
"""
import pytest
import torch

_CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

import fastrpe as fr  # noqa: E402
from fastrpe import positions as P  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear import triton_band as tb  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import (assert_close, assert_lowp_close, features_and_values, quotient_reference,  # noqa: E402
                             weighted_grads)

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


def _table(H, W, seed=0, spread=3.0):
    """`[H, W+1]` leaf: `b(-d)` for `d = 0..W`, the last entry the constant tail."""
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(H, W + 1, generator=g, dtype=torch.float64)).to(DEV).requires_grad_()


def _log_coeff(tab, Lq, Lk, q_offset):
    """`[H, Lq+Lk-1]` in the offset order the ops take (`r = -(Lq-1+q_offset) .. Lk-1-q_offset`);
    `r > 0` gets arbitrary values (causal: never read)."""
    W = tab.shape[1] - 1
    r = torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, device=DEV)
    return torch.where(r <= 0, tab[:, (-r).clamp(0, W)], torch.full((), 7.0, dtype=tab.dtype, device=DEV))


def reference(q, k, v, tab, q_offset=0, kpm=None):
    """Eq. 10's numerator and denominator, causal, materialized (true units)."""
    W = tab.shape[1] - 1
    Lq, Lk = q.shape[2], k.shape[2]
    d = (torch.arange(Lq, device=DEV) + q_offset)[:, None] - torch.arange(Lk, device=DEV)[None, :]  # p_i - j
    c = torch.where(d >= 0, torch.exp(tab[:, d.clamp(0, W)]), torch.zeros((), dtype=tab.dtype, device=DEV))
    a = torch.einsum("bhif,bhjf->bhij", q, k) * c.to(q.dtype)
    if kpm is not None:
        a = a.masked_fill(kpm[:, None, None, :], 0.0)
    return a @ v, a.sum(-1)


def _true(num, den, ls):
    return num * ls.exp()[None, :, :, None], den * ls.exp()[None]


CASES = [  # B, H, Lq, Lk, F, Dv, q_offset, W, chunk
    pytest.param(1, 2, 63, 63, 12, 10, 0, 8, 16, id="T63-W8"),
    pytest.param(2, 1, 1, 1, 12, 10, 0, 8, 16, id="T1"),
    pytest.param(1, 2, 50, 50, 12, 10, 0, 16, 16, id="T50-W16-band-fills-the-chunk"),
    pytest.param(1, 2, 45, 45, 12, 10, 0, 20, 16, id="T45-W20-three-near-chunks"),
    pytest.param(1, 2, 100, 100, 12, 10, 0, 33, 16, id="T100-W33-far-field-past-three-near-chunks"),
    pytest.param(1, 1, 40, 40, 12, 72, 0, 5, 16, id="T40-Dv72-two-value-blocks"),
    pytest.param(1, 2, 5, 60, 12, 10, 55, 8, 16, id="decode-Lq5-Lk60-off55"),
    pytest.param(1, 2, 20, 50, 12, 10, 10, 8, 16, id="Lq20-Lk50-off10"),
    pytest.param(1, 2, 40, 25, 12, 10, 0, 8, 16, id="queries-past-keys"),
    pytest.param(1, 2, 12, 12, 12, 10, 0, 40, 16, id="W40-longer-than-the-call"),
    pytest.param(1, 1, 150, 150, 12, 10, 0, 113, 64, id="T150-W113-T5-support"),
]


@pytest.mark.parametrize("precision", ["ieee", "bf16x3"], ids=["transposed", "key-major"])
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,W,chunk", CASES)
def test_band_kernel_is_exact(B, H, Lq, Lk, F, Dv, q_offset, W, chunk, precision):
    """float64: output and every gradient, the table's included, to round-off, in both forms of
    the key-chunk gradient kernel ("bf16x3" selects the key-major one, which 16-bit operands
    take; float64 operands are multiplied exactly in every mode)."""
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, dtype=torch.float64, device=DEV)
    tab = _table(H, W)
    got = _true(*tb.kernelized_num_den_triton_band(q, k, v, _log_coeff(tab, Lq, Lk, q_offset), window=W,
                                                   q_offset=q_offset, chunk_size=chunk, precision=precision))
    want = reference(q, k, v, tab, q_offset)
    for a, b in zip(got, want):
        assert_close(a, b.detach())
    leaves = (q, k, v, tab)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), weighted_grads(got, leaves), weighted_grads(want, leaves)):
        assert_close(a, b, msg=name)


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,W,chunk",
                         [c for c in CASES if c.id in ("T63-W8", "T1", "T40-Dv72-two-value-blocks",
                                                       "decode-Lq5-Lk60-off55", "T150-W113-T5-support")])
def test_band_quotient_is_exact(B, H, Lq, Lk, F, Dv, q_offset, W, chunk):
    """`divide=`: the quotient and every gradient, the table's included, as `num/den` of the
    dense sums (the plan's per-head shift cancels in it)."""
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, dtype=torch.float64, device=DEV)
    tab = _table(H, W)
    out, _, _ = tb.kernelized_num_den_triton_band(q, k, v, _log_coeff(tab, Lq, Lk, q_offset), window=W,
                                                  q_offset=q_offset, chunk_size=chunk, divide=torch.float64)
    ref = quotient_reference(*reference(q, k, v, tab, q_offset))
    assert_close(out, ref.detach())
    leaves = (q, k, v, tab)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), weighted_grads((out,), leaves), weighted_grads((ref,), leaves)):
        assert_close(a, b, msg=name)


def test_band_kernel_float32_padding_and_a_wide_table():
    """float32, padded keys, a table spanning 40 nats (every row scaled by its head's largest
    coefficient: rows near the start see only tiny ones, still far from float32's floor)."""
    q, k, v = features_and_values(2, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    tab = _table(2, 8, seed=3, spread=10.0)
    with torch.no_grad():
        tab[0, 5] = 20.0
        tab[1, 0] = -20.0
    kpm = torch.zeros(2, 63, dtype=torch.bool, device=DEV)
    kpm[0, 40:] = True
    kpm[1, 2:5] = True  # (every row keeps a key: a row without any is 0/0)
    got = tb.kernelized_num_den_triton_band(q, k, v, _log_coeff(tab, 63, 63, 0), window=8, key_padding_mask=kpm,
                                            chunk_size=16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, tab, kpm=kpm)
    # compare in the units the op chose (true sums span e^40): out = num/den is unit-free
    out, ref = got[0] / got[1][..., None], want[0] / want[1][..., None]
    assert torch.isfinite(out).all()
    assert_close(out, ref.detach(), torch.float32)
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), weighted_grads([out], (q, k, v, tab)),
                          weighted_grads([ref], (q64, k64, v64, tab))):
        assert_close(a, b, torch.float32, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_band_kernel_low_precision_against_float64(dtype):
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=dtype, device=DEV)
    tab = _table(2, 8)
    got = tb.kernelized_num_den_triton_band(q, k, v, _log_coeff(tab, 63, 63, 0), window=8, chunk_size=16)
    got = got[0] / got[1][..., None]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    n64, d64 = reference(q64, k64, v64, tab)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    nl, dl = reference(ql, kl, vl, tab)
    r64, lowp = n64 / d64[..., None], nl / dl[..., None]
    assert_lowp_close(got, lowp, r64.detach())
    d_got, d_lowp = weighted_grads([got], (q, k, v)), weighted_grads([lowp], (ql, kl, vl))
    for name, a, n, r in zip(("dq", "dk", "dv"), d_got, d_lowp, weighted_grads([r64], (q64, k64, v64))):
        assert_lowp_close(a, n, r, msg=name)


def test_band_plan_is_exact_and_keeps_its_shift():
    """No fit: one undecayed term whose weight is the tail's coefficient, the band exact; the
    largest log-coefficient is kept as `shift` (the sums' units)."""
    tab = _table(3, 6).detach()
    plan = tb.band_plan(tab)
    c = torch.exp(tab - tab.amax(-1, keepdim=True))
    assert plan.num_terms == 1 and plan.gamma.item() == 1.0 and plan.window == 6
    assert_close(plan.a[:, 0], c[:, 6])
    assert_close(plan.corr + plan.a, c[:, :6])
    assert_close(plan.shift, tab.amax(-1))
    with pytest.raises(ValueError, match="W >= 1"):
        tb.band_plan(tab[:, :1])


def test_band_kernel_never_sees_the_future():
    """Changing keys and values after position t leaves outputs up to t alone (forward and dq)."""
    q, k, v = features_and_values(1, 2, 50, 50, 12, 10, dtype=torch.float64, device=DEV)
    tab = _table(2, 8)
    lc = _log_coeff(tab, 50, 50, 0)
    num, den, _ = tb.kernelized_num_den_triton_band(q, k, v, lc, window=8, chunk_size=16)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 30:] = torch.rand_like(k2[:, :, 30:]) * 5
    v2[:, :, 30:] = torch.randn_like(v2[:, :, 30:]) * 5
    num2, den2, _ = tb.kernelized_num_den_triton_band(q, k2, v2, lc, window=8, chunk_size=16)
    assert torch.equal(num[:, :, :30], num2[:, :, :30]) and torch.equal(den[:, :, :30], den2[:, :, :30])
    assert not torch.equal(num[:, :, 30:], num2[:, :, 30:])


def test_a_table_without_gradient_keeps_its_plan():
    """A frozen term's table (kept per parameter state by the backend) gets one plan, whose
    kernel tables triton_soe keeps too; an in-place edit makes a new one; a table in the graph
    gets a new plan on every call and its gradient."""
    q, k, v = features_and_values(1, 2, 40, 40, 8, 6, device=DEV)
    lc = _log_coeff(_table(2, 20), 40, 40, 0).detach()

    def plan_of(table):
        seen = []
        real = tb.kernelized_num_den_triton_soe

        def spy(*a, **kw):
            seen.append(a[3])
            return real(*a, **kw)

        tb.kernelized_num_den_triton_soe = spy
        try:
            out = tb.kernelized_num_den_triton_band(q, k, v, table, window=20)
        finally:
            tb.kernelized_num_den_triton_soe = real
        return seen[0], out

    (p1, o1), (p2, o2) = plan_of(lc), plan_of(lc)
    assert p1 is p2 and torch.equal(o1[0], o2[0])
    with torch.no_grad():
        lc[:, 35:40] += 1.0  # b(-d), d = 0..4
    p3, o3 = plan_of(lc)
    assert p3 is not p1 and not torch.equal(o3[0], o1[0])
    live = lc.clone().requires_grad_()
    (p4, o4), (p5, _) = plan_of(live), plan_of(live)
    assert p4 is not p5
    (g,) = torch.autograd.grad(o4[0].sum(), live)
    assert g.abs().sum() > 0


# ----------------------------------------------------------------------------- the backend


@pytest.fixture
def interpret_on_cpu(monkeypatch):
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)


def _t5(H):
    pos = P.T5Bias(H, num_buckets=8, max_distance=20, bidirectional=False).double().to(DEV)
    with torch.no_grad():
        pos.embedding.copy_(torch.randn(pos.embedding.shape, generator=torch.Generator().manual_seed(2),
                                        dtype=torch.float64))
    return pos


@pytest.mark.parametrize("family", ["t5", "learned"])
@pytest.mark.parametrize("L,Lq", [(70, 70), (70, 9)], ids=["L70", "Lq9-of-70"])
def test_backend_equals_dense_for_finite_support_terms(interpret_on_cpu, family, L, Lq):
    """`triton_band` through the public API, exact: output and gradients of q, k, v and the
    term's parameters equal the dense backend's (float64)."""
    torch.manual_seed(0)
    H = 2
    q = torch.randn(1, H, Lq, 16, dtype=torch.float64, device=DEV, requires_grad=True)
    k, v = (torch.randn(1, H, L, 16, dtype=torch.float64, device=DEV, requires_grad=True) for _ in range(2))
    pos = _t5(H) if family == "t5" else P.LearnedTable(H, max_distance=12, causal=True, init_std=1.0).double().to(DEV)
    res = []
    for backend in ("triton_band", "dense"):
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend=backend)
        res.append((out, weighted_grads([out], (q, k, v, *pos.parameters()))))
    (o1, g1), (o2, g2) = res
    assert_close(o1, o2)
    for a, b in zip(g1, g2):
        assert_close(a, b)


def test_backend_refusals_say_why(interpret_on_cpu):
    from fastrpe.backends_triton import MAX_BAND_WINDOW

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEV) for _ in range(3))

    def why(position, causal=True, kernel="elu"):
        with pytest.raises(FastRPEError) as e:
            fr.attention(q, k, v, kernel=kernel, position=position, causal=causal, backend="triton_band")
        return str(e.value)

    assert "causal only" in why(_t5(2), causal=False)
    assert "not constant beyond a finite distance" in why(P.KerpleLog(2).double().to(DEV))
    wide = P.LearnedTable(2, max_distance=MAX_BAND_WINDOW + 1, causal=True).double().to(DEV)
    assert f"over the kernel's {MAX_BAND_WINDOW}" in why(wide)
    assert "only kernelized attention" in why(_t5(2), kernel="softmax")


def test_explain_lists_triton_band_as_exact():
    """`auto` may choose it (exact, unlike triton_soe): the dispatcher knows it as exact."""
    from fastrpe.dispatch import BACKENDS

    assert BACKENDS["triton_band"].exact and not BACKENDS["triton_soe"].exact


@pytest.mark.gpu
def test_band_gpu_realistic_size_bf16():
    """L=4096, H=8, F=32, Dv=64, T5's 128-distance support (chunk 128), bf16 on the GPU
    against the float64 reference."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    q, k, v = features_and_values(1, 8, 4096, 4096, 32, 64, dtype=torch.bfloat16, device=DEV)
    tab = _table(8, 128, spread=1.0)
    got = tb.kernelized_num_den_triton_band(q, k, v, _log_coeff(tab, 4096, 4096, 0), window=128)
    out = got[0].double() / got[1].double()[..., None]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rn, rd = reference(q64, k64, v64, tab)
    ref = rn / rd[..., None]
    assert (out - ref.detach()).abs().max().item() <= 2e-2 * ref.abs().max().item()
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), weighted_grads([out], (q, k, v, tab)),
                          weighted_grads([ref], (q64, k64, v64, tab))):
        assert (a.double() - b).abs().max().item() <= 3e-2 * b.abs().max().item(), name


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,W,chunk",
                         [c for c in CASES if c.id in ("T63-W8", "T100-W33-far-field-past-three-near-chunks",
                                                       "decode-Lq5-Lk60-off55", "queries-past-keys")])
def test_band_kernel_is_exact_with_the_blocked_state_scan(blocked_scan, B, H, Lq, Lk, F, Dv, q_offset, W, chunk):
    """The undecayed term's states in blocks, each from its carry: exact as before."""
    test_band_kernel_is_exact(B, H, Lq, Lk, F, Dv, q_offset, W, chunk, "ieee")


def test_band_keeps_its_one_terms_states_for_the_backward(monkeypatch):
    """The band's far field is one undecayed term: its forward keeps the states for the
    backward (`triton_soe.SAVE_STATES_BYTES`'s rule for one term, as the geometric path keeps
    its own), so a forward and backward make them once, and the gradients are exact."""
    from fastrpe.ops.linear import triton_soe as ts

    made, real = [], ts._soe_states
    monkeypatch.setattr(ts, "_soe_states", lambda *a: made.append(a[2].numel()) or real(*a))
    test_band_kernel_is_exact(1, 2, 63, 63, 12, 10, 0, 8, 16, "ieee")
    assert made == [1]
