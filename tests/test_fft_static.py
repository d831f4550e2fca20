"""The FFT path's static schedule (`ops/linear/fft/`): no host synchronization in the hot
path, the fixed-capacity exact recomputation, and the round-off certificate's margin.

Forward and backward run with every tensor-to-host conversion (`item`, `bool`, `float`,
`int`, `index`, `tolist`, `numpy`, `nonzero`) raising: on a GPU each of them drains the
stream. Input validation done once per call by the API lies outside the op and is not run.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fastrpe.ops.linear.fft as fftmod
from fastrpe.ops import common
from fastrpe.ops.linear.fft import certify, kernelized_num_den_fft
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.testing import assert_close

SYNCS = ["item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "nonzero"]


@pytest.fixture
def no_host_sync(monkeypatch):
    """Every Tensor -> host conversion raises while the fixture is active."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host synchronization: Tensor.{name}")
        return raiser

    def patch():
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, forbid(name))
        monkeypatch.setattr(torch, "nonzero", forbid("nonzero"))

    return patch


def _inputs(B, H, Lq, Lk, F=6, Dv=5, dtype=torch.float64, seed=0, lc_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64)
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)
    r = torch.arange(-(Lq - 1), Lk, dtype=torch.float64)
    lc = -0.1 * r.abs() + lc_scale * torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (pq, pk, v, lc)]


def _padding(B, Lk):
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[-1, ::3] = True
    return kpm


def _loss(res, seed=1):
    g = torch.Generator().manual_seed(seed)
    num, den, ls = res
    num, den = num * ls.exp()[None, :, :, None], den * ls.exp()[None]
    return (num * torch.randn(num.shape, generator=g, dtype=num.dtype)).sum() + \
        (den * torch.randn(den.shape, generator=g, dtype=den.dtype)).sum()


SHAPES = [(150, 150, 0), (90, 200, 110), (200, 90, 0), (70, 130, 5)]

#: not causal, causal by the recursion (the CPU's default) and causal through the blocked
#: product (the GPU's: `fft.causal.BLOCKED`; with the tests' short leaves, many chunks)
MODES = ["full", "causal", "causal-blocked"]


def _mode(mode: str, monkeypatch) -> bool:
    """Sets the causal path for `mode` and returns whether it is causal."""
    monkeypatch.setattr(fftmod.causal, "BLOCKED", "always" if mode == "causal-blocked" else "never")
    return mode != "full"


@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Lq,Lk,off", SHAPES, ids=[f"Lq{a}-Lk{b}-off{c}" for a, b, c in SHAPES])
def test_forward_and_backward_without_host_sync(Lq, Lk, off, mode, padding, no_host_sync, monkeypatch):
    causal = _mode(mode, monkeypatch)
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 16)  # several FFT levels, or 8+ chunks
    orig = fftmod.recompute_capacity
    monkeypatch.setattr(fftmod, "recompute_capacity", lambda *a, **k: (orig(*a, **k)[0], 4))  # several chunks
    pq, pk, v, lc = _inputs(2, 3, Lq, Lk, dtype=torch.float32)
    kw = dict(causal=causal, q_offset=off, key_padding_mask=_padding(2, Lk) if padding else None)
    no_host_sync()
    with fftmod.static_schedule():  # eager mode may sync once to recompute past the capacity
        res = kernelized_num_den_fft(pq, pk, v, lc, **kw)
        grads = torch.autograd.grad(_loss(res), [pq, pk, v, lc])
    monkeypatch.undo()
    want = kernelized_num_den_naive(pq, pk, v, lc, **kw)
    assert all(torch.isfinite(t).all() for t in res + grads)
    for a, b in zip(res, want):
        assert_close(a.double(), b.double(), dtype=torch.float32)


def test_sync_guard_catches_a_sync(no_host_sync):
    """The guard itself: a hot path that asks for a value on the host fails."""
    x = torch.ones(3)
    no_host_sync()
    with pytest.raises(AssertionError, match="host synchronization"):
        float(x.sum())
    with pytest.raises(AssertionError, match="host synchronization"):
        if x.any():
            pass


@pytest.fixture
def nothing_certified(monkeypatch):
    """No FFT row passes its certificate: every row goes to the exact recomputation."""
    monkeypatch.setattr(certify, "ROW_RTOL", {torch.float32: 0.0, torch.float64: 0.0})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Lq,Lk,off", SHAPES, ids=[f"Lq{a}-Lk{b}-off{c}" for a, b, c in SHAPES])
def test_recomputed_rows_match_naive_with_gradients(Lq, Lk, off, mode, nothing_certified, monkeypatch):
    """With every row recomputed (capacity Lq, 7 rows at a time), forward and every gradient
    equal the naive op: the gather / dense / scatter path is exact on its own."""
    causal = _mode(mode, monkeypatch)
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 16)
    monkeypatch.setattr(fftmod, "recompute_capacity", lambda *a, **k: (Lq, 7))
    pq, pk, v, lc = _inputs(2, 3, Lq, Lk)
    kw = dict(causal=causal, q_offset=off, key_padding_mask=_padding(2, Lk))
    got, want = kernelized_num_den_fft(pq, pk, v, lc, **kw), kernelized_num_den_naive(pq, pk, v, lc, **kw)
    for a, b in zip(got, want):
        assert_close(a, b)
    for a, b in zip(torch.autograd.grad(_loss(got), [pq, pk, v, lc]), torch.autograd.grad(_loss(want), [pq, pk, v, lc])):
        assert_close(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_rows_beyond_the_capacity_are_nan_not_wrong(mode, nothing_certified, monkeypatch):
    """With the sync-free schedule, failing rows beyond the capacity are NaN (loud), never a
    silently inaccurate value; every other row is exact."""
    causal = _mode(mode, monkeypatch)
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 8)
    monkeypatch.setattr(fftmod, "recompute_capacity", lambda *a, **k: (5, 2))
    pq, pk, v, lc = (t.detach() for t in _inputs(2, 3, 60, 60))
    with fftmod.static_schedule():
        got = kernelized_num_den_fft(pq, pk, v, lc, causal=causal)
    want = kernelized_num_den_naive(pq, pk, v, lc, causal=causal)
    lost = got[1].isnan()  # (B, H, Lq)
    assert bool(lost.any()) and bool((lost.sum(-1) <= 60 - 5).all())
    assert torch.equal(got[0].isnan().any(-1), lost) and torch.equal(got[0].isnan().all(-1), lost)
    for a, b in zip(got[:2], want[:2]):
        assert_close(a[~lost], b[~lost])


@pytest.mark.parametrize("F,Dv", [(32, 64), (8, 5), (256, 128)])
def test_recompute_capacity_stops_growing_with_the_length(F, Dv):
    """The fixed capacity is one row in 128 while that costs at most RECOMPUTE_SHARE of the
    product, and no more beyond: the rows' bytes stay within that share of the FFT's at any
    length (the path stays O(L log L); one row in 128 alone is O(L²)). The minimum and the
    queries outside the keys still get room."""
    from fastrpe.ops.linear.fft import plan

    caps = {}
    for L in (1024, 4096, 65536, 262144, 1 << 20, 1 << 22):
        rows = plan.recompute_capacity(1, 8, L, L, F, Dv)[0]
        share = plan.recompute_share_rows(L, L, F, Dv)
        assert rows == max(plan.RECOMPUTE_MIN_ROWS, min(-(-L // plan.RECOMPUTE_FRACTION), share))
        if rows > plan.RECOMPUTE_MIN_ROWS:  # beyond the minimum, within the share
            fft_bytes = plan.FFT_BYTES_PER_CHANNEL * F * (Dv + 1) * plan.fft_length(2 * L - 1) / 2
            assert rows * L * plan.DENSE_ROW_BYTES_PER_KEY <= plan.RECOMPUTE_SHARE * fft_bytes
        caps[L] = rows
    capped = [L for L in caps if caps[L] < -(-L // plan.RECOMPUTE_FRACTION)]
    assert capped and len({caps[L] for L in capped}) == 1  # from some length on, the same at every length
    assert caps[1024] == plan.RECOMPUTE_MIN_ROWS
    # queries after every key (decoding past the cache) all get room, whatever the share
    assert plan.recompute_capacity(1, 8, 5000, 1 << 20, F, Dv, q_offset=1 << 20)[0] == 5000


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_eager_mode_recomputes_every_failing_row_with_gradients(causal, nothing_certified, monkeypatch):
    """Outside `static_schedule()`, rows beyond the capacity are recomputed too (one host sync):
    output and every gradient equal the naive op, no NaN."""
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 8)
    monkeypatch.setattr(fftmod, "recompute_capacity", lambda *a, **k: (5, 2))
    pq, pk, v, lc = _inputs(2, 3, 60, 47)
    kw = dict(causal=causal, key_padding_mask=_padding(2, 47))
    got, want = kernelized_num_den_fft(pq, pk, v, lc, **kw), kernelized_num_den_naive(pq, pk, v, lc, **kw)
    for a, b in zip(got, want):
        assert_close(a, b)
    for a, b in zip(torch.autograd.grad(_loss(got), [pq, pk, v, lc]), torch.autograd.grad(_loss(want), [pq, pk, v, lc])):
        assert_close(a, b)


def test_recomputation_is_causal(nothing_certified, monkeypatch):
    """Which rows are recomputed depends on earlier rows only: changing later keys leaves
    the recomputed early rows bitwise unchanged."""
    monkeypatch.setattr(fftmod, "recompute_capacity", lambda *a, **k: (40, 8))
    pq, pk, v, lc = (t.detach().float() for t in _inputs(1, 3, 100, 100))
    base = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    pk2, v2 = pk.clone(), v.clone()
    pk2[:, :, 30:] *= 1e3
    v2[:, :, 30:] = 1e4 * torch.randn_like(v2[:, :, 30:])
    got = kernelized_num_den_fft(pq, pk2, v2, lc, causal=True)
    for a, b in zip(got[:2], base[:2]):
        assert torch.equal(a[:, :, :30], b[:, :, :30])


COEFFS = ["flat", "decay", "sharp", "table30", "spike", "noise3"]


def _round_off_case(name: str, values: str, causal: bool = False, L: int = 2048, F: int = 8, Dv: int = 8):
    """`(pq, pk, vv, lc, scale)` in float64: coefficients from flat to a single spike and ±30
    noise (masked for the future where `causal`), signed or all-positive values."""
    from fastrpe.ops.linear.fft.scale import row_scale

    g = torch.Generator().manual_seed(3)
    r = torch.arange(-(L - 1), L, dtype=torch.float64)
    lc = {"flat": torch.zeros_like(r), "decay": -0.02 * r.abs(), "sharp": -2.0 * r.abs(),
          "table30": torch.rand(r.shape, generator=g, dtype=torch.float64) * 60 - 30,
          "spike": torch.where(r == 0, 0.0, -25.0).double(),
          "noise3": 3 * torch.randn(r.shape, generator=g, dtype=torch.float64)}[name][None].repeat(2, 1)
    if causal:
        lc = lc.masked_fill(~common.causal_offset_mask(L, L, 0), float("-inf"))
    pq = torch.rand(1, 2, L, F, generator=g, dtype=torch.float64)
    pk = torch.rand(1, 2, L, F, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, L, Dv, generator=g, dtype=torch.float64)
    v = v.abs() + 1 if values == "positive" else v
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    return pq, pk, vv, lc, row_scale(lc, L, L)


def _estimate_ratio(product, args) -> float:
    """The largest actual/estimated round-off of `product(pq, pk, vv, lc, scale, block)` in
    float32 against float64 (an entry estimated 0 must have no error)."""
    y64, _ = product(*args, 64)
    y32, err = product(*(t.float() for t in args), 3)
    actual = (y32.double() - y64).abs()
    assert torch.equal(actual[err == 0], torch.zeros_like(actual[err == 0]))
    return (actual / err.double()).nan_to_num(0.0).max().item()


@pytest.mark.parametrize("values", ["signed", "positive"])
@pytest.mark.parametrize("name", COEFFS)
def test_round_off_estimate_bounds_the_actual_error(name, values):
    """Every entry's estimated FFT round-off (float32) is at least 1.5x its actual error
    against the same product in float64, for coefficients from flat to a single spike and
    ±30 noise, with signed and all-positive values (coherent round-off)."""
    from fastrpe.ops.linear.fft.product import scaled_product

    ratio = _estimate_ratio(lambda pq, pk, vv, lc, scale, block: scaled_product(pq, pk, vv, lc, scale, block),
                            _round_off_case(name, values))
    assert ratio <= 1 / 1.5, ratio


@pytest.mark.parametrize("T", [32, 128, 512])
@pytest.mark.parametrize("values", ["signed", "positive"])
@pytest.mark.parametrize("name", COEFFS)
def test_blocked_round_off_estimate_bounds_the_actual_error(name, values, T):
    """The same for the causal blocked product (`fft/blocked.py`) over 4 to 64 chunks: its
    estimate adds the sum's and the pairs' round-off (the pairs' alone left positive values
    over 64 chunks less than this margin)."""
    from fastrpe.ops.linear.fft.blocked import blocked_product

    ratio = _estimate_ratio(lambda pq, pk, vv, lc, scale, block: blocked_product(pq, pk, vv, lc, scale, 0, T, block),
                            _round_off_case(name, values, causal=True))
    assert ratio <= 1 / 1.5, ratio


@pytest.mark.parametrize("mode", MODES)
def test_traces_as_one_graph_under_torch_compile(mode, monkeypatch):
    """`torch.compile(fullgraph=True)` traces the op without a graph break: no
    data-dependent Python control flow (the eager backend: no C++ compiler needed)."""
    causal = _mode(mode, monkeypatch)
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 8 if mode == "causal-blocked" else 32)
    pq, pk, v, lc = (t.detach().float() for t in _inputs(1, 2, 100, 100))
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # Dynamo warns once per process
    f = torch.compile(lambda *a: kernelized_num_den_fft(*a, causal=causal), backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = f(pq, pk, v, lc)
    assert not [w for w in caught if "lru_cache" in str(w.message)]  # no cache Dynamo distrusts
    want = kernelized_num_den_naive(pq, pk, v, lc, causal=causal)
    for a, b in zip(got, want):
        assert_close(a.double(), b.double(), dtype=torch.float32)


def _reads(*entries):
    """A `LaterReads` holding `(event, host copy)` entries."""
    out = common.LaterReads()
    out.pending = [(*e, None) for e in entries]
    return out


def test_nan_rows_on_a_gpu_warn_at_the_next_call(monkeypatch):
    """On a GPU the default schedule is sync-free: rows beyond the recompute capacity come back
    NaN and the flag, copied back without waiting, warns once the copy has landed."""
    class Done:
        def query(self):
            return True

    monkeypatch.setattr(certify, "_PENDING", _reads((Done(), torch.tensor(False)), (Done(), torch.tensor(True))))
    with pytest.warns(RuntimeWarning, match="sync_recompute"):
        certify._warn_pending()
    assert certify._PENDING.pending == []

    class Running:
        def query(self):
            return False

    monkeypatch.setattr(certify, "_PENDING", _reads((Running(), torch.tensor(True))))
    certify._warn_pending()  # not landed yet: nothing read, nothing said
    assert len(certify._PENDING.pending) == 1


def test_no_event_query_while_a_cuda_graph_is_captured(monkeypatch):
    """An event query during CUDA graph capture invalidates the capture: while the stream
    captures, the pending flags are left alone, and read at the next call outside it."""
    class NoQuery:
        def query(self):
            raise AssertionError("queried during capture")

    class Done:
        def query(self):
            return True

    monkeypatch.setattr(certify, "_PENDING", _reads((NoQuery(), torch.tensor(True))))
    monkeypatch.setattr(common, "capturing", lambda: True)
    certify._warn_pending()
    assert len(certify._PENDING.pending) == 1
    monkeypatch.setattr(common, "capturing", lambda: False)
    monkeypatch.setattr(certify, "_PENDING", _reads((Done(), torch.tensor(True))))
    with pytest.warns(RuntimeWarning, match="sync_recompute"):
        certify._warn_pending()


@pytest.mark.parametrize("gb, want", [(16, 512 << 20), (80, int(80e9 / 32)), (141, 4 << 30)])
def test_a_gpus_default_budget_is_a_share_of_its_memory(gb, want, monkeypatch):
    """`plan.device_budget`: 1/32 of a card's memory, from the CPU's 512 MiB up to 4 GiB, read
    once per device; the CPU keeps DEFAULT_BUDGET."""
    from types import SimpleNamespace

    from fastrpe.ops.linear.fft import plan

    asked = []
    monkeypatch.setattr(plan, "_DEVICE_BUDGETS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: asked.append(i) or SimpleNamespace(total_memory=int(gb * 1e9)))
    assert plan.device_budget(torch.device("cuda", 1)) == want
    assert plan.device_budget(torch.device("cuda", 1)) == want and asked == [1]
    assert plan.device_budget(torch.device("cpu")) == plan.DEFAULT_BUDGET


def test_a_call_without_a_budget_takes_its_devices(monkeypatch):
    """`kernelized_num_den_fft` plans with `device_budget(device)` when given no budget: here a
    tiny one, which cuts the non-causal product into one channel a block."""
    seen = []
    monkeypatch.setattr(fftmod, "device_budget", lambda device: seen.append(device.type) or 1)
    monkeypatch.setattr(fftmod, "fft_channel_block",
                        lambda *a: seen.append(("budget", a[-1])) or 1)
    g = torch.Generator().manual_seed(0)
    pq, pk = torch.rand(1, 1, 300, 2, generator=g), torch.rand(1, 1, 300, 2, generator=g)
    v = torch.randn(1, 1, 300, 3, generator=g)
    lc = 0.1 * torch.randn(1, 599, generator=g)
    got = kernelized_num_den_fft(pq, pk, v, lc)
    assert seen == ["cpu", ("budget", 1)]
    monkeypatch.undo()
    for a, b in zip(got, kernelized_num_den_fft(pq, pk, v, lc, memory_budget_bytes=1)):
        assert torch.equal(a, b)  # the same plan as that budget given


def test_a_trace_reads_no_device_property(monkeypatch):
    """Under `torch.compile`'s trace `device_budget` takes what an eager call cached, else
    DEFAULT_BUDGET, and asks the device nothing."""
    from fastrpe.ops.linear.fft import plan

    monkeypatch.setattr(plan, "_DEVICE_BUDGETS", {0: 1 << 30})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: pytest.fail("read a property"))
    assert plan.device_budget(torch.device("cuda", 0)) == 1 << 30
    assert plan.device_budget(torch.device("cuda", 1)) == plan.DEFAULT_BUDGET
