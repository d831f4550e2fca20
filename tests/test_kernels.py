"""Feature maps: shapes, positivity, unbiasedness of random features, seeded draws,
per-position stabilizers, finiteness at large norms and in low precision, gradients."""
from __future__ import annotations

import math

import pytest
import torch

from fastrpe import kernels as K
from fastrpe.testing import assert_close

MAPS = ["elu", "relu", "exp", "dpfp", "prf", "orf", "sphere_prf", "trf", "nelu", "nprf", "ntrf"]
POSITIVE = {"elu", "exp", "prf", "orf", "sphere_prf", "nelu", "nprf"}


def _x(B=2, H=3, L=63, D=60, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("L", [1, 63])
def test_shapes_and_positivity(name, L):
    kern = K.get_kernel(name, head_dim=60, num_features=16)
    x = _x(L=L)
    for is_query in (True, False):
        f = kern(x, is_query=is_query)
        assert f.shape == (2, 3, L, kern.num_features(60))
        assert torch.isfinite(f).all()
        if name in POSITIVE:
            assert bool((f >= 0).all())


@pytest.mark.parametrize("proj", ["prf", "orf", "sphere_prf", "ntrf"])
def test_random_features_estimate_softmax_kernel(proj):
    """φ(q)·φ(k) ≈ exp(q·k/√D) up to the per-query stabilizer, which cancels in attention:
    compare attention weights (rows normalized). TRF does so on normalized inputs."""
    D = 16
    q, k = _x(1, 1, 4, D, scale=0.5, dtype=torch.float64)[0, 0], _x(1, 1, 32, D, scale=0.5, dtype=torch.float64, seed=1)[0, 0]
    if proj == "ntrf":
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    exact = torch.softmax(q @ k.T / math.sqrt(D), -1)
    errs = []
    for m in (16, 4096):
        kern = K.get_kernel(proj, head_dim=D, num_features=m).double()
        a = kern(q, is_query=True) @ kern(k, is_query=False).T
        errs.append(((a / a.sum(-1, keepdim=True)) - exact).abs().sum(-1).mean().item())
    assert errs[1] < errs[0] / 4, errs  # 256x the features: error falls (~1/16 in expectation)
    assert errs[1] < 0.1, errs


def test_orthogonal_rows_and_sphere_norms():
    orf = K.get_kernel("orf", head_dim=8, num_features=20)
    w = orf.w.double()
    blk = w[:8] / w[:8].norm(dim=-1, keepdim=True)
    assert_close(blk @ blk.T, torch.eye(8, dtype=torch.float64), torch.float32)
    sph = K.get_kernel("sphere_prf", head_dim=8, num_features=20)
    assert_close(sph.w.norm(dim=-1), torch.full((20,), math.sqrt(8.0)))


def test_seeded_buffers_redraw_and_state_dict():
    a, b = K.get_kernel("prf", head_dim=8, seed=3), K.get_kernel("prf", head_dim=8, seed=3)
    assert torch.equal(a.w, b.w)
    assert "w" in dict(a.named_buffers())
    before = a.w.clone()
    a(_x(D=8))  # using the map never redraws
    assert torch.equal(a.w, before)
    a.redraw()
    assert not torch.equal(a.w, before)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.w, b.w)


@pytest.mark.parametrize("name", MAPS)
def test_stabilizer_is_per_position(name):
    kern = K.get_kernel(name, head_dim=60, num_features=16)
    x = _x(L=10)
    y = x.clone()
    y[:, :, 7] *= 50  # change one position a lot
    for is_query in (True, False):
        fx, fy = kern(x, is_query=is_query), kern(y, is_query=is_query)
        keep = [i for i in range(10) if i != 7]
        assert torch.equal(fx[:, :, keep], fy[:, :, keep])


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_finite_at_large_norms(name, dtype):
    kern = K.get_kernel(name, head_dim=60, num_features=16)
    x = _x(L=8, dtype=dtype)
    x = x / x.float().norm(dim=-1, keepdim=True).to(dtype) * 1e3
    x.requires_grad_(True)
    for is_query in (True, False):
        f = kern(x, is_query=is_query)
        assert torch.isfinite(f).all(), (name, is_query)
        (g,) = torch.autograd.grad(f.sum(), x)
        assert torch.isfinite(g).all(), (name, is_query)


@pytest.mark.parametrize("name", ["elu", "relu", "exp", "dpfp", "prf", "trf", "nprf"])
def test_gradcheck(name):
    kern = K.get_kernel(name, head_dim=4, num_features=3).double()
    x = (_x(1, 1, 3, 4, dtype=torch.float64) + 0.1).requires_grad_(True)
    for is_query in (True, False):
        assert torch.autograd.gradcheck(lambda t: kern(t, is_query=is_query), (x,))


def test_get_kernel_errors():
    with pytest.raises(ValueError, match="kernel: unknown kernel 'foo'.*prf"):
        K.get_kernel("foo")
    with pytest.raises(ValueError, match="needs head_dim"):
        K.get_kernel("prf")
    kern = K.get_kernel("prf", head_dim=8)
    with pytest.raises(ValueError, match="built for head_dim=8"):
        kern(_x(D=6))
    assert isinstance(K.get_kernel("softmax"), K.Softmax)
    assert K.get_kernel("nprf", head_dim=8).normalize
