"""Every backend of `fastrpe.attention` against the dense reference, forward and gradients."""
from __future__ import annotations

import itertools

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.testing import assert_close, assert_lowp_close, qkv

SIZES = [(1, 1), (1, 9), (63, 63), (100, 100), (257, 257), (63, 100), (100, 63)]
H, D = 3, 60

POSITIONS = {
    "none": lambda: None,
    "learned": lambda: P.LearnedTable(H, max_distance=40),
    "t5": lambda: P.T5Bias(H, num_buckets=16, max_distance=64),
    "alibi": lambda: P.ALiBi(H),
    "kerple_power": lambda: P.KerplePower(H),
    "kerple_log": lambda: P.KerpleLog(H),
    "kerple_log3": lambda: P.KerpleLog3(H),
}


def _randomize(pos, seed=0):
    """Move learned parameters away from their init so that gradients are not trivial."""
    if pos is None:
        return None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in pos.parameters():
            prm.add_(0.3 * torch.randn(prm.shape, generator=g, dtype=prm.dtype))
    return pos


def _make(pos_name, dtype=torch.float64):
    pos = _randomize(POSITIONS[pos_name]())
    return None if pos is None else pos.to(dtype)


def _run(backend, q, k, v, kernel, pos, causal, grad=True):
    out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=causal, backend=backend)
    if not grad:
        return out, []
    go = torch.randn_like(out, generator=torch.Generator().manual_seed(1)) if out.dtype == torch.float64 else torch.ones_like(out)
    params = [q, k, v] + ([] if pos is None else list(pos.parameters()))
    grads = torch.autograd.grad(out, params, go, allow_unused=True)
    return out, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _ids(args):
    (Lq, Lk), causal = args
    return f"Lq{Lq}-Lk{Lk}-{'causal' if causal else 'full'}"


CASES = list(itertools.product(SIZES, [False, True]))


@pytest.mark.parametrize("pos_name", list(POSITIONS))
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_sdpa_matches_dense(case, pos_name):
    (Lq, Lk), causal = case
    q, k, v = qkv(2, H, Lq, Lk, D, 7, requires_grad=True)
    pos = _make(pos_name)
    ref, gref = _run("dense", q, k, v, "softmax", pos, causal)
    out, g = _run("sdpa", q, k, v, "softmax", pos, causal)
    assert_close(out, ref)
    for a, b in zip(g, gref):
        assert_close(a, b)


@pytest.mark.parametrize("pos_name", list(POSITIONS))
@pytest.mark.parametrize("case", CASES[:6], ids=[_ids(c) for c in CASES[:6]])
def test_flex_matches_dense_forward(case, pos_name):
    from fastrpe.ops.softmax.flex import flex_available

    if not flex_available():
        pytest.skip("FlexAttention is not in this PyTorch")
    (Lq, Lk), causal = case
    q, k, v = qkv(1, H, Lq, Lk, 16, 7, dtype=torch.float32)
    pos = _make(pos_name, torch.float32)
    with torch.no_grad():
        ref = fr.attention(q, k, v, position=pos, causal=causal, backend="dense")
        out = fr.attention(q, k, v, position=pos, causal=causal, backend="flex")
    assert_close(out, ref)


KERNELS = {"elu": lambda: fr.kernels.get_kernel("elu"), "nprf": lambda: fr.kernels.get_kernel("nprf", head_dim=D, num_features=16)}


@pytest.mark.parametrize("kernel_name", list(KERNELS))
@pytest.mark.parametrize("pos_name", list(POSITIONS))
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_fft_matches_dense(case, pos_name, kernel_name):
    (Lq, Lk), causal = case
    q, k, v = qkv(1, H, Lq, Lk, D, 5, requires_grad=True, scale=0.5)
    kernel = KERNELS[kernel_name]().double()
    pos = _make(pos_name)
    ref, gref = _run("dense", q, k, v, kernel, pos, causal)
    out, g = _run("fft", q, k, v, kernel, pos, causal)
    assert_close(out, ref)
    for a, b in zip(g, gref):
        assert_close(a, b)


@pytest.mark.parametrize("backend,kernel", [("sdpa", "softmax"), ("fft", "elu"), ("fft", "nprf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_low_precision_against_float64(backend, kernel, dtype):
    q64, k64, v64 = qkv(1, H, 100, 63, 32, 8)
    kern = fr.kernels.get_kernel(kernel, head_dim=32)
    pos = _make("kerple_log")
    ref = fr.attention(q64, k64, v64, kernel=kern if kernel == "softmax" else kern.double(), position=pos, causal=True, backend="dense")
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    pos_l = _make("kerple_log", torch.float32)
    kern = kern if kernel == "softmax" else kern.float()
    naive = fr.attention(q, k, v, kernel=kern, position=pos_l, causal=True, backend="dense")
    fast = fr.attention(q, k, v, kernel=kern, position=pos_l, causal=True, backend=backend)
    assert fast.dtype == dtype and torch.isfinite(fast).all()
    assert_lowp_close(fast, naive, ref, msg=f"{backend}/{kernel}/{dtype}")


@pytest.mark.parametrize("backend,kernel", [("dense", "softmax"), ("sdpa", "softmax"), ("dense", "elu"), ("fft", "elu")])
@pytest.mark.parametrize("pos_name", ["none", "kerple_log", "t5"])
def test_gradcheck_tiny(backend, kernel, pos_name):
    q, k, v = qkv(1, H, 5, 4, 3, 2, requires_grad=True)
    pos = _make(pos_name)
    params = (q, k, v) + (tuple(pos.parameters()) if pos is not None else ())

    def f(q, k, v, *_):
        return fr.attention(q, k, v, kernel=kernel, position=pos, causal=True, backend=backend)

    assert torch.autograd.gradcheck(f, params)


@pytest.mark.parametrize("backend,kernel", [("dense", "softmax"), ("sdpa", "softmax"), ("flex", "softmax"), ("dense", "elu"), ("fft", "elu")])
@pytest.mark.parametrize("pos_name", ["none", "alibi", "learned"])
@pytest.mark.parametrize("Lq,Lk", [(40, 40), (17, 40)])
def test_causal_never_sees_the_future(backend, kernel, pos_name, Lq, Lk):
    q, k, v = qkv(1, H, Lq, Lk, 8, dtype=torch.float32)
    pos = _make(pos_name, torch.float32)
    with torch.no_grad():
        out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=True, backend=backend)
        off = Lk - Lq  # bottom-right aligned
        for i in (0, Lq // 2, Lq - 2):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, off + i + 1:] = 100 * torch.randn_like(k2[:, :, off + i + 1:])
            v2[:, :, off + i + 1:] = 100 * torch.randn_like(v2[:, :, off + i + 1:])
            out2 = fr.attention(q, k2, v2, kernel=kernel, position=pos, causal=True, backend=backend)
            torch.testing.assert_close(out2[:, :, : i + 1], out[:, :, : i + 1], atol=0, rtol=0)


@pytest.mark.parametrize("backend,kernel", [("dense", "softmax"), ("sdpa", "softmax"), ("dense", "elu"), ("fft", "elu")])
def test_key_padding_mask(backend, kernel):
    q, k, v = qkv(2, H, 20, 30, 8)
    pos = _make("kerple_log")
    kpm = torch.zeros(2, 30, dtype=torch.bool)
    kpm[0, 25:] = True
    kpm[1, :] = True  # a batch element with no key: documented output 0
    out = fr.attention(q, k, v, kernel=kernel, position=pos, key_padding_mask=kpm, backend=backend)
    ref0 = fr.attention(q[:1], k[:1, :, :25], v[:1, :, :25], kernel=kernel, position=pos, backend="dense")
    assert_close(out[:1], ref0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_auto_picks_a_supported_backend_and_explains():
    q, k, v = qkv(1, H, 50, 50, 8, dtype=torch.float32)
    ex = fr.explain(q, k, v, kernel="elu", position=P.KerpleLog(H), causal=True)
    assert ex.chosen in ("dense", "fft")
    text = str(ex)
    assert "auto picks" in text and "sdpa" in text and "refused" in text
    out = fr.attention(q, k, v, kernel="elu", position=P.KerpleLog(H), causal=True)
    ref = fr.attention(q, k, v, kernel="elu", position=P.KerpleLog(H), causal=True, backend="dense")
    assert_close(out, ref)


def test_auto_prefers_fft_where_dense_cannot_fit():
    q, k, v = (torch.zeros(1, 1, 65536, 16) for _ in range(3))
    ex = fr.explain(q, k, v, kernel="elu", position=P.KerpleLog(1), causal=True)
    assert ex.chosen == "fft", str(ex)
    assert "dense" in str(ex) and "memory limit" in str(ex)


def test_q_offset_matches_slicing():
    """Queries at q_offset..: the same rows as the full square problem."""
    q, k, v = qkv(1, H, 30, 30, 8)
    pos = _make("kerple_power")
    for backend, kernel in [("dense", "softmax"), ("sdpa", "softmax"), ("fft", "elu")]:
        full = fr.attention(q, k, v, kernel=kernel, position=pos, causal=True, backend=backend)
        tail = fr.attention(q[:, :, 20:], k, v, kernel=kernel, position=pos, causal=True, backend=backend)
        assert_close(tail, full[:, :, 20:])
        tail2 = fr.attention(q[:, :, 20:], k, v, kernel=kernel, position=pos, causal=False, q_offset=20, backend=backend)
        full2 = fr.attention(q, k, v, kernel=kernel, position=pos, causal=False, backend=backend)
        assert_close(tail2, full2[:, :, 20:])
