"""The fused SoE kernels with the PRF maps' backward in their gradient kernels
(`ops/linear/triton_soe_prf.py`) against attention written from Luo et al. 2021 Eq. 10 in
float64 (the map's PyTorch features, dense causal weights `c(p_i - j)`, num/den) and against the
unfused path (the maps' own kernels, then `triton_soe` / `triton_band`): output and the
gradients of q, k, v and of the positional term's parameters; KERPLE log and power (their
sum-of-exponentials plan) and T5 (exact, through the band's plan); one- and two-sided maps,
normalized or not, shared and per-head projections; awkward sizes (L = 1, 63 and 100 across
16-token chunks, Lq != Lk with a q_offset); bf16 and fp16 inputs; KERPLE's terms in two and
three launch groups (a tiny state budget); a causal call never sees the future; the backends
take it only where `FUSED_MAPS` says and the call is covered (`fused_reasons`), and then the
maps' standalone backward does not run. Interpreter set-up as in test_triton_soe.py."""
import copy

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

import fastrpe as fr  # noqa: E402
from fastrpe import backends_triton, kernels, positions  # noqa: E402
from fastrpe.kernels import PRF  # noqa: E402
from fastrpe.ops import triton_prf  # noqa: E402
from fastrpe.ops.kernelized import BandCoefficients  # noqa: E402
from fastrpe.ops.linear import soe  # noqa: E402
from fastrpe.ops.linear import triton_band as tb  # noqa: E402
from fastrpe.ops.linear import triton_soe as ts  # noqa: E402
from fastrpe.ops.linear import triton_soe_prf as tsp  # noqa: E402
from fastrpe.ops.linear.triton_chunked import _pow2, triton_unavailable_reason  # noqa: E402
from fastrpe.ops.triton_prf import prf_features_triton  # noqa: E402
from fastrpe.testing import LOWP_FACTOR, assert_close, assert_lowp_close, weighted_grads  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))

H, D, Dv, CHUNK = 2, 10, 12, 16
VARIANTS = [dict(normalize=True), dict(normalize=False), dict(normalize=False, two_sided=True, num_heads=H),
            dict(normalize=True, two_sided=True, projection="orthogonal")]
VIDS = ["nprf", "prf", "prf-two-sided-per-head", "nprf-two-sided-orf"]
#: fused against unfused in float32: the same sums up to the maps' backward, whose tiles (and
#: so BLAS's order of a product's terms under the interpreter) differ: a few float32 roundings
ROUND_OFF = 16 * torch.finfo(torch.float32).eps


class Term:
    """A positional term as both paths take it: `coeffs(Lq, Lk, q_offset)` for
    `prf_soe_attention`, `unfused(phi_q, phi_k, v, q_offset, divide)` (the `triton_soe` /
    `triton_band` op on features), `weights64(Lq, Lk, q_offset)` the float64 dense causal
    weights `[H, Lq, Lk]` of the reference, and the parameters both differentiate."""

    def __init__(self, name: str, terms: int = 4):
        self.name, self.terms = name, terms
        if name == "t5":  # a support of 23 distances: three near chunks of 16, then the constant tail
            self.pos = positions.T5Bias(H, num_buckets=10, max_distance=32, bidirectional=False)
            with torch.no_grad():
                self.pos.embedding.copy_(torch.randn(self.pos.embedding.shape, generator=torch.Generator().manual_seed(3)))
        else:
            self.pos = positions.KerpleLog(H) if name == "kerple_log" else positions.KerplePower(H)
            with torch.no_grad():  # heads apart
                for p in self.pos.parameters():
                    p.add_(torch.tensor([-0.3, 0.4]))
        self.pos = self.pos.to(DEV)
        self.params = list(self.pos.parameters())

    def plan(self):
        """KERPLE's sum of exponentials: window 8 (two near chunks of 16), `terms` terms (4),
        fitted over 256 distances from the term, differentiable in its parameters."""
        return soe.soe_plan(soe.causal_log_coefficients(self.pos, 256), window=8, num_terms=self.terms)

    def coeffs(self, Lq, Lk, q_offset, plan=None):
        if self.name == "t5":
            return BandCoefficients(self.pos.log_coefficients(Lq, Lk, q_offset), self.pos.finite_support())
        return plan if plan is not None else self.plan()

    def unfused(self, phi_q, phi_k, v, q_offset, divide, state_budget=None):
        Lq, Lk = phi_q.shape[2], phi_k.shape[2]
        if self.name == "t5":
            c = self.coeffs(Lq, Lk, q_offset)
            return tb.kernelized_num_den_triton_band(phi_q, phi_k, v, c.log_coeff, window=c.window, q_offset=q_offset,
                                                     chunk_size=CHUNK, divide=divide)[0]
        return ts.kernelized_num_den_triton_soe(phi_q, phi_k, v, self.plan(), q_offset=q_offset, chunk_size=CHUNK,
                                                divide=divide, state_budget=state_budget)[0]

    def weights64(self, Lq, Lk, q_offset):
        """`c(p_i - j)` for `j <= p_i` (0 after): T5's from its own dense bias (`materialize`) in
        float64; KERPLE's from the plan's definition `Σ_k a_k γ_k^d + [d < W]·corr(d)`."""
        d = (torch.arange(Lq, device=DEV) + q_offset)[:, None] - torch.arange(Lk, device=DEV)[None, :]  # p_i - j
        zero = torch.zeros((), dtype=torch.float64, device=DEV)
        if self.name == "t5":
            # (a gather of the bucket table: exact in float32)
            return torch.where(d >= 0, torch.exp(self.pos.materialize(Lq, Lk, q_offset).double()), zero)
        plan = self.plan()
        r = torch.arange(max(Lk, Lq + q_offset), device=DEV, dtype=torch.float64)
        c = (plan.a[:, None, :] * plan.gamma.double()[None, None, :] ** r[None, :, None]).sum(-1)  # (H, L)
        c = c + torch.nn.functional.pad(plan.corr.double(), (0, r.numel() - plan.window))
        return torch.where(d >= 0, c[:, d.clamp_min(0)], zero)


def reference(q, k, v, kern, weights, dtype=torch.float64):
    """Luo et al. 2021 Eq. 10: `Σ_j c(p_i−j) φ(q_i)·φ(k_j) v_j / Σ_j c(p_i−j) φ(q_i)·φ(k_j)`
    from the map's PyTorch features (`PRF.features`) and dense causal weights `[H, Lq, Lk]`,
    computed in `dtype` (float64; float32, as the map computes a 16-bit call's features, for
    the naive path of a 16-bit call): shares no code with the kernels."""
    km = copy.deepcopy(kern).to(dtype)
    pq = km.features(km._prepare(q.to(dtype)), True)
    pk = km.features(km._prepare(k.to(dtype)), False)
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * weights.to(dtype)  # (B, H, Lq, Lk)
    return torch.einsum("bhij,bhjc->bhic", a, v.to(dtype)) / a.sum(-1, keepdim=True)


def _inputs(B, Lq, Lk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the head split's strided view for q, as the attention layers hand it over
    q = torch.randn(B, Lq, H * D, generator=g).view(B, Lq, H, D).transpose(1, 2)
    k, v = torch.randn(B, H, Lk, D, generator=g), torch.randn(B, H, Lk, Dv, generator=g)
    return [t.to(DEV, dtype).requires_grad_(True) for t in (q, k, v)]


def _fused(q, k, v, kern, term, q_offset, state_budget=None):
    Lq, Lk = q.shape[2], k.shape[2]
    return tsp.prf_soe_attention(q, k, v, kern, term.coeffs(Lq, Lk, q_offset), q_offset=q_offset, chunk_size=CHUNK,
                                 state_budget=state_budget)


def _unfused(q, k, v, kern, term, q_offset, state_budget=None):
    """The maps' own kernels, then the term's op's quotient in q's dtype, as the composition
    asks for it (`divide`)."""
    pq, pk = prf_features_triton(q, kern, True), prf_features_triton(k, kern, False)
    return term.unfused(pq, pk, v, q_offset, q.dtype, state_budget)


def _ref(q, k, v, kern, term, q_offset, dtype=torch.float64):
    return reference(q, k, v, kern, term.weights64(q.shape[2], k.shape[2], q_offset), dtype)


NAMES = ("out", "dq", "dk", "dv", "dpos")


def _results(out, q, k, v, term):
    """out, then the weighted gradients of q, k, v and of the term's parameters (concatenated)."""
    params = [p for p in term.params if p.requires_grad]
    g = weighted_grads((out,), (q, k, v, *params))
    return [out.detach(), *g[:3], torch.cat([x.flatten() for x in g[3:]]) if params else out.new_zeros(0)]


def _assert_round_off(a, b, name):
    if b.numel() == 0:  # (a frozen term's parameters: none)
        assert a.numel() == 0, name
        return
    err, scale = (a.double() - b.double()).abs().max().item(), max(1.0, b.double().abs().max().item())
    assert err <= ROUND_OFF * scale, f"{name}: fused against unfused {err:.3g} (scale {scale:.3g})"


SIZES = {"L1": (1, 1, 0), "L63": (63, 63, 0), "L100": (100, 100, 0), "Lq20-Lk70-off50": (20, 70, 50)}
# every map variant at every size for KERPLE-log; KERPLE-power and T5 (three near chunks) with
# every size for NPRF and every variant at L = 100
CASES = [pytest.param(term, variant, *size, id=f"{term}-{sid}-{vid}")
         for term in ("kerple_log", "kerple_power", "t5") for sid, size in SIZES.items()
         for variant, vid in zip(VARIANTS, VIDS) if term == "kerple_log" or vid == "nprf" or sid == "L100"]


@pytest.mark.parametrize("term,variant,Lq,Lk,q_offset", CASES)
def test_fused_matches_float64_and_the_unfused_path(term, variant, Lq, Lk, q_offset):
    term = Term(term)
    kern = PRF(D, 6, seed=1, **variant).to(DEV)
    q, k, v = _inputs(1, Lq, Lk, seed=Lq + Lk)
    fused = _results(_fused(q, k, v, kern, term, q_offset), q, k, v, term)
    ref = _results(_ref(q, k, v, kern, term, q_offset), q, k, v, term)
    unfused = _results(_unfused(q, k, v, kern, term, q_offset), q, k, v, term)
    for name, a, b, c in zip(NAMES, fused, ref, unfused):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert_close(a, b, torch.float32, msg=name)
        _assert_round_off(a, c, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("term", ["kerple_log", "t5"])
def test_low_precision_inputs_against_float64(term, dtype):
    """16-bit q, k, v (their gradients in their dtype, rounded once): against float64, within
    LOWP_FACTOR of the naive path's error in the same dtype (the reference's formula in float32,
    as the maps compute a 16-bit call's features, its output in the dtype), as the existing
    low-precision tests judge, and within LOWP_FACTOR of the unfused path's, which rounds the
    same sums."""
    term = Term(term)
    kern = PRF(D, 8, seed=2, normalize=True).to(DEV)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _inputs(1, 100, 100, seed=3))
    fused = _results(_fused(q, k, v, kern, term, 0), q, k, v, term)
    unfused = _results(_unfused(q, k, v, kern, term, 0), q, k, v, term)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _results(_ref(q64, k64, v64, kern, term, 0), q64, k64, v64, term)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = _results(_ref(ql, kl, vl, kern, term, 0, torch.float32).to(dtype), ql, kl, vl, term)
    for name, a, n, r, u in zip(NAMES, fused, naive, ref, unfused):
        if name != "dpos":  # (the parameters' gradients stay float32 on every path)
            assert a.dtype == dtype, name
        assert_lowp_close(a, n, r, msg=name)
        err, err_unfused = ((x.double() - r.double()).abs().max().item() for x in (a, u))
        assert err <= LOWP_FACTOR * err_unfused + 1e-6 * max(1.0, r.abs().max().item()), (name, err, err_unfused)


def _groups_budget(B, Lq, Lk, q_offset, kern, terms_a_group):
    """A `state_budget` of `terms_a_group` terms' float32 states (`soe.terms_per_group`'s unit:
    `[B·H, N, BF, BDV]` and z), checked against the groups `triton_soe.launch_group` forms."""
    N, F = -(-max(Lk, q_offset + Lq) // CHUNK), kern.num_features(D)
    per_term = B * H * N * _pow2(F) * (_pow2(Dv) * 4 + 4)
    budget = terms_a_group * per_term
    assert ts.launch_group(B * H, N, F, Dv, torch.float32, 99, budget, ts.STATE_TERMS) == terms_a_group
    return budget


#: (launch groups, the plan's terms): two terms a group, the last one short
GROUPS = {2: 3, 3: 5}
# KERPLE's plans in 2 and 3 launch groups: odd feature counts (7 a side), each map variant at
# an awkward size, Lq != Lk with a q_offset among them
GROUP_CASES = [pytest.param(term, groups, *SIZES[sid], VARIANTS[vi], id=f"{term}-{groups}groups-{sid}-{VIDS[vi]}")
               for term, groups, sid, vi in (("kerple_log", 2, "L63", 0), ("kerple_log", 3, "L100", 2),
                                             ("kerple_log", 3, "Lq20-Lk70-off50", 3),
                                             ("kerple_log", 2, "Lq20-Lk70-off50", 1), ("kerple_power", 3, "L63", 0))]


@pytest.mark.parametrize("term,groups,Lq,Lk,q_offset,variant", GROUP_CASES)
def test_several_launch_groups_match_float64_and_the_unfused_path(term, groups, Lq, Lk, q_offset, variant):
    """KERPLE's terms in 2 and 3 launch groups (a tiny `state_budget`): the earlier groups' dφ
    summed in float32, the last group's kernels taking the whole sum through the maps: output
    and the gradients of q, k, v and the term's parameters against float64, and against the
    unfused path in the same groups to float32 round-off."""
    term = Term(term, terms=GROUPS[groups])
    kern = PRF(D, 7, seed=1, **variant).to(DEV)
    q, k, v = _inputs(1, Lq, Lk, seed=Lq + Lk)
    budget = _groups_budget(1, Lq, Lk, q_offset, kern, 2)
    fused = _results(_fused(q, k, v, kern, term, q_offset, budget), q, k, v, term)
    ref = _results(_ref(q, k, v, kern, term, q_offset), q, k, v, term)
    unfused = _results(_unfused(q, k, v, kern, term, q_offset, budget), q, k, v, term)
    for name, a, b, c in zip(NAMES, fused, ref, unfused):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert_close(a, b, torch.float32, msg=name)
        _assert_round_off(a, c, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_several_launch_groups_in_low_precision(dtype):
    """16-bit q, k, v in 3 launch groups (a bf16 dv summed in bf16 pairs between them): against
    float64 within LOWP_FACTOR of the naive path's error, and of the unfused path's in the same
    groups, as `test_low_precision_inputs_against_float64` judges one group."""
    term = Term("kerple_log", terms=GROUPS[3])
    kern = PRF(D, 8, seed=2, normalize=True).to(DEV)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _inputs(1, 100, 100, seed=3))
    budget = _groups_budget(1, 100, 100, 0, kern, 2)
    fused = _results(_fused(q, k, v, kern, term, 0, budget), q, k, v, term)
    unfused = _results(_unfused(q, k, v, kern, term, 0, budget), q, k, v, term)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _results(_ref(q64, k64, v64, kern, term, 0), q64, k64, v64, term)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = _results(_ref(ql, kl, vl, kern, term, 0, torch.float32).to(dtype), ql, kl, vl, term)
    for name, a, n, r, u in zip(NAMES, fused, naive, ref, unfused):
        if name != "dpos":
            assert a.dtype == dtype, name
        assert_lowp_close(a, n, r, msg=name)
        err, err_unfused = ((x.double() - r.double()).abs().max().item() for x in (a, u))
        assert err <= LOWP_FACTOR * err_unfused + 1e-6 * max(1.0, r.abs().max().item()), (name, err, err_unfused)
    assert torch.equal(fused[3], unfused[3])  # (dv: the same kernels and sums on both paths)


def test_a_causal_call_never_sees_the_future():
    """Rows before position t do not move when keys and values from t on change, and their
    gradient reaches no key or value from t on (KERPLE's far field and T5's tail included)."""
    kern = PRF(D, 6, seed=1, normalize=True).to(DEV)
    t = 57
    for name in ("kerple_log", "t5"):
        term = Term(name)
        q, k, v = _inputs(1, 100, 100, seed=7)
        out = _fused(q, k, v, kern, term, 0)
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[:, :, t:] += 3.0
        v2[:, :, t:] -= 2.0
        out2 = _fused(q, k2, v2, kern, term, 0)
        assert torch.equal(out[:, :, :t], out2[:, :, :t]), name
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
        w[:, :, t:] = 0.0
        dq, dk, dv = torch.autograd.grad((out * w).sum(), (q, k, v))
        assert dk[:, :, t:].abs().max() == 0 and dv[:, :, t:].abs().max() == 0 and dq[:, :, t:].abs().max() == 0, name


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("setting", ["saved-states", "stacked-states", "frozen-term"])
def test_the_states_options_and_a_frozen_term_give_the_same_gradients(monkeypatch, setting, groups):
    """KERPLE's states kept from the forward (`SAVE_STATES_BYTES`; one group only keeps them)
    or built two terms a program (`STATE_TERMS`), or a term that takes no gradient (the bench's:
    no far weights' gradient in the dq kernels, `DWQ`, no near table's), in one launch group or
    two (a stack a group): the fused path as the unfused one under the same option, to float32
    round-off."""
    term = Term("kerple_log")
    if setting == "saved-states":
        monkeypatch.setattr(ts, "SAVE_STATES_BYTES", 1 << 30)
    elif setting == "stacked-states":
        monkeypatch.setattr(ts, "STATE_TERMS", 2)
    else:
        term.pos.requires_grad_(False)
    kern = PRF(D, 6, seed=1, normalize=True).to(DEV)
    q, k, v = _inputs(1, 63, 63, seed=4)
    budget = None if groups == 1 else _groups_budget(1, 63, 63, 0, kern, 2)
    fused = _results(_fused(q, k, v, kern, term, 0, budget), q, k, v, term)
    unfused = _results(_unfused(q, k, v, kern, term, 0, budget), q, k, v, term)
    for name, a, b in zip(NAMES, fused, unfused):
        _assert_round_off(a, b, name)


def _call(q, k, v, kern, pos, **kw):
    backend = "triton_band" if isinstance(pos, positions.T5Bias) else "triton_soe"
    return fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=backend, **kw)


@pytest.mark.parametrize("term", ["kerple_log", "kerple_power", "t5"])
def test_the_backends_take_it_where_asked_and_covered(monkeypatch, count_calls, term):
    """`triton_soe` (KERPLE) and `triton_band` (T5) run the fused path with `FUSED_MAPS` on, for
    a covered call only, with the unfused path's output and gradients (the term's parameters'
    included), and then neither the maps' standalone backward nor the plain dq and dk/dv
    kernels run; key padding declines it, and the call runs unfused."""
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    calls = count_calls(tsp, "prf_soe_attention")
    launches = {name: count_calls(tsp, name) for name in ("launch_dq", "launch_dkv")}
    standalone = count_calls(triton_prf, "prf_backward_launch")
    term = Term(term)
    kern = kernels.get_kernel("nprf", head_dim=D, num_features=8).to(DEV)
    q, k, v = _inputs(1, 70, 70, seed=5)

    def run(**kw):
        return _results(_call(q, k, v, kern, term.pos, **kw), q, k, v, term)

    plain = run()
    assert calls == [] and len(standalone) == 2
    with backends_triton.use_fused_maps(True):
        fused = run()
        assert len(calls) == 1 and len(launches["launch_dq"]) == len(launches["launch_dkv"]) == 1
        assert len(standalone) == 2  # (the fused call's maps ran no backward of their own)
        run(key_padding_mask=torch.zeros(1, 70, dtype=torch.bool, device=DEV))
        assert len(calls) == 1 and len(standalone) == 4
    for name, a, b in zip(NAMES, fused, plain):
        _assert_round_off(a, b, name)


def test_a_call_of_several_launch_groups_runs_fused(monkeypatch, count_calls):
    """KERPLE's terms over the states' budget, a term a launch group (four): `fused_reasons`
    does not decline the call, the backend runs it fused (one launch of each map kernel, the
    last group's; the maps' standalone backward not at all), with the unfused path's output
    and gradients."""
    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", not _CUDA)
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    monkeypatch.setattr(soe, "STATE_BUDGET", 1)  # a term per launch group
    calls = count_calls(tsp, "prf_soe_attention")
    launches = {name: count_calls(tsp, name) for name in ("launch_dq", "launch_dkv")}
    standalone = count_calls(triton_prf, "prf_backward_launch")
    term = Term("kerple_log")
    kern = kernels.get_kernel("nprf", head_dim=D, num_features=8).to(DEV)
    q, k, v = _inputs(1, 40, 40, seed=6)
    assert tsp.fused_reasons(q, k, kern, None, True, None) == []
    plain = _results(_call(q, k, v, kern, term.pos), q, k, v, term)
    assert calls == [] and len(standalone) == 2
    with backends_triton.use_fused_maps(True):
        fused = _results(_call(q, k, v, kern, term.pos), q, k, v, term)
    assert len(calls) == 1 and len(launches["launch_dq"]) == len(launches["launch_dkv"]) == 1
    assert len(standalone) == 2
    for name, a, b in zip(NAMES, fused, plain):
        _assert_round_off(a, b, name)


def test_fused_reasons_say_why(monkeypatch):
    """Each call the fused path does not cover is declined with its reason; a covered one is not."""
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "always")
    kern = PRF(D, 6, seed=1, normalize=True).to(DEV)
    q, k, _ = (t.detach() for t in _inputs(1, 40, 40))

    def why(q=q, kern=kern, kpm=None, causal=True, features_dtype=None):
        return tsp.fused_reasons(q, k, kern, kpm, causal, features_dtype)

    assert why() == []
    cases = {
        "the walk": (None, "far field"),
        "key padding": (why(kpm=torch.zeros(1, 40, dtype=torch.bool, device=DEV)), "padding"),
        "non-causal": (why(causal=False), "causal"),
        "float64": (why(q=q.double()), "float64"),
        "bf16 features": (why(features_dtype=torch.bfloat16), "float32 features"),
        "not PRF": (why(kern=kernels.get_kernel("elu", head_dim=D)), "PRF"),
    }
    with ts.use_far_field("walk"):
        cases["the walk"] = (why(), "far field")
    for case, (reasons, word) in cases.items():
        assert reasons and any(word in r for r in reasons), (case, reasons)
    with monkeypatch.context() as m:
        m.setattr(soe, "STATE_BUDGET", 1)  # a term a launch group: any number of groups is taken
        assert why() == []
    monkeypatch.setattr(kernels, "TRITON_FEATURES", "never")
    assert any("Triton route" in r for r in why())
