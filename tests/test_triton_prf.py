"""PRF/NPRF features by Triton (`ops/triton_prf.py`) against the PyTorch map written from the
formula (`kernels.PRF.features`, in float64): features and dx, queries and keys, one- and
two-sided, shared and per-head projections, awkward sizes (L = 1, 63, 70 across the 64-row
block; D = 10, M = 6), bf16 inputs, ties at a query's maximum, a zero input under the
normalization's clamp; and `PRF.forward` taking it (`kernels.TRITON_FEATURES`).
Interpreter set-up as in test_triton_chunked.py."""
import copy

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe import kernels  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.kernels import PRF  # noqa: E402
from fastrpe.ops import triton_prf  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.ops.triton_prf import prf_features_triton  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))

VARIANTS = [dict(normalize=True), dict(normalize=False), dict(normalize=True, two_sided=True, num_heads=3),
            dict(normalize=False, two_sided=True, projection="orthogonal")]
VIDS = ["nprf", "prf", "nprf-two-sided-per-head", "prf-two-sided-orf"]


def _reference(kern, x, is_query, dphi):
    """φ and dx from the PyTorch map in float64 (autograd through `features`)."""
    k64 = copy.deepcopy(kern).double()
    x64 = x.detach().double().requires_grad_(True)
    phi = k64.features(k64._prepare(x64), is_query)
    phi.backward(dphi.double())
    return phi.detach(), x64.grad


@pytest.mark.parametrize("is_query", [True, False], ids=["query", "key"])
@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("L", [1, 63, 70])
def test_features_and_grad_match_the_float64_map(variant, is_query, L):
    B, H, D, M = 2, 3, 10, 6
    g = torch.Generator().manual_seed(L)
    kern = PRF(D, M, seed=1, **variant).to(DEV)
    # the head split's strided view, as the attention layers hand it over
    x = torch.randn(B, L, H * D, generator=g).to(DEV).view(B, L, H, D).transpose(1, 2).requires_grad_(True)
    dphi = torch.randn(B, H, L, kern.num_features(D), generator=g).to(DEV)
    phi = prf_features_triton(x, kern, is_query)
    phi.backward(dphi)
    ref, ref_dx = _reference(kern, x, is_query, dphi)
    assert phi.dtype == torch.float32
    torch.testing.assert_close(phi.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tiles", [2, 4])
@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[2]], ids=[VIDS[0], VIDS[2]])
def test_programs_walking_several_row_tiles_give_the_one_tile_results(monkeypatch, variant, tiles):
    """A launch whose programs walk `tiles` row tiles in turn (`triton_prf.TILES`, a launch
    choice) gives the one-tile launch's φ and dx bit for bit, queries and keys, with the last
    program's tiles partly past L (70 rows in 16-row tiles); and short calls keep one tile a
    program (`MIN_PROGRAMS`)."""
    B, H, D, M, L = 1, 3, 10, 6, 70
    g = torch.Generator().manual_seed(5)
    kern = PRF(D, M, seed=1, **variant).to(DEV)
    x = torch.randn(B, L, H * D, generator=g).to(DEV).view(B, L, H, D).transpose(1, 2)
    w = kern.w.float().contiguous()
    shift = kern.key_log_shift().to(device=DEV, dtype=torch.float32).reshape(-1)
    F = kern.num_features(D)
    dphi = torch.randn(B, H, L, F, generator=g).to(DEV)
    assert triton_prf._launch_args(x, w, 16, None, None, tiles)[0] == (5, 3)  # 15 tiles < MIN_PROGRAMS: one each
    monkeypatch.setattr(triton_prf, "MIN_PROGRAMS", 1)
    assert triton_prf._launch_args(x, w, 16, None, None, tiles)[0] == (-(-5 // tiles), 3)
    for is_query in (True, False):
        out = []
        for t in (1, tiles):
            phi = torch.empty(B, H, L, F, device=DEV)
            dx = torch.empty(B, H, L, D, device=DEV)
            triton_prf.prf_forward_launch(x, w, shift, phi, kern, is_query, block_rows=16, tiles=t)
            triton_prf.prf_backward_launch(x, w, shift, dphi, dx, kern, is_query, block_rows=16, tiles=t)
            out.append((phi, dx))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_bf16_inputs_give_float32_features_and_bf16_grads(monkeypatch):
    kern = PRF(16, 8, normalize=True).to(DEV)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 70, 16, generator=g).to(DEV, torch.bfloat16).requires_grad_(True)
    dphi = torch.randn(1, 2, 70, 8, generator=g).to(DEV)
    phi = prf_features_triton(x, kern, True)
    phi.backward(dphi)
    ref, ref_dx = _reference(kern, x, True, dphi)
    assert phi.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(phi.double(), ref, rtol=1e-5, atol=1e-7)
    # dx rounded to bf16 to nearest, as the GPU rounds: no further from float64 than the
    # PyTorch map's bf16 dx (a truncating store, the interpreter's, is 3x further)
    x2 = x.detach().clone().requires_grad_(True)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "never")
    kern(x2, is_query=True).backward(dphi)
    err, err_torch = ((g.double() - ref_dx).abs().max().item() for g in (x.grad, x2.grad))
    assert err <= 1.01 * err_torch, (err, err_torch)


def test_ties_at_a_querys_maximum_and_a_zero_input():
    """x = 0: every exponent is 0, all features tie at the maximum (the share is split among
    them, as `amax` does); x = 0 and a tiny x: the normalization divides by its clamp (no
    radial part)."""
    for kw in (dict(normalize=True, two_sided=True), dict(normalize=False)):
        kern = PRF(8, 4, **kw).to(DEV)
        x = torch.zeros(1, 1, 3, 8, device=DEV)
        x[0, 0, 1] = torch.linspace(-1, 1, 8)
        x[0, 0, 2] = 1e-14 * torch.linspace(-1, 2, 8)  # below the clamp, not zero
        x.requires_grad_(True)
        dphi = torch.randn(1, 1, 3, kern.num_features(8), generator=torch.Generator().manual_seed(0)).to(DEV)
        phi = prf_features_triton(x, kern, True)
        phi.backward(dphi)
        ref, ref_dx = _reference(kern, x, True, dphi)
        torch.testing.assert_close(phi.double(), ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-4, atol=1e-3)


def test_second_derivatives_take_the_pytorch_backward():
    kern = PRF(6, 4, normalize=True).to(DEV)
    x = torch.randn(1, 1, 5, 6, dtype=torch.float32, device=DEV, requires_grad=True)
    (gx,) = torch.autograd.grad(prf_features_triton(x, kern, True).pow(2).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    k64, x64 = copy.deepcopy(kern).double(), x.detach().double().requires_grad_(True)
    (rgx,) = torch.autograd.grad(k64.features(k64._prepare(x64), True).pow(2).sum(), x64, create_graph=True)
    (rggx,) = torch.autograd.grad(rgx.sum(), x64)
    torch.testing.assert_close(ggx.double(), rggx, rtol=1e-4, atol=1e-5)


def test_refusals():
    kern = PRF(8, 4, num_heads=2).to(DEV)
    with pytest.raises(FastRPEError, match="head_dim=8"):
        prf_features_triton(torch.zeros(1, 2, 3, 6, device=DEV), kern, True)
    with pytest.raises(FastRPEError, match="num_heads=2"):
        prf_features_triton(torch.zeros(1, 3, 3, 8, device=DEV), kern, True)
    with pytest.raises(FastRPEError, match="float64"):
        prf_features_triton(torch.zeros(1, 2, 3, 8, device=DEV, dtype=torch.float64), kern, True)


# ---- PRF.forward takes it (`kernels.TRITON_FEATURES`) -----------------------------------------

def test_prf_forward_takes_the_kernel_where_asked(monkeypatch, count_calls):
    calls = count_calls(triton_prf, "prf_features_triton")
    kern = kernels.get_kernel("nprf", head_dim=8, num_features=4).to(DEV)
    x = torch.randn(1, 2, 5, 8, device=DEV, requires_grad=True)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    a = kern(x, is_query=False)
    with torch.no_grad():
        kern(x, is_query=True)
    assert len(calls) == 2
    for x_ in (x.double(), x.detach().double()):  # float64: the PyTorch map
        kern(x_, is_query=True)
    assert len(calls) == 2
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "never")
    b = kern(x, is_query=False)
    assert len(calls) == 2
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "cuda")
    kern(x, is_query=True)
    assert len(calls) == (3 if DEV.type == "cuda" else 2)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "fast")
    with pytest.raises(FastRPEError, match="TRITON_FEATURES"):
        kern(x, is_query=True)


@pytest.mark.gpu
def test_bench_shape_on_cuda():
    """The bench's map (D = 64, 32 NPRF features) at 8 heads × 4,096 bf16 positions."""
    kern = kernels.get_kernel("nprf", head_dim=64, num_features=32).to("cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 4096, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    dphi = torch.randn(1, 8, 4096, 32, generator=g).to("cuda")
    for is_query in (True, False):
        x.grad = None
        phi = prf_features_triton(x, kern, is_query)
        phi.backward(dphi)
        ref, ref_dx = _reference(kern, x, is_query, dphi)
        torch.testing.assert_close(phi.double(), ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-2, atol=1e-3)


def test_launch_choices_from_the_environment_and_bad_ones_in_one_line():
    """`FASTRPE_PRF_LAUNCH` (set by gpu_run.sh to the PRF sweep's pick) sets the three launch
    choices when the module is imported; anything else than BR:num_warps:precision is a
    one-line error."""
    import os
    import subprocess
    import sys

    assert triton_prf.parse_launch("128:8:tf32x3") == (128, 8, "tf32x3", 1)
    assert triton_prf.parse_launch("64:4:bf16x3:8") == (64, 4, "bf16x3", 8)
    for bad in ("100:4:ieee", "8:4:ieee", "64:3:ieee", "64:64:ieee", "64:4:tf32", "64:4", "a:b:c", "²:4:ieee",
                "64:4:ieee:3", "64:4:ieee:0", "64:4:ieee:4:1"):
        with pytest.raises(FastRPEError, match="FASTRPE_PRF_LAUNCH: expected BR:num_warps:precision"):
            triton_prf.parse_launch(bad)
    code = "from fastrpe.ops import triton_prf as t; print(t.launch_choice())"

    def launch(**env):
        base = {k: v for k, v in os.environ.items() if k != "FASTRPE_PRF_LAUNCH"}
        return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                              check=False)

    assert launch(FASTRPE_PRF_LAUNCH="32:2:tf32x3:4").stdout.strip() == "32:2:tf32x3:4"
    assert launch(FASTRPE_PRF_LAUNCH="64:4:bf16x3/16:4:bf16x3").stdout.strip() == "64:4:bf16x3/16:4:bf16x3"
    assert launch(FASTRPE_PRF_LAUNCH="64:4:bf16x3/64:4:bf16x3").stdout.strip() == "64:4:bf16x3"  # one for both
    assert launch(FASTRPE_PRF_LAUNCH="").stdout.strip() == "64:4:tf32x3"  # empty: the defaults
    for bad in ("64:4:fast", "64:4:ieee/16:4:fast", "64:4:ieee/"):
        out = launch(FASTRPE_PRF_LAUNCH=bad)
        assert out.returncode != 0 and "FASTRPE_PRF_LAUNCH: expected" in out.stderr.strip().splitlines()[-1]


def test_the_backward_under_its_own_launch_choices(monkeypatch):
    """`BWD_LAUNCH` (the sweep's "FWD/BWD"): the backward computes φ again under other choices
    than the forward's (another row tile, another precision of the projection), and its dx
    still matches the float64 map's, queries and keys, across the row tiles' edges (L = 70);
    the choices in force at the forward are the ones its backward takes."""
    B, H, D, M, L = 1, 2, 10, 6, 70
    kern = PRF(D, M, seed=1, normalize=True).to(DEV)
    g = torch.Generator().manual_seed(11)
    seen = []
    real = triton_prf.prf_backward_launch

    def spy(*a, **kw):
        seen.append((kw["block_rows"], kw["num_warps"], kw["precision"], kw["tiles"]))
        return real(*a, **kw)

    monkeypatch.setattr(triton_prf, "prf_backward_launch", spy)
    monkeypatch.setattr(triton_prf, "BLOCK_ROWS", 64)
    monkeypatch.setattr(triton_prf, "BWD_LAUNCH", triton_prf.Launch(16, 4, "ieee"))
    for is_query in (True, False):
        x = torch.randn(B, H, L, D, generator=g).to(DEV).requires_grad_(True)
        dphi = torch.randn(B, H, L, kern.num_features(D), generator=g).to(DEV)
        phi = prf_features_triton(x, kern, is_query)
        monkeypatch.setattr(triton_prf, "BWD_LAUNCH", None)  # after the forward: not what its backward takes
        phi.backward(dphi)
        monkeypatch.setattr(triton_prf, "BWD_LAUNCH", triton_prf.Launch(16, 4, "ieee"))
        ref, ref_dx = _reference(kern, x, is_query, dphi)
        torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-4, atol=1e-6)
    assert seen == [(16, 4, "ieee", 1)] * 2
    assert triton_prf.launch_choice() == f"64:{triton_prf.NUM_WARPS}:{triton_prf.PRECISION}/16:4:ieee"
