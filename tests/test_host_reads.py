"""No host read in the hot path of any kernelized backend (issue 12): on a GPU, `.item()`,
`bool()`, `float()`, `int()`, `.tolist()` or an index of a tensor drains the stream, and so do
`nonzero` and `masked_select` (their output's size is data). On CPU, each is made
to raise while `fastrpe.attention` runs forward and backward (after a warm-up call, which may
fill memos), for every backend that is not softmax-only and every family of the GPU bench,
plus KERPLE power with a fixed exponent. The input check's non-finite test reads on CPU
tensors only and is switched off here; the FFT path runs its sync-free schedule, as on CUDA.
The Triton backends run under the interpreter. `tests/test_gpu.py` watches the same calls with
CUDA's sync debug mode."""
import pytest
import torch

import fastrpe as fr
from fastrpe import api, backends_triton
from fastrpe.bench.gpu import FAMILIES, SOFTMAX_ONLY_BACKENDS, family_causal, make_position
from fastrpe.dispatch import BACKENDS
from fastrpe.ops.linear.fft import static_schedule

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "masked_select")
H, L, D = 2, 80, 16


class HostRead(Exception):
    pass


def _position(family):
    if family.startswith("kerple_power_fixed"):  # p read on the host to pick the geometric path
        p = 1.0 if family.endswith("1") else 1.5
        return fr.positions.KerplePower(H, p=p, learn_p=False).requires_grad_(False)
    return make_position(family, H, L)


@pytest.mark.parametrize("family", [*FAMILIES, "kerple_power_fixed_p1", "kerple_power_fixed_p1.5"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in SOFTMAX_ONLY_BACKENDS])
def test_no_host_read_in_the_hot_path(monkeypatch, backend, family):
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    check = api.check_qkv
    monkeypatch.setattr(api, "check_qkv", lambda q, k, v, **kw: check(q, k, v, check_finite=False))
    pos = _position(family)
    causal = family.startswith("kerple_power_fixed") or family_causal(family)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))

    def call():
        with static_schedule():
            fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend).sum().backward()

    try:
        call()
    except fr.FastRPEError as e:
        pytest.skip(f"{backend} refuses: {e}")
    if backend.startswith("triton_") and torch.cuda.is_available():
        pytest.skip("the interpreter is off where CUDA is (tests/test_gpu.py watches the GPU)")

    def read(name):
        def raise_(self, *a, **kw):
            raise HostRead(f"Tensor.{name}")
        return raise_

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, read(name))
    call()


@pytest.mark.parametrize("backend,family", [("triton_soe", "kerple_log"), ("triton_band", "t5")])
def test_no_host_read_in_the_walked_far_field(monkeypatch, backend, family):
    """The same with the far field walked in blocks (`triton_soe.FAR_FIELD = "walk"`)."""
    from fastrpe.ops.linear import triton_soe

    monkeypatch.setattr(triton_soe, "FAR_FIELD", "walk")
    test_no_host_read_in_the_hot_path(monkeypatch, backend, family)


@pytest.mark.parametrize("backend,family", [("triton_chunked", "alibi"), ("triton_soe", "kerple_log"),
                                            ("triton_band", "t5")])
def test_no_host_read_with_the_fused_maps(monkeypatch, count_calls, backend, family):
    """The same with the PRF maps' backward inside the kernels (`backends_triton.FUSED_MAPS`,
    the maps on their Triton route): `triton_chunked_prf`, `triton_soe_prf`; and the fused
    path ran, in the warm-up call and in the watched one."""
    from fastrpe import kernels
    from fastrpe.ops.linear import triton_chunked_prf, triton_soe_prf

    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    monkeypatch.setattr(backends_triton, "FUSED_MAPS", True)
    calls = (count_calls(triton_chunked_prf, "prf_chunked_attention") if backend == "triton_chunked"
             else count_calls(triton_soe_prf, "prf_soe_attention"))
    test_no_host_read_in_the_hot_path(monkeypatch, backend, family)
    assert len(calls) == 2


def test_the_watch_catches_a_host_read(monkeypatch):
    """The patch above can fail: a `bool()` of a tensor raises under it."""
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(HostRead("bool")))
    with pytest.raises(HostRead):
        bool(torch.ones(1))


def test_kerple_power_rereads_p_after_an_in_place_edit():
    """The fixed exponent is read on the host only when its buffer changes, and is read again
    after an in-place write (the geometric path follows p = 1)."""
    pos = fr.positions.KerplePower(H, p=1.0, learn_p=False)
    assert pos.geometric_decay() is not None
    with torch.no_grad():
        pos.fixed_p.fill_(1.5)
    assert pos.geometric_decay() is None
    with torch.no_grad():
        pos.fixed_p.fill_(1.0)
    assert pos.geometric_decay() is not None
