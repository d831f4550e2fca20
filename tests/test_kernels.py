"""Feature maps (`fastrpe.kernels`): shapes and dtypes on awkward sizes, positivity,
random features that estimate softmax's kernel, seeded buffers, exact and per-position
stabilizers, finiteness at large norms and in low precision, gradients, `get_kernel`."""
from __future__ import annotations

import math

import pytest
import torch

from fastrpe import kernels as K
from fastrpe.testing import assert_close, tol

BASE = ["elu", "relu", "exp", "dpfp", "prf", "orf", "sphere_prf", "trf"]
MAPS = BASE + ["n" + n for n in BASE]
RANDOM = {"prf", "orf", "sphere_prf", "trf"}
SIGNED = {"trf", "ntrf"}  # every other map promises features >= 0
PRFS = ["prf", "orf", "sphere_prf"]
DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _x(B=2, H=3, L=63, D=60, scale=1.0, dtype=torch.float32, seed=0):
    """`[B, H, L, D]` Gaussian inputs from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * scale).to(dtype)


def _kernel(name, D=60, m=16, seed=0):
    return K.get_kernel(name, head_dim=D, num_features=m, seed=seed)


def _raw_prf(kern: K.PRF, x):
    """Unstabilized `exp(w·sx − ‖sx‖²/2)/√m` in float64, for checking the stabilizers."""
    x = x.double()
    if kern.normalize:
        x = torch.nn.functional.normalize(x, dim=-1)
    xs = x * kern.input_scale
    e = xs @ kern.w.double().T - xs.pow(2).sum(-1, keepdim=True) / 2
    return torch.exp(e) / math.sqrt(kern.m)


# --- shapes, dtypes, signs ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values())[:3], ids=list(DTYPES)[:3])
@pytest.mark.parametrize("B,H,L,D", [(2, 3, 1, 60), (2, 3, 63, 60), (1, 1, 5, 7)], ids=lambda v: str(v))
@pytest.mark.parametrize("name", MAPS)
def test_shapes_dtypes_and_signs(name, B, H, L, D, dtype):
    kern = _kernel(name, D=D, m=16)
    x = _x(B, H, L, D, dtype=dtype)
    for is_query in (True, False):
        f = kern(x, is_query=is_query)
        assert f.shape == (B, H, L, kern.num_features(D))
        assert f.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # never low precision
        assert torch.isfinite(f).all()
        if name not in SIGNED:
            assert bool((f >= 0).all())
    if name in SIGNED:
        assert bool((kern(_x(L=63, D=D), is_query=False) < 0).any())  # TRF really is signed


def test_num_features():
    D = 60
    expect = {"elu": D, "relu": D, "exp": D, "dpfp": 2 * D, "prf": 64, "orf": 64, "sphere_prf": 64, "trf": 128}
    for name, F in expect.items():
        assert K.get_kernel(name, head_dim=D).num_features(D) == F, name
        assert K.get_kernel("n" + name, head_dim=D).num_features(D) == F, name
    assert K.DPFP(nu=3).num_features(D) == 6 * D
    assert K.get_kernel("prf", head_dim=D, num_features=10).num_features(D) == 10


def test_dpfp_matches_schlag_definition():
    x = _x(1, 1, 3, 5, dtype=torch.float64)
    r = torch.relu(torch.cat([x, -x], -1))  # (.., 2D)
    nu = 2
    # Schlag et al.'s reference code: cat of rolls times cat of copies
    ref = torch.cat([r] * nu, -1) * torch.cat([r.roll(j, -1) for j in range(1, nu + 1)], -1)
    assert_close(K.DPFP(nu=nu)(x), ref)


# --- random features ----------------------------------------------------------------------

@pytest.mark.parametrize("name", PRFS)
def test_random_features_estimate_softmax_kernel(name):
    """`φ(q)·φ(k)` estimates `exp(q·k/√D)` up to a per-query factor (which cancels): compare
    attention rows entry by entry; the relative error falls with m and is small at m=4096."""
    D = 16
    q, k = _x(1, 1, 4, D, scale=0.3, dtype=torch.float64)[0, 0], _x(1, 1, 32, D, scale=0.3, dtype=torch.float64, seed=1)[0, 0]
    exact = torch.softmax(q @ k.T / math.sqrt(D), -1)  # (4, 32)
    errs = {}
    for m in (16, 4096):
        e = []
        for seed in range(4):
            kern = K.get_kernel(name, head_dim=D, num_features=m, seed=seed).double()
            a = kern(q, is_query=True) @ kern(k, is_query=False).T
            e.append(((a / a.sum(-1, keepdim=True) - exact).abs() / exact).mean().item())
        errs[m] = sum(e) / len(e)
    assert errs[4096] < errs[16] / 4, errs  # 256x the features: ~1/16 in expectation
    assert errs[4096] < 0.05, errs


def test_trf_estimates_softmax_on_normalized_inputs():
    D = 16
    q, k = _x(1, 1, 4, D, dtype=torch.float64)[0, 0], _x(1, 1, 32, D, dtype=torch.float64, seed=1)[0, 0]
    qn, kn = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    exact = torch.softmax(qn @ kn.T / math.sqrt(D), -1)
    errs = []
    for m in (16, 4096):
        kern = K.get_kernel("trf", head_dim=D, num_features=m).double()
        a = kern(q, is_query=True) @ kern(k, is_query=False).T
        errs.append(((a / a.sum(-1, keepdim=True) - exact).abs() / exact).mean().item())
    assert errs[1] < errs[0] / 4 and errs[1] < 0.02, errs


def test_orthogonal_rows_within_blocks():
    d, m = 8, 20  # blocks of 8, 8 and 4 rows
    w = K.get_kernel("orf", head_dim=d, num_features=m).w.double()
    for start in range(0, m, d):
        blk = w[start:start + d]
        blk = blk / blk.norm(dim=-1, keepdim=True)
        assert_close(blk @ blk.T, torch.eye(len(blk), dtype=torch.float64), torch.float32)
    assert w.norm(dim=-1).std() > 0.1  # chi-distributed norms, not all √d
    # Haar blocks: no coordinate has a fixed sign (plain Householder QR fixes one per block)
    first = torch.stack([K.get_kernel("orf", head_dim=d, num_features=d, seed=s).w[0] for s in range(40)])
    frac = (first > 0).double().mean(0)
    assert bool(((frac > 0.15) & (frac < 0.85)).all()), frac


def test_sphere_rows_have_norm_sqrt_d():
    d, m = 60, 100
    w = K.get_kernel("sphere_prf", head_dim=d, num_features=m).w
    assert_close(w.norm(dim=-1), torch.full((m,), math.sqrt(d)))


def test_iid_rows_are_standard_gaussian():
    w = K.get_kernel("prf", head_dim=64, num_features=512).w.double()
    assert abs(w.mean().item()) < 0.02 and abs(w.var().item() - 1.0) < 0.03


def test_input_scale_is_an_argument():
    D = 16
    assert K.PRF(D).input_scale == pytest.approx(D ** -0.25)
    x = _x(1, 1, 3, D, dtype=torch.float64)
    a = K.PRF(D, 8, input_scale=1.0).double()
    b = K.PRF(D, 8, input_scale=D ** -0.25).double()
    assert_close(a(x * D ** -0.25, is_query=False), b(x, is_query=False))


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_seeded_determinism_and_redraw(name):
    a, b = _kernel(name, D=8, seed=3), _kernel(name, D=8, seed=3)
    assert torch.equal(a.w, b.w)
    x = _x(D=8)
    assert torch.equal(a(x, is_query=False), b(x, is_query=False))
    assert not torch.equal(a.w, _kernel(name, D=8, seed=4).w)
    before = a.w.clone()
    a(x)  # using the map never redraws
    assert torch.equal(a.w, before)
    a.redraw()
    assert a.seed == 4 and not torch.equal(a.w, before)
    assert torch.equal(a.w, _kernel(name, D=8, seed=4).w)
    a.double().redraw(seed=3)  # in place: keeps the buffer's dtype
    assert a.w.dtype == torch.float64 and torch.equal(a.w, before.double())


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_projection_is_a_buffer_in_state_dict(name):
    a, b = _kernel(name, D=8, seed=1), _kernel(name, D=8, seed=2)
    assert "w" in dict(a.named_buffers()) and "w" in a.state_dict()
    assert not list(a.parameters())
    a.redraw(seed=7)
    b.load_state_dict(a.state_dict())
    x = _x(D=8)
    assert torch.equal(a(x, is_query=False), b(x, is_query=False))
    assert a.to(torch.float64).w.dtype == torch.float64  # moves with .to()


# --- stabilizers --------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("name", PRFS)
def test_prf_stabilizers_are_exact(name, normalize):
    """Query features = exact ones times a factor per query; key features = exact ones times
    `exp(-key_log_shift())`, one data-independent factor for every key."""
    kern = _kernel(("n" if normalize else "") + name, D=12, m=16).double()
    x = _x(2, 3, 9, 12, scale=0.5, dtype=torch.float64)
    ratio_q = kern(x, is_query=True) / _raw_prf(kern, x)  # (B, H, L, m)
    assert_close(ratio_q, ratio_q[..., :1].expand_as(ratio_q))
    ratio_k = kern(x, is_query=False) / _raw_prf(kern, x)
    shift = kern.key_log_shift()
    assert_close(ratio_k, torch.exp(-shift).expand_as(ratio_k))
    assert torch.equal(shift, kern.key_log_shift())  # depends on w only
    assert kern.key_log_shift().shape == ()


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("name", PRFS)
def test_prf_key_bound_is_tight_and_never_exceeded(name, normalize):
    """The worst key (aligned with the longest projection row, at the norm maximizing the
    exponent) reaches exactly `1/√m`; huge keys stay below it."""
    kern = _kernel(("n" if normalize else "") + name, D=12, m=16).double()
    w = kern.w.double()
    top = w.norm(dim=-1).argmax()
    worst = w[top] / kern.input_scale  # un-normalized: the sup is at s·x = w
    f = kern(worst[None, None, None], is_query=False)
    assert_close(f.max(), torch.tensor(1 / math.sqrt(kern.m), dtype=torch.float64))
    big = _x(2, 3, 9, 12, scale=1e3, dtype=torch.float64)
    assert bool((kern(big, is_query=False) <= 1 / math.sqrt(kern.m) * (1 + 1e-12)).all())
    assert bool((kern(big, is_query=True) <= 1 / math.sqrt(kern.m) * (1 + 1e-12)).all())


def test_exp_and_trf_stabilizers():
    """Exp: features are exp(x) times a factor of the position's own; TRF: [sin, cos](w·sx)/√m."""
    x = _x(1, 2, 5, 6, dtype=torch.float64)
    for is_query in (True, False):
        r = K.Exp()(x, is_query=is_query) / torch.exp(x)
        assert_close(r, r[..., :1].expand_as(r))
    trf = K.TRF(6, 4, normalize=False).double()
    wx = (x * trf.input_scale) @ trf.w.T
    assert_close(trf(x, is_query=False), torch.cat([wx.sin(), wx.cos()], -1) / 2.0)
    assert_close(trf(x, is_query=True), trf(x, is_query=False))


@pytest.mark.parametrize("name", MAPS)
def test_stabilizer_is_per_position(name):
    """Changing query/key j changes no other position's features; a prefix alone gives the
    same features as inside the whole sequence."""
    kern = _kernel(name)
    x = _x(L=10)
    y = x.clone()
    y[:, :, 7] = y[:, :, 7] * 50 + 3
    keep = [i for i in range(10) if i != 7]
    for is_query in (True, False):
        fx, fy = kern(x, is_query=is_query), kern(y, is_query=is_query)
        assert torch.equal(fx[:, :, keep], fy[:, :, keep])
        assert_close(kern(x[:, :, :4], is_query=is_query), fx[:, :, :4])


# --- extremes and gradients ---------------------------------------------------------------

def _all_maps():
    yield from MAPS
    yield "trf_raw"  # TRF without normalization: only reachable through the class


def _make(name, D=60, m=16):
    return K.TRF(D, m, normalize=False) if name == "trf_raw" else _kernel(name, D=D, m=m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("name", list(_all_maps()))
def test_finite_at_large_norms(name, dtype):
    kern = _make(name)
    x = _x(L=8)
    x = x / x.norm(dim=-1, keepdim=True) * torch.tensor([1e3, 1e2, 1.0, 1e-3, 1e3, 1e3, 1e3, 0.0])[:, None]
    x[:, :, 4] = x[:, :, 4].abs()  # all-positive and all-negative directions too
    x[:, :, 5] = -x[:, :, 4]
    x = x.to(dtype).requires_grad_(True)
    for is_query in (True, False):
        # keys as the composition takes them: `exp` (SIKF) keys share one shift there
        f = kern(x, is_query=True) if is_query else kern.key_features(x)[0]
        assert torch.isfinite(f).all(), (name, is_query)
        # not through the zero row: normalize's gradient there is 1/eps = 1e12 (> fp16's max)
        (g,) = torch.autograd.grad((f[:, :, :7] * torch.linspace(-1, 1, f.shape[-1])).sum(), x)
        assert torch.isfinite(g).all(), (name, is_query)


GRADCHECK = ["elu", "relu", "exp", "dpfp", "dpfp2", "prf", "orf", "sphere_prf", "trf", "trf_raw",
             "nelu", "nexp", "nprf"]


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck(name):
    kern = K.DPFP(nu=2) if name == "dpfp2" else _make(name, D=4, m=3)
    kern = kern.double()
    x = (_x(1, 2, 3, 4, dtype=torch.float64) + 0.1).requires_grad_(True)
    for is_query in (True, False):
        assert torch.autograd.gradcheck(lambda t, iq=is_query: kern(t, is_query=iq), (x,), **tol(torch.float64) | {"atol": 1e-6})


_PRF_VARIANTS = [dict(normalize=n, two_sided=t, num_heads=h) for n in (False, True) for t in (False, True)
                 for h in (None, 2)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("cfg", _PRF_VARIANTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_prf_lean_backward_matches_autograd(cfg, dtype):
    """PRF's hand-written backward (`_PRFFeatures`) against autograd through the very ops of
    `PRF.features`, queries (the maximum's gradient) and keys, a zero row too."""
    kern = K.PRF(6, 5, **cfg)
    kern = kern.double() if dtype == torch.float64 else kern
    x = _x(2, 2, 9, 6, dtype=torch.float64)
    x[0, 0, 0] = 0.0
    x = x.to(dtype)
    w = torch.randn(2, 2, 9, kern.num_features(6), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for is_query in (True, False):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        f1 = kern(x1, is_query=is_query)
        assert f1.grad_fn is not None and "PRFFeatures" in type(f1.grad_fn).__name__
        f2 = kern.features(kern._prepare(x2), is_query)
        assert torch.equal(f1, f2)
        (g1,) = torch.autograd.grad((f1.double() * w).sum(), x1)
        (g2,) = torch.autograd.grad((f2.double() * w).sum(), x2)
        rtol = 1e-12 if dtype == torch.float64 else 1e-2
        torch.testing.assert_close(g1.double(), g2.double(), rtol=rtol, atol=rtol * float(g2.abs().max()))


def test_prf_lean_backward_ties_split_as_amax():
    """Two equal largest exponents share the maximum's gradient, as `amax` splits it."""
    kern = K.PRF(2, 2).double()
    with torch.no_grad():
        kern.w.copy_(torch.tensor([[1.0, 0.0], [1.0, 0.0]]))  # both projections equal: a tie everywhere
    x = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (g1,) = torch.autograd.grad((kern(x1) * w).sum(), x1)
    (g2,) = torch.autograd.grad((kern.features(kern._prepare(x2), True) * w).sum(), x2)
    torch.testing.assert_close(g1, g2, rtol=1e-13, atol=1e-13)


def test_prf_forward_and_backward_in_blocks_of_positions(monkeypatch):
    """The features and their backward taken a few positions at a time (`PRF_BLOCK_BYTES`,
    uneven last block) give those of one block."""
    kern = K.PRF(6, 5, normalize=True, num_heads=2)
    x = _x(2, 2, 11, 6).requires_grad_()
    w = torch.randn(2, 2, 11, 5, generator=torch.Generator().manual_seed(4))
    whole = {}
    for block in (1 << 28, 2 * 2 * 6 * 4 * 3):  # all at once; 3 positions per block
        monkeypatch.setattr(K, "PRF_BLOCK_BYTES", block)
        assert (K._prf_block(x, 4) >= 11) == (block == 1 << 28)  # one block, or several
        for is_query in (True, False):
            phi = kern(x, is_query=is_query)
            (g,) = torch.autograd.grad((phi * w).sum(), x)
            if is_query in whole:
                torch.testing.assert_close(phi, whole[is_query][0], rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(g, whole[is_query][1], rtol=1e-6, atol=1e-7)
            whole[is_query] = (phi, g)


def test_prf_key_shift_is_kept_only_while_w_is_unchanged():
    """The cached key shift is recomputed after a redraw, an in-place write, `.to()` and a
    `load_state_dict`: it always equals a fresh computation."""
    import copy

    kern = K.PRF(6, 5, normalize=True, num_heads=2)

    def _uncached(k):
        c = copy.deepcopy(k)
        c.__dict__.pop("_shift_cache", None)
        return c

    def check(k):
        torch.testing.assert_close(k.key_log_shift(), type(k).key_log_shift(_uncached(k)), rtol=0, atol=0)

    check(kern)
    first = kern.key_log_shift()
    assert kern.key_log_shift() is first  # kept
    kern.redraw()
    check(kern)
    with torch.no_grad():
        kern.w.mul_(2.0)
    check(kern)
    kern = kern.double()
    assert kern.key_log_shift().dtype == torch.float64
    check(kern)
    other = K.PRF(6, 5, normalize=True, num_heads=2, seed=7).double()
    kern.load_state_dict(other.state_dict())
    check(kern)
    torch.testing.assert_close(kern.key_log_shift(), other.key_log_shift(), rtol=0, atol=0)


def test_prf_second_derivatives():
    kern = K.PRF(4, 3, normalize=True, two_sided=True).double()
    x = (_x(1, 1, 3, 4, dtype=torch.float64) + 0.1).requires_grad_(True)
    for is_query in (True, False):
        assert torch.autograd.gradgradcheck(lambda t, iq=is_query: kern(t, is_query=iq), (x,))


def test_prf_saves_only_its_input_and_features():
    """What the feature map holds for backward: x and φ (the bytes autograd would keep were
    the float32, normalized and scaled copies, the projections and the exponents)."""
    kern = K.get_kernel("nprf", head_dim=64, num_features=32)
    x = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        phi = kern(x, is_query=True)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert sum(held.values()) == x.numel() * 2 + phi.numel() * 4


# --- get_kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", MAPS)
def test_get_kernel_names(name):
    kern = K.get_kernel(name, head_dim=8)
    base = name.removeprefix("n")
    assert isinstance(kern, K.FeatureMap) and isinstance(kern, K.Kernel) and not isinstance(kern, K.Softmax)
    assert kern.normalize == (name.startswith("n") or base == "trf")  # "trf" is RFA's normalized form
    cls = {"elu": K.EluPlusOne, "relu": K.ReLU, "exp": K.Exp, "dpfp": K.DPFP, "trf": K.TRF}.get(base, K.PRF)
    assert type(kern) is cls
    if base in RANDOM:
        assert kern.m == K.DEFAULT_NUM_FEATURES == 64 and kern.head_dim == 8
        assert kern.projection == {"orf": "orthogonal", "sphere_prf": "sphere"}.get(base, "iid")


def test_get_kernel_softmax_instances_and_seed():
    assert isinstance(K.get_kernel("softmax"), K.Softmax) and isinstance(K.get_kernel(None), K.Softmax)
    assert not isinstance(K.get_kernel("softmax"), K.FeatureMap)
    inst = K.PRF(8, 5)
    assert K.get_kernel(inst, head_dim=16) is inst
    sm = K.Softmax()
    assert K.get_kernel(sm) is sm
    assert torch.equal(K.get_kernel("orf", head_dim=8, seed=5).w, K.PRF(8, projection="orthogonal", seed=5).w)
    assert K.TRF(8).normalize and not K.PRF(8).normalize and not K.EluPlusOne().normalize


def test_get_kernel_errors():
    with pytest.raises(ValueError, match=r"kernel: unknown kernel 'foo'.*softmax, elu, relu, exp, dpfp, prf, prf2, orf, sphere_prf, trf"):
        K.get_kernel("foo")
    with pytest.raises(ValueError, match="unknown kernel 'nsoftmax'"):
        K.get_kernel("nsoftmax")
    with pytest.raises(ValueError, match=r"kernel: .*'orf'.*needs head_dim"):
        K.get_kernel("orf")
    with pytest.raises(ValueError, match="kernel: expected a name"):
        K.get_kernel(3)
    with pytest.raises(ValueError, match="kernel: head_dim and num_features must be positive"):
        K.get_kernel("prf", head_dim=8, num_features=0)
    with pytest.raises(ValueError, match="kernel: projection must be"):
        K.PRF(8, projection="gaussian")
    with pytest.raises(ValueError, match="kernel: DPFP needs nu >= 1"):
        K.DPFP(nu=0)
    with pytest.raises(ValueError, match="built for head_dim=8"):
        K.get_kernel("prf", head_dim=8)(_x(D=6))
