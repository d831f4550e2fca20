"""The one-token decode step of the constant-size states (`MultiheadAttention._step_token`):
token by token it gives the full forward pass, past the band and the SoE window; it equals
the general step (the one autograd takes); its memos follow in-place parameter updates and
dtype changes; and its aten op count stays where `benchmarks/decode_ops.py` measured it."""
from __future__ import annotations

import pytest
import torch
from _benchmarks import load_benchmark

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.nn import attention as attention_mod
from fastrpe.testing import assert_close

E, H = 12, 3  # D = 4


def _term(family):
    torch.manual_seed(1)
    if family == "alibi":
        return P.ALiBi(H)
    if family == "t5":  # a short band (W = 16) so that decoding runs well past it
        t = P.T5Bias(H, bidirectional=False, num_buckets=8, max_distance=24)
        with torch.no_grad():
            t.embedding.normal_(0, 0.5)
        return t
    return P.KerpleLog(H)


KINDS = [("alibi", "auto", fr.nn.LinearState), ("t5", "auto", fr.nn.BandState), ("kerple_log", "soe", fr.nn.SoEState)]
IDS = [k.__name__ for _, _, k in KINDS]


def _layer(family, backend, **kw):
    torch.manual_seed(0)
    return fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_term(family), causal=True, backend=backend,
                                    **kw).double()


def _decode(mha, x, prompt, grad=False, **kw):
    """Outputs of a prompt then single tokens, and the states after each call."""
    with torch.set_grad_enabled(grad):
        out, st = mha.step(x[:, :prompt] if mha.batch_first else x[:prompt], **kw)
        outs, states = [out], [st]
        for t in range(prompt, x.shape[1 if mha.batch_first else 0]):
            out, st = mha.step(x[:, t:t + 1] if mha.batch_first else x[t:t + 1], st)
            outs.append(out)
            states.append(st)
    return torch.cat(outs, 1 if mha.batch_first else 0), states


@pytest.mark.parametrize("family,backend,kind", KINDS, ids=IDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_token_by_token_equals_the_full_forward_in_float64(family, backend, kind, batch_first):
    mha = _layer(family, backend, batch_first=batch_first)
    L = 90  # past the band (16) and the SoE window (64)
    x = torch.randn(2, L, E, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    with torch.no_grad():
        full = mha(x)
    dec, states = _decode(mha, x, 3, max_length=L)
    assert isinstance(states[-1], kind) and states[-1].length == L
    torch.testing.assert_close(dec, full, rtol=1e-9, atol=1e-10)


def _assert_states_close(a, b):
    assert type(a) is type(b) and a.length == b.length
    for f in ("S", "keys", "values"):
        if hasattr(a, f):
            assert_close(getattr(a, f), getattr(b, f))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused_qkv", "separate_qkv"])
@pytest.mark.parametrize("family,backend,kind", KINDS, ids=IDS)
def test_the_token_step_equals_the_general_step(monkeypatch, family, backend, kind, fuse):
    """Without autograd a token takes `_step_token`; with it, the general path: same
    outputs and states, every step (`fuse=False`: a layer too big to fuse q/k/v)."""
    if not fuse:
        monkeypatch.setattr(attention_mod, "STEP_FUSE_MAX_BYTES", 0)
    mha = _layer(family, backend)
    x = torch.randn(2, 30, E, dtype=torch.float64)
    fast, fast_states = _decode(mha, x, 5, max_length=30)
    slow, slow_states = _decode(mha, x, 5, grad=True, max_length=30)
    assert slow.requires_grad and not fast.requires_grad
    assert_close(fast, slow.detach())
    for a, b in zip(fast_states, slow_states):
        _assert_states_close(a, b)


def test_a_hooked_projection_is_called_not_fused():
    """A hook or an adapter on q/k/v must see the call: the token step then projects through
    the modules (and still gives the general step's result)."""
    mha = _layer("alibi", "auto")
    x = torch.randn(2, 8, E, dtype=torch.float64)
    seen = []
    mha.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    fast, _ = _decode(mha, x, 5)
    slow, _ = _decode(mha, x, 5, grad=True)
    assert seen.count(1) == 2 * 3  # each single token, once per decode
    assert_close(fast, slow.detach())


def _edit_in_place(mha, family):
    with torch.no_grad():
        mha.q_proj.weight.mul_(1.5)
        mha.v_proj.bias.add_(0.25)
        if family == "alibi":
            mha.position.slopes.mul_(0.5)
        elif family == "t5":
            mha.position.embedding.add_(1.0)


@pytest.mark.parametrize("family,backend,kind", KINDS, ids=IDS)
def test_memos_follow_parameter_updates_and_dtype_changes(family, backend, kind):
    mha = _layer(family, backend)
    x = torch.randn(1, 40, E, dtype=torch.float64)
    with torch.no_grad():
        _, st = mha.step(x[:, :38], max_length=64)
        before, _ = mha.step(x[:, 38:39], st)  # builds the memos
        _edit_in_place(mha, family)
        after, st2 = mha.step(x[:, 38:39], st)
    with torch.enable_grad():
        ref, ref_st = mha.step(x[:, 38:39], st)
    assert (after - before).abs().max() > 1e-3
    assert_close(after, ref.detach())
    _assert_states_close(st2, ref_st)
    # a dtype round trip: new storage each time, so the memos are rebuilt
    outs = {}
    for dt in (torch.float32, torch.float64):
        mha.to(dt)
        with torch.no_grad():
            _, s = mha.step(x[:, :38].to(dt), max_length=64)
            outs[dt], _ = mha.step(x[:, 38:39].to(dt), s)
        with torch.enable_grad():
            ref, _ = mha.step(x[:, 38:39].to(dt), s)
        assert outs[dt].dtype == dt
        assert_close(outs[dt], ref.detach())
    torch.testing.assert_close(outs[torch.float32].double(), outs[torch.float64], rtol=1e-4, atol=1e-5)


def _op_counter():
    return load_benchmark("decode_ops").count_ops


#: aten ops of one token's step at the GPU bench's layer shape (float32, NPRF, 32 features),
#: as `benchmarks/decode_ops.py` counts them (`benchmarks/results/decode_ops.json`), plus a
#: small margin. The feature maps take about half of each (`fastrpe.kernels`).
MAX_OPS = {"LinearState": 68 + 4, "BandState": 94 + 4, "SoEState": 88 + 4}


@pytest.mark.parametrize("family,backend,kind", KINDS, ids=IDS)
def test_a_decode_step_dispatches_no_more_ops_than_measured(family, backend, kind):
    count_ops = _op_counter()
    Hb, Db = 8, 64
    kern = fr.kernels.get_kernel("nprf", head_dim=Db, num_features=32)
    pos = P.ALiBi(Hb) if family == "alibi" else P.KerpleLog(Hb) if family == "kerple_log" else \
        P.T5Bias(Hb, bidirectional=False)
    mha = fr.nn.MultiheadAttention(Hb * Db, Hb, kernel=kern, position=pos, causal=True, backend=backend).eval()
    x = torch.randn(1, 200, Hb * Db)
    with torch.no_grad():
        _, st = mha.step(x[:, :199], max_length=256)
        mha.step(x[:, 199:], st)  # warm: the memos are built on the first token
        n = count_ops(lambda: mha.step(x[:, 199:], st)).total
    assert type(st) is kind
    limit = MAX_OPS[kind.__name__]
    assert n <= limit, f"{kind.__name__}: {n} aten ops per step, more than the {limit - 4} measured (+4)"


def test_host_timing_stubs_the_fused_launch_and_times_each_state():
    """`decode_ops.py --host` (`measure_host`): each constant-size state's fused step timed on
    the CPU with its Triton launch counted, not run (at small widths), and the launches then
    run again (`skip` restored)."""
    from dataclasses import replace

    from fastrpe.bench.gpu import GpuConfig

    mod = load_benchmark("decode_ops")
    cfg = replace(GpuConfig(decode_context=64, decode_prompt=16, device="cpu"), H=1, D=4, features=2)
    got = mod.measure_host(cfg, torch.float32, repeats=3, warmup=1)
    assert sorted(got) == sorted(n + mod.FUSED for n in ("state-linear (alibi, nprf)", "state-soe (kerple_log, nprf)",
                                                         "state-band (t5, nprf)"))
    assert all(0 < us < 1e6 for us in got.values())
    calls = []

    class Kern:
        skip, n = False, 0

    def step(launch=True):
        calls.append(Kern.skip)
        Kern.n += launch

    mod.host_time(step, Kern, repeats=2, warmup=1)
    assert calls == [True, True, True] and Kern.skip is False
    with pytest.raises(RuntimeError, match="did not take the kernel"):
        mod.host_time(lambda: step(launch=False), Kern, repeats=2, warmup=1)


def test_profiling_the_fused_steps_names_each_state_and_its_host_functions():
    """`decode_ops.py --profile` (`profile_steps`): per constant-size state, the eager step's µs
    and cProfile's functions by own time, the fused step's among them (on a CPU with the launch
    counted, not run)."""
    from dataclasses import replace

    from fastrpe.bench.gpu import GpuConfig

    mod = load_benchmark("decode_ops")
    cfg = replace(GpuConfig(decode_context=64, decode_prompt=16, device="cpu"), H=1, D=4, features=2)
    lines = mod.profile_steps(cfg, torch.device("cpu"), torch.float32, steps=3, top=10)
    heads = [ln for ln in lines if ln.startswith("---- ")]
    names = [n + mod.FUSED for n in ("state-linear (alibi, nprf)", "state-soe (kerple_log, nprf)",
                                     "state-band (t5, nprf)")]
    assert len(heads) == 3 and all(h.startswith(f"---- {n} (torch.float32, cpu)") for h, n in zip(heads, names))
    assert all("µs per eager step over 3 steps" in h for h in heads)
    assert any("_prf_step" in ln for ln in lines) and any("ncalls" in ln for ln in lines)
