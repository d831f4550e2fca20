"""Issue: low precision. Under bf16 / fp16 autocast every backend returns finite outputs and
gradients for query/key norms up to 1e3, and its error against float64 is within a small
factor of the dense path's error under the same autocast."""
from __future__ import annotations

import copy

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P

H, L, D = 2, 48, 16
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

# (backend, kernel, position, causal)
CASES = [
    ("sdpa", "softmax", "kerple_log", False),
    ("sdpa", "softmax", "alibi", True),
    ("fft", "nprf", "kerple_log", False),
    ("fft", "nprf", "kerple_log", True),
    ("fft", "elu", "t5", False),
    ("chunked", "nprf", "alibi", True),
    ("chunked", "elu", "none", True),
    ("prefix", "nprf", "none", True),
    ("soe", "nprf", "kerple_log", True),
    ("soe", "nexp", "kerple_power", True),  # causal raw exp needs dense's running maximum (FastRPB §3.1)
]


def _position(name):
    if name == "none":
        return None
    torch.manual_seed(3)
    t = P.make(name, H, causal=True, max_len=64)
    if name == "t5":
        with torch.no_grad():
            for p in t.parameters():
                p.normal_(0, 1.0)
    return t


def _qkv(norm, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = (x / x.norm(dim=-1, keepdim=True) * norm for x in (q, k))
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def _run(backend, kernel, pos, causal, q, k, v, dtype):
    kern = fr.kernels.get_kernel(kernel, head_dim=D, num_features=32)
    if q.dtype == torch.float64:
        kern = kern.double() if isinstance(kern, torch.nn.Module) else kern
        pos = None if pos is None else copy.deepcopy(pos).double()  # .double() is in place
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend)
    with torch.autocast("cpu", dtype=dtype):
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend)


def _assert_finite_at_norm_1e3(backend, kernel, position, causal, dtype):
    """Outputs and q/k/v gradients are finite under `dtype` autocast with |q| = |k| = 1e3."""
    q, k, v = _qkv(1e3)
    out = _run(backend, kernel, _position(position), causal, q, k, v, dtype)
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend,kernel,position,causal", CASES)
def test_huge_norms_under_autocast_stay_finite(backend, kernel, position, causal, dtype):
    _assert_finite_at_norm_1e3(backend, kernel, position, causal, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend,kernel,position,causal", CASES)
def test_error_within_a_small_factor_of_dense_under_autocast(backend, kernel, position, causal, dtype):
    pos = _position(position)
    q, k, v = _qkv(3.0, seed=1)
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    ref = _run("dense", kernel, pos, causal, q64, k64, v64, None)
    if backend == "soe":  # the approximation is the backend's own: compare with its float64 self
        ref = _run("soe", kernel, pos, causal, q64, k64, v64, None)

    def rel(out):
        return ((out.double() - ref).norm() / ref.norm()).item()

    err = rel(_run(backend, kernel, pos, causal, q, k, v, dtype))
    err_dense = rel(_run("dense", kernel, pos, causal, q, k, v, dtype))
    if backend == "soe":
        err_dense = max(err_dense, rel(_run("dense", kernel, pos, causal, q64, k64, v64, None)))
    assert err <= 4 * max(err_dense, EPS[dtype]), (err, err_dense)


MAPS = ["softmax", "elu", "relu", "exp", "dpfp", "prf", "orf", "sphere_prf", "trf", "nprf", "ntrf"]


def _full_matrix():
    """(kernel, backend, position, causal) for every feature map and every backend that takes
    it with a gradient (by the backend's own reasons), with the first positional term of
    KERPLE-log / ALiBi / none that the backend accepts."""
    x = torch.zeros(1, H, L, D, requires_grad=True)
    cases = []
    for kernel in MAPS:
        kern = fr.kernels.get_kernel(kernel, head_dim=D, num_features=32)
        for causal in (False, True):
            chosen = {}
            for position in ("kerple_log", "alibi", "none"):
                ex = fr.explain(x, x, x, kernel=kern, position=_position(position), causal=causal,
                                allow_approximate=True)
                for c in ex.candidates:
                    if not c.reasons and c.backend not in chosen:
                        chosen[c.backend] = position
            cases += [(kernel, b, p, causal) for b, p in sorted(chosen.items())]
    return cases


FULL = _full_matrix()


def test_full_matrix_covers_every_map_and_1d_backend():
    assert {k for k, *_ in FULL} == set(MAPS)
    assert {b for _, b, *_ in FULL} == {"dense", "sdpa", "fft", "chunked", "prefix", "bidirectional", "soe"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kernel,backend,position,causal", FULL,
                         ids=[f"{k}-{b}-{p}-{'causal' if c else 'full'}" for k, b, p, c in FULL])
def test_every_map_and_backend_finite_under_autocast(kernel, backend, position, causal, dtype):
    _assert_finite_at_norm_1e3(backend, kernel, position, causal, dtype)
