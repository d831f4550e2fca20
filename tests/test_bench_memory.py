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


def test_peak_is_linear_in_the_size_of_a_linear_computation():
    def run(n):
        x = torch.randn(n, 64)
        return measure_peak(lambda: (x * 2).cumsum(0).sum())

    small, big = run(10_000), run(40_000)
    assert 3.5 < big / small < 4.5
