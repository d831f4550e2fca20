"""benchmarks/byte_count.py counts each op's reads and writes once: a lower bound, not a tally
of every tensor an op names."""
from __future__ import annotations

import torch

from _benchmarks import load_benchmark

bc = load_benchmark("byte_count")


def _count(fn):
    with bc.ByteCounter() as c:
        fn()
    return c


def test_an_elementwise_op_reads_its_inputs_and_writes_its_output():
    a, b = torch.ones(1000), torch.ones(1000)
    c = _count(lambda: a + b)
    assert (c.bytes, c.launches) == (3 * 4000, 1)


def test_an_allocation_moves_nothing_and_zeroing_writes_once():
    x = torch.ones(10)
    c = _count(lambda: x.new_empty(1000))
    assert (c.bytes, c.launches) == (0, 0)
    y = torch.empty(1000)
    c = _count(lambda: y.zero_())
    assert (c.bytes, c.launches) == (4000, 1)
    c = _count(lambda: x.new_zeros(1000))
    assert c.bytes == 4000  # the template's bytes are not read


def test_out_and_in_place_targets_count_once_unless_read():
    a, b, out = torch.ones(1000), torch.ones(1000), torch.empty(1000)
    c = _count(lambda: torch.mul(a, b, out=out))
    assert c.bytes == 3 * 4000  # a, b read; out written once
    c = _count(lambda: a.mul_(b))
    assert c.bytes == 3 * 4000  # a read and written, b read
    dst = torch.empty(1000)
    c = _count(lambda: dst.copy_(b))
    assert c.bytes == 2 * 4000


def test_a_gather_reads_no_more_of_its_source_than_it_returns():
    src, idx = torch.ones(1000, 10), torch.arange(5)
    c = _count(lambda: src[idx])
    assert c.bytes == 5 * 40 + idx.numel() * 8 + 5 * 40


def test_views_are_free_and_the_split_per_op_adds_up():
    a = torch.ones(100, 10)
    c = _count(lambda: (a.t().reshape(-1)[:10] * 2).sum())
    assert sum(b for b, _ in c.by_op.values()) == c.bytes
    assert {op.split(".")[1] for op in c.by_op} == {"clone", "mul", "sum"}  # the transposed reshape copies
    assert c.launches == 3
    assert c.top(1)[0][1] == max(b for b, _ in c.by_op.values())


def test_an_in_place_scatter_touches_only_its_sources_entries():
    y, part = torch.zeros(1000, 10), torch.ones(10, 10)
    idx = torch.arange(10)
    c = _count(lambda: y.index_add_(0, idx, part))
    assert c.bytes == 8 * 10 + 400 + 2 * 400  # index, source, its rows of y read and written
    c = _count(lambda: y.index_copy_(0, idx, part))
    assert c.bytes == 8 * 10 + 400 + 400  # its rows of y written only


def test_a_slice_copied_onto_itself_moves_nothing():
    """Python's `y[s] += x` ends with its setitem copying the slice onto itself, which ATen's
    `copy_` returns from at once (the same storage, offset, sizes and strides): no bytes, no
    launch; a copy between two different slices of one tensor still counts."""
    y, x = torch.zeros(100, 10), torch.ones(100, 4)

    def add_into_slice():
        y[:, 2:6] += x

    c = _count(add_into_slice)
    assert (c.bytes, c.launches) == (3 * 1600, 1)  # the add_ alone
    c = _count(lambda: y[:, 2:6].copy_(y[:, 4:8]))
    assert (c.bytes, c.launches) == (2 * 1600, 1)
