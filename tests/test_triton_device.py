"""Triton launches on the current CUDA device and its current stream, not on its arguments'
device: with tensors on cuda:1 while cuda:0 is current (a model split over two GPUs), a
kernel would read device-1 pointers on device 0. Every function that launches kernels runs
under `triton_chunked.launch_device` of its tensors. Checked here on the CPU: the context's
logic with a stand-in tensor, and, under the interpreter, that every kernel launch of every
Triton backend (forward and backward), of the PRF feature kernels and of the three fused
decoding steps happens inside it."""
import contextlib

import pytest
import torch

pytest.importorskip("triton")

import fastrpe as fr  # noqa: E402
from fastrpe import backends_triton, kernels  # noqa: E402
from fastrpe.bench.gpu import family_causal, make_position  # noqa: E402
from fastrpe.nn import attention as attention_mod  # noqa: E402
from fastrpe.ops.linear import triton_chunked as tc  # noqa: E402

H, L, D = 2, 80, 16


def test_launch_device_makes_the_tensors_device_current(monkeypatch):
    entered = []

    class Tensor:
        is_cuda, device = True, "cuda:1"

        def get_device(self):
            return 1

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    with tc.launch_device(Tensor()):
        pass
    assert entered == ["cuda:1"]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # already current: nothing to do
    with tc.launch_device(Tensor()):
        pass
    assert entered == ["cuda:1"]
    with tc.launch_device(torch.ones(1)):  # the CPU
        pass
    assert entered == ["cuda:1"]


@pytest.fixture
def launches(monkeypatch):
    """`(inside, outside)`: the names of the kernels launched inside and outside a
    `launch_device` context (the interpreter's launches)."""
    from triton.runtime.interpreter import InterpretedFunction

    if torch.cuda.is_available():
        pytest.skip("the interpreter is off where CUDA is")
    depth, inside, outside = [0], [], []
    real = tc.launch_device

    @contextlib.contextmanager
    def recording(t):
        depth[0] += 1
        try:
            with real(t):
                yield
        finally:
            depth[0] -= 1

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        (inside if depth[0] else outside).append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(tc, "launch_device", recording)
    monkeypatch.setattr(InterpretedFunction, "run", counted)
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    return inside, outside


@pytest.mark.parametrize("backend,family", [("triton_chunked", "alibi"), ("triton_soe", "kerple_log"),
                                            ("triton_band", "t5"), ("triton_tiled", "learned_full")])
def test_every_backend_launch_is_on_its_tensors_device(launches, backend, family):
    inside, outside = launches
    pos = make_position(family, H, L)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
    out = fr.attention(q, k, v, kernel=kern, position=pos, causal=family_causal(family), backend=backend)
    out.sum().backward()
    names = set(inside)
    assert "_prf_fwd_kernel" in names and "_prf_bwd_kernel" in names, names
    assert len(names) >= 5 and not outside, (names, outside)


@pytest.mark.parametrize("family", ["alibi", "t5", "kerple_log"])
def test_every_decoding_step_launch_is_on_its_tensors_device(launches, monkeypatch, family):
    inside, outside = launches
    monkeypatch.setattr(attention_mod, "FUSED_STEP", "always")
    pos = {"alibi": lambda: fr.positions.ALiBi(H),
           "t5": lambda: fr.positions.T5Bias(H, bidirectional=False, num_buckets=6, max_distance=12),
           "kerple_log": lambda: fr.positions.KerpleLog(H)}[family]()
    torch.manual_seed(0)
    mha = fr.nn.MultiheadAttention(8 * H, H, kernel="nprf", position=pos, causal=True,
                                   backend="soe" if family == "kerple_log" else "auto")
    x = torch.randn(1, 6, 8 * H)
    with torch.no_grad():
        _, st = mha.step(x[:, :5])
        inside.clear()
        mha.step(x[:, 5:], st)
    assert {"alibi": "_prf_step_kernel", "t5": "_prf_band_step_kernel",
            "kerple_log": "_prf_soe_step_kernel"}[family] in inside and not outside, (inside, outside)


def test_the_feature_step_launch_is_on_its_tensors_device(launches):
    from fastrpe.ops.linear.triton_recurrent import linear_step_triton

    inside, outside = launches
    g = torch.Generator().manual_seed(1)
    q, k = (torch.rand(1, H, 1, 8, generator=g) for _ in range(2))
    linear_step_triton(q, k, torch.randn(1, H, 1, 4, generator=g), torch.rand(1, H, 8, 5, generator=g))
    assert inside == ["_step_kernel"] and not outside, (inside, outside)


def test_more_batch_x_heads_than_a_grid_axis_holds_is_refused(monkeypatch):
    """The kernels put B·H on the grid's second axis, which CUDA caps at 65,535: a backend
    says so (and `auto` picks another); the PRF features take the PyTorch maps."""
    from fastrpe.api import _problem
    from fastrpe.dispatch import BACKENDS
    from fastrpe.ops.common import MAX_GRID_YZ

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    kern = fr.kernels.get_kernel("nprf", head_dim=4, num_features=4)
    for B, refused in ((MAX_GRID_YZ, False), (MAX_GRID_YZ + 1, True)):
        q = torch.zeros(B, 1, 2, 4).expand(B, 1, 2, 4)
        p, _ = _problem(q, q, q, kern, fr.positions.ALiBi(1), True, None, None, None)
        why = BACKENDS["triton_chunked"].not_supported_reasons(p)
        assert any("B·H" in r for r in why) == refused, why
        assert kern._triton_features(q) == (not refused)
