"""`auto` under the "measure" policy (issue 12 item 3): the first call of a signature bucket
times the exact candidates near the model's best and keeps the fastest.

Most tests inject a fake timer (`dispatch.time_backend`), so the choice is deterministic and
can disagree with the model on purpose; one runs the real timer at tiny sizes.
"""
from __future__ import annotations

import json

import pytest
import torch

import fastrpe as fr
from fastrpe import dispatch
from fastrpe.api import _problem
from fastrpe.dispatch import BACKENDS

H, D = 2, 8


@pytest.fixture
def measure(monkeypatch):
    monkeypatch.delenv("FASTRPE_CACHE_DIR", raising=False)  # CPU timings stay in memory
    fr.set_auto_policy("measure")
    yield
    fr.set_auto_policy(None)


@pytest.fixture
def fake_timer(monkeypatch):
    """`set(times)` gives each backend a fake time in seconds (the rest: 1 s); `calls` lists
    (backend, Lq, Lk) per timing."""
    class Fake:
        times: dict = {}
        calls: list = []
        fail: set = set()

        def __call__(self, backend, inputs, p, **kw):
            self.calls.append((backend.name, p.Lq, p.Lk))
            if backend.name in self.fail:
                raise RuntimeError("out of memory (fake)")
            return self.times.get(backend.name, 1.0)

    fake = Fake()
    fake.times, fake.calls, fake.fail = {}, [], set()
    monkeypatch.setattr(dispatch, "time_backend", fake)
    return fake


def _qkv(L, Lk=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Lk = L if Lk is None else Lk
    return (torch.randn(1, H, L, D, generator=g, dtype=dtype), torch.randn(1, H, Lk, D, generator=g, dtype=dtype),
            torch.randn(1, H, Lk, D, generator=g, dtype=dtype))


def _model_ranking(q, k, v, kernel, pos, causal):
    p, _ = _problem(q, k, v, kernel, pos, causal, None, None, None)
    ex = dispatch.explain_problem(p, eligible_only=True, measured=False)
    return [c.backend for c in sorted((c for c in ex.candidates if not c.reasons), key=lambda c: c.cost.seconds)]


def test_policy_api():
    assert dispatch.auto_policy(torch.device("cpu")) == "model"  # calibrated there; first-call timings are noisy
    assert dispatch.auto_policy(torch.device("cuda")) == "measure"
    with pytest.raises(fr.FastRPEError, match="policy"):
        fr.set_auto_policy("fastest")
    fr.set_auto_policy("measure")
    try:
        assert dispatch.auto_policy(torch.device("cpu")) == "measure"
    finally:
        fr.set_auto_policy(None)


@pytest.mark.parametrize("kernel,causal", [("softmax", True), ("nprf", False)], ids=["softmax-causal", "nprf-bidir"])
def test_picks_the_measured_fastest_over_the_models_first(measure, fake_timer, ran, monkeypatch, kernel, causal):
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)  # time every candidate
    q, k, v = _qkv(33)
    pos = fr.positions.KerpleLog(H)
    ranking = _model_ranking(q, k, v, kernel, pos, causal)
    assert len(ranking) >= 2, ranking
    fake_timer.times = {ranking[0]: 2e-3, ranking[1]: 1e-3}  # the model's second is the fastest
    out = fr.attention(q, k, v, kernel, pos, causal=causal)
    assert ran == [ranking[1]]
    assert {c[0] for c in fake_timer.calls} == set(ranking)
    ex = fr.explain(q, k, v, kernel, pos, causal=causal)
    assert ex.chosen == ranking[1] and ex.policy == "measure"
    assert ex.measurement.times[ranking[1]] == 1e-3
    text = str(ex)
    assert "measured 1 ms" in text and "policy: measure" in text and "Lq<=64" in text
    # the result is the chosen backend's, bit for bit
    torch.testing.assert_close(out, fr.attention(q, k, v, kernel, pos, causal=causal, backend=ranking[1]),
                               rtol=0, atol=0)


def test_measures_once_per_bucket(measure, fake_timer):
    pos = fr.positions.KerpleLog(H)
    for L in (33, 40, 40, 64, 50):  # one bucket: lengths up to 64
        fr.attention(*_qkv(L), "nprf", pos, causal=True)
    n = len(fake_timer.calls)
    assert n >= 1 and {c[1] for c in fake_timer.calls} == {33}
    fr.attention(*_qkv(65), "nprf", pos, causal=True)  # the next bucket
    assert len(fake_timer.calls) > n and {c[1] for c in fake_timer.calls[n:]} == {65}
    m = len(fake_timer.calls)
    for _ in range(3):
        fr.attention(*_qkv(65), "nprf", pos, causal=True)
        fr.attention(*_qkv(100), "nprf", pos, causal=True)
    assert len(fake_timer.calls) == m


def test_candidates_far_above_the_best_estimate_are_not_timed(measure, fake_timer):
    q, k, v = _qkv(64)
    pos = fr.positions.KerpleLog(H)
    p, kpm = _problem(q, k, v, "nprf", pos, False, None, None, None)
    ex = dispatch.explain_problem(p, eligible_only=True, measured=False)
    est = {c.backend: c.cost.seconds for c in ex.candidates if not c.reasons}
    best = min(est.values())
    m = dispatch.measure_problem(p, (q, k, v, kpm), factor=1.0)
    assert set(m.times) == {n for n, s in est.items() if s <= best}
    assert all("x the best" in why for why in m.not_measured.values())
    assert set(m.times) | set(m.not_measured) == set(est)


def test_approximate_backends_are_timed_only_when_allowed(measure, fake_timer, monkeypatch):
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)
    q, k, v = _qkv(64, dtype=torch.float32)
    pos = fr.positions.KerpleLog(H)  # causal: soe (approximate) supports it
    assert fr.explain(q, k, v, "nprf", pos, causal=True, allow_approximate=True).chosen is not None
    fake_timer.times = {"soe": 1e-9}
    fr.attention(q, k, v, "nprf", pos, causal=True)
    timed = {c[0] for c in fake_timer.calls}
    assert timed and "soe" not in timed and all(BACKENDS[n].exact for n in timed)
    p, kpm = _problem(q, k, v, "nprf", pos, True, None, None, None)
    m = dispatch.measure_problem(p, (q, k, v, kpm), allow_approximate=True)
    assert "soe" in m.times


def test_a_failing_candidate_is_not_chosen(measure, fake_timer, ran, monkeypatch):
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)
    q, k, v = _qkv(20)
    ranking = _model_ranking(q, k, v, "softmax", None, True)
    fake_timer.times = {ranking[0]: 1e-6, ranking[1]: 1e-3}
    fake_timer.fail = {ranking[0]}
    fr.attention(q, k, v, "softmax", None, causal=True)
    assert ran == [ranking[1]]
    assert "failed: RuntimeError: out of memory" in str(fr.explain(q, k, v, "softmax", None, causal=True))


def test_without_the_calls_tensors_the_model_decides(measure, fake_timer):
    q, k, v = _qkv(16)
    p, _ = _problem(q, k, v, "softmax", None, True, None, None, None)
    assert dispatch.select_backend(p, "auto").name == _model_ranking(q, k, v, "softmax", None, True)[0]
    assert fake_timer.calls == []


def test_measuring_leaves_autograd_grads_and_rng_alone(measure):
    """The real timer, with grad: no `.grad` written by the timings, the RNG state kept, and
    output and gradients equal to the chosen backend's run."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(24, 31))
    pos = fr.positions.KerpleLog(H)
    rng = torch.get_rng_state()
    out = fr.attention(q, k, v, "nprf", pos, causal=True)
    assert torch.equal(rng, torch.get_rng_state())
    assert q.grad is None and all(prm.grad is None for prm in pos.parameters())
    ex = fr.explain(q, k, v, "nprf", pos, causal=True)
    assert ex.measurement is not None and ex.measurement.what == "forward+backward"
    assert BACKENDS[ex.chosen].exact and ex.measurement.times[ex.chosen] > 0
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    leaves = [q, k, v, *pos.parameters()]
    g_auto = torch.autograd.grad((out * w).sum(), leaves)
    ref = fr.attention(q, k, v, "nprf", pos, causal=True, backend=ex.chosen)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(g_auto, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kernel,position,causal,Lq,Lk", [
    ("softmax", None, True, 1, 1), ("softmax", "alibi", False, 7, 13), ("nelu", None, True, 63, 63),
    ("nprf", "kerple_log", False, 17, 9), ("nprf", "t5", True, 5, 21),
])
def test_real_timer_at_tiny_sizes(measure, kernel, position, causal, Lq, Lk):
    pos = {None: None, "alibi": fr.positions.ALiBi(H), "kerple_log": fr.positions.KerpleLog(H),
           "t5": fr.positions.T5Bias(H)}[position]
    q, k, v = _qkv(Lq, Lk, dtype=torch.float32)
    with torch.no_grad():
        out = fr.attention(q, k, v, kernel, pos, causal=causal)
        ex = fr.explain(q, k, v, kernel, pos, causal=causal)
        assert ex.chosen in BACKENDS and BACKENDS[ex.chosen].exact
        assert ex.measurement is not None and ex.chosen in ex.measurement.times
        assert torch.equal(out, fr.attention(q, k, v, kernel, pos, causal=causal, backend=ex.chosen))


def test_no_timing_under_compile(measure, fake_timer, ran, monkeypatch):
    """fullgraph compile of a layer under "measure": no graph break, nothing timed while
    tracing, and the compiled graph runs the model's choice (eager calls measure and may
    pick another)."""
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)
    torch._dynamo.reset()
    torch.manual_seed(0)
    E, L = 16, 33
    m = fr.nn.MultiheadAttention(E, H, "softmax", fr.positions.ALiBi(H), causal=True).double()
    x = torch.randn(1, L, E, dtype=torch.float64)
    with torch.no_grad():
        q = torch.randn(1, H, L, E // H, dtype=torch.float64)
        ranking = _model_ranking(q, q, q, "softmax", m.position if hasattr(m, "position") else fr.positions.ALiBi(H),
                                 True)
    fake_timer.times = {ranking[0]: 2e-3, ranking[1]: 1e-3}
    try:
        out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        assert fake_timer.calls == []
        assert set(ran) == {ranking[0]}, ran
        ran.clear()
        eager = m(x)  # eager: measured, the fake's fastest
        assert fake_timer.calls and ran == [ranking[1]]
        torch.testing.assert_close(out, eager, atol=1e-10, rtol=1e-10)
    finally:
        torch._dynamo.reset()


def test_terms_of_one_structure_share_a_measurement(measure, fake_timer):
    """Timings depend on structure, not parameter values: a second layer's term of the same
    class and configuration is not timed again; another configuration is."""
    q, k, v = _qkv(40)
    fr.attention(q, k, v, "nprf", fr.positions.KerpleLog(H), causal=True)
    n = len(fake_timer.calls)
    fr.attention(q, k, v, "nprf", fr.positions.KerpleLog(H), causal=True)
    assert n >= 1 and len(fake_timer.calls) == n
    fr.attention(q, k, v, "nprf", fr.positions.T5Bias(H, bidirectional=False), causal=True)
    assert len(fake_timer.calls) > n


def test_timings_persist_on_disk(measure, fake_timer, tmp_path, monkeypatch, ran):
    """With FASTRPE_CACHE_DIR, a fresh process (here: memory cleared) reads the timings back
    instead of timing again, and picks the same backend."""
    monkeypatch.setenv("FASTRPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)
    q, k, v = _qkv(24)
    ranking = _model_ranking(q, k, v, "softmax", None, True)
    fake_timer.times = {ranking[0]: 2e-3, ranking[1]: 1e-3}
    fr.attention(q, k, v, "softmax", None, causal=True)
    files = list(tmp_path.glob("auto_timings-*.json"))
    assert len(files) == 1 and ran == [ranking[1]]
    n = len(fake_timer.calls)
    dispatch.clear_dispatch_cache()
    ran.clear()
    fr.attention(q, k, v, "softmax", None, causal=True)
    assert len(fake_timer.calls) == n and ran == [ranking[1]]
    files[0].write_text("{not json")  # a broken file: timed again, and rewritten
    dispatch.clear_dispatch_cache()
    fr.attention(q, k, v, "softmax", None, causal=True)
    assert len(fake_timer.calls) > n
    assert len(json.loads(files[0].read_text())) == 1


def test_a_first_call_that_compiles_is_not_its_time(monkeypatch):
    """A candidate whose first call compiles (Triton, FlexAttention) is judged by its next
    calls: with a faster candidate already timed, a slow first call is followed by another
    before the candidate is given up; a candidate slow at every call is given up after two."""
    import time

    q, k, v = _qkv(8, dtype=torch.float32)
    p, kpm = _problem(q, k, v, "softmax", None, False, None, None, None)

    class Stub(dispatch.Backend):
        def __init__(self, first, then):
            super().__init__("stub")
            self.first, self.then, self.calls = first, then, 0

        def run(self, q, k, v, p, kpm):
            self.calls += 1
            time.sleep(self.first if self.calls == 1 else self.then)
            return q

    compiles = Stub(first=0.3, then=0.0)
    assert dispatch.time_backend(compiles, (q, k, v, kpm), p, give_up_after=0.01) < 0.05
    assert compiles.calls == 2 + dispatch.MEASURE_REPEATS
    slow = Stub(first=0.15, then=0.15)
    assert dispatch.time_backend(slow, (q, k, v, kpm), p, give_up_after=0.01) >= 0.15
    assert slow.calls == 2


def test_timings_taken_before_decide_where_nothing_may_be_timed(measure, fake_timer, ran, monkeypatch):
    """While a CUDA graph is captured (or syncs are watched) `auto` times nothing, but the
    timings taken before still decide: the captured call runs the backend the eager calls ran
    (already compiled and tuned), for the same signature and for a new one in the same bucket.
    A bucket never timed falls back to the model."""
    monkeypatch.setattr(dispatch, "MEASURE_FACTOR", 1e9)
    pos = fr.positions.KerpleLog(H)
    q, k, v = _qkv(33)
    ranking = _model_ranking(q, k, v, "softmax", pos, True)
    fake_timer.times = {ranking[0]: 2e-3, ranking[1]: 1e-3}
    fr.attention(q, k, v, "softmax", pos, causal=True)  # eager: timed, the model's second is the fastest
    n = len(fake_timer.calls)
    monkeypatch.setattr(dispatch, "_can_measure", lambda device: False)  # as during capture
    ran.clear()
    fr.attention(q, k, v, "softmax", pos, causal=True)
    fr.attention(*_qkv(40), "softmax", pos, causal=True)  # another signature, the same bucket
    assert ran == [ranking[1], ranking[1]] and len(fake_timer.calls) == n
    ran.clear()
    fr.attention(*_qkv(65), "softmax", pos, causal=True)  # a bucket never timed: the model's pick
    assert ran == _model_ranking(*_qkv(65), "softmax", pos, True)[:1] and len(fake_timer.calls) == n


def test_a_bucket_whose_timings_all_failed_keeps_the_models_pick(measure, fake_timer, ran, monkeypatch):
    """When no timed candidate supports the call (every timing failed), the model's pick is
    kept for the signature: later calls look nothing up again."""
    q, k, v = _qkv(33)
    pos = fr.positions.KerpleLog(H)
    fake_timer.fail = set(BACKENDS)
    fr.attention(q, k, v, "softmax", pos, causal=True)
    assert ran == _model_ranking(q, k, v, "softmax", pos, True)[:1]
    calls = []
    real = dispatch.explain_problem
    monkeypatch.setattr(dispatch, "explain_problem", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for _ in range(3):
        fr.attention(q, k, v, "softmax", pos, causal=True)
    assert calls == [] and ran[1:] == ran[:1] * 3
