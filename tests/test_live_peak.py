"""benchmarks/live_peak.py: the bytes a call holds at its peak, and the byte count and the
peak under FakeTensorMode (shapes only) equal to those of the real call."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from _benchmarks import load_benchmark

lp = load_benchmark("live_peak")
bc = load_benchmark("byte_count")


def test_allocations_views_and_frees():
    m = lp.LivePeak()
    with m:
        a = torch.ones(1000)  # 4,000
        b = a * 2  # 8,000
        c = b.view(10, 100)  # a view: nothing more
        del b
        assert m.live == 8000  # the view keeps b's storage
        del c
        assert m.live == 4000
        a.mul_(3)  # in place: nothing more
        torch.mul(a, a, out=torch.empty(1000))  # the target's allocation only
        assert m.live == 4000
    assert m.peak == 8000  # a and b together
    assert sorted(n for n, _ in m.at_peak) == [4000, 4000]


def test_saved_tensors_live_until_the_backward_frees_them():
    x = torch.randn(1000, requires_grad=True)
    m = lp.LivePeak()
    with m:
        y = x.exp()  # saved for the backward
        z = (y * 2).sum()
        del y
        held = m.live
        z.backward()
    assert held == 4004  # exp's output, kept by autograd though y is gone, and z
    assert m.live == 4004  # exp's output freed by the backward, x.grad held
    assert m.peak > held + 4000  # the backward's own temporaries besides


def _call(x, w):
    h = torch.fft.rfft(x @ w, dim=-1)
    return torch.fft.irfft(h * h.conj(), n=x.shape[-1], dim=-1).square().sum()


def test_fake_tensors_count_and_hold_what_real_ones_do():
    def measure(make):
        x, w = make((8, 64)), make((64, 64))
        with lp.LivePeak() as m, bc.ByteCounter() as c:
            _call(x, w).backward()
        return c.bytes, c.launches, m.peak

    real = measure(lambda s: torch.randn(s, requires_grad=True))
    with FakeTensorMode():
        fake = measure(lambda s: torch.empty(s, requires_grad=True))
    assert real == fake and real[0] > 0
