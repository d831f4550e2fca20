"""Bad input raises a clear error that names the argument; nothing returns NaN silently."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.testing import qkv


def _qkv(**kw):
    return qkv(1, 2, 5, 6, 4, dtype=torch.float32, **kw)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda q, k, v: (q[0], k, v), r"q must have 4 dimensions"),
        (lambda q, k, v: (q, k[..., :3], v), r"k's last dimension"),
        (lambda q, k, v: (q, k, v[:, :, :4]), r"v's length"),
        (lambda q, k, v: (q, k[:, :1], v), r"head counts differ"),
        (lambda q, k, v: (q, torch.cat([k, k]), v), r"batch sizes differ"),
        (lambda q, k, v: (q.double(), k, v), r"one dtype"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), r"q must be a floating point"),
        (lambda q, k, v: (q[:, :, :0], k, v), r"q is an empty sequence"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), r"k and v are empty"),
        (lambda q, k, v: (q, k, v.to("meta")), r"one device"),
        (lambda q, k, v: (q.index_fill(2, torch.tensor([1]), float("nan")), k, v), r"q contains non-finite"),
        (lambda q, k, v: (q, k.index_fill(2, torch.tensor([0]), float("inf")), v), r"k contains non-finite"),
        (lambda q, k, v: ("q", k, v), r"q must be a torch.Tensor"),
    ],
    ids=["q-3d", "k-dim", "v-len", "heads", "batch", "dtype", "int", "empty-q", "empty-k", "device", "nan-q", "inf-k", "not-tensor"],
)
def test_bad_tensors(mutate, match):
    q, k, v = mutate(*_qkv())
    with pytest.raises(fr.FastRPEError, match=match):
        fr.attention(q, k, v)


def test_bad_options():
    q, k, v = _qkv()
    with pytest.raises(fr.FastRPEError, match="backend: unknown backend 'nope'"):
        fr.attention(q, k, v, backend="nope")
    with pytest.raises(fr.FastRPEError, match="kernel"):
        fr.attention(q, k, v, kernel="not-a-kernel")
    with pytest.raises(fr.FastRPEError, match="q_offset must be >= 0"):
        fr.attention(q, k, v, q_offset=-1)
    with pytest.raises(fr.FastRPEError, match="causal must be a bool"):
        fr.attention(q, k, v, causal="yes")
    with pytest.raises(fr.FastRPEError, match="scale must be a positive"):
        fr.attention(q, k, v, scale=-1.0)
    with pytest.raises(fr.FastRPEError, match="position: KerpleLog has num_heads=3 but q has H=2"):
        fr.attention(q, k, v, position=P.KerpleLog(3))
    with pytest.raises(fr.FastRPEError, match="position must be"):
        fr.attention(q, k, v, position=torch.zeros(2, 10))
    with pytest.raises(fr.FastRPEError, match="at most one log-coefficient term"):
        fr.attention(q, k, v, position=[P.KerpleLog(2), P.ALiBi(2)])


def test_bad_key_padding_mask():
    q, k, v = _qkv()
    with pytest.raises(fr.FastRPEError, match="key_padding_mask must have dtype torch.bool"):
        fr.attention(q, k, v, key_padding_mask=torch.zeros(1, 6))
    with pytest.raises(fr.FastRPEError, match=r"key_padding_mask must have shape \[B, Lk\]"):
        fr.attention(q, k, v, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))


def test_forced_backend_lists_reasons():
    q, k, v = _qkv()
    with pytest.raises(fr.FastRPEError, match="backend='fft' cannot run this call: only kernelized"):
        fr.attention(q, k, v, backend="fft")
    with pytest.raises(fr.FastRPEError, match="backend='sdpa' cannot run this call: only exact softmax"):
        fr.attention(q, k, v, kernel="elu", backend="sdpa")


def test_softmax_only_position_refused_by_kernelized_backends():
    q, k, v = _qkv()
    pos = P.KerpleBiasWeight(2)
    with pytest.raises(fr.FastRPEError, match="backend='fft' cannot run this call"):
        fr.attention(q, k, v, kernel="elu", position=pos, backend="fft")
    # dense is the reference for softmax; the term is defined there
    out = fr.attention(q, k, v, kernel="softmax", position=pos)
    assert torch.isfinite(out).all()
    ex = fr.explain(q, k, v, kernel="elu", position=pos)
    assert "fft" in str(ex) and "refused" in str(ex)


def test_mha_rejects_bad_config():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        fr.nn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="position: KerpleLog has num_heads=2"):
        fr.nn.MultiheadAttention(12, 3, position=P.KerpleLog(2))


def test_value_checks_read_no_tensor_on_an_accelerator():
    """The non-finite check reads a value back to the host: free on the CPU, a stream sync on a
    GPU (issue 12: none in the hot path), so it runs on CPU tensors only. Meta tensors stand in
    for a device here: reading one would raise."""
    from fastrpe._validate import check_qkv

    q, k, v = (torch.empty(1, 2, 5, 4, device="meta") for _ in range(3))
    check_qkv(q, k, v)
