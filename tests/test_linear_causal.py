"""Linear-time causal kernelized attention (chunked) against the naive reference."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.ops.linear.chunked import kernelized_num_den_chunked
from fastrpe.ops.linear.naive import kernelized_num_den_naive
from fastrpe.testing import assert_close, features_and_values, qkv

CASES = [(1, 1, 0, 64), (63, 63, 0, 16), (100, 100, 0, 64), (257, 257, 0, 60), (63, 100, 37, 16), (100, 63, 0, 7),
         (20, 300, 280, 32)]


def _true(res):
    return res[0] * res[2].exp()[None, :, :, None], res[1] * res[2].exp()[None]


def _inputs(Lq, Lk, H=3, F=8, Dv=5, dtype=torch.float64, seed=0):
    pq, pk, v = features_and_values(2, H, Lq, Lk, F, Dv, dtype=dtype, seed=seed)
    gamma = torch.tensor([0.9, 0.5, 1.0][:H], dtype=dtype).requires_grad_()
    return pq, pk, v, gamma


def _geometric_lc(gamma, Lq, Lk, off):
    r = torch.arange(-(Lq - 1 + off), Lk - off, dtype=gamma.dtype)
    return r.abs()[None] * torch.log(gamma)[:, None]


@pytest.mark.parametrize("case", CASES, ids=[f"Lq{a}-Lk{b}-off{c}-T{d}" for a, b, c, d in CASES])
@pytest.mark.parametrize("decay", [True, False], ids=["gamma", "no-rpe"])
def test_chunked_matches_naive(case, decay):
    Lq, Lk, off, T = case
    pq, pk, v, gamma = _inputs(Lq, Lk)
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, ::4] = True
    lc = _geometric_lc(gamma, Lq, Lk, off) if decay else None
    a = _true(kernelized_num_den_naive(pq, pk, v, lc, causal=True, q_offset=off, key_padding_mask=kpm))
    b = _true(kernelized_num_den_chunked(pq, pk, v, gamma=gamma if decay else None, q_offset=off,
                                         key_padding_mask=kpm, chunk_size=T))
    for x, y in zip(b, a):
        assert_close(x, y)
    w = [torch.randn_like(t) for t in a]
    params = [pq, pk, v] + ([gamma] if decay else [])
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip(a, w)), params)
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip(b, w)), params)
    for x, y in zip(gb, ga):
        assert_close(x, y)


def test_state_continues_a_prompt():
    """Prompt in one call (returning the state), then the rest from that state = one call."""
    pq, pk, v, gamma = (t.detach() for t in _inputs(50, 50))
    full = kernelized_num_den_chunked(pq, pk, v, gamma=gamma, chunk_size=8)
    *_, state = kernelized_num_den_chunked(pq[:, :, :21], pk[:, :, :21], v[:, :, :21], gamma=gamma, chunk_size=8,
                                           return_state=True)
    # the remaining tokens sit at positions 21.. : shift them to start at 0 with the state before them
    rest = kernelized_num_den_chunked(pq[:, :, 21:], pk[:, :, 21:], v[:, :, 21:], gamma=gamma, chunk_size=8,
                                      initial_state=state)
    assert_close(rest[0], full[0][:, :, 21:])
    assert_close(rest[1], full[1][:, :, 21:])


def test_gradcheck_tiny():
    pq, pk, v, gamma = _inputs(6, 6, H=2, F=2, Dv=2)
    assert torch.autograd.gradcheck(
        lambda *t: _true(kernelized_num_den_chunked(*t[:3], gamma=t[3], chunk_size=4)), (pq, pk, v, gamma))


@pytest.mark.parametrize("pos_name", ["none", "alibi", "kerple_power_p1"])
@pytest.mark.parametrize("kernel", ["elu", "nprf"])
def test_backend_matches_dense_and_never_sees_the_future(pos_name, kernel):
    H, D = 3, 16
    q, k, v = qkv(1, H, 150, 150, D, requires_grad=True)
    pos = None if pos_name == "none" else P.make(pos_name, H).double()
    kern = fr.kernels.get_kernel(kernel, head_dim=D, num_features=8)
    kern = kern.double() if isinstance(kern, torch.nn.Module) else kern
    ref = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="dense")
    out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="chunked")
    assert_close(out, ref)
    params = [q, k, v] + (list(pos.parameters()) if pos is not None else [])
    u = torch.randn_like(ref)
    for x, y in zip(torch.autograd.grad((out * u).sum(), params), torch.autograd.grad((ref * u).sum(), params)):
        assert_close(x, y)
    with torch.no_grad():
        for i in (0, 70, 148):
            k2, v2 = k.detach().clone(), v.detach().clone()
            k2[:, :, i + 1:] *= 20
            v2[:, :, i + 1:] = 1e3
            o2 = fr.attention(q, k2, v2, kernel=kern, position=pos, causal=True, backend="chunked")
            assert torch.equal(o2[:, :, : i + 1], out.detach()[:, :, : i + 1])


def test_chunked_refuses_what_it_cannot_do():
    q, k, v = qkv(1, 2, 10, 10, 8)
    with pytest.raises(fr.FastRPEError, match="causal only"):
        fr.attention(q, k, v, kernel="elu", backend="chunked")
    with pytest.raises(fr.FastRPEError, match="KerpleLog is not a geometric decay"):
        fr.attention(q, k, v, kernel="elu", position=P.KerpleLog(2).double(), causal=True, backend="chunked")
    assert P.KerplePower(2).geometric_decay() is None  # learnable p: not geometric


@pytest.mark.parametrize("case", CASES, ids=[f"Lq{a}-Lk{b}-off{c}-T{d}" for a, b, c, d in CASES])
def test_prefix_matches_naive_and_chunked(case):
    from fastrpe.ops.linear.prefix import kernelized_num_den_prefix

    Lq, Lk, off, _ = case
    pq, pk, v, _ = _inputs(Lq, Lk)
    a = _true(kernelized_num_den_naive(pq, pk, v, None, causal=True, q_offset=off))
    b = _true(kernelized_num_den_prefix(pq, pk, v, q_offset=off))
    c = _true(kernelized_num_den_chunked(pq, pk, v, q_offset=off))
    for x, y, z in zip(b, a, c):
        assert_close(x, y)
        assert_close(z, y)
    w = [torch.randn_like(t) for t in a]
    ga = torch.autograd.grad(sum((t * u).sum() for t, u in zip(a, w)), [pq, pk, v])
    gb = torch.autograd.grad(sum((t * u).sum() for t, u in zip(b, w)), [pq, pk, v])
    for x, y in zip(gb, ga):
        assert_close(x, y)
