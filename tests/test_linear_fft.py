"""Kernelized attention with a Toeplitz RPE by FFT (`ops/linear/fft/`) against the naive op.

Both return `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])`, the true values being
`num·exp(log_scale)` and `den·exp(log_scale)`; the FFT op uses the same per-row scale, so the
three are compared directly.
"""
from __future__ import annotations

import math

import pytest
import torch

import fastrpe.ops.linear.fft as fftmod
import fastrpe.ops.linear.fft.product as fftproduct
from fastrpe.ops.linear.fft import plan as fftplan
from fastrpe.ops.common import safe_divide
from fastrpe.ops.linear.fft import estimate_fft_cost, fft_block_size, kernelized_num_den_fft
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.testing import assert_close, assert_lowp_close

# (B, H, Lq, Lk, q_offset, F, Dv)
CASES = [
    (1, 3, 1, 1, 0, 8, 5),
    (2, 3, 63, 63, 0, 8, 60),
    (2, 3, 63, 100, 0, 8, 5),
    (2, 3, 63, 100, 37, 60, 5),  # causal decoding layout: queries bottom-right aligned
    (2, 3, 100, 63, 0, 8, 5),
    (2, 3, 100, 100, 7, 8, 5),
    (2, 3, 1, 100, 99, 8, 5),  # one query after 99 cached keys
    (1, 3, 257, 257, 0, 60, 60),
]


def _id(c):
    return "B{}-H{}-Lq{}-Lk{}-off{}-F{}-Dv{}".format(*c)


def _inputs(B, H, Lq, Lk, F, Dv, *, dtype=torch.float64, seed=0, lc_scale=2.0, grad=True):
    """Non-negative features (as PRF-type maps give), random values, and log-coefficients
    that decay with |r| plus noise (rows see different maxima: the FFT op splits them)."""
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64)
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)
    r = torch.arange(-(Lq - 1), Lk, dtype=torch.float64)
    slope = torch.tensor([0.0, 0.05, 0.5], dtype=torch.float64)[:, None].repeat(math.ceil(H / 3), 1)[:H]
    lc = -slope * r.abs() + lc_scale * torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_(grad) for t in (pq, pk, v, lc)]


def _padding(B, Lk):
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    if B > 1:
        kpm[1, ::3] = True  # every third key of the second sequence is padding
    return kpm


def _grads(res, params, seed=1):
    """Gradients of a random linear function of (num, den) with respect to `params`."""
    g = torch.Generator().manual_seed(seed)
    num, den = res[0], res[1]
    loss = (num * torch.randn(num.shape, generator=g, dtype=num.dtype)).sum() + \
        (den * torch.randn(den.shape, generator=g, dtype=den.dtype)).sum()
    return torch.autograd.grad(loss, params)


def _true(res):
    num, den, ls = res
    return num * ls.exp()[None, :, :, None], den * ls.exp()[None]


@pytest.mark.parametrize("rpe", [True, False], ids=["rpe", "norpe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fft_matches_naive(case, causal, rpe):
    B, H, Lq, Lk, off, F, Dv = case
    pq, pk, v, lc = _inputs(B, H, Lq, Lk, F, Dv)
    params = [pq, pk, v] + ([lc] if rpe else [])
    kw = dict(causal=causal, q_offset=off, key_padding_mask=_padding(B, Lk))
    want = kernelized_num_den_naive(pq, pk, v, lc if rpe else None, **kw)
    got = kernelized_num_den_fft(pq, pk, v, lc if rpe else None, **kw)
    assert [tuple(t.shape) for t in got] == [(B, H, Lq, Dv), (B, H, Lq), (H, Lq)]
    for name, a, b in zip(("num", "den", "log_scale"), got, want):
        assert_close(a, b, msg=name)
    for p, a, b in zip(("phi_q", "phi_k", "v", "log_coeff"), _grads(got, params), _grads(want, params)):
        assert_close(a, b, msg=f"grad {p}")


@pytest.fixture
def small_leaves(monkeypatch):
    """Causal recursion with 4-position leaves, so that short sequences use many FFT levels."""
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *args, **kwargs: 4)


@pytest.mark.parametrize("case", [(2, 3, 63, 100, 37, 8, 5), (2, 3, 100, 63, 0, 8, 5), (1, 3, 63, 63, 0, 8, 60)],
                         ids=_id)
def test_causal_recursion_with_many_levels(case, small_leaves):
    B, H, Lq, Lk, off, F, Dv = case
    pq, pk, v, lc = _inputs(B, H, Lq, Lk, F, Dv)
    kw = dict(causal=True, q_offset=off, key_padding_mask=_padding(B, Lk))
    want = kernelized_num_den_naive(pq, pk, v, lc, **kw)
    got = kernelized_num_den_fft(pq, pk, v, lc, **kw)
    for a, b in zip(got, want):
        assert_close(a, b)
    for a, b in zip(_grads(got, [pq, pk, v, lc]), _grads(want, [pq, pk, v, lc])):
        assert_close(a, b)


@pytest.mark.parametrize("causal,segments", [(False, "never"), (True, "never"), (True, "always")],
                         ids=["full", "causal", "causal-segment-blocks"])
def test_feature_blocks_follow_the_budget_and_agree(causal, segments, monkeypatch, small_leaves):
    """Features go through the FFT `block` at a time, as many as fit the memory budget: for
    the whole length, or (`SEGMENT_BLOCKS`, the default on CUDA) for each product's own
    segment of the causal recursion, whose short segments take more features at a time."""
    monkeypatch.setattr(fftmod.causal, "SEGMENT_BLOCKS", segments)
    B, H, Lq, Lk, F, Dv = 2, 3, 40, 40, 8, 5
    pq, pk, v, _ = _inputs(B, H, Lq, Lk, F, Dv)
    lc = (-0.05 * torch.arange(-(Lq - 1), Lk).abs().double()).expand(H, -1).clone().requires_grad_()
    per_feature = fftplan._bytes_per_feature(B, H, Lq, Lk, Dv, 8)
    calls, products = [], []
    orig = fftproduct._channels
    monkeypatch.setattr(fftproduct, "_channels",
                        lambda a, b, N: calls.append(a.shape[-2]) or orig(a, b, N))
    orig_scaled = fftmod.causal.scaled_product
    monkeypatch.setattr(fftmod.causal, "scaled_product",
                        lambda *a: products.append((a[0].shape[2], a[1].shape[2], a[-1])) or orig_scaled(*a))
    results = {}
    for block in (1, 3, F):
        budget = block * per_feature
        assert fft_block_size(B, H, Lq, Lk, F, Dv, torch.float64, budget) == block
        calls.clear()
        products.clear()
        res = kernelized_num_den_fft(pq, pk, v, lc, causal=causal, memory_budget_bytes=budget)
        if causal and segments == "always":
            assert len(products) > 1
            for nq, nk, (fb, _) in products:  # each segment's own plan, within the budget
                assert fb == fft_block_size(B, H, nq, nk, F, Dv, torch.float64, budget)
                assert fb == 1 or fb * fftplan._bytes_per_feature(B, H, nq, nk, Dv, 8) <= budget
            assert block == F or max(fb for *_, (fb, _) in products) > block
            assert max(calls) == max(fb for *_, (fb, _) in products)
        else:
            n_products = len(calls) // math.ceil(F / block)
            assert n_products >= 1 and len(calls) == n_products * math.ceil(F / block)
            assert max(calls) == block  # the channels of `block` features at a time, never more
        widest = max(calls)
        calls.clear()
        results[block] = (res, _grads(res, [pq, pk, v, lc]))
        assert max(calls) == widest  # backward too
    for block in (1, 3):
        for a, b in zip(results[block][0] + results[block][1], results[F][0] + results[F][1]):
            assert_close(a, b)


@pytest.mark.parametrize("causal,segments", [(False, "never"), (True, "never"), (True, "always")],
                         ids=["full", "causal", "causal-segment-blocks"])
def test_a_feature_too_big_for_the_budget_goes_through_in_channel_parts(causal, segments, monkeypatch,
                                                                         small_leaves):
    """A budget below one feature's `Dv + 1` channels (what 1M tokens with B·H = 8 gives):
    one feature at a time, its channels in parts of the size that fits; output, gradients and
    the round-off estimate as with whole features (the certificates read it)."""
    monkeypatch.setattr(fftmod.causal, "SEGMENT_BLOCKS", segments)
    B, H, Lq, Lk, F, Dv = 2, 3, 40, 40, 4, 6
    C = Dv + 1
    pq, pk, v, _ = _inputs(B, H, Lq, Lk, F, Dv)
    lc = (-0.05 * torch.arange(-(Lq - 1), Lk).abs().double()).expand(H, -1).clone().requires_grad_()
    per_channel = fftplan._bytes_per_feature(B, H, Lq, Lk, Dv, 8) // C
    widths = []
    orig = fftproduct._channels
    monkeypatch.setattr(fftproduct, "_channels", lambda a, b, N: widths.append(a.shape[-2] * b.shape[-2])
                        or orig(a, b, N))
    errs, plans = [], []
    orig_scaled = fftproduct.scaled_product
    monkeypatch.setattr(fftmod.causal if causal else fftmod, "scaled_product",
                        lambda *a: plans.append((a[0].shape[2], a[1].shape[2], a[-1]))
                        or errs.append(r := orig_scaled(*a)) or r)
    res = {}
    for cb in (3, C):
        budget = cb * per_channel
        assert fftplan.fft_channel_block(B, H, Lq, Lk, Dv, torch.float64, budget) == cb
        widths.clear()
        errs.clear()
        plans.clear()
        out = kernelized_num_den_fft(pq, pk, v, lc, causal=causal, memory_budget_bytes=budget)
        if segments == "always":  # each segment its own plan: the longest still in parts, shorter ones maybe whole
            for nq, nk, (_, c) in plans:
                assert c == fftplan.fft_channel_block(B, H, nq, nk, Dv, torch.float64, budget)
            assert cb == C or min(c for *_, (_, c) in plans) < C
        else:
            assert max(widths) == cb  # never a whole feature's 7 channels when 3 fit
        res[cb] = (out, _grads(out, [pq, pk, v, lc]), [e[1] for e in errs])
    for a, b in zip(res[3][0] + res[3][1], res[C][0] + res[C][1]):
        assert_close(a, b)
    for a, b in zip(res[3][2], res[C][2]):
        assert_close(a, b)


def test_channel_parts_at_a_million_tokens():
    """The default budget at L = 1M, B·H = 8, Dv = 64 (fp32): one feature's channels need
    ~35 GB of temporaries, one channel 0.54 GB (just over 512 MiB: one at a time), and the
    estimated peak stays under issue 12's 40 GiB (it was 50 GB with whole features)."""
    L = 1 << 20
    per_feature = fftplan._bytes_per_feature(1, 8, L, L, 64, 4)
    assert per_feature > 30e9 and fftplan.fft_channel_block(1, 8, L, L, 64, torch.float32) == 1
    assert fftplan.fft_channel_block(1, 8, 4096, 4096, 64, torch.float32) == 65
    _, peak = estimate_fft_cost(1, 8, L, L, 32, 64, torch.float32)
    assert peak < 40 * 2 ** 30
    with pytest.raises(ValueError, match="one feature at a time"):
        fftproduct._blocks(8, 65, (2, 10))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_minus_inf_coefficients_and_a_dead_head(causal):
    B, H, Lq, Lk, F, Dv = 2, 3, 150, 140, 8, 5
    pq, pk, v, lc = _inputs(B, H, Lq, Lk, F, Dv, grad=False)
    lc[0] = float("-inf")  # head 0 sees no key at all: den 0, out 0
    lc[1, ::2] = float("-inf")
    lc[2, : Lq // 2] = float("-inf")  # head 2: the first query rows see no key
    params = [t.requires_grad_() for t in (pq, pk, v, lc)]
    kw = dict(causal=causal, q_offset=3, key_padding_mask=_padding(B, Lk))
    got = kernelized_num_den_fft(*params, **kw)
    want = kernelized_num_den_naive(*params, **kw)
    num, den, ls = got
    assert all(torch.isfinite(t).all() for t in got)
    assert bool((den[:, 0] == 0).all()) and bool((num[:, 0] == 0).all())
    for a, b in zip(got, want):
        assert_close(a, b)
    out = safe_divide(num, den)
    assert torch.isfinite(out).all() and bool((out[:, 0] == 0).all())
    grads = torch.autograd.grad(out.square().sum() + num.sum() + den.sum(), params)
    assert all(torch.isfinite(g).all() for g in grads)
    ref = torch.autograd.grad((lambda n, d: safe_divide(n, d).square().sum() + n.sum() + d.sum())(*want[:2]), params)
    for a, b in zip(grads, ref):
        assert_close(a, b)


@pytest.mark.parametrize("rpe", [True, False], ids=["rpe", "norpe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_keys_padded_gives_den_zero(causal, rpe):
    pq, pk, v, lc = _inputs(2, 3, 40, 40, 8, 5)
    kpm = torch.zeros(2, 40, dtype=torch.bool)
    kpm[0] = True
    num, den, _ = kernelized_num_den_fft(pq, pk, v, lc if rpe else None, causal=causal, key_padding_mask=kpm)
    assert bool((den[0] == 0).all()) and bool((num[0] == 0).all()) and bool((den[1] > 0).all())
    grads = torch.autograd.grad(safe_divide(num, den).sum(), [pq, pk, v] + ([lc] if rpe else []))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_low_precision_against_float64(dtype, causal):
    B, H, Lq, Lk, F, Dv = 2, 3, 257, 257, 8, 5
    p64 = _inputs(B, H, Lq, Lk, F, Dv, lc_scale=0.5)
    kw = dict(causal=causal, key_padding_mask=_padding(B, Lk))

    def outputs(fn, params):
        num, den = _true(fn(*params, **kw))
        out = safe_divide(num, den)
        return [out, den / den.detach().abs().amax()] + list(torch.autograd.grad(out.square().sum(), params))

    low = [t.detach().to(dtype).requires_grad_() for t in p64]
    ref = outputs(kernelized_num_den_naive, p64)
    naive = outputs(kernelized_num_den_naive, low)
    fast_res = kernelized_num_den_fft(*low, **kw)
    assert all(t.dtype == dtype for t in fast_res)  # FFTs in float32, results cast back
    fast = outputs(kernelized_num_den_fft, low)
    for name, f, n, r in zip(("out", "den", "phi_q", "phi_k", "v", "log_coeff"), fast, naive, ref):
        assert_lowp_close(f, n, r, msg=name)


@pytest.mark.parametrize("rpe", [True, False], ids=["rpe", "norpe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_tiny(causal, rpe, small_leaves):
    pq, pk, v, lc = _inputs(2, 2, 7, 6, 2, 2, lc_scale=1.0)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 2] = True
    params = (pq, pk, v, lc) if rpe else (pq, pk, v)

    def f(*t):
        lc_ = t[3] if rpe else None
        return _true(kernelized_num_den_fft(*t[:3], lc_, causal=causal, q_offset=1, key_padding_mask=kpm,
                                            memory_budget_bytes=1))

    assert torch.autograd.gradcheck(f, params, fast_mode=True)


@pytest.mark.parametrize("block", [1, 2], ids=["block1", "block2"])
@pytest.mark.parametrize("Lq,Lk", [(5, 3), (3, 5), (1, 1)], ids=["Lq5-Lk3", "Lq3-Lk5", "Lq1-Lk1"])
def test_gradcheck_blocked_function(Lq, Lk, block):
    """The custom autograd function's own backward (recomputed per block, transposed Toeplitz)."""
    g = torch.Generator().manual_seed(0)
    pq = torch.rand(1, 2, Lq, 3, generator=g, dtype=torch.float64, requires_grad=True)
    pk = torch.rand(1, 2, Lk, 3, generator=g, dtype=torch.float64, requires_grad=True)
    vv = torch.randn(1, 2, Lk, 2, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.rand(2, Lq + Lk - 1, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: fftproduct._FFTNumDen.apply(*t, block)[0], (pq, pk, vv, c), fast_mode=True)


NO_LEAK = [(300, 300, 0, torch.float64, True), (300, 300, 0, torch.float32, True),
           (100, 300, 200, torch.float32, True), (300, 300, 0, torch.float32, False)]


@pytest.mark.parametrize("Lq,Lk,off,dtype,rpe", NO_LEAK,
                         ids=[f"Lq{a}-Lk{b}-off{c}-{str(d)[6:]}-{'rpe' if e else 'norpe'}" for a, b, c, d, e in NO_LEAK])
def test_causal_never_reads_the_future(Lq, Lk, off, dtype, rpe):
    """Changing keys/values after position i leaves rows <= i bitwise unchanged, and the
    gradient of rows <= i with respect to later keys/values is exactly zero."""
    pq, pk, v, lc = (t.detach() for t in _inputs(1, 3, Lq, Lk, 8, 5, dtype=dtype))
    lc = lc if rpe else None
    base = kernelized_num_den_fft(pq, pk, v, lc, causal=True, q_offset=off)
    for i in (0, 77, Lq - 2):
        cut = off + i + 1  # first key after query i
        pk2, v2 = pk.clone(), v.clone()
        pk2[:, :, cut:] *= 1e3
        v2[:, :, cut:] = 1e4 * torch.randn_like(v2[:, :, cut:])
        got = kernelized_num_den_fft(pq, pk2, v2, lc, causal=True, q_offset=off)
        for a, b in zip(got[:2], base[:2]):
            assert torch.equal(a[:, :, : i + 1], b[:, :, : i + 1])
        pk3, v3 = pk.clone().requires_grad_(), v.clone().requires_grad_()
        num, den, _ = kernelized_num_den_fft(pq, pk3, v3, lc, causal=True, q_offset=off)
        gk, gv = torch.autograd.grad(num[:, :, : i + 1].sum() + den[:, :, : i + 1].sum(), [pk3, v3])
        assert bool((gk[:, :, cut:] == 0).all()) and bool((gv[:, :, cut:] == 0).all())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_saved_for_backward_grows_with_f_plus_dv_not_f_times_dv(causal):
    """Backward memory stays O(L·(F + Dv)): no block's `[L, f·(Dv+1)]` channels are saved."""

    def saved_bytes(F, Dv):
        pq, pk, v, lc = _inputs(1, 2, 1024, 1024, F, Dv, lc_scale=0.0)
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kernelized_num_den_fft(pq, pk, v, lc, causal=causal, memory_budget_bytes=1 << 40)
        return sum(storages.values())

    small, big = saved_bytes(8, 8), saved_bytes(64, 64)
    # F·(Dv+1) grows 58x, F + Dv 8x
    assert big < 8.5 * small


def test_block_size_and_cost_estimates():
    assert fft_block_size(1, 1, 65536, 65536, 64, 64, memory_budget_bytes=1) == 1
    assert fft_block_size(1, 1, 64, 64, 64, 64) == 64
    sizes = [fft_block_size(1, 1, 4096, 4096, 64, 64, memory_budget_bytes=b << 20) for b in (16, 64, 256, 1024)]
    assert sizes == sorted(sizes) and 1 <= sizes[0] < sizes[-1] <= 64
    f1, m1 = estimate_fft_cost(1, 1, 4096, 4096, 64, 64, torch.float32)
    f2, m2 = estimate_fft_cost(1, 1, 65536, 65536, 64, 64, torch.float32)
    assert 0 < f1 < f2 and 0 < m1 and 0 < m2
    assert m1 < 2 << 30 and m2 < 2 << 30  # the default budget keeps 64k tokens (one head) under 2 GiB
    # float64 doubles the bytes per feature: half as many features fit the same budget
    assert fft_block_size(1, 1, 4096, 4096, 64, 64, torch.float64, 256 << 20) < sizes[2]


MIXED = [("alibi8", False, 1500, 1500), ("alibi8", True, 1500, 1500), ("power_mix", True, 700, 1900),
         ("power_mix", False, 900, 1400)]


@pytest.mark.parametrize("kernel", ["elu", "relu"])
@pytest.mark.parametrize("name,causal,Lq,Lk", MIXED, ids=[f"{n}-{'causal' if c else 'full'}-Lq{a}-Lk{b}"
                                                          for n, c, a, b in MIXED])
def test_heads_with_different_decays_and_key_windows(name, causal, Lq, Lk, kernel):
    """Heads that split rows differently are blocked one at a time, and each row block reads
    only the keys within e^-60 of its rows' scale: every row stays within 1e-4 (float32) of
    float64 dense, with relu features (zero products) sending rows to the exact recompute."""
    import fastrpe as fr
    from fastrpe import positions as P

    if name == "alibi8":
        pos = P.ALiBi(8)  # slopes 1/2 .. 1/256: the steep heads need a few keys, the flat ones all
    else:
        pos = P.KerplePower(4, r1=[2.0, 0.5, 0.05, 0.02], p=[1.9, 1.0, 0.5, 1.5])
    H = pos.num_heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, Lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, H, Lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        ref = fr.attention(q, k, v, kernel=kernel, position=pos.double(), causal=causal, backend="dense")
        out = fr.attention(q.float(), k.float(), v.float(), kernel=kernel, position=pos.float(), causal=causal,
                           backend="fft")
        dense32 = fr.attention(q.float(), k.float(), v.float(), kernel=kernel, position=pos.float(), causal=causal,
                               backend="dense")
    # a row whose weight is below float32's underflow floor (tiny/eps of its own scale) is
    # empty in float32 by convention (relu rows whose near keys all give 0): fft agrees with
    # float32 dense on exactly which rows those are, and every other row is accurate
    empty = dense32.norm(dim=-1) == 0
    assert torch.equal(out.norm(dim=-1) == 0, empty)
    rel = (out.double() - ref).norm(dim=-1)[~empty] / ref.norm(dim=-1)[~empty]
    assert rel.max() < 1e-4, rel.max()


def test_causal_leaf_follows_the_memory_budget():
    from fastrpe.ops.linear.fft import CAUSAL_LEAF, CAUSAL_LEAF_MAX, causal_leaf

    assert causal_leaf(1, 2) == CAUSAL_LEAF_MAX  # 4·2·4096²·4 B = 512 MiB: fits the default budget
    assert causal_leaf(4, 8) == 1024
    assert causal_leaf(64, 16, torch.float64) == CAUSAL_LEAF  # never below the smallest leaf
    budget = 4 * 512 ** 2 * 4
    small = causal_leaf(1, 1, memory_budget_bytes=budget)  # the largest leaf whose 4 copies fit
    assert small == 512 and 4 * small ** 2 * 4 <= budget < 4 * (2 * small) ** 2 * 4


def test_causal_saved_bytes_do_not_grow_with_the_leaf():
    """Leaves are recomputed in backward: what autograd keeps is O(L·(F + Dv)) whatever the
    leaf size (it was O(L·leaf): every leaf's dense weights, 3.3 GiB at 64k tokens)."""

    def saved_bytes(leaf, L=2048):
        pq, pk, v, lc = _inputs(1, 1, L, L, 4, 4, lc_scale=0.0)
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        orig = fftmod.causal_leaf
        fftmod.causal_leaf = lambda *a, **k: leaf
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                kernelized_num_den_fft(pq, pk, v, lc, causal=True)
        finally:
            fftmod.causal_leaf = orig
        return sum(storages.values())

    small, big = saved_bytes(64), saved_bytes(1024)
    dense_leaves = 2048 * 1024 * 8  # the [L, leaf] float64 weights that are no longer kept
    assert big < 2 * small and big < dense_leaves / 4, (small, big)
