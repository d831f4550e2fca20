"""The CPU memory measure of the benchmarks: the allocator's peak, from profiler events."""
import torch

from fastrpe.bench.memory import allocator_peak_bytes, measure_peak


def test_allocator_peak_counts_freed_temporaries_and_net_counts_kept_tensors():
    kept = []

    def fn():
        a = torch.ones(1000, 1000)  # 4 MB, freed before the end
        kept.append(torch.ones(500, 1000))  # 2 MB, still held
        del a

    peak, net = allocator_peak_bytes(fn)
    assert peak == 6_000_000 and net == 2_000_000


def test_freeing_what_an_earlier_call_left_does_not_lower_the_peak():
    """A block an earlier measured call left behind (the profiler then knows its size), freed
    during this one, is not this call's memory: its free must not offset this call's
    allocations (the Triton interpreter leaves each launch's arguments to the garbage
    collector, so benchmark rows freed the previous row's buffers)."""
    held = []
    allocator_peak_bytes(lambda: held.append(torch.ones(1000, 1000)))  # 4 MB left by a measured call

    def fn():
        held.clear()  # freed here
        b = torch.ones(500, 1000)  # 2 MB: this call's peak
        del b

    peak, net = allocator_peak_bytes(fn)
    assert peak == 2_000_000 and net == 0


def test_peak_is_linear_in_the_size_of_a_linear_computation():
    def run(n):
        x = torch.randn(n, 64)
        return measure_peak(lambda: (x * 2).cumsum(0).sum())

    small, big = run(10_000), run(40_000)
    assert 3.5 < big / small < 4.5


def test_slow_competitor_timed_once_then_skipped_at_longer_lengths():
    """Over the time limit: one timed call instead of `repeats`, and the longer lengths of the
    same family are skipped with the reason; other families are unaffected."""
    import time

    from fastrpe.bench.registry import Problem
    from fastrpe.bench.runner import run_suite

    calls = {"slow": 0, "fast": 0}

    def slow(p, device, dtype):
        def fn():
            calls["slow"] += 1
            time.sleep(0.3 if p.L > 8 else 0.0)  # far from the limit: a loaded machine adds ~10 ms
        return fn

    def fast(p, device, dtype):
        def fn():
            calls["fast"] += 1
        return fn

    probs = [Problem(L=L, position=pos) for pos in ("alibi", "none") for L in (8, 16, 32)]
    res = run_suite(probs, ["slow", "fast"], repeats=4, warmup=1, time_limit_s=0.15, registry={"slow": slow, "fast": fast},
                    log=lambda m: None)
    rows = {(r["competitor"], r["problem"]["position"], r["problem"]["L"]): r for r in res["rows"]}
    assert rows[("slow", "alibi", 8)]["repeats"] == 4
    assert rows[("slow", "alibi", 16)]["repeats"] == 1
    assert "exceeded" in rows[("slow", "alibi", 32)]["skipped"]
    assert rows[("slow", "none", 16)]["repeats"] == 1  # its own family: measured, not skipped
    assert all("seconds" in rows[("fast", pos, L)] for pos in ("alibi", "none") for L in (8, 16, 32))
    # per (family, length): probe + warm-up + repeats + profiled call; over the limit: probe + 1 + profiled
    assert calls["slow"] == 2 * ((1 + 1 + 4 + 1) + (1 + 1 + 1))
