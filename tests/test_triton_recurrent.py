"""Fused decode step (`ops/linear/triton_recurrent.py`): a prompt by the Triton chunked op,
then token-by-token steps, gives the full sequence's outputs from the dense reference
(`ops/linear/naive.py`, weights `γ^(i-j)`, j <= i). Interpreter set-up as in
test_triton_chunked.py.
"""

import os

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear.naive import kernelized_num_den_naive  # noqa: E402
from fastrpe.ops.linear.triton_chunked import kernelized_num_den_triton_chunked, triton_unavailable_reason  # noqa: E402
from fastrpe.ops.linear.triton_recurrent import linear_step_triton  # noqa: E402
from fastrpe.testing import assert_close  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


@pytest.mark.parametrize("F,Dv", [(12, 10), (20, 70)], ids=["F12-Dv10", "F20-Dv70-two-blocks"])
def test_prompt_then_steps_equal_full_pass(F, Dv):
    B, H, L, P = 2, 3, 21, 13  # P prompt tokens, then L - P single steps
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, L, F, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=g).to(DEV)
    gamma = torch.tensor([0.6, 0.9, 1.0], device=DEV)
    r = torch.arange(-(L - 1), L, device=DEV, dtype=torch.float64)
    lc = r.abs()[None] * torch.log(gamma.double())[:, None]
    rn, rd, _ = kernelized_num_den_naive(q.double(), k.double(), v.double(), lc, causal=True)
    num, den, _, S = kernelized_num_den_triton_chunked(q[:, :, :P], k[:, :, :P], v[:, :, :P], gamma=gamma,
                                                       chunk_size=16, return_state=True)
    nums, dens = [num], [den]
    for t in range(P, L):
        n1, d1, S = linear_step_triton(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], S, gamma=gamma)
        nums.append(n1)
        dens.append(d1)
    assert_close(torch.cat(nums, 2), rn.float(), torch.float32)
    assert_close(torch.cat(dens, 2), rd.float(), torch.float32)


def test_step_refuses_more_than_one_token():
    x = torch.rand(1, 1, 2, 4, device=DEV)
    with pytest.raises(FastRPEError, match="one token"):
        linear_step_triton(x, x, x, torch.zeros(1, 1, 4, 5, device=DEV))
    with pytest.raises(FastRPEError, match="state"):
        linear_step_triton(x[:, :, :1], x[:, :, :1], x[:, :, :1], torch.zeros(1, 1, 4, 4, device=DEV))


# ---- the step with PRF's features fused (`prf_linear_token_triton`) ----------------------------

from fastrpe.kernels import PRF  # noqa: E402
from fastrpe.ops.linear import recurrent  # noqa: E402
from fastrpe.ops.linear.triton_recurrent import prf_linear_token_triton  # noqa: E402


def _prf_step_reference(kern, q, k, vv, S, gamma):
    """PyTorch's step: the map's own features, `recurrent.linear_token`, `divide_packed`."""
    pq, pk = kern(q[:, :, None], is_query=True), kern(k[:, :, None], is_query=False)  # (B, H, 1, F)
    y, S = recurrent.linear_token(pq, pk, vv[:, :, None].float(), S, None if gamma is None else gamma[:, None, None])
    return recurrent.divide_packed(y)[:, :, 0], S


def _prf_args(kern, H):
    shift = kern.key_log_shift().float().reshape(-1).expand(H).contiguous()
    return dict(w=kern.w.float().contiguous(), key_shift=shift, input_scale=kern.input_scale,
                normalize=kern.normalize, two_sided=kern.two_sided)


@pytest.mark.parametrize("normalize,two_sided,per_head,decay", [
    (True, False, False, True), (False, False, False, False), (True, True, True, True), (False, True, False, True),
], ids=["nprf-decay", "prf-no-decay", "nprf-two-sided-per-head", "prf-two-sided"])
def test_prf_step_matches_features_then_step(normalize, two_sided, per_head, decay):
    B, H, D, M, Dv = 2, 3, 10, 12, 70  # non-powers of two; C = 71 spans a 128-wide tile
    g = torch.Generator().manual_seed(1)
    kern = PRF(D, M, normalize=normalize, two_sided=two_sided, num_heads=H if per_head else None, seed=3).to(DEV)
    F = kern.num_features(D)
    # q, k, [v, 1] as strided views of one fused row, as the layer's decode step makes them
    row = torch.randn(B, 2 * H * D + H * (Dv + 1), generator=g).to(DEV)
    q, k = row[:, :H * D].view(B, H, D), row[:, H * D:2 * H * D].view(B, H, D)
    vv = row[:, 2 * H * D:].view(B, H, Dv + 1)
    vv[..., -1] = 1.0
    if not normalize:
        q *= 20  # exponents near -600: without the query's own shift every feature underflows
    S = torch.rand(B, H, F, Dv + 1, generator=g).to(DEV) * 0.1
    gamma = torch.tensor([0.5, 0.9, 1.0], device=DEV) if decay else None
    S0 = S.clone()
    o, S1 = prf_linear_token_triton(q, k, vv, S, gamma=gamma, **_prf_args(kern, H))
    ro, rS = _prf_step_reference(kern, q, k, vv, S, gamma)
    torch.testing.assert_close(S1, rS, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(o, ro, rtol=2e-5, atol=1e-6)
    assert torch.equal(S, S0)  # the input state is not written


def test_prf_step_bf16_inputs_and_output():
    B, H, D, M = 3, 8, 16, 8
    g = torch.Generator().manual_seed(2)
    kern = PRF(D, M, normalize=True).to(DEV)
    q, k = (torch.randn(B, H, D, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    vv = torch.cat([torch.randn(B, H, D, generator=g), torch.ones(B, H, 1)], -1).to(DEV, torch.bfloat16)
    S = torch.rand(B, H, M, D + 1, generator=g).to(DEV)
    gamma = torch.linspace(0.7, 0.95, H, device=DEV)
    o, S1 = prf_linear_token_triton(q, k, vv, S, gamma=gamma, out_dtype=torch.bfloat16, **_prf_args(kern, H))
    ro, rS = _prf_step_reference(kern, q, k, vv, S, gamma)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(S1, rS, rtol=2e-6, atol=1e-7)
    # rounded to nearest, as the GPU rounds: no further from float32 than torch's own rounding
    assert (o.float() - ro).abs().max() <= 1.01 * (ro.to(torch.bfloat16).float() - ro).abs().max()


def test_packed_step_equals_the_separate_rows_and_checks_its_row():
    """`prf_linear_token_packed` on one fused q/k/v row per batch (the layer's step) is
    `prf_linear_token_triton` on the three views of it, bit for bit; a row of another width
    (a map built for other heads) and a state of another shape are refused."""
    from fastrpe.ops.linear.triton_recurrent import prf_linear_token_packed, prf_step

    B, H, D, M = 2, 3, 8, 4
    g = torch.Generator().manual_seed(3)
    kern = PRF(D, M, two_sided=True).to(DEV)
    qkv = torch.randn(B, 2 * H * D + H * (D + 1), generator=g).to(DEV)
    q, k = qkv[:, :H * D].view(B, H, D), qkv[:, H * D:2 * H * D].view(B, H, D)
    vv = qkv[:, 2 * H * D:].view(B, H, D + 1)
    S = torch.rand(B, H, 2 * M, D + 1, generator=g).to(DEV)
    gamma = torch.linspace(0.7, 0.95, H, device=DEV)
    args = _prf_args(kern, H)
    o, S1 = prf_linear_token_triton(q, k, vv, S, gamma=gamma, **args)
    p = prf_step(args.pop("w"), args.pop("key_shift"), H, D, **args)
    po, pS = prf_linear_token_packed(p, qkv, S, gamma)
    assert torch.equal(po, o) and torch.equal(pS, S1)
    for bad in (qkv[:, 1:], qkv[None]):
        with pytest.raises(FastRPEError, match="qkv: expected"):
            prf_linear_token_packed(p, bad, S, gamma)
    with pytest.raises(FastRPEError, match="S: expected"):
        prf_linear_token_packed(p, qkv, S[:, :, 1:].contiguous(), gamma)


def test_fast_launch_goes_through_the_jit_once_per_specialization(monkeypatch):
    """`FAST_LAUNCH`: the JIT launches a specialization once and its compiled binary every later
    time, with every argument in signature order (constexprs last, as the JIT hands them to the
    launcher) and a grid of three dims; a tensor of another dtype or alignment, or another int, is a new specialization;
    off (the default) or interpreted, the JIT every time."""
    from fastrpe.ops.linear import triton_recurrent as tr

    calls = []

    class Compiled:  # as Triton's `CompiledKernel[grid]`, whose runner reads three grid dims
        def __getitem__(self, grid):
            return lambda *a: calls.append(("binary", (grid[0], grid[1], grid[2]), a))

    class Kernel:
        arg_names = ["x_ptr", "n", "s", "BC", "FLAG"]

        def __getitem__(self, grid):
            def jit(*a, **kw):
                calls.append(("jit", grid, a, kw))
                return Compiled()
            return jit

    k, x = Kernel(), torch.zeros(8)
    monkeypatch.setattr(tr, "_LAUNCHERS", {})
    tr._launch(k, (2,), (x, 3, 0.5), {"BC": 16, "FLAG": True}, num_warps=8)
    assert calls[-1] == ("jit", (2,), (x, 3, 0.5), {"BC": 16, "FLAG": True, "num_warps": 8})  # off: the JIT
    monkeypatch.setattr(tr, "FAST_LAUNCH", True)
    monkeypatch.setattr(tr, "INTERPRETED", False)
    for n in (3, 3, 4, 4):
        tr._launch(k, (2,), (x, n, 0.5), {"BC": 16, "FLAG": True}, num_warps=8)
    assert [c[0] for c in calls] == ["jit", "jit", "binary", "jit", "binary"]
    assert calls[2] == ("binary", (2, 1, 1), (x, 3, 0.5, 16, True))  # (the grid padded to three, as the JIT's)
    tr._launch(k, (2,), (x[1:], 4, 0.5), {"BC": 16, "FLAG": True}, num_warps=8)  # 4 bytes in: not 16-aligned
    tr._launch(k, (2,), (x.double(), 4, 0.5), {"BC": 16, "FLAG": True}, num_warps=8)
    tr._launch(k, (2,), (x, 4, 0.5), {"BC": 16, "FLAG": False}, num_warps=8)
    assert [c[0] for c in calls[5:]] == ["jit", "jit", "jit"]


@pytest.mark.parametrize("family", ["alibi", "t5", "kerple_log"])
def test_each_fused_step_hands_its_launch_over_in_signature_order(monkeypatch, family):
    """What `FAST_LAUNCH` relies on: each fused step's launch passes its kernel's runtime
    arguments in order and then its constexprs, named in the kernel's own order (else the
    binary's launcher, which takes them all positionally, could not be used: `_launch` would
    keep the JIT's launch)."""
    from fastrpe.ops.linear import triton_recurrent as tr

    seen = []
    launch = tr._launch
    monkeypatch.setattr(tr, "_launch", lambda kernel, grid, args, consts, **o: (
        seen.append((kernel, args, consts)), launch(kernel, grid, args, consts, **o)))
    mha = _family_layer(family)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    x = torch.randn(1, 10, 15).to(DEV)
    with torch.no_grad():
        _, st = mha.step(x[:, :9])
        mha.step(x[:, 9:], st)
    assert seen
    for kernel, args, consts in seen:
        names = kernel.arg_names
        assert list(consts) == names[len(args):] and len(args) + len(consts) == len(names), kernel


def test_prf_step_empty_row_gives_zero():
    """A key whose features underflow after an empty state: den = 0, the output 0, not NaN."""
    B, H, D, M = 1, 1, 8, 4
    kern = PRF(D, M).to(DEV)
    x = torch.ones(B, H, D, device=DEV)
    vv = torch.cat([x, torch.ones(B, H, 1, device=DEV)], -1)
    args = _prf_args(kern, H)
    args["key_shift"] = torch.full((H,), 1e4, device=DEV)  # exp(e - 1e4) = 0
    o, S1 = prf_linear_token_triton(x, x, vv, torch.zeros(B, H, M, D + 1, device=DEV), **args)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(S1, torch.zeros_like(S1))


def test_prf_step_refuses_wrong_shapes():
    kern = PRF(8, 4).to(DEV)
    x = torch.ones(1, 2, 8, device=DEV)
    vv = torch.ones(1, 2, 9, device=DEV)
    with pytest.raises(FastRPEError, match="S: expected"):
        prf_linear_token_triton(x, x, vv, torch.zeros(1, 2, 8, 9, device=DEV), **_prf_args(kern, 2))
    with pytest.raises(FastRPEError, match="w: expected"):
        prf_linear_token_triton(x, x, vv, torch.zeros(1, 2, 4, 9, device=DEV),
                                **{**_prf_args(kern, 2), "w": torch.zeros(4, 7, device=DEV)})


# ---- the band and sum-of-exponentials steps (`prf_band_token_triton`, `prf_soe_token_triton`) ----

from dataclasses import replace  # noqa: E402

from fastrpe.ops.linear.soe import causal_log_coefficients, soe_plan  # noqa: E402
from fastrpe.ops.linear.state import BandState, SoEState  # noqa: E402
from fastrpe.ops.linear.triton_recurrent import prf_band_token_triton, prf_soe_token_triton  # noqa: E402
from fastrpe.testing import assert_lowp_close  # noqa: E402


def _kerple_log(H):
    """KERPLE-log with different parameters per head (its default starts every head alike)."""
    from fastrpe import positions as P

    pos = P.KerpleLog(H)
    with torch.no_grad():
        pos.raw_r1.add_(torch.linspace(-0.5, 0.5, H))
        pos.raw_r2.add_(torch.linspace(0.5, -0.5, H))
    return pos


def _token_rows(B, H, D, Dv, g, dtype):
    """q, k `[B, H, D]` and `[v, 1]` `[B, H, Dv+1]` of one token, strided views of one fused row
    in `dtype`, as the layer's decode step makes them."""
    row = torch.randn(B, 2 * H * D + H * (Dv + 1), generator=g)
    row[:, 2 * H * D:].view(B, H, Dv + 1)[..., -1] = 1.0
    row = row.to(DEV, dtype)
    return row[:, :H * D].view(B, H, D), row[:, H * D:2 * H * D].view(B, H, D), row[:, 2 * H * D:].view(B, H, Dv + 1)


def _features(kern, q, k, dtype=torch.float32):
    """PRF's own features of one token (`[B, H, 1, F]`), computed in `dtype`."""
    return kern(q[:, :, None].to(dtype), is_query=True), kern(k[:, :, None].to(dtype), is_query=False)


def _assert_window_state(st, ref, length):
    assert type(st) is type(ref) and st.length == ref.length == length
    for f in ("S", "keys", "values"):
        a, b = getattr(st, f), getattr(ref, f)
        assert a.shape == b.shape and a.dtype == torch.float32, f
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=f)


def _judge(fast, naive, ref64, dtype):
    """The fused outputs against the PyTorch ops' (same dtype) and both against float64."""
    if dtype == torch.float32:
        assert_close(fast, naive, torch.float32)
        assert_lowp_close(fast, naive, ref64)
    else:  # bf16 o, rounded to nearest as the GPU rounds: no further than torch's own rounding
        assert fast.dtype == dtype
        assert (fast.float() - naive).abs().max() <= 1.01 * (naive.to(dtype).float() - naive).abs().max()
        assert_lowp_close(fast, naive.to(dtype), ref64)


PRF_CASES = [(True, False, False, torch.float32), (False, True, True, torch.float32),
             (True, True, False, torch.bfloat16)]
PRF_IDS = ["nprf-fp32", "prf-two-sided-per-head-fp32", "nprf-two-sided-bf16"]


@pytest.mark.parametrize("normalize,two_sided,per_head,dtype", PRF_CASES, ids=PRF_IDS)
def test_band_step_matches_band_token_and_the_dense_reference(normalize, two_sided, per_head, dtype):
    """From an empty band, W = 5 steps that fill it and 8 past it (the oldest key joining the
    tail sum): each output and state against `recurrent.band_token`'s, and the outputs against
    `recurrent_naive` in float64 with weights `exp(b(-min(d, W)))`. F and Dv + 1 = 11 are not
    powers of two."""
    B, H, D, M, Dv, W, L = 2, 3, 10, 6, 10, 5, 13
    g = torch.Generator().manual_seed(7)
    kern = PRF(D, M, normalize=normalize, two_sided=two_sided, num_heads=H if per_head else None, seed=3).to(DEV)
    F = kern.num_features(D)
    b = torch.randn(H, W + 1, generator=g, dtype=torch.float64).to(DEV)  # b(-d), d = 0..W
    st = ref = BandState(torch.zeros(B, H, F, Dv + 1, device=DEV), torch.zeros(B, H, 0, F, device=DEV),
                         torch.zeros(B, H, 0, Dv, device=DEV), W, 0)
    toks, outs, refs = [], [], []
    for t in range(L):
        q, k, vv = _token_rows(B, H, D, Dv, g, dtype)
        w, tail, _ = recurrent.band_token_weights(b.float(), st.keys.shape[2] + 1, W)
        prev, S0, K0 = st, st.S.clone(), st.keys.clone()
        o, st = prf_band_token_triton(q, k, vv, st, w, tail, out_dtype=dtype, **_prf_args(kern, H))
        y, ref = recurrent.band_token(*_features(kern, q, k), vv[:, :, None].float(), ref, w, tail)
        _assert_window_state(st, ref, t + 1)
        assert st.keys.shape[2] == min(t + 1, W)
        assert torch.equal(prev.S, S0) and torch.equal(prev.keys, K0)  # the input state is not written
        toks.append((q, k, vv))
        outs.append(o)
        refs.append(recurrent.divide_packed(y)[:, :, 0])
    q, k, vv = (torch.stack(x, 2) for x in zip(*toks))  # (B, H, L, D | C)
    pq, pk = kern(q.double(), is_query=True), kern(k.double(), is_query=False)
    num, den = recurrent.recurrent_naive(pq, pk, vv[..., :Dv].double(),
                                         torch.exp(b[:, torch.arange(L, device=DEV).clamp_max(W)]))
    _judge(torch.stack(outs, 2), torch.stack(refs, 2), num / den[..., None], dtype)


@pytest.mark.parametrize("normalize,two_sided,per_head,dtype", PRF_CASES, ids=PRF_IDS)
def test_soe_step_matches_soe_token_and_the_dense_reference(normalize, two_sided, per_head, dtype):
    """From an empty state, W - 1 = 6 steps that fill the band and 6 past it, K = 5 terms of a
    KERPLE-log fit: each output and state against `recurrent.soe_token`'s, and the outputs
    against `recurrent_naive` in float64 with the plan's weights `Σ_k a_k γ_k^d + corr(d)`
    (`corr` for d < W only)."""
    B, H, D, M, Dv, W, K, L = 2, 3, 10, 6, 10, 7, 5, 12
    g = torch.Generator().manual_seed(8)
    kern = PRF(D, M, normalize=normalize, two_sided=two_sided, num_heads=H if per_head else None, seed=4).to(DEV)
    F = kern.num_features(D)
    with torch.no_grad():
        plan = soe_plan(causal_log_coefficients(_kerple_log(H).to(DEV), 200), W, K)
    st = ref = SoEState(torch.zeros(B, H, K, F, Dv + 1, device=DEV), torch.zeros(B, H, 0, F, device=DEV),
                        torch.zeros(B, H, 0, Dv + 1, device=DEV), plan, 0)
    toks, outs, refs = [], [], []
    for t in range(L):
        q, k, vv = _token_rows(B, H, D, Dv, g, dtype)
        gamma, a, cw = recurrent.soe_token_coefficients(plan, st.keys.shape[2] + 1, torch.float32)
        prev, S0, K0 = st, st.S.clone(), st.keys.clone()
        o, st = prf_soe_token_triton(q, k, vv, st, gamma.view(K), a.view(H, K), cw, out_dtype=dtype,
                                     **_prf_args(kern, H))
        y, ref = recurrent.soe_token(*_features(kern, q, k), vv[:, :, None].float(), ref, gamma, a, cw)
        _assert_window_state(st, ref, t + 1)
        assert st.keys.shape[2] == min(t + 1, W - 1) and st.plan is plan
        assert torch.equal(prev.S, S0) and torch.equal(prev.keys, K0)
        toks.append((q, k, vv))
        outs.append(o)
        refs.append(recurrent.divide_packed(y)[:, :, 0])
    q, k, vv = (torch.stack(x, 2) for x in zip(*toks))
    pq, pk = kern(q.double(), is_query=True), kern(k.double(), is_query=False)
    d = torch.arange(L, device=DEV, dtype=torch.float64)
    coeff = (plan.a[:, None, :] * plan.gamma ** d[:, None]).sum(-1)  # (H, L)
    coeff[:, :W] += plan.corr
    num, den = recurrent.recurrent_naive(pq, pk, vv[..., :Dv].double(), coeff)
    _judge(torch.stack(outs, 2), torch.stack(refs, 2), num / den[..., None], dtype)


def test_band_and_soe_steps_refuse_constants_of_another_step():
    from fastrpe import positions as P

    B, H, D, M, Dv, W = 1, 2, 8, 4, 5, 3
    kern = PRF(D, M).to(DEV)
    q, k, vv = _token_rows(B, H, D, Dv, torch.Generator().manual_seed(0), torch.float32)
    full = BandState(torch.zeros(B, H, M, Dv + 1, device=DEV), torch.zeros(B, H, W, M, device=DEV),
                     torch.zeros(B, H, W, Dv, device=DEV), W, 9)
    b = torch.zeros(H, W + 1, device=DEV)
    w, tail, _ = recurrent.band_token_weights(b, W + 1, W)
    with pytest.raises(FastRPEError, match="weights, tail"):  # a full band reads its tail sum
        prf_band_token_triton(q, k, vv, full, w, None, **_prf_args(kern, H))
    with pytest.raises(FastRPEError, match="weights, tail"):  # weights for another n
        prf_band_token_triton(q, k, vv, full, w[:, 1:].contiguous(), tail, **_prf_args(kern, H))
    with pytest.raises(FastRPEError, match="state: expected"):
        prf_band_token_triton(q, k, vv, replace(full, values=full.values[..., 1:]), w, tail, **_prf_args(kern, H))
    plan = soe_plan(causal_log_coefficients(P.KerpleLog(H).to(DEV), 50).detach(), 4, 3)
    st = SoEState(torch.zeros(B, H, 3, M, Dv + 1, device=DEV), torch.zeros(B, H, 3, M, device=DEV),
                  torch.zeros(B, H, 3, Dv + 1, device=DEV), plan, 9)
    gamma, a, cw = recurrent.soe_token_coefficients(plan, 4, torch.float32)
    with pytest.raises(FastRPEError, match="gamma, a, cw"):  # cw of 3 keys, not this step's 4
        prf_soe_token_triton(q, k, vv, st, gamma.view(-1), a.view(H, -1), cw[:, :3].contiguous(),
                             **_prf_args(kern, H))
    over = replace(st, keys=torch.zeros(B, H, 4, M, device=DEV), values=torch.zeros(B, H, 4, Dv + 1, device=DEV))
    with pytest.raises(FastRPEError, match="gamma, a, cw"):  # 4 buffered keys: more than W - 1
        prf_soe_token_triton(q, k, vv, over, gamma.view(-1), a.view(H, -1), cw, **_prf_args(kern, H))


# ---- the layer's decode step through it (`MultiheadAttention._prf_step`) ---------------------

import copy  # noqa: E402

import fastrpe as fr  # noqa: E402
from fastrpe.nn import attention as attention_mod  # noqa: E402
from fastrpe.ops.linear import triton_recurrent  # noqa: E402


def _prf_layer(kernel, position, dtype=torch.float32):
    torch.manual_seed(0)
    return fr.nn.MultiheadAttention(15, 3, kernel=kernel, position=position, causal=True).to(DEV, dtype)


def _steps(mha, x, prompt, states=None):
    """Outputs of a prompt then single tokens, and the last state (each one appended to `states`)."""
    with torch.no_grad():
        out, st = mha.step(x[:, :prompt])
        outs = [out]
        for t in range(prompt, x.shape[1]):
            out, st = mha.step(x[:, t:t + 1], st)
            outs.append(out)
            if states is not None:
                states.append(st)
    return torch.cat(outs, 1), st


#: each constant-size state's fused op, by the family of the layers below
FUSED_OPS = {"alibi": "prf_linear_token_packed", "t5": "prf_band_token_packed", "kerple_log": "prf_soe_token_packed"}


def _family_layer(family, E=15, H=3, kernel="nprf", dtype=torch.float32, W=8):
    """A decode layer of each constant-size state: ALiBi (geometric), T5 (a band of width W:
    8, or 113 at its defaults) and KERPLE-log (backend "soe": K terms, a 64-wide band)."""
    from fastrpe import positions as P

    torch.manual_seed(0)
    if family == "t5":
        pos = P.T5Bias(H, bidirectional=False, **({} if W == 113 else dict(num_buckets=6, max_distance=12)))
        with torch.no_grad():
            pos.embedding.normal_(0, 0.5)
        assert pos.finite_support() == W
    else:
        pos = P.ALiBi(H) if family == "alibi" else _kerple_log(H)
    return fr.nn.MultiheadAttention(E, H, kernel=kernel, position=pos, causal=True,
                                    backend="soe" if family == "kerple_log" else "auto").to(DEV, dtype)


@pytest.mark.parametrize("kernel,position", [
    ("nprf", "alibi"),
    (PRF(5, 6, two_sided=True, num_heads=3, seed=2), None),
    (PRF(5, 7, normalize=True, projection="orthogonal"), "alibi"),
], ids=["nprf-alibi", "prf-two-sided-per-head-no-term", "nprf-orthogonal-alibi"])
def test_layer_steps_through_the_fused_kernel_equal_the_full_forward(monkeypatch, kernel, position, count_calls):
    from fastrpe import positions as P

    calls = count_calls(triton_recurrent, "prf_linear_token_packed")
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    mha = _prf_layer(kernel, P.ALiBi(3) if position == "alibi" else None)
    x = torch.randn(2, 20, 15, generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.no_grad():
        full = mha(x)
    dec, st = _steps(mha, x, 4)
    assert len(calls) == 16 and isinstance(st, fr.nn.LinearState) and st.length == 20
    assert_close(dec, full, torch.float32)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    ref, ref_st = _steps(mha, x, 4)
    assert len(calls) == 16  # "never": the PyTorch ops
    torch.testing.assert_close(dec, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.S, ref_st.S, rtol=1e-5, atol=1e-6)


def test_layer_fused_step_in_bf16_and_after_parameter_updates(monkeypatch, count_calls):
    from fastrpe import positions as P

    calls = count_calls(triton_recurrent, "prf_linear_token_packed")
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    mha = _prf_layer("nprf", P.ALiBi(3), torch.bfloat16)
    x = torch.randn(1, 9, 15, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    with torch.no_grad():
        _, st = mha.step(x[:, :8])
        before, _ = mha.step(x[:, 8:], st)
        mha.position.slopes.mul_(3.0)  # the memoized decay and features follow in-place updates
        mha.kernel.redraw()
        after, st2 = mha.step(x[:, 8:], st)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    with torch.no_grad():
        ref, ref_st = mha.step(x[:, 8:], st)
    wide = copy.deepcopy(mha).float()  # the same step computed in float32 throughout
    with torch.no_grad():
        ref32, _ = wide.step(x[:, 8:].float(), st)
    assert len(calls) == 2 and after.dtype == torch.bfloat16
    assert (after.float() - before.float()).abs().max() > 1e-2
    assert_lowp_close(after, ref, ref32)  # no further from float32 than the PyTorch step, 4x
    torch.testing.assert_close(st2.S, ref_st.S, rtol=1e-5, atol=1e-6)


def test_fused_step_plan_is_checked_every_step(monkeypatch, count_calls):
    """The fused step's constants are one memo (`MultiheadAttention._fused_step_plan`), but what
    can change without touching a tensor is checked every step: a hook on out_proj added after
    the memo is built is called, one on k_proj sends the step to the PyTorch ops (the hook sees
    the token), and a feature map's setting changed in place (`input_scale`) is followed."""
    from fastrpe import positions as P

    calls = count_calls(triton_recurrent, "prf_linear_token_packed")
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    mha = _prf_layer("nprf", P.ALiBi(3)).eval()
    x = torch.randn(1, 9, 15, generator=torch.Generator().manual_seed(6)).to(DEV)

    def step():
        with torch.no_grad():
            return mha.step(x[:, 8:], st)[0]

    with torch.no_grad():
        _, st = mha.step(x[:, :8])
    first = step()
    assert len(calls) == 1
    seen = []
    mha.out_proj.register_forward_hook(lambda m, i, o: seen.append("out"))
    torch.testing.assert_close(step(), first, rtol=0, atol=0)
    assert len(calls) == 2 and seen == ["out"]
    hook = mha.k_proj.register_forward_hook(lambda m, i, o: seen.append("k"))
    torch.testing.assert_close(step(), first, rtol=1e-5, atol=1e-6)
    assert len(calls) == 2 and seen == ["out", "k", "out"]
    hook.remove()
    mha.kernel.input_scale = 0.5
    scaled = step()
    assert len(calls) == 3 and (scaled - first).abs().max() > 1e-4
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    torch.testing.assert_close(scaled, step(), rtol=1e-5, atol=1e-6)


def test_fused_step_is_not_taken_where_it_does_not_apply(monkeypatch, count_calls):
    from fastrpe import positions as P

    calls = count_calls(triton_recurrent, "prf_linear_token_packed")
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "cuda")
    x = torch.randn(1, 6, 15).to(DEV)
    layers = [_prf_layer("elu", P.ALiBi(3)), _prf_layer("nprf", P.ALiBi(3), torch.float64)]
    if DEV.type == "cpu":
        layers.append(_prf_layer("nprf", P.ALiBi(3)))  # "cuda" leaves the CPU to PyTorch
    for mha in layers:
        _steps(mha, x.to(next(mha.parameters()).dtype), 4)
    assert calls == []
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "fast")
    with pytest.raises(FastRPEError, match="FUSED_STEP"):
        _steps(layers[0], x, 4)


@pytest.mark.parametrize("family", list(FUSED_OPS))
def test_fused_step_never_reads_a_tensor_on_the_host(monkeypatch, count_calls, family):
    """As test_decoding's host-read ban, through the fused step (the interpreter's own reads,
    which a GPU launch does not make, and the input check's are exempt); T5's band is full."""
    import sys

    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    calls = count_calls(triton_recurrent, FUSED_OPS[family])
    mha = _family_layer(family)
    x = torch.randn(1, 10, 15).to(DEV)
    syncs = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero")
    originals = {n: getattr(torch.Tensor, n) for n in syncs}

    def forbid(name):
        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith("_validate.py") or f"{os.sep}triton{os.sep}" in caller:
                return originals[name](*args, **kwargs)
            raise AssertionError(f"host read in a decode step: Tensor.{name}")
        return read

    with torch.no_grad():
        _, st = mha.step(x[:, :9])
        mha.step(x[:, 9:], st)  # warm: the memos are built once
        with monkeypatch.context() as m:
            for name in syncs:
                m.setattr(torch.Tensor, name, forbid(name))
            out, st2 = mha.step(x[:, 9:], st)
    assert len(calls) == 2 and st2.length == 10 and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True], ids=["jit-launch", "fast-launch"])
def test_fused_step_at_the_bench_shape_on_cuda(monkeypatch, count_calls, fast):
    """The bench's decode layer (H = 8, D = 64, 32 NPRF features, bf16, ALiBi) on the GPU: the
    fused step's outputs and states against the PyTorch ops' for 64 tokens after a prompt,
    its kernel launched by the JIT every time or through its binary (`FAST_LAUNCH`)."""
    from fastrpe import positions as P

    monkeypatch.setattr(triton_recurrent, "FAST_LAUNCH", fast)

    mha = fr.nn.MultiheadAttention(512, 8, kernel=fr.kernels.get_kernel("nprf", head_dim=64, num_features=32),
                                   position=P.ALiBi(8), causal=True).to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, 320, 512, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    calls = count_calls(triton_recurrent, "prf_linear_token_packed")
    fast, fast_st = _steps(mha, x, 256)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    ref, ref_st = _steps(mha, x, 256)
    wide = copy.deepcopy(mha).float()
    ref32, _ = _steps(wide, x.float(), 256)
    assert len(calls) == 64
    assert_lowp_close(fast[:, 256:], ref[:, 256:], ref32[:, 256:])
    torch.testing.assert_close(fast_st.S, ref_st.S, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family,aten", [("alibi", 4), ("t5", 6), ("kerple_log", 6)])
def test_fused_step_dispatches_few_ops(family, aten):
    """`benchmarks/decode_ops.py`'s count of the bench's decode layers through the fused step:
    the two matmuls, the allocations (o and the new state: two, or four with a band's window),
    views and the one Triton launch (PyTorch ops: 39, 46 and 45 launches)."""
    from _benchmarks import load_benchmark

    ops = load_benchmark("decode_ops")
    mha = _family_layer(family, 512, 8, fr.kernels.get_kernel("nprf", head_dim=64, num_features=32),
                        torch.bfloat16, W=113).eval()
    x = torch.randn(1, 9, 512).to(DEV, torch.bfloat16)
    with torch.no_grad(), ops.fused_step() as kern:
        _, st = mha.step(x[:, :8])
        mha.step(x[:, 8:], st)  # warm: the memos
        kern.skip = True  # count, do not interpret
        c = ops.count_ops(lambda: mha.step(x[:, 8:], st))
    assert kern.n == 2 and c.launches <= aten + 2, c.by_name()  # aten launches measured, + 2


@pytest.mark.parametrize("family,prompt,L", [("t5", 2, 16), ("kerple_log", 58, 68)],
                         ids=["t5-band-W8", "kerple_log-soe-W64"])
def test_layer_band_and_soe_steps_through_the_fused_kernel(monkeypatch, count_calls, family, prompt, L):
    """The layer's steps with FUSED_STEP "always" against "never", token by token from a prompt
    that leaves the band filling to past it: the same outputs and every state alike, and the
    full forward's outputs."""
    calls = count_calls(triton_recurrent, FUSED_OPS[family])
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    mha = _family_layer(family)
    x = torch.randn(2, L, 15, generator=torch.Generator().manual_seed(9)).to(DEV)
    with torch.no_grad():
        full = mha(x)
    fast_states, ref_states = [], []
    fast, _ = _steps(mha, x, prompt, fast_states)
    assert len(calls) == L - prompt  # every token after the prompt
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    ref, _ = _steps(mha, x, prompt, ref_states)
    assert len(calls) == L - prompt  # "never": the PyTorch ops
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    assert_close(fast, full, torch.float32)
    window = 8 if family == "t5" else 63
    assert [s.keys.shape[2] for s in fast_states] == [min(t + 1, window) for t in range(prompt, L)]
    for st, rst in zip(fast_states, ref_states):
        for f in ("S", "keys", "values"):
            torch.testing.assert_close(getattr(st, f), getattr(rst, f), rtol=1e-5, atol=1e-6, msg=f)


@pytest.mark.parametrize("family", ["t5", "kerple_log"])
def test_layer_band_and_soe_fused_steps_in_bf16(monkeypatch, count_calls, family):
    """A bf16 layer: the fused step's bf16 outputs no further from a float32 copy's than the
    PyTorch ops' (4x), its float32 states alike; the band and the SoE window are full."""
    calls = count_calls(triton_recurrent, FUSED_OPS[family])
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    mha = _family_layer(family, dtype=torch.bfloat16)
    x = torch.randn(1, 70, 15, generator=torch.Generator().manual_seed(10)).to(DEV, torch.bfloat16)
    fast, fast_st = _steps(mha, x, 64)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    ref, ref_st = _steps(mha, x, 64)
    ref32, _ = _steps(copy.deepcopy(mha).float(), x.float(), 64)
    assert len(calls) == 6 and fast.dtype == torch.bfloat16
    assert_lowp_close(fast[:, 64:], ref[:, 64:], ref32[:, 64:])
    for f in ("S", "keys", "values"):
        torch.testing.assert_close(getattr(fast_st, f), getattr(ref_st, f), rtol=1e-5, atol=1e-6, msg=f)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True], ids=["jit-launch", "fast-launch"])
@pytest.mark.parametrize("family", ["t5", "kerple_log"])
def test_band_and_soe_fused_steps_at_the_bench_shape_on_cuda(monkeypatch, count_calls, family, fast):
    """The bench's decode layers (H = 8, D = 64, 32 NPRF features, bf16; T5's 113-wide band,
    KERPLE-log's SoE) on the GPU: 120 tokens after a 40-token prompt, the band filling and
    then full, the fused step against the PyTorch ops (its kernel launched as
    `test_fused_step_at_the_bench_shape_on_cuda`'s)."""
    monkeypatch.setattr(triton_recurrent, "FAST_LAUNCH", fast)
    mha = _family_layer(family, 512, 8, fr.kernels.get_kernel("nprf", head_dim=64, num_features=32),
                        torch.bfloat16, W=113).eval()
    x = torch.randn(1, 160, 512, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    calls = count_calls(triton_recurrent, FUSED_OPS[family])
    fast, fast_st = _steps(mha, x, 40)
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "never")
    ref, ref_st = _steps(mha, x, 40)
    ref32, _ = _steps(copy.deepcopy(mha).float(), x.float(), 40)
    assert len(calls) == 120 and fast_st.keys.shape[2] == (113 if family == "t5" else 63)
    assert_lowp_close(fast[:, 40:], ref[:, 40:], ref32[:, 40:])
    for f in ("S", "keys", "values"):
        torch.testing.assert_close(getattr(fast_st, f), getattr(ref_st, f), rtol=1e-4, atol=1e-5, msg=f)
