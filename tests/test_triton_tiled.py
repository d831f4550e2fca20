"""Any Toeplitz term, exactly, in flash-style tiles (`ops/linear/triton_tiled.py`, backend
`triton_tiled`), against a dense reference written here from Luo et al. 2021 Eq. 10:
`num_i = Σ_j exp(b(r_ij) - m_i)·(φq_i·φk_j)·v_j`, `den_i` the same without `v_j`,
`r_ij = j - (q_offset + i)`, causal keeping `r <= 0`, `m_i` the row's largest visible `b`.

On CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1).
"""
import pytest
import torch

_CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

import fastrpe as fr  # noqa: E402
from fastrpe import positions as P  # noqa: E402
from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear import triton_tiled as tt  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import (assert_close, assert_lowp_close, features_and_values, quotient_reference,  # noqa: E402
                             weighted_grads)

DEV = torch.device("cuda" if _CUDA else "cpu")
EXP_SPAN = tt.EXP_TABLE_SPAN
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


def reference(q, k, v, lc, *, causal, q_offset=0, kpm=None, kls=None):
    """Dense sums from the definition, each row scaled by its own largest visible `b` (with
    `kls: [B, H, Lk]`, keys whose true features are `k·exp(kls)`: `b + kls_j`, padding left out)."""
    Lq, Lk = q.shape[2], k.shape[2]
    i = torch.arange(Lq, device=q.device)[:, None]
    j = torch.arange(Lk, device=q.device)[None, :]
    b = lc[:, j - i + Lq - 1]  # (H, Lq, Lk): offset r = j - q_offset - i sits at index r + Lq - 1 + q_offset
    if causal:
        b = b.masked_fill(j > q_offset + i, float("-inf"))
    if kls is not None:
        b = b + kls[:, :, None, :]  # (B, H, Lq, Lk)
        if kpm is not None:
            b = b.masked_fill(kpm[:, None, None, :], float("-inf"))
    m = b.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    a = torch.einsum("bhif,bhjf->bhij", q, k) * torch.exp(b - m)
    if kpm is not None:
        a = a.masked_fill(kpm[:, None, None, :], 0.0)
    return a @ v.to(a.dtype), a.sum(-1), m[..., 0]


def _assert_grads_close(got, want, leaves):
    """The gradients of φq, φk, v and the table from `got` equal those from `want` (weighted
    sums, `weighted_grads`)."""
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), weighted_grads(got, leaves), weighted_grads(want, leaves)):
        assert_close(a, b, msg=name)


def _table(H, R, seed=0, spread=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(H, R, generator=g, dtype=torch.float64)).to(DEV, dtype).requires_grad_()


CASES = [  # B, H, Lq, Lk, F, Dv, q_offset, causal
    (1, 1, 1, 1, 4, 3, 0, True),  # one token
    (1, 2, 1, 70, 12, 10, 69, True),  # one query after 69 keys (a decoding step)
    (2, 3, 63, 63, 12, 10, 0, True),  # odd lengths inside one tile
    (1, 2, 130, 130, 20, 33, 0, True),  # three tiles, widths that are no power of two
    (2, 2, 70, 90, 12, 10, 20, True),  # Lq != Lk with a q_offset
    (2, 2, 70, 90, 12, 10, 0, False),  # not causal, Lq != Lk
    (1, 2, 129, 65, 8, 16, 5, False),  # more queries than keys
    # interior tile pairs (read without masks) beside edge ones: a q_offset that is no multiple
    # of the tile, and lengths that are (every tile full, only the diagonal's pairs masked)
    (1, 2, 130, 200, 12, 10, 70, True),
    (1, 1, 192, 192, 8, 16, 0, True),
    (1, 1, 128, 192, 8, 16, 0, False),
]


@pytest.fixture(params=["table", "exponentials"])
def weights(request, monkeypatch):
    """Both ways the kernels weigh a pair: from the call's table `exp(b - top)` (`exp_table`,
    the default for a table of moderate span) and by an exponential per pair."""
    monkeypatch.setattr(tt, "EXP_TABLE", request.param == "table")
    return request.param


@pytest.mark.parametrize("B,H,Lq,Lk,F,Dv,q_offset,causal", CASES)
def test_tiled_matches_reference(B, H, Lq, Lk, F, Dv, q_offset, causal, weights):
    """float64: num, den, log_scale and the gradients of φq, φk, v and the table."""
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, device=DEV)
    lc = _table(H, Lq + Lk - 1)
    got = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=causal, q_offset=q_offset)
    want = reference(q, k, v, lc, causal=causal, q_offset=q_offset)
    for name, a, b in zip(("num", "den", "log_scale"), got, want):
        assert_close(a, b, msg=name)
    _assert_grads_close(got[:2], want[:2], (q, k, v, lc))


@pytest.mark.parametrize("causal", [True, False])
def test_quotient_and_padding_match_reference(causal, weights):
    """`divide=`: the quotient in place of num, a padded batch row, and a table with `-inf`
    entries (coefficient 0), gradients through the quotient included."""
    B, H, Lq, Lk, F, Dv = 2, 2, 70, 70, 12, 10
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, device=DEV)
    lc = _table(H, Lq + Lk - 1, seed=3)
    with torch.no_grad():
        lc[:, ::7] = float("-inf")
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=DEV)
    kpm[1, -9:] = True
    out, den, _ = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=causal, key_padding_mask=kpm,
                                                     divide=torch.float64)
    rn, rd, _ = reference(q, k, v, lc, causal=causal, kpm=kpm)
    ref = quotient_reference(rn, rd)
    assert_close(out, ref)
    assert_close(den, rd)
    _assert_grads_close([out], [ref], (q, k, v, lc))


def test_a_row_that_sees_nothing_is_zero():
    """Every coefficient a query sees is `-inf` (or it is before every key): num, den 0, its
    log-scale 0, and no NaN anywhere, gradients included."""
    q, k, v = features_and_values(1, 1, 5, 5, 4, 3, device=DEV)
    lc = torch.full((1, 9), float("-inf"), dtype=torch.float64, device=DEV, requires_grad=True)
    num, den, ls = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=True)
    assert torch.equal(num, torch.zeros_like(num)) and torch.equal(den, torch.zeros_like(den))
    assert torch.equal(ls, torch.zeros_like(ls))
    for g in weighted_grads([num, den], (q, k, v, lc)):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_steep_heads_take_the_exponentials_in_the_same_launch(causal, dtype):
    """One launch, three heads: a moderate table (weights from `exp_table`), a ramp spanning more
    than `EXP_TABLE_SPAN` (exponentials: relative to the ramp's top, the weights of a row whose own
    maximum is far below it would underflow in the table), and
    a head with `-inf` entries around a moderate span. Each head's flag is as said, and sums,
    log-scales and gradients are the reference's."""
    H, Lq, Lk = 3, 130, 130
    q, k, v = features_and_values(1, H, Lq, Lk, 12, 10, device=DEV)
    r = torch.arange(-(Lq - 1), Lk, dtype=torch.float64)
    steep = 2.0 * EXP_SPAN[dtype] / (Lq - 1)
    lc = torch.stack([3.0 * torch.randn(Lq + Lk - 1, generator=torch.Generator().manual_seed(7),
                                        dtype=torch.float64),
                      steep * r.abs(),  # largest far away: a causal row's own maximum is far below it
                      torch.where(r.long() % 5 == 0, float("-inf"), torch.cos(r))]).to(DEV)
    lc = lc.requires_grad_()
    _, top, fast = tt.exp_table(lc.detach().to(dtype), causal, Lq, 0)
    assert fast.tolist() == [1, 0, 1]
    assert_close(top[1], torch.tensor(steep * (Lq - 1), dtype=dtype, device=DEV))
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, lc)]
    got = tt.kernelized_num_den_triton_tiled(*cast, causal=causal)
    want = reference(*cast, causal=causal)
    for name, a, b in zip(("num", "den", "log_scale"), got, want):
        assert_close(a, b, msg=name)
    _assert_grads_close(got[:2], want[:2], cast)


def test_a_row_that_sees_nothing_beside_a_table_far_above_zero():
    """The first query sees only a `-inf` entry (log-scale 0) while the table's top is 800: its
    factor `exp(top - m)` would overflow float64; capped, its weights stay 0 and nothing is NaN."""
    q, k, v = features_and_values(1, 1, 70, 70, 4, 3, device=DEV)
    lc = torch.full((1, 139), 800.0, dtype=torch.float64) + torch.rand(1, 139, dtype=torch.float64,
                                                                         generator=torch.Generator().manual_seed(1))
    lc[0, 69] = float("-inf")  # r = 0: all the first query sees
    lc = lc.to(DEV).requires_grad_()
    got = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=True)
    want = reference(q, k, v, lc, causal=True)
    assert torch.equal(got[1][..., 0], torch.zeros_like(got[1][..., 0]))
    for name, a, b in zip(("num", "den", "log_scale"), got, want):
        assert_close(a, b, msg=name)
    _assert_grads_close(got[:2], want[:2], (q, k, v, lc))


def test_float32_table_near_its_span_with_small_features():
    """float32, a head whose table spans just under `EXP_TABLE_SPAN` (so it takes the table),
    the first queries' own maxima far below its top, and features of 1e-3 (a den under 1e-4):
    the output and every gradient finite and within `LOWP_FACTOR` of the dense float32 path's own
    error against float64 (at 77 nats the dk/dv kernel's `inv·exp(top - m)` overflowed here)."""
    g = features_and_values(1, 1, 130, 130, 8, 6, device=DEV)
    r = torch.arange(-129, 130, dtype=torch.float64)
    lc = (0.99 * EXP_SPAN[torch.float32] / 129 * r.abs())[None].to(DEV)  # largest far away
    base = (1e-3 * g[0], 1e-3 * g[1], g[2], lc)
    assert tt.exp_table(lc.float(), True, 130, 0)[2].tolist() == [1]
    runs = []
    for dtype, fn in ((torch.float32, "triton"), (torch.float32, "dense"), (torch.float64, "dense")):
        leaves = [t.detach().to(dtype).requires_grad_() for t in base]
        if fn == "triton":
            out = tt.kernelized_num_den_triton_tiled(*leaves, causal=True, divide=dtype)[0]
        else:
            out = quotient_reference(*reference(*leaves, causal=True)[:2])
        runs.append((out, weighted_grads([out], leaves)))
    (o, gs), (on, gn), (o64, g64) = runs
    assert reference(*(t.detach().float() for t in base), causal=True)[1][0, 0, 0] < 1e-4
    assert_lowp_close(o, on, o64.detach(), msg="out")
    for name, a, n, w in zip(("dq", "dk", "dv", "dtable"), gs, gn, g64):
        assert torch.isfinite(a).all(), name
        assert_lowp_close(a, n, w, msg=name)


def test_causal_never_reads_the_future():
    """Changing keys, values and table entries after a query (r > 0) changes nothing of
    its outputs or of its gradients to the past."""
    q, k, v = features_and_values(1, 2, 90, 90, 12, 10, device=DEV, requires_grad=False)
    lc = _table(2, 179).detach()
    out = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=True)[0]
    k2, v2, lc2 = k.clone(), v.clone(), lc.detach().clone()
    k2[:, :, 50:] += 1.0
    v2[:, :, 50:] -= 2.0
    lc2[:, 90:] += 5.0  # r > 0
    out2 = tt.kernelized_num_den_triton_tiled(q, k2, v2, lc2, causal=True)[0]
    assert torch.equal(out[:, :, :50], out2[:, :, :50])
    assert not torch.equal(out[:, :, 50:], out2[:, :, 50:])


def test_low_precision_against_float64():
    """bf16 values and float32 features, the quotient in bf16 as the backends ask for it:
    within a small factor of the naive path's own error against float64."""
    q, k, v = features_and_values(1, 2, 130, 130, 12, 10, dtype=torch.float32, device=DEV)
    v = v.detach().bfloat16().requires_grad_()
    lc = _table(2, 259, dtype=torch.float32)
    out, _, _ = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=True, divide=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    q64, k64, v64, lc64 = (t.detach().double().requires_grad_() for t in (q, k, v, lc))
    r64 = quotient_reference(*reference(q64, k64, v64, lc64, causal=True)[:2])
    ql, kl, vl, lcl = (t.detach().clone().requires_grad_() for t in (q, k, v, lc))
    rl = quotient_reference(*reference(ql, kl, vl.float(), lcl, causal=True)[:2]).bfloat16()
    assert_lowp_close(out, rl, r64.detach(), msg="out")
    got, lowp, want = (weighted_grads((o,), leaves) for o, leaves in
                       ((out, (q, k, v, lc)), (rl, (ql, kl, vl, lcl)), (r64, (q64, k64, v64, lc64))))
    for name, a, n, r in zip(("dq", "dk", "dv", "dtable"), got, lowp, want):
        assert_lowp_close(a, n, r, msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_key_log_scale_matches_reference(causal):
    """Keys stabilized one by one (causal SIKF's running maximum): each row's log-scale is its
    largest `b + s_j`, per batch row, padding left out; sums and gradients as the reference's."""
    B, H, Lq, Lk, F, Dv = 2, 2, 70, 90, 12, 10
    q, k, v = features_and_values(B, H, Lq, Lk, F, Dv, device=DEV)
    lc = _table(H, Lq + Lk - 1, seed=4, spread=1.0)
    g = torch.Generator().manual_seed(5)
    kls = (4.0 * torch.randn(B, H, Lk, generator=g, dtype=torch.float64)).cummax(-1).values.to(DEV)
    kpm = torch.zeros(B, Lk, dtype=torch.bool, device=DEV)
    kpm[1, -7:] = True
    kls[1, :, -7:] = 50.0  # a padding key's scale must not enter a row's maximum
    got = tt.kernelized_num_den_triton_tiled(q, k, v, lc, causal=causal, q_offset=20, key_padding_mask=kpm,
                                             key_log_scale=kls)
    want = reference(q, k, v, lc, causal=causal, q_offset=20, kpm=kpm, kls=kls)
    assert got[2].shape == (B, H, Lq)
    for name, a, b in zip(("num", "den", "log_scale"), got, want):
        assert_close(a, b, msg=name)
    _assert_grads_close(got[:2], want[:2], (q, k, v, lc))


def test_bad_inputs_say_why():
    q, k, v = features_and_values(1, 2, 8, 8, 4, 3, device=DEV)
    with pytest.raises(FastRPEError, match="log_coeff: expected shape"):
        tt.kernelized_num_den_triton_tiled(q, k, v, _table(2, 14), causal=True)
    with pytest.raises(FastRPEError, match="needs at least one key"):
        tt.kernelized_num_den_triton_tiled(q, k[:, :, :0], v[:, :, :0], None, causal=False)


# ----------------------------------------------------------------------------- the backend


@pytest.fixture
def interpret_on_cpu(monkeypatch):
    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)


def _position(family, H, L):
    g = torch.Generator().manual_seed(2)
    if family == "learned_full":  # a table over every offset, both directions: nothing to clip
        pos = P.LearnedTable(H, max_distance=L - 1, causal=False)
    elif family == "learned":
        pos = P.LearnedTable(H, max_distance=L - 1, causal=True)
    elif family == "t5":
        pos = P.T5Bias(H, num_buckets=8, max_distance=20, bidirectional=False)
    else:
        pos = P.KerpleLog(H)
    pos = pos.double().to(DEV)
    with torch.no_grad():
        for prm in pos.parameters():
            if family != "kerple_log":
                prm.copy_(torch.randn(prm.shape, generator=g, dtype=torch.float64))
    return pos


@pytest.mark.parametrize("family,causal,kernel", [("learned_full", False, "elu"), ("learned", True, "elu"),
                                                  ("t5", True, "elu"), ("kerple_log", True, "elu"),
                                                  ("learned", True, "exp"), ("learned_full", False, "exp")])
def test_backend_equals_dense(interpret_on_cpu, family, causal, kernel):
    """`triton_tiled` through the public API, exact: output and gradients of q, k, v and the
    term's parameters equal the dense backend's (float64), with a padded batch row; SIKF
    (`exp`) too, whose causal keys carry a running maximum."""
    torch.manual_seed(0)
    B, H, L = 2, 2, 70
    q, k, v = (torch.randn(B, H, L, 16, dtype=torch.float64, device=DEV, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(B, L, dtype=torch.bool, device=DEV)
    kpm[0, :4] = True
    pos = _position(family, H, L)
    res = []
    for backend in ("triton_tiled", "dense"):
        out = fr.attention(q, k, v, kernel=kernel, position=pos, causal=causal, backend=backend,
                           key_padding_mask=kpm)
        res.append((out, weighted_grads([out], (q, k, v, *pos.parameters()))))
    (o1, g1), (o2, g2) = res
    assert_close(o1, o2)
    for a, b in zip(g1, g2):
        assert_close(a, b)


def test_backend_refusals_say_why(interpret_on_cpu):
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEV) for _ in range(3))
    pos = _position("learned_full", 2, 8)
    with pytest.raises(FastRPEError, match="only kernelized attention"):
        fr.attention(q, k, v, kernel="softmax", position=pos, causal=False, backend="triton_tiled")
    grid = P.Table2D(2, grid=(2, 4))
    with pytest.raises(FastRPEError, match="2D FFT"):
        fr.attention(q, k, v, kernel="elu", position=grid, causal=False, backend="triton_tiled")


def test_backend_is_exact_and_refused_on_cpu_without_the_interpreter():
    """`auto` may choose it (exact); on the CPU it refuses unless the tests ask for the interpreter."""
    from fastrpe.dispatch import BACKENDS, Problem
    from fastrpe.kernels import get_kernel

    b = BACKENDS["triton_tiled"]
    assert b.exact
    p = Problem(1, 2, 64, 64, 16, 16, torch.float32, torch.device("cpu"), get_kernel("elu", head_dim=16),
                _position("learned_full", 2, 64), (), False, 0, False, False)
    if not _CUDA:
        assert any("CUDA" in r for r in b.not_supported_reasons(p))


@pytest.mark.gpu
def test_tiled_gpu_realistic_size_bf16(monkeypatch):
    """L = 4096, H = 8, F = 32, Dv = 64, a table over every offset, causal and not, bf16 values
    and float32 features by tf32x3 on the GPU, against the float64 reference. Heads 0-5 take the
    weight table (`exp_table`), heads 6-7 (a ramp of 41 nats) the exponentials, in one launch:
    the compiled kernels' branch on each head's flag. First the table against the exponentials
    everywhere (`EXP_TABLE` off; the same kernels otherwise), then both against the dense float32
    path. (The kernels' backward reads the bf16 quotient, as flash attention reads its bf16
    output, where the dense path keeps float32: under the interpreter at L = 256 that put dq at
    4.2x the dense path's error, either way of weighing; `LOWP_FACTOR` is 4.)"""
    if not _CUDA:
        pytest.skip("needs CUDA")
    for causal in (True, False):
        q, k, v = features_and_values(1, 8, 4096, 4096, 32, 64, dtype=torch.float32, device=DEV)
        v = v.detach().bfloat16().requires_grad_()
        lc = _table(8, 8191, dtype=torch.float32).detach()
        lc[6:] = 0.01 * torch.arange(-4095, 4096, device=DEV).abs().float()
        lc.requires_grad_()
        assert tt.exp_table(lc.detach(), causal, 4096, 0)[2].tolist() == [1] * 6 + [0] * 2
        q64, k64, v64, lc64 = (t.detach().double().requires_grad_() for t in (q, k, v, lc))
        r64 = quotient_reference(*reference(q64, k64, v64, lc64, causal=causal)[:2])
        want = weighted_grads((r64,), (q64, k64, v64))
        runs = {}
        for weights in ("table", "exponentials"):
            monkeypatch.setattr(tt, "EXP_TABLE", weights == "table")
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, lc))
            out = tt.kernelized_num_den_triton_tiled(*leaves, causal=causal, divide=torch.bfloat16,
                                                     precision="tf32x3")[0]
            runs[weights] = (out, weighted_grads((out,), leaves[:3]))
        (out, got), (oe, ge) = runs["table"], runs["exponentials"]
        for name, a, e, r in zip(("out", "dq", "dk", "dv"), (out, *got), (oe, *ge), (r64, *want)):
            assert_lowp_close(a, e, r.detach(), msg=f"{name}, table against exponentials")
        ql, kl, vl, lcl = (t.detach().clone().requires_grad_() for t in (q, k, v, lc))
        rl = quotient_reference(*reference(ql, kl, vl.float(), lcl, causal=causal)[:2]).bfloat16()
        assert_lowp_close(out, rl, r64.detach(), msg="out")
        lowp = weighted_grads((rl,), (ql, kl, vl))
        for name, a, n, r in zip(("dq", "dk", "dv"), got, lowp, want):
            assert_lowp_close(a, n, r, msg=name)
