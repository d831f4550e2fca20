"""Low precision and extremes: finite outputs and gradients everywhere."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P

MAPS = ["softmax", "elu", "relu", "exp", "dpfp", "prf", "orf", "sphere_prf", "trf", "nprf", "ntrf"]


def _big(dtype, L=40, H=2, D=16, norm=1e3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(1, H, L, D, generator=g)
        out.append((x / x.norm(dim=-1, keepdim=True) * norm).to(dtype).requires_grad_())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("kernel", MAPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_huge_norms_low_precision_stay_finite(kernel, dtype, causal):
    q, k, v = _big(dtype)
    pos = P.KerpleLog(2)
    kern = fr.kernels.get_kernel(kernel, head_dim=16, num_features=8)
    backends = ["dense", "sdpa"] if kernel == "softmax" else ["dense", "fft"] + (["chunked"] if causal else [])
    if causal and kernel == "exp":  # SIKF's causal running maximum runs on dense only (the others refuse, by design)
        backends = ["dense"]
    for backend in backends:
        p = None if backend == "chunked" else pos
        out = fr.attention(q, k, v, kernel=kern, position=p, causal=causal, backend=backend)
        assert out.dtype == dtype and torch.isfinite(out).all(), backend
        grads = torch.autograd.grad(out.float().sum(), [q, k, v])
        assert all(torch.isfinite(g).all() for g in grads), backend


@pytest.mark.parametrize("backend,kernel", [("dense", "softmax"), ("sdpa", "softmax"), ("dense", "elu"), ("fft", "elu"),
                                            ("chunked", "elu")])
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 7), (7, 1)])
def test_length_one(backend, kernel, Lq, Lk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, Lq, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, Lk, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, Lk, 4, generator=g, dtype=torch.float64, requires_grad=True)
    causal = backend == "chunked" or Lq <= Lk
    ref = fr.attention(q, k, v, kernel=kernel, causal=causal, backend="dense")
    out = fr.attention(q, k, v, kernel=kernel, causal=causal, backend=backend)
    torch.testing.assert_close(out, ref)
    for gr in torch.autograd.grad(out.sum(), [q, k, v]):
        assert torch.isfinite(gr).all()


@pytest.mark.parametrize("backend,kernel", [("dense", "softmax"), ("sdpa", "softmax"), ("dense", "elu"), ("fft", "elu")])
def test_rows_with_no_admissible_key_are_zero_with_finite_grads(backend, kernel):
    """A table of -inf beyond offset 0 with causal queries past every key: rows see nothing."""
    t = P.LearnedTable(2, max_distance=3).double()
    with torch.no_grad():
        t.table.fill_(float("-inf"))
        t.table[:, 3] = 0.0  # only r = 0 allowed
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    out = fr.attention(q, k, v, kernel=kernel, position=t, backend=backend)  # queries 3..5 have no key at r=0
    assert torch.equal(out[:, :, 3:], torch.zeros_like(out[:, :, 3:]))
    assert torch.isfinite(out).all()
    for gr in torch.autograd.grad(out.sum(), [q, k, v]):
        assert torch.isfinite(gr).all()
