"""How the Triton backends multiply a bf16 problem's features on the GPU (`backends_triton.
lowp_dots`), checked on the CPU under the interpreter with the GPU's choice forced.

The first H100 run failed tests/test_gpu.py's float64 comparison for `triton_chunked` (ALiBi)
and `triton_soe` (KERPLE-log) at L = 4,096 in bf16, while the same tests passed under the
interpreter: on CUDA the backends rounded the feature maps to bf16 before the kernels, on the
CPU they did not. Forcing the CUDA choice here reproduces that failure (dq 4.4x and 6.1x dense
bf16's error at L = 1,024); the default now keeps the features float32 on the GPU too.

`FLOAT32_PRODUCTS = "bf16x3"` multiplies those float32 features by bf16 halves (`_dot` MODE 3,
emulated under the interpreter as MODE 4): its products carry about 16 bits, and every backend
stays within LOWP_FACTOR of dense bf16 here. On the H100 three of its backends stopped with an
illegal memory access (2026-11-27): a Triton miscompile on Hopper of the pattern their key-tile
gradient kernels had then (`triton_chunked.HOPPER_TRANS_NOTE`); tests/test_gpu.py checks it
there, tests/test_triton_compile.py that the pattern is gone. Two H100 sessions later it is the
default for 16-bit calls (`backends_triton.FLOAT32_PRODUCTS`), "tf32x3" an option.
"""
import dataclasses

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import fastrpe as fr  # noqa: E402
from fastrpe import backends_triton as bt  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.api import _problem  # noqa: E402
from fastrpe.ops.linear.triton_chunked import (  # noqa: E402
    PRECISIONS,
    _dot,
    _split_tf32,
    dot_mode,
    triton_unavailable_reason,
)
from fastrpe.testing import LOWP_FACTOR, TRITON_CASES  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")


@triton.jit
def _product(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr):
    """`a @ b` of one tile by `triton_chunked._dot` in MODE (float32 operands' DT and ACC)."""
    m, kk, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + kk[None, :])
    b = tl.load(b_ptr + kk[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], _dot(a, b, tl.float32, tl.float32, MODE))
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))

B, H, L, D, F = 1, 2, 256, 32, 16


def _problem_on(device, dtype):
    q = torch.zeros(1, 2, 8, 16, dtype=dtype)
    kern = fr.kernels.get_kernel("nprf", head_dim=16, num_features=16)
    prob, _ = _problem(q, q, q, kern, fr.positions.ALiBi(2), True, None, None, None)
    return dataclasses.replace(prob, device=torch.device(device))


def test_lowp_dots_policy(monkeypatch):
    # a 16-bit call's float32 features by bf16 halves (the default since two H100 sessions)
    assert bt.lowp_dots(_problem_on("cuda", torch.bfloat16)) == (None, "bf16x3")
    assert bt.lowp_dots(_problem_on("cuda", torch.float16)) == (None, "bf16x3")
    assert bt.lowp_dots(_problem_on("cuda", torch.float32)) == (None, "ieee")
    assert bt.lowp_dots(_problem_on("cpu", torch.bfloat16)) == (None, "ieee")
    with bt.use_lowp_features("bfloat16"):  # what the bench's `+bf16-features` rows run under
        assert bt.lowp_dots(_problem_on("cuda", torch.bfloat16)) == (torch.bfloat16, "ieee")
    assert bt.LOWP_FEATURES == "float32"
    with bt.use_float32_products("tf32x3"):  # three tf32 products (the bench's plain rows); a float32 call never
        assert bt.lowp_dots(_problem_on("cuda", torch.bfloat16)) == (None, "tf32x3")
        assert bt.lowp_dots(_problem_on("cuda", torch.float32)) == (None, "ieee")
        assert bt.lowp_dots(_problem_on("cpu", torch.bfloat16)) == (None, "ieee")
    assert bt.FLOAT32_PRODUCTS == "bf16x3"
    monkeypatch.setattr(bt, "LOWP_FEATURES", "fp8")
    with pytest.raises(FastRPEError, match="LOWP_FEATURES: 'float32' or 'bfloat16', got 'fp8'"):
        bt.lowp_dots(_problem_on("cuda", torch.bfloat16))
    monkeypatch.setattr(bt, "LOWP_FEATURES", "float32")
    monkeypatch.setattr(bt, "FLOAT32_PRODUCTS", "tf32")
    with pytest.raises(FastRPEError, match="FLOAT32_PRODUCTS: 'tf32x3' or 'bf16x3', got 'tf32'"):
        bt.lowp_dots(_problem_on("cuda", torch.bfloat16))


def test_dot_mode_names_the_precisions():
    assert PRECISIONS == ("ieee", "tf32x3", "bf16x3")
    with pytest.raises(FastRPEError, match="precision: one of ieee, tf32x3, bf16x3, got 'tf32'"):
        dot_mode("tf32")
    # the interpreter's products are exact, but bf16x3's halves are emulated there
    assert [dot_mode(x) for x in PRECISIONS] == ([1, 1, 4] if not _CUDA else [0, 2, 3])


@pytest.mark.skipif(_CUDA, reason="the interpreter's emulation (on CUDA the GPU tests compare against float64)")
@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
def test_bf16x3_products_carry_16_bits(b_dtype):
    """`_dot` with MODE 4 (bf16x3, emulated): a float32 product to about 2^-16 of |a|·|b|,
    far from bf16's rounding (2^-8) and not exact either (the halves are really taken)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g).to(b_dtype)
    ref = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    err = {}
    for mode in (1, 4):
        c = torch.empty(32, 16)
        _product[(1,)](a, b, c, 32, 64, 16, mode)
        err[mode] = float(((c.double() - ref).abs() / scale).max())
    rounded = float(((a.bfloat16().double() @ b.bfloat16().double() - ref).abs() / scale).max())
    assert err[1] < 1e-6 < err[4] < 2.0 ** -14 < rounded / 8


@triton.jit
def _tf32_halves(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    """`triton_chunked._split_tf32` of N values."""
    i = tl.arange(0, N)
    hi, lo = _split_tf32(tl.load(x_ptr + i))
    tl.store(hi_ptr + i, hi)
    tl.store(lo_ptr + i, lo)


@pytest.mark.skipif(_CUDA, reason="the interpreter's exact products (on a GPU the float64 tests judge the real ones)")
@pytest.mark.parametrize("bf16_side", ["left", "right"])
def test_tf32x2_puts_each_half_on_its_side(bf16_side):
    """`_dot` in MODE 2 (tf32x3) with either operand the bf16 one takes `_dot_tf32x2`: `a @ b`
    (the interpreter's tf32 products are exact float32 ones, so this checks which half meets
    which operand)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(64, 16, generator=g)
    if bf16_side == "left":
        a = a.bfloat16()
    else:
        b = b.bfloat16()
    c = torch.empty(32, 16)
    _product[(1,)](a, b, c, 32, 64, 16, 2)
    ref = a.double() @ b.double()
    assert float(((c.double() - ref).abs() / (a.double().abs() @ b.double().abs())).max()) < 1e-6


@pytest.mark.skipif(_CUDA, reason="the interpreter runs the split (the PTX test counts the GPU's passes)")
def test_tf32x2_halves_are_exact_and_keep_tf32x3s_accuracy():
    """`_dot`'s two tf32 products against a bf16 operand (MODE 2, `_dot_tf32x2`): the float32
    operand's halves sum to it exactly, hi holds tf32's 10 explicit bits (rounded to nearest:
    lo within 2^-11 of |x|), and with lo as the tensor cores read it (tf32: its low 13 bits
    dropped) the product is within 2^-21 of |a|·|b|, as tf32x3's (one tf32 rounding of bf16's
    operand would cost 2^-11). Negative, tiny and huge values included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    x[::2] = -x[::2]
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    _tf32_halves[(1,)](x, hi, lo, 4096)
    assert torch.equal(hi + lo, x)
    assert not (hi.view(torch.int32) & 0x1FFF).any()
    assert ((lo.abs() <= 2.0 ** -11 * x.abs()) | (lo == 0)).all()
    a = torch.randn(32, 64, generator=g)
    b = torch.randn(64, 16, generator=g).bfloat16().double()
    a_hi, a_lo = torch.empty_like(a), torch.empty_like(a)
    _tf32_halves[(1,)](a.flatten(), a_hi.view(-1), a_lo.view(-1), 2048)
    tf32 = (lambda t: (t.view(torch.int32) & -0x2000).view(torch.float32))  # what an MMA reads of a float32
    got = tf32(a_lo).double() @ b + tf32(a_hi).double() @ b
    scale = a.double().abs() @ b.abs()
    err = float(((got - a.double() @ b).abs() / scale).max())
    one_pass = float(((tf32(a).double() @ b - a.double() @ b).abs() / scale).max())
    assert err < 2.0 ** -21 < 2.0 ** -13 < one_pass


def _errors(backend, family):
    """Max error of `backend` and of dense, both bf16, against float64 dense: out, dq, dk, dv."""
    from fastrpe.bench.gpu import family_causal, make_position

    pos = make_position(family, H, L)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    g = torch.Generator().manual_seed(0)
    x64 = [torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3)]
    w = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(name, dtype):
        q, k, v = (t.to(DEV, dtype).requires_grad_() for t in x64)
        out = fr.attention(q, k, v, kernel=kern, position=pos, causal=family_causal(family), backend=name)
        return [out.double(), *torch.autograd.grad((out.double() * w.to(DEV)).sum(), (q, k, v))]

    ref = run("dense", torch.float64)
    err = {name: [(a.double() - r).abs().max().item() for a, r in zip(run(name, torch.bfloat16), ref)]
           for name in (backend, "dense")}
    return err[backend], err["dense"]


@pytest.mark.parametrize("backend,family", TRITON_CASES)
def test_bf16x3_products_are_as_accurate_as_dense_bf16(monkeypatch, backend, family):
    """The kernels' bf16x3 products (emulated under the interpreter, run on a GPU): every output
    and gradient within LOWP_FACTOR of dense bf16's error against float64."""
    monkeypatch.setattr(bt, "INTERPRET_ON_CPU", not _CUDA)
    monkeypatch.setattr(bt, "lowp_dots", lambda p: (None, "bf16x3") if p.dtype in (torch.bfloat16, torch.float16)
                        else (None, "ieee"))
    fast, dense = _errors(backend, family)
    for name, e, n in zip(("out", "dq", "dk", "dv"), fast, dense):
        assert e <= LOWP_FACTOR * n, f"{name}: {e:.3g} vs dense bf16 {n:.3g}"


@pytest.mark.parametrize("backend,family", [("triton_chunked", "alibi"), ("triton_soe", "kerple_log"),
                                            ("triton_band", "t5")])
def test_bf16_problem_with_the_gpu_choice_is_as_accurate_as_dense(monkeypatch, backend, family):
    """The GPU's policy (forced here on the CPU) within LOWP_FACTOR of dense bf16, and rounding
    the features to bf16 (`LOWP_FEATURES = "bfloat16"`) measurably worse: the check can fail."""
    monkeypatch.setattr(bt, "INTERPRET_ON_CPU", not _CUDA)
    on_cuda = bt.lowp_dots
    monkeypatch.setattr(bt, "lowp_dots", lambda p: on_cuda(dataclasses.replace(p, device=torch.device("cuda"))))
    fast, dense = _errors(backend, family)
    for name, e, n in zip(("out", "dq", "dk", "dv"), fast, dense):
        assert e <= LOWP_FACTOR * n, f"{name}: {e:.3g} vs dense bf16 {n:.3g}"
    monkeypatch.setattr(bt, "LOWP_FEATURES", "bfloat16")
    rounded, _ = _errors(backend, family)
    assert rounded[1] > 1.5 * fast[1], f"dq: bf16 features {rounded[1]:.3g}, float32 features {fast[1]:.3g}"


def _num_den_ops():
    from fastrpe.ops.linear.soe import soe_plan_for
    from fastrpe.ops.linear.triton_chunked import kernelized_num_den_triton_chunked
    from fastrpe.ops.linear.triton_soe import kernelized_num_den_triton_soe

    plan = soe_plan_for(fr.positions.KerpleLog(H).to(DEV), L)
    gamma = torch.tensor([0.9, 0.99], device=DEV)
    return {"triton_chunked": lambda a, b, v: kernelized_num_den_triton_chunked(a, b, v, gamma=gamma)[:2],
            "triton_soe": lambda a, b, v: kernelized_num_den_triton_soe(a, b, v, plan)[:2],
            # a term per launch: dv adds up over the launches as a pair of bf16 numbers (about 16
            # bits), then is rounded once
            "triton_soe-groups": lambda a, b, v: kernelized_num_den_triton_soe(a, b, v, plan, state_budget=1)[:2]}


@pytest.mark.parametrize("name", ["triton_chunked", "triton_soe", "triton_soe-groups"])
def test_bf16_values_are_read_as_they_are(name):
    """float32 features with bf16 values: the kernels widen v in registers, so num, den and the
    feature gradients equal those of `v.float()` exactly, dv is the float32 dv rounded once (over
    several launches, but for the rare entry the carried pair rounds the other way by one
    step), and no float32 copy of v is kept for backward."""
    op = _num_den_ops()[name]
    g = torch.Generator().manual_seed(0)
    pq, pk = (torch.rand(B, H, 100, F, generator=g).to(DEV).requires_grad_() for _ in range(2))
    v16 = torch.randn(B, H, 100, D, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    v32 = v16.detach().float().requires_grad_()
    wn = torch.randn(B, H, 100, D, generator=g).to(DEV)
    res = {}
    for v in (v16, v32):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            num, den = op(pq, pk, v)
        assert not any(t.dtype == torch.float32 and t.shape == v.shape for t in saved) or v is v32
        res[v.dtype] = (num, den, *torch.autograd.grad((num * wn).sum() + den.sum(), (pq, pk, v)))
    a, b = res[torch.bfloat16], res[torch.float32]
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    once = b[4].to(torch.bfloat16)
    assert a[4].dtype == torch.bfloat16
    if name != "triton_soe-groups":
        assert torch.equal(a[4], once)
    else:  # the pair's 16 bits round the other way now and then, by one bf16 step
        step = 2.0 ** (torch.frexp(once.float())[1] - 8).double()
        diff = (a[4].double() - once.double()).abs()
        assert (diff <= step).all() and (diff == 0).double().mean() >= 0.98
