"""The chunked decay with the PRF maps' backward in its gradient kernels
(`ops/linear/triton_chunked_prf.py`) against attention written from the definitions in float64
(the map's PyTorch features, dense weights `γ^(p_i - j)`, `j <= p_i`, num/den) and against the
unfused path (the maps' own kernels, then `triton_chunked`): output and the gradients of q, k
and v; one- and two-sided maps, normalized or not, shared and per-head projections, awkward
sizes (L = 1, 63 and 70 across 16-token chunks, Lq != Lk with a q_offset), bf16 inputs; a
causal call never sees the future; the backend takes it only where `FUSED_MAPS` says and the
call is covered (`fused_reasons`). Interpreter set-up as in test_triton_chunked.py."""
import copy

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

import fastrpe as fr  # noqa: E402
from fastrpe import backends_triton, kernels, positions  # noqa: E402
from fastrpe.kernels import PRF  # noqa: E402
from fastrpe.ops.linear import triton_chunked as tc  # noqa: E402
from fastrpe.ops.linear import triton_chunked_prf as tcp  # noqa: E402
from fastrpe.ops.triton_prf import prf_features_triton  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(tc.triton_unavailable_reason(DEV) is not None,
                                reason=str(tc.triton_unavailable_reason(DEV)))

VARIANTS = [dict(normalize=True), dict(normalize=False, two_sided=True, num_heads=2),
            dict(normalize=True, two_sided=True, projection="orthogonal")]
VIDS = ["nprf", "prf-two-sided-per-head", "nprf-two-sided-orf"]


def reference(q, k, v, kern, gamma, q_offset=0):
    """Causal `Σ_j γ^(p_i−j) φ(q_i)·φ(k_j) v_j / Σ_j γ^(p_i−j) φ(q_i)·φ(k_j)`, float64, from
    the map's PyTorch features (`PRF.features`) and dense weights: shares no code with the
    kernels."""
    k64 = copy.deepcopy(kern).double()
    pq = k64.features(k64._prepare(q.double()), True)
    pk = k64.features(k64._prepare(k.double()), False)
    Lq, Lk = q.shape[2], k.shape[2]
    p = torch.arange(Lq, dtype=torch.float64, device=q.device)[:, None] + q_offset
    j = torch.arange(Lk, dtype=torch.float64, device=q.device)[None, :]
    g = gamma.double()[:, None, None] if gamma is not None else torch.ones(1, 1, 1, dtype=torch.float64, device=q.device)
    w = torch.where(j <= p, g ** (p - j).clamp_min(0), torch.zeros((), dtype=torch.float64, device=q.device))
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * w  # (B, H, Lq, Lk)
    return torch.einsum("bhij,bhjc->bhic", a, v.double()) / a.sum(-1, keepdim=True)


def _inputs(B, H, Lq, Lk, D, Dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the head split's strided view for q, as the attention layers hand it over
    q = torch.randn(B, Lq, H * D, generator=g).view(B, Lq, H, D).transpose(1, 2)
    k, v = torch.randn(B, H, Lk, D, generator=g), torch.randn(B, H, Lk, Dv, generator=g)
    do = torch.randn(B, H, Lq, Dv, generator=g)
    return [t.to(DEV, dtype).requires_grad_(True) for t in (q, k, v)] + [do.to(DEV)]


def _grads(out, xs, do):
    return (out,) + torch.autograd.grad(out, xs, do.to(out.dtype))


def _unfused(q, k, v, kern, gamma, q_offset):
    """The maps' own kernels, then the chunked kernels' quotient in q's dtype, as the
    composition asks for it (`divide`)."""
    pq, pk = prf_features_triton(q, kern, True), prf_features_triton(k, kern, False)
    out, den, _ = tc.kernelized_num_den_triton_chunked(pq, pk, v, gamma=gamma, q_offset=q_offset, chunk_size=16,
                                                       divide=q.dtype)
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=VIDS)
@pytest.mark.parametrize("Lq,Lk,q_offset", [(1, 1, 0), (63, 63, 0), (70, 70, 0), (20, 70, 50)],
                         ids=["L1", "L63", "L70", "Lq20-Lk70-off50"])
def test_fused_matches_float64_and_the_unfused_path(variant, Lq, Lk, q_offset):
    B, H, D, Dv = 1, 2, 10, 12
    kern = PRF(D, 6, seed=1, **variant).to(DEV)
    gamma = torch.tensor([0.8, 0.97], device=DEV)
    q, k, v, do = _inputs(B, H, Lq, Lk, D, Dv, seed=Lq + Lk)
    fused = _grads(tcp.prf_chunked_attention(q, k, v, kern, gamma=gamma, q_offset=q_offset, chunk_size=16),
                   (q, k, v), do)
    ref = _grads(reference(q, k, v, kern, gamma, q_offset), (q, k, v), do)
    unfused = _grads(_unfused(q, k, v, kern, gamma, q_offset), (q, k, v), do)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), fused, ref, unfused):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        # (row 0's dq is round-off about 0: one key, whatever the query)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6 * max(1.0, float(c.detach().abs().max())),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_bf16_inputs_and_no_decay():
    """bf16 q, k, v (bf16 gradients, rounded once), γ = 1: as close to float64 as the unfused
    path's, which rounds the same sums: in the root mean square, and entry by entry within one
    bf16 step of the largest (the two round a sum to bf16 once each, either side)."""
    kern = PRF(16, 8, seed=2, normalize=True).to(DEV)
    q, k, v, do = _inputs(1, 2, 70, 70, 16, 16, dtype=torch.bfloat16, seed=3)
    fused = _grads(tcp.prf_chunked_attention(q, k, v, kern, chunk_size=16), (q, k, v), do)
    ref = _grads(reference(q, k, v, kern, None), (q, k, v), do)
    unfused = _grads(_unfused(q, k, v, kern, None, 0), (q, k, v), do)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), fused, ref, unfused):
        assert a.dtype == torch.bfloat16, name
        b = b.detach().double()
        rms, rms_unfused = ((a.double() - b) ** 2).mean().sqrt(), ((c.double() - b) ** 2).mean().sqrt()
        assert rms <= 1.25 * rms_unfused + 1e-7, (name, float(rms), float(rms_unfused))
        err, err_unfused = (a.double() - b).abs().max(), (c.double() - b).abs().max()
        assert err <= err_unfused + 2.0 ** -7 * b.abs().max(), (name, float(err), float(err_unfused))


def test_a_causal_call_never_sees_the_future():
    """Rows before position t do not move when keys and values from t on change, and their
    gradient reaches no key or value from t on."""
    kern = PRF(10, 6, seed=1, normalize=True).to(DEV)
    gamma = torch.tensor([0.9, 1.0], device=DEV)
    q, k, v, do = _inputs(1, 2, 70, 70, 10, 12, seed=7)
    t = 37
    out = tcp.prf_chunked_attention(q, k, v, kern, gamma=gamma, chunk_size=16)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, t:] += 3.0
    v2[:, :, t:] -= 2.0
    out2 = tcp.prf_chunked_attention(q, k2, v2, kern, gamma=gamma, chunk_size=16)
    assert torch.equal(out[:, :, :t], out2[:, :, :t])
    do = do.clone()
    do[:, :, t:] = 0.0
    _, dq, dk, dv = _grads(out, (q, k, v), do)
    assert dk[:, :, t:].abs().max() == 0 and dv[:, :, t:].abs().max() == 0 and dq[:, :, t:].abs().max() == 0


def test_the_backend_takes_it_where_asked_and_covered(monkeypatch, count_calls):
    """`triton_chunked` runs the fused path with `FUSED_MAPS` on, for a covered call only,
    with the unfused path's results; key padding or a decay that needs its gradient decline
    it (`fused_reasons`), and the call runs unfused."""
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    calls = count_calls(tcp, "prf_chunked_attention")
    H = 2
    kern = kernels.get_kernel("nprf", head_dim=16, num_features=8).to(DEV)
    pos = positions.make("alibi", H, causal=True, max_len=70).to(DEV)
    q, k, v, do = _inputs(1, H, 70, 70, 16, 16, seed=5)

    def run(**kw):
        out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="triton_chunked", **kw)
        return _grads(out, (q, k, v), do)

    plain = run()
    assert calls == []
    with backends_triton.use_fused_maps(True):
        fused = run()
        assert len(calls) == 1
        run(key_padding_mask=torch.zeros(1, 70, dtype=torch.bool, device=DEV))
        assert len(calls) == 1
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    x = q.detach()
    assert tcp.fused_reasons(x, x, kern, None, None, True, None) == []
    why = tcp.fused_reasons(x, x, kernels.get_kernel("elu", head_dim=16), torch.ones(H, requires_grad=True),
                            torch.zeros(1, 70, dtype=torch.bool), False, torch.bfloat16)
    assert len(why) == 5 and any("PRF" in w for w in why) and any("padding" in w for w in why)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "never")
    assert any("Triton route" in w for w in tcp.fused_reasons(x, x, kern, None, None, True, None))


def test_at_the_gpu_benchs_shapes_the_fused_path_gives_the_unfused_sums(monkeypatch):
    """D = 64, 32 NPRF features, bf16, through `fastrpe.attention` (the bench's row): the same
    output and gradients as the unfused path, to the bit under the interpreter (both sum the
    same products exactly there), to float32 round-off on a GPU (the maps' backward there takes
    the attention's products, the unfused one the map's own)."""
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    H, L, D = 2, 80, 64
    kern = kernels.get_kernel("nprf", head_dim=D, num_features=32).to(DEV)
    pos = positions.make("alibi", H, causal=True, max_len=L).to(DEV)
    q, k, v, do = _inputs(1, H, L, L, D, D, dtype=torch.bfloat16, seed=9)
    res = []
    for on in (False, True):
        with backends_triton.use_fused_maps(on):
            out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="triton_chunked")
            res.append(_grads(out, (q, k, v), do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *res):
        if _CUDA:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()), msg=name)
        else:
            assert torch.equal(a, b), name
