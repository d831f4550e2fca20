"""The causal FFT path's blocked product (`ops/linear/fft/blocked.py`): the pairs across chunks
by one FFT per chunk and a lower-triangular sum per frequency, against the dense formula.

The reference here is Luo et al.'s sum written out, `Σ_m φq_im Σ_j c(i-j) φk_jm [v_j, 1]` over
the keys in an earlier chunk than the query's (or over all earlier keys, for the whole causal
path), with its own coefficients gathered from the table: no code shared with the path under
test.
"""
from __future__ import annotations

import pytest
import torch

import fastrpe.ops.linear.fft as fftmod
from fastrpe.ops.common import causal_offset_mask
from fastrpe.ops.linear.fft import kernelized_num_den_fft
from fastrpe.ops.linear.fft.blocked import blocked_product, chunk_layout
from fastrpe.ops.linear.fft.plan import BLOCKED_CHUNKS, BLOCKED_MIN_CHUNKS, Shape, blocked_block, causal_chunk
from fastrpe.ops.linear.fft.scale import row_scale
from fastrpe.testing import assert_close


def _inputs(B, H, Lq, Lk, F, Dv, off, *, seed=0, dtype=torch.float64, lc_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64)
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    r = torch.arange(-(Lq - 1), Lk, dtype=torch.float64)
    lc = -0.05 * r.abs() + lc_scale * torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)
    lc = lc.masked_fill(~causal_offset_mask(Lq, Lk, off), float("-inf"))
    return [t.to(dtype).requires_grad_() for t in (pq, pk, vv, lc)]


def _dense_across(pq, pk, vv, lc, off, T):
    """The pairs (query i, key j) with j's chunk of T positions before i's, in true units:
    query i sits at position off + i, its coefficient for key j is `exp(lc[Lq-1-i+j])`."""
    Lq, Lk = pq.shape[2], pk.shape[2]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    c = torch.exp(lc[:, Lq - 1 - i + j])  # (H, Lq, Lk)
    across = (j // T) < ((i + off) // T)
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * torch.where(across, c, torch.zeros_like(c))
    return a @ vv


# (B, H, Lq, Lk, q_offset, F, Dv, T)
CASES = [
    (1, 2, 40, 40, 0, 3, 4, 8),
    (2, 3, 37, 60, 23, 5, 3, 8),  # queries after cached keys, a chunk boundary inside the first
    (1, 1, 1, 100, 99, 2, 2, 16),  # one query after 99 keys
    (2, 2, 70, 50, 0, 4, 3, 8),  # more queries than keys
    (1, 2, 64, 64, 0, 3, 2, 16),  # whole chunks
    (1, 2, 63, 63, 0, 3, 5, 4),  # 16 chunks, the last one short
]


def _id(c):
    return "B{}-H{}-Lq{}-Lk{}-off{}-F{}-Dv{}-T{}".format(*c)


@pytest.mark.parametrize("block", [(1, 2), 2, 64], ids=["channel-parts", "two-features", "whole"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_blocked_product_matches_the_dense_pairs_across_chunks(case, block):
    B, H, Lq, Lk, off, F, Dv, T = case
    pq, pk, vv, lc = _inputs(B, H, Lq, Lk, F, Dv, off)
    scale = row_scale(lc, Lq, Lk)
    y, err = blocked_product(pq, pk, vv, lc, scale, off, T, block)
    want = _dense_across(pq, pk, vv, lc, off, T) * torch.exp(-scale)[None, :, :, None]
    assert_close(y, want)
    assert (err >= 0).all() and not err.requires_grad
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    got = torch.autograd.grad((y * g).sum(), [pq, pk, vv, lc])
    exp = torch.autograd.grad((want * g).sum(), [pq, pk, vv, lc])
    for name, a, b in zip(("phi_q", "phi_k", "vv", "log_coeff"), got, exp):
        assert_close(a, b, msg=f"grad {name}")


@pytest.mark.parametrize("block", [(1, 2), 64], ids=["channel-parts", "whole"])
@pytest.mark.parametrize("case", CASES[1:2] + CASES[-1:], ids=_id)
def test_lag_matrices_built_a_slice_of_frequencies_at_a_time_give_the_same_product(case, block, monkeypatch):
    """Matrices over `MATRIX_BYTES` are built per slice of frequencies for every block of
    channels, and the coefficients' gradient is then summed into the lags block by block (with
    the matrices whole, the blocks' pair correlations add up first): the same results."""
    import fastrpe.ops.linear.fft.blocked as blocked_mod

    B, H, Lq, Lk, off, F, Dv, T = case
    pq, pk, vv, lc = _inputs(B, H, Lq, Lk, F, Dv, off)
    scale = row_scale(lc, Lq, Lk)
    g = torch.randn(B, H, Lq, Dv + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run():
        y, _ = blocked_product(pq, pk, vv, lc, scale, off, T, block)
        return (y, *torch.autograd.grad((y * g).sum(), [pq, pk, vv, lc]))

    whole = run()
    monkeypatch.setattr(blocked_mod, "MATRIX_BYTES", 1)  # one frequency a slice
    for name, a, b in zip(("y", "phi_q", "phi_k", "vv", "log_coeff"), run(), whole):
        assert_close(a, b, msg=name)


def test_chunk_layout_names_the_chunks_with_pairs_across():
    assert chunk_layout(40, 40, 0, 8) == (0, 5, 4)  # query chunks 0..4, keys seen across in 0..3
    assert chunk_layout(1, 100, 99, 16) == (6, 1, 6)  # the one query in chunk 6 sees chunks 0..5
    assert chunk_layout(8, 8, 0, 8)[2] == 0  # one chunk: no pair across
    assert chunk_layout(37, 60, 23, 8) == (2, 6, 7)  # keys past the last query are not needed


#: the GPU bench's problem, one head (B, H, F, Dv)
ONE_HEAD = Shape(1, 1, 32, 64)


def test_causal_chunk_keeps_the_recursion_below_its_minimum():
    assert causal_chunk(2048 * (BLOCKED_MIN_CHUNKS - 1), 0, 2048, ONE_HEAD) is None
    assert causal_chunk(2048 * BLOCKED_MIN_CHUNKS, 0, 2048, ONE_HEAD) == 2048
    assert causal_chunk(2048 * 32, 0, 2048, ONE_HEAD) == 2048  # as many chunks as leaves, while few
    assert causal_chunk(100, 0, 4, ONE_HEAD) == 4


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("H", [1, 8])
@pytest.mark.parametrize("n", [8, 32, 64, 128, 512])
def test_causal_chunk_takes_the_cheapest_of_the_chunk_counts_it_may_take(n, H, kernels):
    """Among the power-of-two multiples of the leaf that make BLOCKED_MIN_CHUNKS to
    BLOCKED_CHUNKS chunks, and the recursion, the pick has the least `causal_levels`, with the
    lag kernels' model or the torch path's."""
    from fastrpe.ops.linear.fft.plan import causal_levels

    L, shape = 2048 * n, Shape(1, H, 32, 64)
    T = causal_chunk(L, 0, 2048, shape, kernels)
    options = [None] + [2048 << s for s in range(10) if BLOCKED_MIN_CHUNKS <= -(-L // (2048 << s)) <= BLOCKED_CHUNKS]
    assert T in options
    cost = [causal_levels(L, 0, 2048, t, shape, kernels) for t in options]
    assert causal_levels(L, 0, 2048, T, shape, kernels) == min(cost)


def test_with_many_heads_long_sequences_take_the_recursion():
    """B = 1, H = 8, F = 32, Dv = 64, the default budget: from 262,144 tokens on a block of the
    blocked product holds 1 or 2 channels, and the lag matrices it reads for each would cost
    dozens of levels (`plan.matrix_levels`): the recursion. At 65,536 tokens, 32 chunks."""
    from fastrpe.ops.linear.fft.plan import causal_leaf, matrix_levels

    bench = Shape(1, 8, 32, 64)
    leaf = causal_leaf(1, 8)
    assert causal_chunk(65536, 0, leaf, bench) == 2048
    assert causal_chunk(262144, 0, leaf, bench) is None and causal_chunk(1 << 20, 0, leaf, bench) is None
    assert matrix_levels(1 << 20, 0, (1 << 20) // 64, bench) > 50  # what 64 chunks would have moved


def test_with_the_lag_kernels_long_sequences_take_the_most_chunks():
    """The kernels build no lag matrices (`plan.KERNEL_BLOCKED_LEVELS`): at the GPU bench's
    problem, an H200's budget, 64 chunks at 262,144 and 1,048,576 tokens (the recursion and 8
    chunks without them), 32 of the leaf at 65,536 as before (by the byte count,
    results/fft_blocked_kernel_chunks.json: 64 chunks moved the least at each)."""
    from fastrpe.ops.linear.fft.plan import budget_for_memory, causal_leaf

    bench = Shape(1, 8, 32, 64, torch.float32, budget_for_memory(141 * 10**9))
    leaf = causal_leaf(1, 8, torch.float32, bench.budget)
    assert leaf == 2048
    assert causal_chunk(65536, 0, leaf, bench, kernels=True) == 2048
    assert causal_chunk(262144, 0, leaf, bench, kernels=True) == 262144 // BLOCKED_CHUNKS
    assert causal_chunk(1 << 20, 0, leaf, bench, kernels=True) == (1 << 20) // BLOCKED_CHUNKS
    assert causal_chunk(2048 * (BLOCKED_MIN_CHUNKS - 1), 0, 2048, bench, kernels=True) is None


def test_the_chunk_pick_knows_whether_the_kernels_take_the_call():
    """`causal.kernels_on`: only where `blocked.KERNEL` routes the device and the kernels take
    the FFT's dtype (float32 for 16-bit inputs; not float64)."""
    from fastrpe.ops.linear.fft import blocked
    from fastrpe.ops.linear.fft.causal import kernels_on
    from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason

    cpu = torch.device("cpu")
    assert not kernels_on(cpu, Shape(1, 8, 32, 64, torch.float32))  # "never" by default
    if triton_unavailable_reason(cpu) is not None:
        pytest.skip(str(triton_unavailable_reason(cpu)))
    with blocked.use_kernel("always"):
        assert kernels_on(cpu, Shape(1, 8, 32, 64, torch.float32))
        assert kernels_on(cpu, Shape(1, 8, 32, 64, torch.bfloat16))  # its FFTs run in float32
        assert not kernels_on(cpu, Shape(1, 8, 32, 64, torch.float64))
    with blocked.use_kernel("cuda"):
        assert not kernels_on(cpu, Shape(1, 8, 32, 64, torch.float32))


def test_blocked_block_follows_the_budget():
    per_channel = 1 * 2 * 8 * 12 * (5 + 4) * 8  # B, H, float64, 12 reals, nb + na chunks, T
    assert blocked_block(1, 2, 5, 4, 8, 6, 4, torch.float64, 5 * 2 * per_channel) == (2, 5)
    assert blocked_block(1, 2, 5, 4, 8, 6, 4, torch.float64, 3 * per_channel) == (1, 3)
    assert blocked_block(1, 2, 5, 4, 8, 6, 4, torch.float64, 1) == (1, 1)


@pytest.fixture
def blocked(monkeypatch):
    """The causal path through the blocked product on the CPU, with 4-position leaves, so that
    short sequences cut into many chunks."""
    monkeypatch.setattr(fftmod.causal, "BLOCKED", "always")
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 4)


# (B, H, Lq, Lk, q_offset, F, Dv)
PATH_CASES = [(2, 3, 63, 100, 37, 8, 5), (2, 3, 100, 63, 0, 8, 5), (1, 3, 63, 63, 0, 8, 60), (1, 2, 1, 100, 99, 4, 3),
              (1, 2, 257, 257, 0, 6, 7)]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: "B{}-H{}-Lq{}-Lk{}-off{}-F{}-Dv{}".format(*c))
def test_the_causal_path_through_the_blocked_product_matches_the_formula(case, blocked):
    B, H, Lq, Lk, off, F, Dv = case
    pq, pk, vv, lc = _inputs(B, H, Lq, Lk, F, Dv, off)
    v = vv[..., :-1].detach().clone().requires_grad_()
    num, den, ls = kernelized_num_den_fft(pq, pk, v, lc, causal=True, q_offset=off)
    # the formula over every key at or before the query, in true units
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    c = torch.exp(lc[:, Lq - 1 - i + j])  # masked entries are exp(-inf) = 0
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * c
    want_num, want_den = a @ v, a.sum(-1)
    got_num, got_den = num * ls.exp()[None, :, :, None], den * ls.exp()[None]
    assert_close(got_num, want_num)
    assert_close(got_den, want_den)
    gen = torch.Generator().manual_seed(2)
    wn, wd = torch.randn(num.shape, generator=gen, dtype=num.dtype), torch.randn(den.shape, generator=gen, dtype=den.dtype)
    got = torch.autograd.grad((got_num * wn).sum() + (got_den * wd).sum(), [pq, pk, v, lc])
    exp = torch.autograd.grad((want_num * wn).sum() + (want_den * wd).sum(), [pq, pk, v, lc])
    for name, x, y in zip(("phi_q", "phi_k", "v", "log_coeff"), got, exp):
        assert_close(x, y, msg=f"grad {name}")


def test_no_future_key_reaches_a_past_query_even_through_round_off(blocked):
    """Keys after position 40 changed by orders of magnitude: every output up to 40 is bitwise
    the same (float32: an FFT over them would leak their round-off), and their gradient is
    exactly zero."""
    B, H, L, F, Dv = 1, 2, 100, 6, 5
    pq, pk, vv, lc = (t.detach().float() for t in _inputs(B, H, L, L, F, Dv, 0))
    v = vv[..., :-1].contiguous()
    base = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    pk2, v2 = pk.clone(), v.clone()
    pk2[:, :, 41:] *= 1e3
    v2[:, :, 41:] = 1e4 * torch.randn_like(v2[:, :, 41:])
    got = kernelized_num_den_fft(pq, pk2, v2, lc, causal=True)
    for a, b in zip(got[:2], base[:2]):
        assert torch.equal(a[:, :, :41], b[:, :, :41])
    v2.requires_grad_()
    num, den, _ = kernelized_num_den_fft(pq, pk2, v2, lc, causal=True)
    (g,) = torch.autograd.grad(num[:, :, :41].sum() + den[:, :, :41].sum(), [v2])
    assert torch.count_nonzero(g[:, :, 41:]) == 0


def test_float32_matches_float64(blocked):
    B, H, L, F, Dv = 1, 2, 160, 6, 5
    pq, pk, vv, lc = (t.detach() for t in _inputs(B, H, L, L, F, Dv, 0, lc_scale=1.0))
    v = vv[..., :-1]
    want = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    got = kernelized_num_den_fft(pq.float(), pk.float(), v.float(), lc.float(), causal=True)
    for a, b in zip(got[:2], want[:2]):
        assert ((a.double() - b).abs() / b.abs().clamp_min(1e-6)).max() < 1e-4


def test_the_cost_models_levels_follow_the_path():
    """`plan.causal_levels`, what `auto`'s cost of the causal FFT path counts above the leaves:
    the recursion's halvings, or the blocked product's worth (fewer from 8 chunks on)."""
    from fastrpe.ops.linear.fft.plan import causal_levels

    def blocked(n):  # the levels where the blocked product runs, at 2,048 * n tokens
        return causal_levels(2048 * n, 0, 2048, causal_chunk(2048 * n, 0, 2048, ONE_HEAD), ONE_HEAD)

    assert [causal_levels(2048 * n, 0, 2048, None, ONE_HEAD) for n in (1, 2, 8, 64)] == [0.0, 1.0, 3.0, 6.0]
    assert blocked(4) == 2.0  # 4 chunks: the recursion
    for n in (8, 64, 512):
        assert blocked(n) < causal_levels(2048 * n, 0, 2048, None, ONE_HEAD)


def test_a_lag_without_coefficients_leaves_the_chunks_units_alone():
    """A table that is -inf beyond 20 positions (a local window), whose kept coefficients are
    far below 1: the lags that see none do not set a chunk's units (their kernel is 0), so
    nothing is scaled by exp(-60) and the result matches the formula."""
    B, H, L, F, Dv, T = 1, 2, 64, 3, 4, 8
    pq, pk, vv, lc = _inputs(B, H, L, L, F, Dv, 0, lc_scale=0.0)
    r = torch.arange(-(L - 1), L)
    lc = torch.where((r <= 0) & (r > -20), -60.0 + 0.1 * r, float("-inf")).double()[None].repeat(H, 1)
    lc.requires_grad_()
    scale = row_scale(lc, L, L)
    want = _dense_across(pq, pk, vv, lc, 0, T) * torch.exp(-scale)[None, :, :, None]
    # float32: a unit 60 nats off its rows would pass `fft.scale`'s 40-nat clamp
    y, _ = blocked_product(*(t.detach().float() for t in (pq, pk, vv, lc, scale)), 0, T, 2)
    assert ((y.double() - want).abs().max() / want.abs().max()) < 1e-5
