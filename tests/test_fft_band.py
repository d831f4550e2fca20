"""The FFT path's dense near band, computed a block of rows at a time (`fft.band.band_rows`):
the same values and gradients as all rows at once, and as the dense formula."""
from __future__ import annotations

import pytest
import torch

from fastrpe.ops.linear.fft.band import band_product, band_rows


def _inputs(Lq, Lk, q_offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, F, C = 2, 3, 5, 4
    mk = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    phi_q, phi_k, vv = mk(B, H, Lq, F), mk(B, H, Lk, F), mk(B, H, Lk, C)
    lc = (torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    scale = torch.full((H, Lq), 2.0, dtype=torch.float64)
    return phi_q, phi_k, vv, lc, scale


def _dense_band(phi_q, phi_k, vv, lc, scale, q_offset, w):
    """Row i (position q_offset + i) and key j with |j - (q_offset + i)| <= w: coefficient
    exp(lc[Lq - 1 + q_offset + (j - q_offset - i)] - scale[i]), written from the formula."""
    Lq, Lk = phi_q.shape[2], phi_k.shape[2]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    r = j - (q_offset + i)
    idx = (Lq - 1 + q_offset + r).clamp(0, lc.shape[-1] - 1)
    x = lc[:, idx] - scale[:, :, None]
    w_ = torch.where((r.abs() <= w)[None], torch.exp(x), torch.zeros_like(x))  # (H, Lq, Lk)
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k) * w_
    return a @ vv


@pytest.mark.parametrize("Lq,Lk,q_offset", [(37, 37, 0), (1, 50, 49), (20, 61, 30), (64, 64, 0), (45, 30, 0)])
@pytest.mark.parametrize("rows", [None, 4, 8, 12])
def test_blocks_of_rows_match_the_dense_band(Lq, Lk, q_offset, rows):
    w = 4
    ins = _inputs(Lq, Lk, q_offset)
    y = band_product(*ins, q_offset, w, rows)
    ref = _dense_band(*ins, q_offset, w)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, ins[:4], g)
    want = torch.autograd.grad(ref, ins[:4], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_band_rows_fit_the_budget():
    # the bench's problem at a million tokens: bounded by the budget, a multiple of w
    r = band_rows(1, 8, 32, 64, torch.float32, 4 << 30, 32)
    assert r % 32 == 0 and 100_000 < r < 1_048_576
    assert band_rows(1, 8, 32, 64, torch.float32, 1, 32) == 32  # at least one block of w rows


def test_no_block_makes_a_full_size_key_gradient():
    """Each block reads only the keys within w of its rows, and its gradients are added in place
    at those rows (`segments.SegmentSums`): autograd alone gathered every block's key gradients
    into a full-size tensor (`index_select`'s backward) and summed one per block."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.full = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape[:3] == (2, 3, 64) and func._schema.name != "aten::detach":
                self.full += 1
            return out

    phi_q, phi_k, vv, lc, scale = _inputs(64, 64, 0)
    y = band_product(phi_q, phi_k, vv, lc, scale, 0, 4, 8)  # 8 blocks
    ops = Ops()
    with ops:
        torch.autograd.grad(y.sum(), [phi_k, vv])
    assert ops.full <= 4  # the two gradients' zeros and the incoming gradient, not one a block
