"""Fused sum-of-exponentials Triton kernel (`ops/linear/triton_soe.py`) against a dense
reference written from the plan's definition: `c(d) = Σ_k a_k γ_k^d + [d < W]·corr(d)`,
weights `c(p_i - j)` for `j <= p_i` (Luo et al. 2021 Eq. 10 with that coefficient).

Interpreter set-up as in test_triton_chunked.py (TRITON_INTERPRET before triton imports).
"""

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe.ops.linear import triton_soe as ts  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear.soe import SoEPlan, soe_plan  # noqa: E402
from fastrpe.testing import (assert_close, assert_lowp_close, features_and_values, quotient_reference,  # noqa: E402
                             weighted_grads)

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


def _plan(H, window, terms, fit_length=256):
    """A KERPLE-log-like decay per head, fitted; `a` and `corr` as leaves with gradients."""
    d = torch.arange(fit_length, dtype=torch.float64)
    r1 = torch.linspace(0.5, 2.0, H, dtype=torch.float64)
    b = -r1[:, None] * torch.log1p(0.3 * d)[None]
    p = soe_plan(b, window=window, num_terms=terms)
    return SoEPlan(p.gamma.to(DEV), p.a.detach().to(DEV).requires_grad_(), p.corr.detach().to(DEV).requires_grad_(),
                   p.window, p.fit_length)


def reference(q, k, v, plan, q_offset=0, kpm=None):
    """Dense causal sums with the plan's coefficients."""
    Lq, Lk = q.shape[2], k.shape[2]
    L = max(Lk, q_offset + Lq)
    d = torch.arange(L, device=q.device, dtype=torch.float64)
    c = (plan.a[:, None, :] * plan.gamma[None, None, :] ** d[None, :, None]).sum(-1)  # (H, L)
    c = c + torch.nn.functional.pad(plan.corr, (0, L - plan.window))
    dist = (torch.arange(Lq, device=q.device) + q_offset)[:, None] - torch.arange(Lk, device=q.device)[None, :]
    w = torch.where(dist >= 0, c[:, dist.clamp_min(0)], torch.zeros((), dtype=c.dtype, device=q.device))
    a = torch.einsum("bhif,bhjf->bhij", q, k) * w.to(q.dtype)
    if kpm is not None:
        a = a.masked_fill(kpm[:, None, None, :], 0.0)
    return a @ v, a.sum(-1)


CASES = [  # B, H, Lq, Lk, F, Dv, q_offset, window, chunk, state budget (None: default)
    pytest.param(1, 2, 63, 63, 12, 10, 0, 8, 16, None, id="T63-F12-Dv10-W8-C16"),
    pytest.param(2, 1, 1, 1, 12, 10, 0, 8, 16, None, id="T1"),
    pytest.param(1, 1, 40, 40, 12, 72, 0, 8, 16, None, id="T40-Dv72-two-value-blocks"),
    pytest.param(1, 2, 50, 50, 12, 10, 0, 16, 16, None, id="T50-W16-C16"),
    pytest.param(1, 2, 45, 45, 12, 10, 0, 20, 16, None, id="T45-W20-three-near-chunks"),
    pytest.param(1, 2, 90, 90, 12, 10, 0, 40, 16, None, id="T90-W40-four-near-chunks"),
    pytest.param(1, 2, 90, 70, 12, 10, 20, 60, 16, None, id="W60-chunk-raised-to-32"),
    pytest.param(1, 2, 5, 60, 12, 10, 55, 8, 16, None, id="decode-Lq5-Lk60-off55"),
    pytest.param(1, 2, 20, 50, 12, 10, 10, 8, 16, None, id="Lq20-Lk50-off10"),
    pytest.param(1, 2, 40, 25, 12, 10, 0, 8, 16, None, id="queries-past-keys"),
    # a state budget of one byte: one term per launch (4 launches adding into num/den, dq, dk,
    # dv), the near field in the first only
    pytest.param(1, 2, 63, 63, 12, 10, 0, 8, 16, 1, id="T63-a-term-per-launch"),
    pytest.param(1, 1, 40, 40, 12, 72, 0, 8, 16, 1, id="Dv72-a-term-per-launch"),
    pytest.param(1, 2, 20, 50, 12, 10, 10, 8, 16, 1, id="off10-a-term-per-launch"),
]


# (the key-chunk gradient kernel's two forms: transposed products for 32- and 64-bit operands,
# key-major tiles for 16-bit ones, `triton_chunked.HOPPER_TRANS_NOTE`, which "bf16x3" selects;
# float64 operands are multiplied exactly in every mode)
@pytest.mark.parametrize("precision", ["ieee", "bf16x3"], ids=["transposed", "key-major"])
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", CASES)
def test_soe_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget, precision, terms=4):
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, dtype=torch.float64, device=DEV)
    plan = _plan(H, window, terms)
    num, den, ls = ts.kernelized_num_den_triton_soe(q, k, v, plan, q_offset=q_offset, chunk_size=chunk,
                                                   state_budget=budget, precision=precision)
    assert not ls.any()
    rn, rd = reference(q, k, v, plan, q_offset)
    assert_close(num, rn.detach())
    assert_close(den, rd.detach())
    leaves = (q, k, v, plan.a, plan.corr)
    got, want = weighted_grads((num, den), leaves), weighted_grads((rn, rd), leaves)
    for name, a, b in zip(("dq", "dk", "dv", "da", "dcorr"), got, want):
        assert_close(a, b, msg=name)


@pytest.mark.parametrize("budget", [None, 1], ids=["one-group", "a-term-per-launch"])
@pytest.mark.parametrize("trains", ["nothing", "a", "corr"])
def test_soe_gradients_without_the_far_weights_gradient(trains, budget):
    """A term whose far weights take no gradient (frozen: the bench's KERPLE rows) runs the dq
    kernel without its dwq sums (`DWQ`): q's, k's and v's gradients are those of the call
    whose plan trains, bit for bit, and what trains has the trainable call's gradient."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    full = _plan(2, 8, 4)
    part = SoEPlan(full.gamma, full.a.detach().requires_grad_(trains == "a"),
                   full.corr.detach().requires_grad_(trains == "corr"), full.window, full.fit_length)
    grads = []
    for plan in (full, part):
        num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_budget=budget)
        named = {"dq": q, "dk": k, "dv": v, **{n: x for n, x in (("a", plan.a), ("corr", plan.corr)) if x.requires_grad}}
        grads.append(dict(zip(named, weighted_grads((num, den), tuple(named.values())))))
    for name, g in grads[1].items():
        assert torch.equal(g, grads[0][name]), name


QUOTIENT_CASES = [c for c in CASES if c.id in ("T63-F12-Dv10-W8-C16", "T1", "T40-Dv72-two-value-blocks",
                                                "T45-W20-three-near-chunks", "decode-Lq5-Lk60-off55",
                                                "T63-a-term-per-launch", "off10-a-term-per-launch")]


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", QUOTIENT_CASES)
def test_soe_quotient_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget):
    """`divide=`: the quotient, and the gradients the kernels make from its gradient scaled by
    1/den (the plan's `a` and `corr` included), as `num/den` of the dense sums; term groups too."""
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, dtype=torch.float64, device=DEV)
    plan = _plan(H, window, 4)
    out, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, q_offset=q_offset, chunk_size=chunk,
                                                   state_budget=budget, divide=torch.float64)
    rn, rd = reference(q, k, v, plan, q_offset)
    ref = quotient_reference(rn, rd)
    assert_close(out, ref.detach())
    assert_close(den, rd.detach(), msg="den")
    # den's gradient too (`_QuotientGrad` adds the quotient's part to it)
    leaves = (q, k, v, plan.a, plan.corr)
    got, want = weighted_grads((out, den), leaves), weighted_grads((ref, rd), leaves)
    for name, a, b in zip(("dq", "dk", "dv", "da", "dcorr"), got, want):
        assert_close(a, b, msg=name)


@pytest.mark.parametrize("budget", [None, 1], ids=["one-launch", "a-term-per-launch"])
def test_soe_quotient_low_precision_against_float64(budget):
    """A bf16 quotient from float32 features and bf16 values, as the backends ask for it,
    against float64, within a small factor of the naive path dividing in float32: written by
    the kernel (one launch), or formed after the launches' float32 sums."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    v = v.detach().bfloat16().requires_grad_()
    plan = _plan(2, 8, 4)
    out, _, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_budget=budget,
                                                 divide=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r64 = quotient_reference(*reference(q64, k64, v64, plan))
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rl = quotient_reference(*reference(ql, kl, vl.float(), plan)).bfloat16()
    assert_lowp_close(out, rl, r64.detach(), msg="out")
    got, lowp, want = (weighted_grads((o,), leaves) for o, leaves in
                       ((out, (q, k, v)), (rl, (ql, kl, vl)), (r64, (q64, k64, v64))))
    for name, a, n, r in zip(("dq", "dk", "dv"), got, lowp, want):
        assert_lowp_close(a, n, r, msg=name)


def test_soe_term_groups_in_low_precision_sum_in_float32():
    """bf16 outputs from several launches: the partial sums stay float32 until the end, so the
    grouped result is within one bf16 rounding (2^-7 of each entry) of the one-launch result."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.bfloat16, device=DEV)
    plan = _plan(2, 8, 4)
    one = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    grouped = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_budget=1)
    for a, b in zip(one[:2], grouped[:2]):
        assert a.dtype == b.dtype == torch.bfloat16
        assert ((a.double() - b.double()).abs() <= 2 ** -7 * b.double().abs()).all()


def test_term_groups_carry_bf16_dv_as_a_pair():
    """A bf16 v's gradient over several launches is carried between them as bf16 pairs
    (`hi + lo`, about 16 bits) instead of a float32 sum and its bf16 copy: the result is the
    float32 sum rounded once (that of a float32 v holding the same values) in all but the
    rare entries the pair's 16 bits round the other way, and there by one bf16 step."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    plan = _plan(2, 8, 4)
    g = torch.Generator(device=DEV).manual_seed(1)
    dout = torch.randn(1, 2, 63, 10, generator=g, device=DEV).bfloat16()
    dvs = []
    for vdt in (torch.bfloat16, torch.float32):
        vv = v.detach().bfloat16().to(vdt).requires_grad_()
        out, _, _ = ts.kernelized_num_den_triton_soe(q.detach(), k.detach(), vv, plan, chunk_size=16, state_budget=1,
                                                     divide=torch.bfloat16)
        out.backward(dout)
        dvs.append(vv.grad)
    pair, sum32 = dvs
    assert pair.dtype == torch.bfloat16 and sum32.dtype == torch.float32
    once = sum32.bfloat16()
    ulp = 2.0 ** (torch.frexp(once.float())[1] - 8).double()  # one bf16 step at each entry
    diff = (pair.double() - once.double()).abs()
    assert (diff <= ulp).all()
    assert (diff == 0).double().mean() >= 0.98


def test_kernel_tables_are_kept_for_a_plan_without_gradient():
    """A frozen plan's kernel tables are built once (a GPU call would pay a dozen launches each
    time); an in-place edit of the plan builds them again, with the fresh values; a plan in the
    graph gets new ones on every call, so gradients reach it."""
    plan = _plan(2, 8, 4)
    frozen = SoEPlan(plan.gamma, plan.a.detach().clone(), plan.corr.detach().clone(), plan.window, plan.fit_length)
    first = ts.kernel_tables(frozen, 16, 2, torch.float32)
    assert all(a is b for a, b in zip(first, ts.kernel_tables(frozen, 16, 2, torch.float32)))
    with torch.no_grad():
        frozen.a.mul_(2.0)
    edited = ts.kernel_tables(frozen, 16, 2, torch.float32)
    assert edited[1] is not first[1] and torch.allclose(edited[1], 2.0 * first[1])
    live = [ts.kernel_tables(plan, 16, 2, torch.float32) for _ in range(2)]
    assert live[0][1] is not live[1][1] and live[0][1].requires_grad
    with torch.no_grad():  # autograd off: nothing can flow, so they are kept
        kept = [ts.kernel_tables(plan, 16, 2, torch.float32) for _ in range(2)]
    assert kept[0][1] is kept[1][1]


def test_near_chunks_cover_the_band():
    """The far field starts past the band: `W <= (NB-1)·T + 1`, with NB as small as that
    allows and at most MAX_NEAR (a wider band raises T)."""
    assert ts.near_chunks(64, 64) == (64, 2)  # the soe band
    assert ts.near_chunks(113, 64) == (64, 3)  # T5's 32 buckets over 128 distances
    assert ts.near_chunks(1, 64) == (64, 2)
    for W in range(1, 300, 7):
        for chunk in (16, 64):
            T, NB = ts.near_chunks(W, chunk)
            assert W <= (NB - 1) * T + 1 and 2 <= NB <= ts.MAX_NEAR
            assert NB == 2 or W > (NB - 2) * T + 1
            assert T == chunk or ts.near_chunks(W, T // 2)[0] == T  # raised only as far as needed


def test_terms_per_group_bounds_the_states():
    """1M tokens, B·H = 8, F = 32, Dv = 64, bf16 states: one term's states are 0.54 GB, so the
    1 GiB default takes one term per launch; at 64k all 16 fit; never fewer than one."""
    N = (1 << 20) // 64
    assert ts.terms_per_group(8, N, 32, 64, 2, 16) == 1
    assert ts.terms_per_group(8, N // 16, 32, 64, 2, 16) == 16
    assert ts.terms_per_group(8, N, 32, 64, 2, 16, budget=1) == 1
    per_term = 8 * N * 32 * (64 * 2 + 4)
    assert ts.terms_per_group(8, N, 32, 64, 2, 16, budget=3 * per_term) == 3


def test_soe_float32_and_padding():
    q, k, v = features_and_values(2, 1, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    plan = _plan(1, 8, 4)
    kpm = torch.zeros(2, 63, dtype=torch.bool, device=DEV)
    kpm[0, 40:] = True
    kpm[1, :5] = True
    num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, key_padding_mask=kpm, chunk_size=16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rn, rd = reference(q64, k64, v64, plan, kpm=kpm)
    assert_close(num, rn.detach(), torch.float32)
    assert_close(den, rd.detach(), torch.float32)
    got = weighted_grads((num, den), (q, k, v, plan.a, plan.corr))
    want = weighted_grads((rn, rd), (q64, k64, v64, plan.a, plan.corr))
    for name, a, b in zip(("dq", "dk", "dv", "da", "dcorr"), got, want):
        assert_close(a, b, torch.float32, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_soe_low_precision_against_float64(dtype):
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=dtype, device=DEV)
    plan = _plan(2, 8, 5)
    num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r64 = reference(q64, k64, v64, plan)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rl = reference(ql, kl, vl, plan)
    for name, a, n, r in zip(("num", "den"), (num, den), rl, r64):
        assert_lowp_close(a, n, r.detach(), msg=name)
    got = weighted_grads((num, den), (q, k, v))
    lowp, want = weighted_grads(rl, (ql, kl, vl)), weighted_grads(r64, (q64, k64, v64))
    for name, a, n, r in zip(("dq", "dk", "dv"), got, lowp, want):
        assert_lowp_close(a, n, r, msg=name)


def test_soe_float32_features_with_bf16_states():
    """`state_dtype=bfloat16` (what a bf16 call's float32 features use): the far-field states
    rounded to bf16, the output and gradients still within bf16's tolerance of float64, and
    not bit-equal to float32 storage (the option is applied)."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    plan = _plan(2, 8, 4)
    num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_dtype=torch.bfloat16)
    full, _, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    assert not torch.equal(num, full)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rn, rd = reference(q64, k64, v64, plan)
    assert_close(den, rd.detach(), torch.float32)  # z stays float32

    def rel(a, b):  # against the largest entry: num sums signed values, single entries cancel
        return ((a.double() - b.detach()).abs().max() / b.detach().abs().max()).item()

    assert rel(num, rn) <= 4 * 2 ** -8  # a few bf16 roundings (1.6e-3 here; float32 storage: 1.8e-7)
    got, want = weighted_grads((num, den), (q, k, v)), weighted_grads((rn, rd), (q64, k64, v64))
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) <= 4 * 2 ** -8, name


def test_soe_refusals_name_the_argument():
    q, k, v = features_and_values(1, 2, 8, 8, 12, 10, dtype=torch.float64, device=DEV)
    with pytest.raises(FastRPEError, match="chunk_size"):
        ts.kernelized_num_den_triton_soe(q, k, v, _plan(2, 8, 4), chunk_size=24)
    with pytest.raises(FastRPEError, match="plan"):
        ts.kernelized_num_den_triton_soe(q, k, v, _plan(3, 8, 4))


@pytest.mark.gpu
def test_soe_gpu_realistic_size_bf16():
    """L=4096, H=8, F=32, Dv=64, 16 terms, W=64, bf16 on the GPU against the float64 reference."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    q, k, v = features_and_values(1, 8, 4096, 4096, 32, 64, dtype=torch.bfloat16, device=DEV)
    plan = _plan(8, 64, 16, fit_length=4096)
    num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    rn, rd = reference(q64, k64, v64, plan)
    out, ref = num.double() / den.double()[..., None], rn / rd[..., None]
    assert (out - ref.detach()).abs().max().item() <= 2e-2 * ref.abs().max().item()
    got = weighted_grads((num, den), (q, k, v, plan.a, plan.corr))
    want = weighted_grads((rn, rd), (q64, k64, v64, plan.a, plan.corr))
    for name, a, b in zip(("dq", "dk", "dv", "da", "dcorr"), got, want):
        assert (a.double() - b).abs().max().item() <= 3e-2 * b.abs().max().item(), name


@pytest.mark.gpu
def test_soe_gpu_realistic_size_bf16_blocked_scan():
    """The same with every term's states in blocks (64 chunks: 8 blocks of 8)."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    from fastrpe.ops.linear.triton_chunked import use_state_scan

    with use_state_scan("blocked"):
        test_soe_gpu_realistic_size_bf16()


@pytest.mark.gpu
@pytest.mark.parametrize("scan", ["auto", "sequential"])
def test_soe_gpu_realistic_size_bf16_stacked_states(scan):
    """The same with four terms' states a program in the state passes (`STATE_TERMS = 4`, the
    bench's `+stacked-states` rows), blocked as "auto" blocks them on a GPU, and sequential."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    from fastrpe.ops.linear.triton_chunked import use_state_scan

    with use_state_scan(scan), ts.use_state_terms(4):
        test_soe_gpu_realistic_size_bf16()


@pytest.fixture
def interpret_on_cpu(monkeypatch):
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)


def test_backend_matches_dense_within_the_fit(interpret_on_cpu):
    """`triton_soe` through the public API, learnable KERPLE-log: output and gradients (the
    term's parameters included) within the fit's 1e-3 of the exact dense backend."""
    import fastrpe as fr
    from fastrpe.positions.kerple import KerpleLog

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16, dtype=torch.float64, device=DEV, requires_grad=True) for _ in range(3))
    pos = KerpleLog(2).double().to(DEV)
    res = []
    for backend in ("triton_soe", "dense"):
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend=backend)
        res.append((out, weighted_grads([out], (q, k, v, *pos.parameters()))))
    (o1, g1), (o2, g2) = res
    assert (o1 - o2).abs().max().item() <= 1e-3 * o2.abs().max().item()
    for a, b in zip(g1, g2):
        assert (a - b).abs().max().item() <= 1e-3 * b.abs().max().item()


def test_backend_refuses_geometric_and_bidirectional(interpret_on_cpu):
    import fastrpe as fr
    from fastrpe.positions.alibi import ALiBi

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEV) for _ in range(3))
    with pytest.raises(FastRPEError, match="geometric decay"):
        fr.attention(q, k, v, kernel="elu", position=ALiBi(2).double().to(DEV), causal=True, backend="triton_soe")
    with pytest.raises(FastRPEError, match="causal only"):
        fr.attention(q, k, v, kernel="elu", position=ALiBi(2).double().to(DEV), causal=False, backend="triton_soe")


@pytest.mark.parametrize("budget", [None, 1], ids=["one-launch", "a-term-per-launch"])
def test_quotient_is_not_held_by_the_kernels_backward(budget):
    """With `divide`, the kernels' autograd node saves den, not the quotient: the quotient is
    held only by `_QuotientGrad`, which runs first and frees it (128 B per head and token at
    the kernels' backward peak, bf16, Dv = 64); same for the geometric kernels."""
    from fastrpe.ops.linear import triton_chunked as tc

    q, k, v = features_and_values(1, 2, 40, 40, 12, 10, dtype=torch.float32, device=DEV)
    v = v.detach().bfloat16().requires_grad_()
    plan = _plan(2, 8, 4)
    for out in (ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_budget=budget,
                                                 divide=torch.bfloat16)[0],
                tc.kernelized_num_den_triton_chunked(q, k, v, gamma=torch.full((2,), 0.9, device=DEV), chunk_size=16,
                                                     divide=torch.bfloat16)[0]):
        assert type(out.grad_fn).__name__ == "_QuotientGradBackward"
        kernels = out.grad_fn.next_functions[0][0]
        held = [t.untyped_storage().data_ptr() for t in kernels.saved_tensors if t is not None]
        assert held and out.untyped_storage().data_ptr() not in held


def test_soe_keeps_no_states_for_backward():
    """The K·N chunk states are recomputed in backward: autograd keeps only the inputs and
    the plan's tables (with states kept, 8.6 GB at L = 1M, B·H = 8, K = 16, bf16)."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    plan = _plan(2, 8, 4)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    T, K, H = 16, 4, 2
    tables = 2 * (H * 2 * T + H * K * T) + K  # cn, wq, their float64 powers γ^d, log γ
    assert sum(saved) <= q.numel() + k.numel() + v.numel() + tables  # one state set alone: 2·K·4·16·16


BLOCKED_IDS = ("T63-F12-Dv10-W8-C16", "T40-Dv72-two-value-blocks", "T90-W40-four-near-chunks", "decode-Lq5-Lk60-off55",
               "queries-past-keys", "T63-a-term-per-launch")


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", [c for c in CASES if c.id in BLOCKED_IDS])
def test_soe_blocked_state_scan_matches_reference(blocked_scan, monkeypatch, B, H, Lq, Lk, F, Dv, q_offset, window,
                                                  chunk, budget):
    """Every term's states and their gradients in blocks walked side by side, each from its
    carry (`triton_chunked._state_pass`): the same outputs and gradients (the plan's `a` and
    `corr` included), plain and as a quotient, term groups too."""
    from fastrpe.ops.linear import triton_chunked as tc

    carries, real = [], tc._block_carries
    monkeypatch.setattr(tc, "_block_carries", lambda *a: carries.append(a[-1]) or real(*a))
    test_soe_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget, "ieee")
    test_soe_quotient_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget)
    assert False in carries and True in carries  # forward states and their gradients, in blocks


def test_saved_states_give_the_recomputed_gradients_and_spare_a_pass(monkeypatch):
    """`SAVE_STATES_BYTES` (`use_saved_states`): a forward whose terms run in one group keeps
    its states for the backward, which then makes none; outputs and gradients (the plan's `a`
    and `corr` included) are the recomputing twin's to the bit, plain and as a quotient.
    Inference keeps none, and neither do several term groups."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    plan = _plan(2, 8, 4)
    made = []
    real = ts._soe_states
    monkeypatch.setattr(ts, "_soe_states", lambda *a: made.append(1) or real(*a))
    g = torch.Generator().manual_seed(5)
    wn, wd = torch.randn(1, 2, 63, 10, generator=g, dtype=torch.float64), torch.randn(1, 2, 63, generator=g,
                                                                                   dtype=torch.float64)
    for divide in (None, torch.float64):
        runs = {}
        for keep in (-1, 1 << 30):
            made.clear()
            with ts.use_saved_states(keep):
                num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, divide=divide)
            grads = torch.autograd.grad((num * wn.to(DEV)).sum() + (den * wd.to(DEV)).sum(),
                                        (q, k, v, plan.a, plan.corr))
            runs[keep] = ((num.detach(), den.detach(), *grads), len(made))
        assert runs[-1][1] == 2 and runs[1 << 30][1] == 1, (runs[-1][1], runs[1 << 30][1])
        for a, b in zip(runs[-1][0], runs[1 << 30][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    made.clear()
    with ts.use_saved_states(1 << 30), torch.no_grad():
        ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    with ts.use_saved_states(1 << 30):  # a state budget of one byte: a term per launch, four groups
        num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16, state_budget=1)
    (num.sum() + den.sum()).backward()
    assert len(made) == 1 + 4 + 4


def test_saved_states_in_blocks_give_the_recomputed_gradients(blocked_scan, monkeypatch):
    """The kept states of a blocked scan (the GPU bench's `+saved-states+blocked-scan` rows)
    are every chunk's, as the backward's recomputation would make them: the same to the bit."""
    test_saved_states_give_the_recomputed_gradients_and_spare_a_pass(monkeypatch)


def test_which_calls_keep_their_states():
    """One term (T5's band) keeps its states by default, as the geometric path keeps its own;
    more terms only within SAVE_STATES_BYTES; -1 none; several groups none."""
    phi = torch.empty(1, 8, 65536, 32, device="meta")
    v = torch.empty(1, 8, 65536, 64, device="meta")
    bf16 = torch.bfloat16
    assert ts._keeps_states(phi, v, 1, 0, 64, 1, bf16, 0)
    assert not ts._keeps_states(phi, v, 1, 0, 64, 1, bf16, -1)
    assert not ts._keeps_states(phi, v, 16, 0, 64, 16, bf16, 0)
    need = 8 * 16 * 1024 * 32 * (64 * 2 + 4)  # h in bf16, z in float32: 0.54 GB
    assert ts._keeps_states(phi, v, 16, 0, 64, 16, bf16, need)
    assert not ts._keeps_states(phi, v, 16, 0, 64, 16, bf16, need - 1)
    assert not ts._keeps_states(phi, v, 16, 0, 64, 8, bf16, need)  # two groups of 8 terms
    with pytest.raises(FastRPEError, match="max_bytes"), ts.use_saved_states(-2):
        pass


STACKED_IDS = ("T63-F12-Dv10-W8-C16", "T1", "T40-Dv72-two-value-blocks", "T45-W20-three-near-chunks",
               "decode-Lq5-Lk60-off55", "queries-past-keys", "T63-a-term-per-launch")


def _count_stacked(monkeypatch) -> list:
    """The stacked passes' launches, as ("forward" | "backward", KG) each."""
    from fastrpe.ops.linear import triton_soe_stacked as st

    ran = []
    for name in ("forward_states", "backward_states"):
        real = getattr(st, name)
        monkeypatch.setattr(st, name, lambda *a, real=real, name=name: ran.append((name, a[-1])) or real(*a))
    return ran


@pytest.mark.parametrize("stack,terms", [(2, 5), (4, 5), (4, 3)], ids=["KG2-K5", "KG4-K5-padded", "KG4-K3-padded"])
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", [c for c in CASES if c.id in STACKED_IDS])
def test_stacked_state_passes_match_reference(monkeypatch, stack, terms, B, H, Lq, Lk, F, Dv, q_offset, window, chunk,
                                              budget):
    """`STATE_TERMS` (`triton_soe_stacked`): the states of up to KG terms a program, the last
    stack padded past K, forward and backward: the dense reference's outputs and gradients (the
    plan's `a` and `corr` included), term groups too (a budget of one term: groups of a stack,
    `stacked_group`)."""
    ran = _count_stacked(monkeypatch)
    with ts.use_state_terms(stack):
        test_soe_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget, "ieee", terms=terms)
    if budget == 1:  # each group of a whole stack, made again in the backward: at least one stacked
        assert ran and {r[1] for r in ran} == {stack} and {r[0] for r in ran} == {"forward_states", "backward_states"}
    else:  # the forward's states, the backward's again (not kept), then their gradients
        assert ran == [("forward_states", stack)] * 2 + [("backward_states", stack)], ran


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", QUOTIENT_CASES)
def test_stacked_state_passes_match_reference_as_a_quotient(monkeypatch, B, H, Lq, Lk, F, Dv, q_offset, window, chunk,
                                                            budget):
    """The same for the quotient the kernels divide themselves, whose backward scales each
    query row by 1/den inside the stacked gradient pass (SCALED)."""
    ran = _count_stacked(monkeypatch)
    with ts.use_state_terms(2):
        test_soe_quotient_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget)
    assert {r[0] for r in ran} == {"forward_states", "backward_states"} and {r[1] for r in ran} == {2}, ran


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,window,chunk,budget", [c for c in CASES if c.id in BLOCKED_IDS])
def test_stacked_state_passes_in_blocks_match_reference(blocked_scan, monkeypatch, B, H, Lq, Lk, F, Dv, q_offset,
                                                        window, chunk, budget):
    """The stacked passes in blocks walked side by side from their carries (PHASE 1 and 2), as
    STATE_SCAN's "auto" runs them where the stacks fill few SMs: the same against the reference."""
    from fastrpe.ops.linear import triton_chunked as tc

    carries, real = [], tc._block_carries
    monkeypatch.setattr(tc, "_block_carries", lambda *a: carries.append(a[-1]) or real(*a))
    ran = _count_stacked(monkeypatch)
    with ts.use_state_terms(4):
        test_soe_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, window, chunk, budget, "ieee", terms=5)
    assert False in carries and True in carries  # forward states and their gradients, in blocks
    assert {r[0] for r in ran} == {"forward_states", "backward_states"} and {r[1] for r in ran} == {4}, ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "f16", "float32-features"])
def test_stacked_state_passes_in_low_precision(monkeypatch, dtype):
    """bf16 and fp16 calls, and float32 features with bf16 states (the GPU bench's bf16 call),
    through the stacked passes: as close to float64 as the per-term passes' tests ask."""
    ran = _count_stacked(monkeypatch)
    with ts.use_state_terms(4):
        if dtype is None:
            test_soe_float32_features_with_bf16_states()
        else:
            test_soe_low_precision_against_float64(dtype)
    assert {r[0] for r in ran} == {"forward_states", "backward_states"} and {r[1] for r in ran} == {4}, ran


def test_state_terms_is_checked():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(FastRPEError, match="STATE_TERMS"):
            with ts.use_state_terms(bad):
                pass


def test_the_backward_stacks_as_its_forward_did(monkeypatch):
    """`STATE_TERMS` as the forward saw it serves its backward too, as STATE_SCAN's does: the
    GPU bench sets it around the call, and autograd runs the backward after the block ends."""
    ran = _count_stacked(monkeypatch)
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    plan = _plan(2, 8, 5)
    with ts.use_state_terms(4):
        num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
    (num.sum() + den.sum()).backward()
    assert ran == [("forward_states", 4)] * 2 + [("backward_states", 4)], ran


def test_a_stacked_launch_group_takes_whole_stacks():
    """`stacked_group`: where the state budget holds every term, one group; else whole stacks,
    at least one, past the budget (at 1M one term's states fill it: a stack of four is four)."""
    from fastrpe.ops.linear.triton_soe_stacked import stacked_group

    assert [stacked_group(g, 9, 4) for g in (1, 2, 4, 5, 8, 9, 12)] == [4, 4, 4, 4, 8, 9, 12]
    assert [stacked_group(g, 11, 2) for g in (1, 3, 11)] == [2, 2, 11]
    assert [stacked_group(g, 9, 1) for g in (1, 5)] == [1, 5]  # no stacking: the budget's
    assert stacked_group(1, 3, 4) == 4  # (a stack of three, padded to four: the group takes all)
