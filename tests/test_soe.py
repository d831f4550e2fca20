"""Sum-of-exponentials backend: linear-time causal kernelized attention for any decaying
positional term, within 1e-3 of the exact path; marked approximate in explain()."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.ops.common import LaterReads
from fastrpe.ops.linear.soe import soe_fit_error

H, D = 3, 16


def _pos(name):
    if name == "kerple_log":
        return P.KerpleLog(H, r1=[0.5, 1.5, 3.0], r2=[0.1, 1.0, 2.0])
    if name == "kerple_power":
        return P.KerplePower(H, r1=[0.05, 0.3, 1.0], p=[0.5, 1.0, 1.5])
    if name == "learned":  # a table up to distance 40, constant beyond
        t = P.LearnedTable(H, max_distance=40)
        with torch.no_grad():
            t.table.copy_(-0.1 * torch.arange(81.0).sub(40).abs()[None].expand(H, -1) + torch.randn(H, 81) * 0.3)
        return t
    return P.make(name, H, max_len=64)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "learned"])
@pytest.mark.parametrize("Lq,Lk", [(1200, 1200), (200, 1200)])
def test_soe_output_within_1e3_of_exact(name, Lq, Lk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, Lq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, H, Lk, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, H, Lk, D, generator=g, dtype=torch.float64, requires_grad=True)
    pos = _pos(name).double()
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=16).double()
    ref = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="dense")
    out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="soe")
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-3, rel
    params = [q, k, v, *pos.parameters()]
    u = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * u).sum(), params)
    g_out = torch.autograd.grad((out * u).sum(), params)
    for a, b in zip(g_out, g_ref):
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_soe_never_sees_the_future():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 300, D, generator=g) for _ in range(3))
    pos = _pos("kerple_log")
    with torch.no_grad():
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
        for i in (0, 150, 298):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, i + 1:] *= 10
            v2[:, :, i + 1:] = 1e3
            o2 = fr.attention(q, k2, v2, kernel="elu", position=pos, causal=True, backend="soe")
            assert torch.equal(o2[:, :, : i + 1], out[:, :, : i + 1])


def test_explain_marks_soe_approximate_and_auto_skips_it():
    q = torch.zeros(1, H, 2048, D)
    ex = fr.explain(q, q, q, kernel="elu", position=_pos("kerple_log"), causal=True)
    assert "APPROXIMATE" in str(ex) or "approximate" in str(ex)
    assert ex.chosen != "soe"
    ex2 = fr.explain(q, q, q, kernel="elu", position=_pos("kerple_log"), causal=True, allow_approximate=True)
    assert any(c.backend == "soe" and not c.reasons for c in ex2.candidates)


def test_fit_error_is_reported_and_small():
    lc = _pos("kerple_log").double().log_coefficients(1, 2000).detach()  # b(d), d = 0..1999 (symmetric)
    err = soe_fit_error(lc)
    assert 0 <= err < 1e-4, err  # in units of c(0)


def test_soe_refuses_geometric_decays():
    q = torch.zeros(1, H, 64, D)
    with pytest.raises(fr.FastRPEError, match="chunked runs it exactly"):
        fr.attention(q, q, q, kernel="elu", position=P.ALiBi(H), causal=True, backend="soe")


def test_prefix_outputs_do_not_depend_on_the_sequence_length():
    # one fit serves every length up to SOE_FIT_LENGTH: a prefix's outputs are bit-identical
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 257, D, generator=g, dtype=torch.float64) for _ in range(3))
    pos = _pos("kerple_log").double()
    with torch.no_grad():
        full = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
        for n in (1, 64, 130):
            part = fr.attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], kernel="elu", position=pos, causal=True,
                                backend="soe")
            torch.testing.assert_close(part, full[:, :, :n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "learned"])
def test_soe_decoding_reproduces_forward_with_constant_state(name):
    E, Hh, n_prompt, n_total = 24, 3, 37, 150  # the band (W = 64) fills and then slides
    torch.manual_seed(0)
    pos = _pos(name)
    mha = fr.nn.MultiheadAttention(E, Hh, kernel="nprf", position=pos, causal=True, backend="soe").double()
    assert mha.decode_state == "soe"
    x = torch.randn(2, n_total, E, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x)
        exact = fr.nn.MultiheadAttention(E, Hh, kernel="nprf", position=pos, causal=True, backend="dense").double()
        exact.load_state_dict(mha.state_dict())
        ref = exact(x)
        out, state = mha.step(x[:, :n_prompt])
        outs, sizes = [out], []
        for t in range(n_prompt, n_total):
            o, state = mha.step(x[:, t:t + 1], state)
            outs.append(o)
            sizes.append(state.nbytes())
    assert isinstance(state, fr.nn.SoEState) and state.length == n_total
    dec = torch.cat(outs, 1)
    torch.testing.assert_close(dec, full, rtol=1e-9, atol=1e-10)  # same fit: the same function
    rel = ((dec - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-3, rel  # and within the backend's accuracy of exact attention
    assert sizes[-1] == sizes[64 - n_prompt] and max(sizes) == sizes[-1]  # constant once the band is full


def test_soe_decode_state_select_for_beams():
    torch.manual_seed(0)
    mha = fr.nn.MultiheadAttention(16, 2, kernel="elu", position=P.KerpleLog(2), causal=True, backend="soe")
    x = torch.randn(3, 10, 16)
    with torch.no_grad():
        _, st = mha.step(x)
        sel = st.select(torch.tensor([2, 0]))
        mha.step(x[[2, 0], -1:], sel)  # a selected state decodes on
        _, st2 = mha.step(x[[2, 0]])
    assert sel.S.shape[0] == 2 and sel.length == st.length
    torch.testing.assert_close(sel.S, st2.S)


def _noisy_table(Hh=H, reach=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = P.LearnedTable(Hh, max_distance=reach, causal=True)
    with torch.no_grad():
        t.table.copy_(6 * torch.rand(Hh, reach + 1, generator=g) - 3)  # no decay to fit beyond the band
    return t


@pytest.mark.parametrize("name", ["t5", "noisy_table"])
def test_soe_refuses_terms_it_cannot_fit(name):
    """A term with steps or noise beyond the exact band is refused with the measured error,
    by the forward backend, by auto even when approximation is allowed, and by decoding."""
    pos = _noisy_table() if name == "noisy_table" else P.make("t5", H, causal=True, max_len=256)
    if name == "t5":
        with torch.no_grad():
            for prm in pos.parameters():
                prm.copy_(torch.randn(prm.shape, generator=torch.Generator().manual_seed(0)))
    q = torch.randn(1, H, 300, D)
    with pytest.raises(fr.FastRPEError, match=r"misplaces .* of a row's positional weight"):
        fr.attention(q, q, q, kernel="elu", position=pos, causal=True, backend="soe")
    ex = fr.explain(q, q, q, kernel="elu", position=pos, causal=True, allow_approximate=True)
    assert ex.chosen != "soe" and any(c.backend == "soe" and c.reasons for c in ex.candidates)
    # both have a finite support: the reason points to the exact band backend
    assert any(c.backend == "soe" and "band is exact" in " ".join(c.reasons) for c in ex.candidates)
    mha = fr.nn.MultiheadAttention(H * D, H, kernel="elu", position=pos, causal=True, backend="soe")
    assert mha.decode_state == "kv" and "misplaces" in mha.decoder().fatal
    with pytest.raises(fr.FastRPEError, match=r"cannot decode with this term: .*misplaces .* row's positional weight"):
        mha.step(torch.randn(1, 5, H * D))


def test_soe_accepts_a_table_that_ends_inside_the_band():
    """Up to the band width the table is exact; beyond it the edge entry is a constant: fits."""
    pos = _noisy_table(reach=40)
    q = torch.randn(1, H, 300, D, dtype=torch.float64)
    out = fr.attention(q, q, q, kernel="elu", position=pos.double(), causal=True, backend="soe")
    ref = fr.attention(q, q, q, kernel="elu", position=pos.double(), causal=True, backend="dense")
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-6


@pytest.mark.parametrize("r1,r2", [(1.5, 1.0), (2.0, 0.5), (1.5, 0.3), (0.1, 0.1), (5.0, 5.0)])
def test_weight_error_small_for_kerple_log(r1, r2):
    """Column-equilibrated fit: every KERPLE-log shape misplaces under a fifth of the limit of a
    row's weight with the default 16 terms, at most 1.2e-5 (a ridge scaled to the slow rates'
    columns once left 3e-4 for r1=2, r2=0.5)."""
    from fastrpe.ops.linear.soe import SOE_MAX_WEIGHT_ERROR, causal_log_coefficients, soe_weight_error

    b = causal_log_coefficients(P.KerpleLog(1, r1=[r1], r2=[r2]).double(), 4096)
    assert float(soe_weight_error(b)) < SOE_MAX_WEIGHT_ERROR / 5


def _bump_table(reach=120, at=100):
    """Decays smoothly to distance `at`, then jumps up by 5 nats: a fit that ends before `at`
    cannot know, one that reaches it refuses."""
    t = P.LearnedTable(H, max_distance=reach, causal=True)
    d = torch.arange(reach, -1, -1, dtype=torch.float32)  # entry reach + r holds b(r), r = -d
    with torch.no_grad():
        t.table.copy_(torch.where(d < at, -0.05 * d, torch.zeros(())).expand(H, -1))
    return t


def test_decoding_past_the_fit_is_checked_or_refused(monkeypatch):
    from fastrpe.ops.linear import soe as soe_mod

    # a term that dies out within the fit: its fit holds further (a power law that never does, as
    # KERPLE log, is fitted to its fit length and misplaces 1.3e-3 at twice it: refused below)
    kp = P.KerplePower(H).double()
    plan = soe_mod.soe_plan(soe_mod.causal_log_coefficients(kp, 300))
    longer, why = soe_mod.soe_extend(plan, kp, 400)
    assert why is None and longer.fit_length == 600 and longer.a is plan.a  # the same function, checked further
    kl = P.KerpleLog(H).double()
    _, why = soe_mod.soe_extend(soe_mod.soe_plan(soe_mod.causal_log_coefficients(kl, 300)), kl, 400)
    assert "misplaces" in why
    _, why = soe_mod.soe_extend(soe_mod.soe_plan(soe_mod.causal_log_coefficients(_bump_table(), 64)), _bump_table(), 70)
    assert "misplaces" in why

    monkeypatch.setattr(soe_mod, "SOE_FIT_LENGTH", 64)
    mha = fr.nn.MultiheadAttention(H * D, H, kernel="elu", position=_bump_table(), causal=True, backend="soe")
    x = torch.randn(1, 70, H * D)
    with torch.no_grad():
        _, st = mha.step(x[:, :20])
        assert isinstance(st, fr.nn.SoEState) and st.plan.fit_length == 64
        for t in range(20, 64):
            _, st = mha.step(x[:, t:t + 1], st)
        with pytest.raises(fr.FastRPEError, match="cannot decode past 64 tokens: .*misplaces"):
            mha.step(x[:, 64:65], st)
        # asked up front for the whole generation, the fit sees the jump and soe is refused
        assert "misplaces" in str(mha.decoder(130))
        with pytest.raises(fr.FastRPEError, match="cannot decode with this term: .*misplaces"):
            mha.step(x[:, :20], max_length=130)


def test_the_fit_verdict_is_read_once_per_parameter_state(monkeypatch):
    """The refusal reads the fit's error on the host (a GPU stream sync): a frozen term pays it on
    its first call only; a parameter update (in-place, as an optimizer does) is judged again."""
    import fastrpe.ops.linear.soe as soe_mod

    calls = []
    real = soe_mod.soe_weight_error
    monkeypatch.setattr(soe_mod, "soe_weight_error", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    pos = P.KerpleLog(2)
    q, k, v = (torch.randn(1, 2, 50, 8) for _ in range(3))
    fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
    first = len(calls)  # one fit per number of terms tried
    assert first >= 1
    for _ in range(2):
        fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
    assert len(calls) == first
    with torch.no_grad():
        pos.raw_r1.add_(0.1)
    fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
    assert len(calls) > first


def test_a_slowly_decaying_term_takes_more_exponentials():
    """A fit takes the fewest terms of `TERM_CHOICES` within SOE_MAX_WEIGHT_ERROR. The GPU
    bench's KERPLE power (exponents 0.5..1.5, dying out by d ≈ 1,600), frozen as the bench
    runs it, takes 9 at 64k (32 before the rates followed the term's reach and the fit weighed
    errors as rows count them, 12 with the rates' grid from W/16 to 4x the reach); its KERPLE log
    takes 11 (was 16); with autograd on or off alike. A slowly decaying power (r1 = 0.02,
    p = 0.25 and 1) takes 14 at 3,000 tokens, and its output stays within the promised 1e-3 of
    exact."""
    from fastrpe.ops.linear.soe import SOE_MAX_WEIGHT_ERROR, soe_terms

    power = P.KerplePower(8, p=torch.linspace(0.5, 1.5, 8))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            K, err = soe_terms(power, 65536)
            assert K == 9 and err <= SOE_MAX_WEIGHT_ERROR
            assert soe_terms(P.KerpleLog(8), 65536)[0] == 11
    power = P.KerplePower(2, r1=0.02, p=torch.tensor([0.25, 1.0]))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3000, 8, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        assert soe_terms(power, 3000)[0] == 14
        out = fr.attention(q, k, v, kernel="elu", position=power.double(), causal=True, backend="soe")
        ref = fr.attention(q, k, v, kernel="elu", position=power.double(), causal=True, backend="dense")
    assert (out - ref).abs().max() < 1e-3


def test_fit_weights_do_not_cancel_and_follow_the_term_smoothly():
    """The ridge on the fitted weights keeps Σ|a| small: without it 12 terms fitted KERPLE log
    with Σ|a| = 190, a fast term cancelling against the exact band correction, which float32
    kernels then sum with 1e-5 errors. And the rates follow the term's reach smoothly
    (`live_distance`), so a float32 copy of a term gets its float64 original's fit up to
    round-off."""
    from fastrpe.ops.linear.soe import causal_log_coefficients, soe_plan

    d = torch.arange(4096, dtype=torch.float64)
    for pos in (P.KerpleLog(3), P.KerplePower(3, p=torch.tensor([0.5, 1.0, 1.5]))):
        b64 = causal_log_coefficients(pos.double(), 4096).detach()
        b32 = causal_log_coefficients(pos.float(), 4096).detach()
        for K in (12, 16):
            p64, p32 = soe_plan(b64, num_terms=K), soe_plan(b32, num_terms=K)
            assert p64.a.abs().sum(-1).max() < 11, (type(pos).__name__, K)
            # the coefficients the kernels use: fitted beyond the band, fitted + correction in it
            coef = [(p.a[:, None, :] * p.gamma ** d[:, None]).sum(-1) + Fn.pad(p.corr, (0, 4096 - p.window))
                    for p in (p64, p32)]
            assert (coef[0] - coef[1]).abs().max() < 1e-7, (type(pos).__name__, K)


def test_a_frozen_terms_fit_is_kept_and_a_trainable_ones_is_not(count_calls):
    """`soe_plan_for`: a term that takes no gradient is fitted once per parameter state (the fit
    is ~80 launches a GPU call would pay each time); an in-place edit refits; a term in training
    is fitted in the graph on every call, so that its gradients flow."""
    import fastrpe.ops.linear.soe as soe_mod

    fits = count_calls(soe_mod, "soe_plan")
    pos = P.KerpleLog(2)
    pos.requires_grad_(False)
    q, k, v = (torch.randn(1, 2, 50, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    outs = [fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe") for _ in range(3)]
    n = len(fits)  # the verdict's fits (soe_terms) and one plan
    assert soe_mod.soe_plan_for(pos, 50) is soe_mod.soe_plan_for(pos, 50) and len(fits) == n
    assert all(torch.equal(o, outs[0]) for o in outs)
    with torch.no_grad():
        pos.raw_r1.add_(0.3)
    edited = soe_mod.soe_plan_for(pos, 50)
    fresh = soe_mod.soe_plan(soe_mod.causal_log_coefficients(pos, soe_mod.soe_fit_length(50)),
                             num_terms=edited.num_terms)
    assert len(fits) > n + 1 and torch.equal(edited.a, fresh.a) and torch.equal(edited.corr, fresh.corr)
    pos.requires_grad_(True)
    first, second = soe_mod.soe_plan_for(pos, 50), soe_mod.soe_plan_for(pos, 50)
    assert first is not second and first.a.requires_grad
    out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
    out.sum().backward()
    assert pos.raw_r1.grad is not None and pos.raw_r1.grad.abs().sum() > 0
    with torch.no_grad():  # no gradient asked: kept again
        assert soe_mod.soe_plan_for(pos, 50) is soe_mod.soe_plan_for(pos, 50)


class _Landed:
    """A copy that has arrived (an event whose query is true)."""

    def query(self):
        return True


@pytest.fixture
def gpu_training(monkeypatch):
    """The GPU's training path on the CPU: each call's fit check is copied at once (the
    copies listed in `.copies`, the host memory a GPU run would read)."""
    import fastrpe.ops.linear.soe as soe_mod

    copies = []

    class AtOnce(LaterReads):
        @staticmethod
        def _copy(t):
            copies.append(t.clone())
            return _Landed(), copies[-1]

    monkeypatch.setattr(soe_mod, "_checked_on_the_gpu", soe_mod.takes_grad)
    monkeypatch.setattr(soe_mod, "_FIT_CHECKS", AtOnce())
    soe_mod.copies = copies
    return soe_mod


def _training(pos, L=50):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 8, generator=g) for _ in range(3))
    opt = torch.optim.SGD(pos.parameters(), lr=0.05)

    def step():
        out = fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="soe")
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()
    return step


def test_a_term_in_training_on_a_gpu_reads_nothing_per_step(gpu_training, monkeypatch):
    """Training on a GPU: every step is a new parameter state. The fit's verdict is read on
    the host once, at the first call; later steps keep its term count and check their own
    fit on the device, read later from host memory: no tensor is read on a step."""
    from fastrpe import api

    step = _training(P.KerpleLog(2))
    step()
    check = api.check_qkv
    monkeypatch.setattr(api, "check_qkv", lambda q, k, v, **kw: check(q, k, v, check_finite=False))

    def read(name):
        real = getattr(torch.Tensor, name)

        def guarded(self, *a, **kw):
            if not any(self is c for c in gpu_training.copies):  # a landed host copy may be read
                raise AssertionError(f"Tensor.{name} read on a training step")
            return real(self, *a, **kw)
        return guarded

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, read(name))
    n = len(gpu_training.copies)
    for _ in range(3):
        step()
    assert len(gpu_training.copies) == n + 3  # each step's fit checked on the device


def test_a_term_in_training_on_a_gpu_takes_terms_with_headroom(gpu_training):
    """The verdict a term in training on a GPU keeps for its next steps takes the fewest terms
    within a quarter of the limit (the GPU bench's KERPLE power at 64k: 15, frozen 9), so that
    the steps after it, new terms fitted with its count, pass the check too."""
    power = P.KerplePower(8, p=torch.linspace(0.5, 1.5, 8))
    K, err = gpu_training.soe_terms(power, 65536)
    assert K == 15 and err <= gpu_training.SOE_MAX_WEIGHT_ERROR * gpu_training.TRAINING_HEADROOM
    with torch.no_grad():
        assert gpu_training.soe_terms(power, 65536)[0] == 9


def test_the_far_samples_go_to_the_device_once_per_length(gpu_training, monkeypatch):
    """Each training step fits again, at the same distances: they are made and copied to the
    device once (a copy from pageable host memory at every step cannot be captured in a
    CUDA graph), and made again for another fit length."""
    made = []
    orig = gpu_training._far_samples
    monkeypatch.setattr(gpu_training, "_far_samples", lambda *a: made.append(a) or orig(*a))
    monkeypatch.setattr(gpu_training, "_FAR_ON_DEVICE", {})
    step = _training(P.KerpleLog(2), L=60)
    for _ in range(3):
        step()
    assert len(made) == 1
    _training(P.KerpleLog(2), L=5000)()
    assert len(made) == 2 and made[0] != made[1]


def test_under_compile_the_far_samples_are_a_constant_made_on_the_device(monkeypatch):
    """Traced, the distances are a constant of the graph: made on the call's device, not on the
    host and copied inside the graph (a copy a backend may run at every call; a CPU tensor in a
    GPU graph is what Inductor's CUDA-graph check looks for). The same distances as eager's."""
    from fastrpe.ops.linear import soe

    eager = soe._far_samples_on(32, 5000, torch.device("cpu"))
    made, tensor = [], torch.tensor

    def recording(*a, **k):
        made.append(torch.device(k["device"]) if k.get("device") is not None else None)
        return tensor(*a, **k)

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch, "tensor", recording)
    traced = soe._far_samples_on(32, 5000, torch.device("meta"))
    assert made == [torch.device("meta")]  # made there, not made on the host and copied
    assert traced.device.type == "meta" and traced.shape == eager.shape and traced.dtype == torch.long
    assert soe._far_samples_on(32, 20, torch.device("meta")).device.type == "meta"  # none: still there


def test_a_failing_fit_found_on_the_gpu_is_fitted_again_at_the_next_call(gpu_training, monkeypatch):
    """A step whose fit fails the device check is reported at the next call, which takes a
    verdict of its own: here (every fit misplacing all of a row's weight) the refusal."""
    step = _training(P.KerpleLog(2))
    step()
    step()
    monkeypatch.setattr(gpu_training, "soe_weight_error", lambda b, plan=None: torch.ones(b.shape[0]))
    step()  # runs on the kept verdict; its fit is checked on the device, read at the next call
    with pytest.warns(RuntimeWarning, match="fits again"), pytest.raises(fr.FastRPEError, match="misplaces 1.0e"):
        step()


def test_a_refused_term_in_training_on_a_gpu_is_judged_again_at_its_next_state(gpu_training, monkeypatch):
    """A refusal is not kept as a term's latest verdict: the next parameter state is judged on
    its own, and runs once it fits."""
    pos = P.KerpleLog(2)
    step = _training(pos)
    real = gpu_training.soe_weight_error
    monkeypatch.setattr(gpu_training, "soe_weight_error", lambda b, plan=None: torch.ones(b.shape[0]))
    with pytest.raises(fr.FastRPEError, match="misplaces"):
        step()
    with torch.no_grad():
        pos.raw_r1.add_(0.01)  # a new state
    monkeypatch.setattr(gpu_training, "soe_weight_error", real)
    step()
