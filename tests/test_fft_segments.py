"""The causal FFT path's segments (`fft.segments.SegmentSums`): each segment's gradients added
in place at its rows, not one full-size gradient per segment summed by autograd; the same
gradients as the dense formula, also through a retained graph's second backward."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import fastrpe.ops.linear.fft as fftmod
from fastrpe.ops.linear.fft import kernelized_num_den_fft


@pytest.fixture
def small_leaves(monkeypatch):
    """The recursion with 4-position leaves: a short sequence makes many segments."""
    monkeypatch.setattr(fftmod, "causal_leaf", lambda *args, **kwargs: 4)


def _inputs(B, H, Lq, Lk, F, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64).requires_grad_()
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64).requires_grad_()
    lc = (torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64) - 0.02 * torch.arange(Lq + Lk - 1.0)).requires_grad_()
    return pq, pk, v, lc


def _dense(pq, pk, v, lc, off):
    """Causal num and den in true units, from the formula: query i at position off + i sees
    key j <= off + i with coefficient exp(lc[Lq - 1 - i + j])."""
    Lq, Lk = pq.shape[2], pk.shape[2]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    c = torch.where(j <= off + i, torch.exp(lc[:, Lq - 1 - i + j]), torch.zeros(()))
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * c
    return a @ v, a.sum(-1)


def _loss(num, den, ls, g):
    scale = ls.exp()
    return ((num * scale[None, :, :, None]) * g[0]).sum() + ((den * scale[None]) * g[1]).sum()


@pytest.mark.parametrize("Lq,Lk,off", [(63, 63, 0), (37, 90, 53), (90, 50, 0)])
def test_gradients_match_the_formula_also_through_a_retained_graph(Lq, Lk, off, small_leaves):
    pq, pk, v, lc = _inputs(2, 3, Lq, Lk, 5, 4)
    num, den, ls = kernelized_num_den_fft(pq, pk, v, lc, causal=True, q_offset=off)
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(num.shape, generator=gen, dtype=num.dtype), torch.randn(den.shape, generator=gen, dtype=den.dtype))
    loss = _loss(num, den, ls, g)
    first = torch.autograd.grad(loss, [pq, pk, v, lc], retain_graph=True)
    second = torch.autograd.grad(loss, [pq, pk, v, lc])  # each segment made again
    wn, wd = _dense(pq, pk, v, lc, off)
    want = torch.autograd.grad((wn * g[0]).sum() + (wd * g[1]).sum(), [pq, pk, v, lc])
    for name, a, b, w in zip(("phi_q", "phi_k", "v", "log_coeff"), first, second, want):
        assert_close(a, w, msg=f"grad {name}")
        assert_close(b, a, rtol=0, atol=0, msg=f"second backward {name}")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


def test_no_segment_makes_a_full_size_gradient(small_leaves):
    pq, pk, v, lc = _inputs(1, 2, 128, 128, 4, 3)
    num, den, _ = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    ops = _Ops()
    with ops:
        (num.sum() + den.sum()).backward()
    # 63 segments (32 leaves of 4 positions): autograd alone made one slice_backward per
    # segment and input it slices; the one left is the output's own (num = y[..., :Dv])
    assert ops.names.count("slice_backward") == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_around_the_call(reentrant, small_leaves):
    """A model's layers under `torch.utils.checkpoint` (Hugging Face's gradient checkpointing):
    the segments' own backward runs inside its recomputation, with the same gradients."""
    from torch.utils.checkpoint import checkpoint

    ins = _inputs(1, 2, 64, 64, 4, 3)

    def f(*ins):
        num, den, ls = kernelized_num_den_fft(*ins, causal=True)
        return (num * ls.exp()[None, :, :, None]).sum() + (den * ls.exp()[None]).sum()

    want = torch.autograd.grad(f(*ins), ins)
    checkpoint(f, *ins, use_reentrant=reentrant).backward()
    for t, w in zip(ins, want):
        assert_close(t.grad, w, rtol=0, atol=0)
