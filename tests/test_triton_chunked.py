"""Triton geometric-decay kernels (`ops/linear/triton_chunked.py`) against the dense
reference (`ops/linear/naive.py`, Luo et al. 2021 Eq. 10) and the state's definition.

Without CUDA the kernels run on the CPU under the Triton interpreter. Triton reads
TRITON_INTERPRET when it decorates (its own library functions too, at `import triton`)
and again when it runs, so tests/conftest.py sets it before anything imports triton, for
the whole process; the `triton_chunked` backend still refuses CPU calls unless a test opts in.
"""

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe.ops.linear import triton_chunked as tc  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear.naive import kernelized_num_den_naive  # noqa: E402
from fastrpe.testing import (assert_close, assert_lowp_close, features_and_values, quotient_reference,  # noqa: E402
                             weighted_grads)

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(tc.triton_unavailable_reason(DEV) is not None,
                                reason=str(tc.triton_unavailable_reason(DEV)))


def _gamma(H):
    """`[H]` float64 leaf, decays from 0.5 to 1.0 (1.0: no positional term)."""
    return torch.linspace(0.5, 1.0, H, dtype=torch.float64, device=DEV).requires_grad_()


def _log_coeff(gamma, Lq, Lk, q_offset, causal=True):
    """`[H, Lq+Lk-1]`: `b(r) = |r|·log γ` over offsets `r = -(Lq-1+q_offset) .. Lk-1-q_offset`."""
    r = torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, device=gamma.device, dtype=gamma.dtype)
    return r.abs()[None, :] * torch.log(gamma)[:, None]


def reference(q, k, v, gamma, s0, *, q_offset=0, kpm=None):
    """Causal geometric decay from the definitions: the dense weights `γ^(p_i - j)` (naive op),
    the initial state as keys before position 0 (`γ^(p_i + 1)·φq_i·S0`) and the final state
    `Σ_j γ^(Lk-1-j) φk_j ⊗ [v_j, 1] + γ^Lk·S0`."""
    Lq, Lk = q.shape[2], k.shape[2]
    num, den, ls = kernelized_num_den_naive(q, k, v, _log_coeff(gamma, Lq, Lk, q_offset), causal=True,
                                            q_offset=q_offset, key_padding_mask=kpm)
    num, den = num * ls.exp()[None, :, :, None], den * ls.exp()[None]
    kk = k if kpm is None else k.masked_fill(kpm[:, None, :, None], 0.0)
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    w = gamma[:, None] ** (Lk - 1 - torch.arange(Lk, device=q.device, dtype=gamma.dtype))  # (H, Lk)
    state = torch.einsum("hj,bhjf,bhjc->bhfc", w, kk, vv)
    if s0 is not None:
        p = torch.arange(Lq, device=q.device, dtype=gamma.dtype) + q_offset
        y = torch.einsum("hi,bhif,bhfc->bhic", gamma[:, None] ** (p + 1), q, s0)
        num, den = num + y[..., :-1], den + y[..., -1]
        state = state + gamma[None, :, None, None] ** Lk * s0
    return num, den, state


CASES = [  # B, H, Lq, Lk, F, Dv, q_offset, chunk
    pytest.param(1, 2, 63, 63, 12, 10, 0, 16, id="B1-H2-T63-F12-Dv10-C16"),
    pytest.param(2, 2, 1, 1, 12, 10, 0, 16, id="B2-H2-T1"),
    pytest.param(1, 2, 37, 37, 32, 40, 0, 32, id="B1-H2-T37-F32-Dv40-C32"),  # several value blocks
    pytest.param(1, 1, 20, 20, 12, 72, 0, 16, id="B1-H1-T20-F12-Dv72"),
    pytest.param(1, 2, 5, 40, 12, 10, 35, 16, id="decode-Lq5-Lk40-off35"),
    pytest.param(1, 2, 20, 50, 12, 10, 10, 16, id="Lq20-Lk50-off10"),
    pytest.param(1, 2, 30, 20, 12, 10, 0, 16, id="queries-past-keys-Lq30-Lk20"),
]


#: the two forms of the key-chunk gradient kernel: its transposed products (float32 and float64
#: operands), and its key-major tiles (16-bit operands, `triton_chunked.HOPPER_TRANS_NOTE`),
#: which "bf16x3" selects; float64 operands are multiplied exactly in every mode, so both are
#: checked to float64's round-off
FORMS = [(torch.float64, "ieee"), (torch.float64, "bf16x3"), (torch.float32, "ieee")]
FORM_IDS = ["f64", "f64-key-major", "f32"]


@pytest.mark.parametrize("dtype,precision", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,chunk", CASES)
def test_causal_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, chunk, dtype, precision):
    q, k, v, s0 = features_and_values(B, H, Lq, Lk, F, Dv, dtype=dtype, device=DEV, state=True)
    gamma = _gamma(H)
    num, den, ls, state = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, q_offset=q_offset,
                                                               chunk_size=chunk, initial_state=s0, return_state=True,
                                                               precision=precision)
    assert not ls.any()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64, s64 = gamma.detach().clone().requires_grad_(), s0.detach().double().requires_grad_()
    ref = reference(q64, k64, v64, g64, s64, q_offset=q_offset)
    for name, a, b in zip(("num", "den", "state"), (num, den, state), ref):
        assert_close(a, b.detach(), dtype, msg=name)
    got = weighted_grads((num, den, state), (q, k, v, gamma, s0))
    want = weighted_grads(ref, (q64, k64, v64, g64, s64))
    for name, a, b in zip(("dq", "dk", "dv", "dgamma", "dinitial_state"), got, want):
        assert_close(a, b, dtype, msg=name)


@pytest.mark.parametrize("dtype,precision", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,chunk", CASES)
def test_quotient_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, chunk, dtype, precision):
    """`divide=`: the kernels' backward reads the quotient's gradient and scales it by 1/den
    itself, den's gradient comes from `_QuotientGrad`; output, den, final state and every
    gradient (initial state's and γ's included, through den too) as Eq. 10's `num/den` and
    `den` from the dense sums."""
    q, k, v, s0 = features_and_values(B, H, Lq, Lk, F, Dv, dtype=dtype, device=DEV, state=True)
    gamma = _gamma(H)
    out, den, _, state = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, q_offset=q_offset, chunk_size=chunk,
                                                              initial_state=s0, return_state=True, divide=dtype,
                                                              precision=precision)
    assert out.dtype == dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64, s64 = gamma.detach().clone().requires_grad_(), s0.detach().double().requires_grad_()
    rn, rd, rs = reference(q64, k64, v64, g64, s64, q_offset=q_offset)
    ref = (quotient_reference(rn, rd), rd, rs)
    for name, a, b in zip(("out", "den", "state"), (out, den, state), ref):
        assert_close(a, b.detach(), dtype, msg=name)
    got = weighted_grads((out, den, state), (q, k, v, gamma, s0))
    want = weighted_grads(ref, (q64, k64, v64, g64, s64))
    for name, a, b in zip(("dq", "dk", "dv", "dgamma", "dinitial_state"), got, want):
        assert_close(a, b, dtype, msg=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("Dv", [10, 200], ids=["Dv10", "Dv200-two-column-blocks"])
def test_quotient_backward_is_the_gradient_of_num_over_den(Dv, dtype):
    """`quotient_backward`: `dout·inv` is the gradient of num and `-inv·Σ dout·out` that of den
    (autograd through `num / den`); empty rows get 0; bf16 rows are summed in float32 (to
    float32's round-off, not bf16's)."""
    g = torch.Generator().manual_seed(2)
    num = torch.randn(2, 3, 67, Dv, generator=g, dtype=torch.float64)
    den = torch.randn(2, 3, 67, generator=g, dtype=torch.float64)
    den[1, 0, 3] = 0.0
    dout = torch.randn(num.shape, generator=g, dtype=torch.float64)
    n, d = num.clone().requires_grad_(), den.clone().requires_grad_()
    empty = d.detach() == 0
    ref = torch.where(empty[..., None], 0.0, n / torch.where(empty, 1.0, d)[..., None])
    rn, rd = torch.autograd.grad((ref * dout).sum(), (n, d))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out, go = ref.detach().to(dtype), dout.to(dtype)
    inv, dd = tc.quotient_backward(go.to(DEV), out.to(DEV), den.to(DEV, acc))
    assert inv.dtype == dd.dtype == acc
    if dtype == torch.float64:
        assert_close(go.to(DEV) * inv[..., None], rn.to(DEV))
        assert_close(dd, rd.to(DEV))
    else:  # the same sums from the rounded inputs, in float64
        want = -(go.double() * out.double()).sum(-1) * inv.double().cpu()
        assert_close(dd.double().cpu(), want, torch.float32)
    assert float(dd[1, 0, 3]) == 0.0 and float(inv[1, 0, 3]) == 0.0


def test_quotient_rows_without_keys_are_zero():
    """Padding before a row's first real key leaves it no weight: 0, with finite gradients
    equal to the reference's (which gives such a row none)."""
    q, k, v = features_and_values(2, 2, 45, 45, 12, 10, dtype=torch.float64, device=DEV)
    kpm = torch.zeros(2, 45, dtype=torch.bool, device=DEV)
    kpm[1, :7] = True
    out, _, _ = tc.kernelized_num_den_triton_chunked(q, k, v, key_padding_mask=kpm, chunk_size=16,
                                                     divide=torch.float64)
    assert not out[1, :, :7].any()
    ref = quotient_reference(*reference(q, k, v, torch.ones(2, dtype=torch.float64, device=DEV), None, kpm=kpm)[:2])
    assert_close(out, ref)
    for a, b in zip(weighted_grads((out,), (q, k, v)), weighted_grads((ref,), (q, k, v))):
        assert torch.isfinite(a).all()
        assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_quotient_low_precision_against_float64(dtype):
    """The quotient in bf16/fp16 from float32 features (what the backends ask for): output
    and gradients against float64 within a small factor of the naive path's error, which
    divides its own sums in the same dtype."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    v = v.detach().to(dtype).requires_grad_()
    gamma = _gamma(2)
    out, _, _ = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, chunk_size=16, divide=dtype)
    assert out.dtype == dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64, gl = gamma.detach().clone().requires_grad_(), gamma.detach().clone().requires_grad_()
    r64 = quotient_reference(*kernelized_num_den_naive(q64, k64, v64, _log_coeff(g64, 63, 63, 0), causal=True)[:2])
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    nl, dl = kernelized_num_den_naive(ql, kl, vl.float(), _log_coeff(gl, 63, 63, 0).float(), causal=True)[:2]
    rl = quotient_reference(nl, dl).to(dtype)
    assert_lowp_close(out, rl, r64.detach(), msg="out")
    got = weighted_grads((out,), (q, k, v, gamma))
    lowp, want = weighted_grads((rl,), (ql, kl, vl, gl)), weighted_grads((r64,), (q64, k64, v64, g64))
    for name, a, n, r in zip(("dq", "dk", "dv", "dgamma"), got, lowp, want):
        assert_lowp_close(a, n, r, msg=name)


@pytest.mark.parametrize("divide", [None, torch.bfloat16], ids=["num-den", "quotient"])
def test_float32_features_with_bf16_states(divide):
    """`state_dtype=bfloat16` (what a bf16 call's float32 features use): the chunk states
    between the kernels rounded to bf16 (each kernel carries its running state in float32),
    output and gradients (γ's through the states' dot products included) within a few bf16
    roundings of float64, and not bit-equal to float32 storage (the option is applied). The
    interpreter truncates to bf16 where the GPU rounds to nearest: up to twice the GPU's error."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    gamma = _gamma(2)
    kw = dict(gamma=gamma, chunk_size=16, divide=divide)
    got = tc.kernelized_num_den_triton_chunked(q, k, v, state_dtype=torch.bfloat16, **kw)[:2]
    full = tc.kernelized_num_den_triton_chunked(q, k, v, **kw)[:2]
    assert not torch.equal(got[0], full[0])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64 = gamma.detach().clone().requires_grad_()
    rn, rd, _ = kernelized_num_den_naive(q64, k64, v64, _log_coeff(g64, 63, 63, 0), causal=True)
    want = (rn, rd) if divide is None else (quotient_reference(rn, rd),)
    got = got[:len(want)]

    def rel(a, b):  # against the largest entry: num sums signed values, single entries cancel
        return ((a.double() - b.detach()).abs().max() / b.detach().abs().max()).item()

    for a, b in zip(got, want):
        assert rel(a, b) <= 4 * 2 ** -8
    for name, a, b in zip(("dq", "dk", "dv", "dgamma"), weighted_grads(got, (q, k, v, gamma)),
                          weighted_grads(want, (q64, k64, v64, g64))):
        assert rel(a, b) <= 4 * 2 ** -8, name


def test_states_passed_on_keep_the_accumulation_dtype():
    """An initial state in or a final state out: `state_dtype` does not apply (the states it
    hands on are not rounded), so the result is float32 storage's, bit for bit."""
    q, k, v, s0 = features_and_values(1, 2, 40, 40, 12, 10, dtype=torch.float32, device=DEV, state=True)
    a = tc.kernelized_num_den_triton_chunked(q, k, v, initial_state=s0, return_state=True, chunk_size=16,
                                             state_dtype=torch.bfloat16)
    b = tc.kernelized_num_den_triton_chunked(q, k, v, initial_state=s0, return_state=True, chunk_size=16)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_key_padding_and_no_decay():
    q, k, v = features_and_values(2, 2, 45, 45, 12, 10, dtype=torch.float64, device=DEV)
    kpm = torch.zeros(2, 45, dtype=torch.bool, device=DEV)
    kpm[0, 30:] = True
    kpm[1, :7] = True
    num, den, _, state = tc.kernelized_num_den_triton_chunked(q, k, v, key_padding_mask=kpm, chunk_size=16,
                                                              return_state=True)
    ones = torch.ones(2, dtype=torch.float64, device=DEV)
    ref = reference(q, k, v, ones, None, kpm=kpm)
    for a, b in zip((num, den, state), ref):
        assert_close(a, b, torch.float64)
    for a, b in zip(weighted_grads((num, den, state), (q, k, v)), weighted_grads(ref, (q, k, v))):
        assert_close(a, b, torch.float64)


def test_state_continues_across_calls():
    """Context parallelism / decoding: the second half from the first half's final state
    gives the full pass's outputs and final state, and gradients flow through the state."""
    q, k, v, s0 = features_and_values(1, 2, 50, 50, 12, 10, dtype=torch.float64, device=DEV, state=True)
    gamma = _gamma(2)
    full = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, initial_state=s0, chunk_size=16,
                                                return_state=True)
    a = tc.kernelized_num_den_triton_chunked(q[:, :, :21], k[:, :, :21], v[:, :, :21], gamma=gamma, initial_state=s0,
                                             chunk_size=16, return_state=True)
    b = tc.kernelized_num_den_triton_chunked(q[:, :, 21:], k[:, :, 21:], v[:, :, 21:], gamma=gamma,
                                             initial_state=a[3], chunk_size=16, return_state=True)
    split = (torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2), b[3])
    for x, y in zip(split, (full[0], full[1], full[3])):
        assert_close(x, y, torch.float64)
    leaves = (q, k, v, gamma, s0)
    for x, y in zip(weighted_grads(split, leaves), weighted_grads((full[0], full[1], full[3]), leaves)):
        assert_close(x, y, torch.float64)


@pytest.mark.parametrize("L", [1, 63], ids=["T1", "T63"])
def test_bidirectional_matches_reference(L):
    q, k, v = features_and_values(1, 2, L, L, 12, 10, dtype=torch.float64, device=DEV)
    gamma = _gamma(2)
    kpm = torch.zeros(1, L, dtype=torch.bool, device=DEV)
    kpm[0, L // 2:L // 2 + 3] = True
    num, den, _ = tc.kernelized_num_den_triton_bidirectional(q, k, v, gamma=gamma, key_padding_mask=kpm, chunk_size=16)
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    g64 = gamma.detach().clone().requires_grad_()
    rn, rd, ls = kernelized_num_den_naive(q64, k64, v64, _log_coeff(g64, L, L, 0), causal=False, key_padding_mask=kpm)
    assert not ls.any()  # the diagonal's coefficient is the row max, 1
    assert_close(num, rn.detach())
    assert_close(den, rd.detach())
    for a, b in zip(weighted_grads((num, den), (q, k, v, gamma)), weighted_grads((rn, rd), (q64, k64, v64, g64))):
        assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_low_precision_against_float64(dtype):
    """bf16/fp16 inputs: error against float64 within a small factor of the naive path's
    (outputs and the gradients of the features, values and γ)."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=dtype, device=DEV)
    gamma = _gamma(2)
    num, den, _ = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, chunk_size=16)
    assert num.dtype == dtype and den.dtype == dtype
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64, gl = gamma.detach().clone().requires_grad_(), gamma.detach().clone().requires_grad_()
    r64 = kernelized_num_den_naive(q64, k64, v64, _log_coeff(g64, 63, 63, 0), causal=True)[:2]
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rl = kernelized_num_den_naive(ql, kl, vl, _log_coeff(gl, 63, 63, 0).to(dtype), causal=True)[:2]
    for name, a, n, r in zip(("num", "den"), (num, den), rl, r64):
        assert_lowp_close(a, n, r.detach(), msg=name)
    got = weighted_grads((num, den), (q, k, v, gamma))
    lowp, want = weighted_grads(rl, (ql, kl, vl, gl)), weighted_grads(r64, (q64, k64, v64, g64))
    for name, a, n, r in zip(("dq", "dk", "dv", "dgamma"), got, lowp, want):
        assert_lowp_close(a, n, r, msg=name)


def test_refusals_name_the_argument():
    q, k, v = features_and_values(1, 2, 8, 8, 12, 10, dtype=torch.float64, device=DEV)
    gamma = _gamma(2)
    with pytest.raises(FastRPEError, match="chunk_size"):
        tc.kernelized_num_den_triton_chunked(q, k, v, chunk_size=24)
    with pytest.raises(FastRPEError, match="initial_state"):
        tc.kernelized_num_den_triton_chunked(q, k, v, initial_state=torch.zeros(1, 2, 12, 10, device=DEV))
    with pytest.raises(FastRPEError, match="gamma"):
        tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma[:1])
    with pytest.raises(FastRPEError, match="Lq == Lk"):
        tc.kernelized_num_den_triton_bidirectional(q[:, :, :5], k, v)


@pytest.mark.gpu
def test_gpu_realistic_size_bf16():
    """L=4096, H=8, F=32, Dv=64, bf16 on the GPU: forward, final state and gradients vs float64."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    B, H, L, F, Dv = 1, 8, 4096, 32, 64
    q, k, v, s0 = features_and_values(B, H, L, L, F, Dv, dtype=torch.bfloat16, device=DEV, state=True)
    gamma = (1 - torch.exp(torch.linspace(-8, -3, H, device=DEV, dtype=torch.float64))).requires_grad_()
    q.data /= F  # keep the dense reference's sums moderate
    out = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=gamma, initial_state=s0, return_state=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g64, s64 = gamma.detach().clone().requires_grad_(), s0.detach().double().requires_grad_()
    ref = reference(q64, k64, v64, g64, s64)
    for a, b in zip((out[0], out[1], out[3]), ref):
        scale = b.abs().max().item()
        assert (a.double() - b.detach()).abs().max().item() <= 2e-2 * scale
    got = weighted_grads((out[0], out[1], out[3]), (q, k, v, gamma, s0))
    want = weighted_grads(ref, (q64, k64, v64, g64, s64))
    for name, a, b in zip(("dq", "dk", "dv", "dgamma", "dinitial_state"), got, want):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 3e-2 * scale, name


@pytest.mark.gpu
def test_gpu_realistic_size_bf16_blocked_scan():
    """The same at 4,096 tokens with the states in blocks (64 chunks: 8 blocks of 8), and at
    the bench's 65,536 (1,024 chunks: 32 of 32) against the sequential scan's outputs."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    with tc.use_state_scan("blocked"):
        test_gpu_realistic_size_bf16()
    q, k, v = features_and_values(1, 8, 65536, 65536, 32, 64, dtype=torch.bfloat16, device=DEV)
    gamma = 1 - torch.exp(torch.linspace(-8, -3, 8, device=DEV, dtype=torch.float32))
    kw = {"gamma": gamma, "state_dtype": torch.bfloat16, "divide": torch.bfloat16}
    runs = {}
    for mode in tc.STATE_SCANS:
        with tc.use_state_scan(mode):
            out = tc.kernelized_num_den_triton_chunked(q, k, v, **kw)[0]
            runs[mode] = (out, *weighted_grads((out,), (q, k, v)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs["blocked"], runs["sequential"]):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * scale, name


# ---------------------------------------------------------------------------------------------
# The `triton_chunked` backend


@pytest.fixture
def interpret_on_cpu(monkeypatch):
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)


def test_backend_refuses_cpu_without_opt_in():
    import fastrpe as fr

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3))
    with pytest.raises(FastRPEError, match="needs CUDA and triton"):
        fr.attention(q, k, v, kernel="elu", causal=True, backend="triton_chunked")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_backend_matches_dense(interpret_on_cpu, causal):
    """Through the public API, learnable decays: output and every gradient (γ's included)."""
    import fastrpe as fr
    from fastrpe.positions.geometric import GeometricDecay

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 16, dtype=torch.float64, device=DEV, requires_grad=True) for _ in range(3))
    pos = GeometricDecay(2, gamma=[0.8, 0.97], learnable=True).double().to(DEV)
    kpm = torch.zeros(2, 37, dtype=torch.bool, device=DEV)
    kpm[1, 30:] = True
    outs, grads = [], []
    for backend in ("triton_chunked", "dense"):
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=causal, key_padding_mask=kpm, backend=backend)
        outs.append(out)
        grads.append(weighted_grads([out], (q, k, v, *pos.parameters())))
    assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        assert_close(a, b)


@pytest.mark.parametrize("kind", ["none", "fastrpb", "shaw"])
def test_backend_with_additive_terms_matches_dense(interpret_on_cpu, kind):
    """The composition asks the kernels for the quotient unless Shaw's sums join num and den
    (FastRPB's W·v is added to the quotient, taken in the features' dtype): all three against
    the dense backend, output and every gradient."""
    import fastrpe as fr
    from fastrpe import positions as P

    torch.manual_seed(0)
    H = 2
    q, k, v = (torch.randn(2, H, 37, 8, dtype=torch.float64, device=DEV, requires_grad=True) for _ in range(3))
    pos = [P.ALiBi(H).double().to(DEV)]
    if kind == "fastrpb":
        pos.append(P.FastRPB1D(H, max_len=50, init_std=0.3).double().to(DEV))
    elif kind == "shaw":
        pos.append(P.ShawRelative(H, 8, max_distance=4, init_std=0.3).double().to(DEV))
    leaves = [q, k, v, *(p for t in pos for p in t.parameters())]
    outs = [fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend=b) for b in ("triton_chunked", "dense")]
    assert_close(outs[0], outs[1])
    for a, b in zip(weighted_grads(outs[:1], leaves), weighted_grads(outs[1:], leaves)):
        assert_close(a, b)


def test_backend_keeps_no_float32_numerator(interpret_on_cpu):
    """bf16 in: autograd keeps no float32 `[B, H, L, Dv]` tensor (the numerator that
    `safe_divide` would save: 2 GiB at L = 1M, B·H = 8, Dv = 64); the kernels return the
    quotient in bf16 and divide the gradient themselves."""
    import fastrpe as fr
    from fastrpe import positions as P

    B, H, L, D = 1, 2, 70, 16
    q, k, v = (torch.randn(B, H, L, D, device=DEV).bfloat16().requires_grad_() for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        out = fr.attention(q, k, v, kernel="nprf", position=P.ALiBi(H).to(DEV), causal=True, backend="triton_chunked")
    assert out.dtype == torch.bfloat16
    assert ((B, H, L, D), torch.float32) not in saved
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_backend_refusals_say_why(interpret_on_cpu):
    import fastrpe as fr
    from fastrpe.positions.kerple import KerpleLog

    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEV) for _ in range(3))
    with pytest.raises(FastRPEError, match="not a geometric decay"):
        fr.attention(q, k, v, kernel="elu", position=KerpleLog(2).double().to(DEV), causal=True,
                     backend="triton_chunked")
    with pytest.raises(FastRPEError, match="Lq == Lk"):
        fr.attention(q[:, :, :5], k, v, kernel="elu", causal=False, backend="triton_chunked")


# ----------------------------------------------------------------------------- blocked state scan

BLOCKED_CASES = [  # N = cdiv(max(Lk, q_offset + Lq), chunk) chunks; blocks of round(√N)
    pytest.param(1, 2, 63, 63, 12, 10, 0, 16, id="N4-two-blocks"),
    pytest.param(1, 2, 80, 80, 12, 10, 0, 16, id="N5-ragged-last-block"),
    pytest.param(1, 1, 70, 70, 12, 72, 0, 16, id="N5-several-value-blocks"),
    pytest.param(1, 2, 5, 80, 12, 10, 75, 16, id="decode-N5"),
    pytest.param(1, 2, 80, 50, 12, 10, 0, 16, id="queries-past-keys-N5"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,chunk", BLOCKED_CASES)
def test_blocked_state_scan_matches_reference(blocked_scan, B, H, Lq, Lk, F, Dv, q_offset, chunk, dtype):
    """The states in blocks walked side by side, each from its carry (`_block_carries`): the
    same outputs, final state and gradients (γ's and the initial state's included) as Eq. 10,
    with the initial state in and the final state out, in both passes."""
    N = -(-max(Lk, q_offset + Lq) // chunk)
    assert tc.scan_blocks(N)[1] >= 2
    test_causal_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, chunk, dtype, "ieee")
    test_quotient_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, chunk, dtype, "ieee")


def test_blocked_state_scan_equals_the_sequential_one(monkeypatch):
    """float64, 13 chunks in 4 blocks, key padding, no initial state: the two scans agree to
    round-off in every output and gradient; so do bf16-stored states (state_dtype) within
    their roundings."""
    q, k, v = features_and_values(2, 2, 200, 200, 12, 10, dtype=torch.float64, device=DEV)
    gamma = _gamma(2)
    kpm = torch.zeros(2, 200, dtype=torch.bool)
    kpm[1, 150:] = True
    kw = {"gamma": gamma, "chunk_size": 16, "key_padding_mask": kpm.to(DEV)}
    monkeypatch.setattr(tc, "BLOCKED_MIN_CHUNKS", 2)
    runs = {}
    for mode in tc.STATE_SCANS:
        monkeypatch.setattr(tc, "STATE_SCAN", mode)
        out = tc.kernelized_num_den_triton_chunked(q, k, v, **kw)[:2]
        runs[mode] = (*out, *weighted_grads(out, (q, k, v, gamma)))
    assert tc.scan_blocks(13) == (4, 4)
    for name, a, b in zip(("num", "den", "dq", "dk", "dv", "dgamma"), runs["sequential"], runs["blocked"]):
        assert_close(a, b, torch.float64, msg=name)


def test_scan_blocks_rule_and_bad_setting(monkeypatch):
    assert tc.scan_blocks(1024) == (1024, 1)  # the default, "auto": sequential off a GPU
    monkeypatch.setattr(tc, "STATE_SCAN", "blocked")
    assert tc.scan_blocks(1024) == (32, 32) and tc.scan_blocks(16384) == (128, 128)
    assert tc.scan_blocks(15) == (15, 1)  # below BLOCKED_MIN_CHUNKS: nothing to split
    G, NB = tc.scan_blocks(1000)
    assert G * NB >= 1000 > G * (NB - 1)
    monkeypatch.setattr(tc, "STATE_SCAN", "parallel")
    with pytest.raises(FastRPEError, match="STATE_SCAN"):
        tc.scan_blocks(64)


def test_auto_scan_blocks_only_long_passes_that_leave_most_sms_idle(monkeypatch):
    """STATE_SCAN's default "auto": blocked on a CUDA device from AUTO_BLOCKED_MIN_CHUNKS
    chunks when the sequential grid fills under half the SMs (the H100's 132: triton_chunked's
    32 programs at 64k, triton_band's 8), sequential for triton_soe's 128 programs, at 4k
    (64 chunks), and always on the CPU (the interpreter)."""
    monkeypatch.setattr(tc, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert tc.STATE_SCAN == "auto"
    assert tc.scan_blocks(1024, "auto", 32, cuda) == (32, 32)
    assert tc.scan_blocks(1024, "auto", 8, cuda) == (32, 32)
    assert tc.scan_blocks(256, "auto", 32, cuda) == (16, 16)
    assert tc.scan_blocks(1024, "auto", 128, cuda) == (1024, 1)
    assert tc.scan_blocks(64, "auto", 32, cuda) == (64, 1)
    assert tc.scan_blocks(1024, "auto", 32, torch.device("cpu")) == (1024, 1)
    assert tc.scan_blocks(1024, "auto", None, cuda) == (1024, 1)
    assert tc.scan_blocks(1024, "sequential", 8, cuda) == (1024, 1)


def test_state_passes_tell_auto_their_grid(monkeypatch):
    """Each state pass hands "auto" the size of its sequential grid: B·H·(value blocks) for
    triton_chunked, forward and backward (here 2·3 rows, one value block)."""
    seen = []
    real = tc.scan_blocks
    monkeypatch.setattr(tc, "scan_blocks", lambda N, mode=None, programs=None, device=None: seen.append(
        (mode, programs, torch.device(device).type)) or real(N, mode, programs, device))
    q, k, v = features_and_values(2, 3, 40, 40, 12, 10, dtype=torch.float64, device=DEV)
    num, den, _ = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=_gamma(3), chunk_size=16)
    (num.sum() + den.sum()).backward()
    assert seen == [("auto", 6, "cpu")] * 2


@pytest.mark.parametrize("divide", [None, torch.bfloat16], ids=["num-den", "quotient"])
def test_blocked_scan_with_bf16_states(blocked_scan, divide):
    """bf16-stored states under the blocked scan: the carries are float32 (only the states
    between the kernels are rounded), so the same bounds hold."""
    test_float32_features_with_bf16_states(divide)


def test_a_backward_keeps_its_forwards_state_scan(monkeypatch):
    """The bench's `+blocked-scan` rows set the scan around the forward call only
    (`use_state_scan`): the backward, run later, takes the mode its forward saved."""
    monkeypatch.setattr(tc, "BLOCKED_MIN_CHUNKS", 2)
    calls = []
    real = tc._block_carries
    monkeypatch.setattr(tc, "_block_carries", lambda *a, **kw: calls.append(kw.get("reverse", a[-1])) or real(*a, **kw))
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    with tc.use_state_scan("blocked"):
        num, den, _ = tc.kernelized_num_den_triton_chunked(q, k, v, gamma=_gamma(2), chunk_size=16)
    assert tc.STATE_SCAN == "auto" and calls == [False]
    (num.sum() + den.sum()).backward()
    assert calls == [False, True]
    with pytest.raises(FastRPEError, match="STATE_SCAN"), tc.use_state_scan("parallel"):
        pass


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("from_zero", [False, True], ids=["from-start", "from-zero"])
def test_block_carries_kernel_is_the_recurrence(dtype, from_zero):
    """The blocked scan's carries (`_block_carries`, one kernel launch per state tensor) are
    the recurrence's, forward and reverse, step by step from the start state (or zero), with
    a ragged last block (E = 0, 48, 96, 100) and rows that repeat two decays; and they equal
    the closed matrix form (`block_carries_reference`, float64)."""
    BHn, NB, BF, BDV, N, G, BT, Lk = 4, 3, 2, 3, 7, 3, 16, 100
    g = torch.Generator().manual_seed(0)
    tot = torch.randn(BHn, NB, BF, BDV, generator=g, dtype=dtype)
    totz = torch.randn(BHn, NB, BF, generator=g, dtype=dtype)
    h = torch.randn(BHn, N + 1, BF, BDV, generator=g, dtype=dtype)  # the start is a chunk of it (strided rows)
    z = torch.randn(BHn, N + 1, BF, generator=g, dtype=dtype)
    log_g = torch.log(torch.tensor([0.9, 0.99], dtype=dtype))
    E = [min(min(b * G, N) * BT, Lk) for b in range(NB + 1)]  # 0, 48, 96, 100
    gam = torch.tensor([0.9, 0.99], dtype=dtype).repeat(2)
    for reverse in (False, True):
        at = N if reverse else 0
        start, startz = (h[:, at], z[:, at]) if not from_zero else (None, None)
        got = tc._block_carries(tot, totz, log_g, start, startz, N, G, BT, Lk, reverse=reverse)
        s0 = (h[:, at], z[:, at]) if not from_zero else (torch.zeros_like(h[:, 0]), torch.zeros_like(z[:, 0]))
        for i, (t, s) in enumerate(zip((tot, totz), s0)):
            want, c = [None] * NB, s
            decay = gam.view(-1, *[1] * (s.dim() - 1))
            for b in (reversed(range(NB)) if reverse else range(NB)):
                want[b] = c  # forward: the state entering block b; reverse: the gradient leaving it
                c = decay ** (E[b + 1] - E[b]) * c + t[:, b]
            assert got[i].dtype == dtype
            assert_close(got[i], torch.stack(want, 1), dtype)
        ref = tc.block_carries_reference(tot, totz, log_g, *s0, N, G, BT, Lk, reverse=reverse)
        for a, b in zip(got, ref):
            assert_close(a, b, dtype)


def test_length_bucket_keeps_4k_and_64k_apart_and_nearby_lengths_together():
    """The autotuners' `LB` key: the GPU bench tunes at 4,096 tokens first, and 64k reused
    4k's choice before; a factor of 4 in chunks moves the bucket by one, a factor under 2
    at most by one, and it never decreases."""
    b = [tc.length_bucket(n) for n in range(1, 20000)]
    assert b == sorted(b) and b[0] == 0
    assert tc.length_bucket(4096 // 64) != tc.length_bucket(65536 // 64)
    for n in (1, 7, 64, 1000, 4096):
        assert tc.length_bucket(4 * n) == tc.length_bucket(n) + 1
        assert tc.length_bucket(n + n // 2) - tc.length_bucket(n) <= 1
