"""Property-based tests (hypothesis): random shapes, families, causal flags, offsets and
backends agree with the naive reference, and causal outputs never depend on the future."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.testing import assert_close

FAMILIES = ["none", *P.NAMES]
SOFTMAX_BACKENDS = ["sdpa"]
KERNEL_BACKENDS = ["fft", "chunked"]


@st.composite
def problems(draw):
    kernel = draw(st.sampled_from(["softmax", "elu", "relu", "nprf", "dpfp"]))
    backend = draw(st.sampled_from(SOFTMAX_BACKENDS if kernel == "softmax" else KERNEL_BACKENDS))
    family = draw(st.sampled_from(FAMILIES))
    causal = draw(st.booleans()) if backend != "chunked" else True
    Lq = draw(st.integers(1, 70))
    Lk = draw(st.integers(1, 70))
    q_offset = draw(st.one_of(st.none(), st.integers(0, 20)))
    return dict(kernel=kernel, backend=backend, family=family, causal=causal, Lq=Lq, Lk=Lk,
                q_offset=q_offset, H=draw(st.integers(1, 3)), D=draw(st.integers(1, 9)),
                seed=draw(st.integers(0, 2**16)))


def _setup(pb):
    g = torch.Generator().manual_seed(pb["seed"])
    H, D = pb["H"], pb["D"]
    q = torch.randn(1, H, pb["Lq"], D, generator=g, dtype=torch.float64)
    k = torch.randn(1, H, pb["Lk"], D, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, pb["Lk"], 3, generator=g, dtype=torch.float64)
    pos = None if pb["family"] == "none" else P.make(pb["family"], H, causal=pb["causal"], max_len=64).double()
    if pos is not None:
        with torch.no_grad():
            for prm in pos.parameters():
                prm.add_(0.3 * torch.randn(prm.shape, generator=g, dtype=prm.dtype))
    kern = fr.kernels.get_kernel(pb["kernel"], head_dim=D, num_features=6)
    kern = kern.double() if isinstance(kern, torch.nn.Module) else kern
    return q, k, v, pos, kern


def _supported(pb, q, k, v, pos, kern):
    ex = fr.explain(q, k, v, kernel=kern, position=pos, causal=pb["causal"], q_offset=pb["q_offset"])
    return not next(c for c in ex.candidates if c.backend == pb["backend"]).reasons


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_backend_agrees_with_dense(pb):
    q, k, v, pos, kern = _setup(pb)
    assume(_supported(pb, q, k, v, pos, kern))
    kw = dict(kernel=kern, position=pos, causal=pb["causal"], q_offset=pb["q_offset"])
    ref = fr.attention(q, k, v, backend="dense", **kw)
    out = fr.attention(q, k, v, backend=pb["backend"], **kw)
    assert torch.isfinite(out).all()
    assert_close(out, ref)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_causal_outputs_ignore_the_future(pb, data):
    pb["causal"] = True
    q, k, v, pos, kern = _setup(pb)
    assume(_supported(pb, q, k, v, pos, kern))
    Lq, Lk = pb["Lq"], pb["Lk"]
    off = pb["q_offset"] if pb["q_offset"] is not None else (Lk - Lq if Lq < Lk else 0)
    i = data.draw(st.integers(0, Lq - 1))
    first_future = off + i + 1  # key positions > query i's position
    assume(first_future < Lk)
    kw = dict(kernel=kern, position=pos, causal=True, q_offset=pb["q_offset"], backend=pb["backend"])
    out = fr.attention(q, k, v, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, first_future:] = -k2[:, :, first_future:] * 3
    v2[:, :, first_future:] = 100.0
    out2 = fr.attention(q, k2, v2, **kw)
    assert torch.equal(out2[:, :, : i + 1], out[:, :, : i + 1])
