"""Decoding token by token (a prompt in one call, then single steps) reproduces the
full-sequence output for every causal backend and positional family, softmax and
kernelized. A backend that cannot run a combination says so and the case is skipped."""
import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P

E, H, L, PROMPT = 16, 2, 23, 7
FAMILIES = ["none", "learned", "t5", "alibi", "kerple_power", "kerple_power_p1", "kerple_log", "kerple_log3",
            "kerple_bias_weight", "fastrpb", "shaw", "geometric"]
BACKENDS = ["auto", "dense", "sdpa", "flex", "fft", "chunked", "prefix", "soe", "band"]


def _terms(family, kernel):
    torch.manual_seed(1)
    if family == "none":
        return None
    if family == "fastrpb":
        t = P.FastRPB1D(H, 64)
        with torch.no_grad():
            for p in t.parameters():
                p.normal_(0, 0.1)
        return [P.KerpleLog(H), t]
    if family == "shaw":
        return [P.ShawRelative(H, dim=E // H if kernel == "softmax" else fr.kernels.get_kernel(
            kernel, head_dim=E // H).num_features(E // H), max_distance=4)]
    t = P.make(family, H, causal=True, max_len=64)
    with torch.no_grad():
        if family in ("learned", "t5"):
            for p in t.parameters():
                p.normal_(0, 0.5)
    return t


def _runnable():
    """(backend, family, kernel) triples the backend accepts (by its own reasons); the rest
    are covered by the refusal tests."""
    cases = []
    x = torch.zeros(1, H, L, E // H)
    for kernel in ("softmax", "nprf"):
        for family in FAMILIES:
            terms = _terms(family, kernel)
            kern = fr.kernels.get_kernel(kernel, head_dim=E // H)
            with torch.no_grad():  # decoding needs no backward (FlexAttention has none on CPU)
                ex = fr.explain(x, x, x, kernel=kern, position=terms, causal=True, allow_approximate=True)
            ok = {c.backend for c in ex.candidates if not c.reasons}
            cases += [(b, family, kernel) for b in BACKENDS if b == "auto" or b in ok]
    return cases


CASES = _runnable()


def test_the_matrix_covers_every_backend_and_family():
    assert {b for b, _, _ in CASES} == set(BACKENDS)
    assert {f for _, f, _ in CASES} == set(FAMILIES)
    assert len(CASES) >= 80


@pytest.mark.parametrize("backend,family,kernel", CASES)
def test_prompt_then_single_steps_equal_full_forward(backend, family, kernel):
    terms = _terms(family, kernel)
    torch.manual_seed(0)
    mha = fr.nn.MultiheadAttention(E, H, kernel=kernel, position=terms, causal=True, backend=backend).double()
    x = torch.randn(2, L, E, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x)
        out, cache = mha.step(x[:, :PROMPT])
        outs = [out]
        for t in range(PROMPT, L):
            out, cache = mha.step(x[:, t:t + 1], cache)
            outs.append(out)
    assert cache.length == L
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-10)


# what dispatch keeps between steps for a kernelized causal layer (backend auto unless said)
EXPECTED_STATE = {"none": "linear", "alibi": "linear", "kerple_power_p1": "linear", "learned": "band", "t5": "band",
                  "kerple_log": "kv", "kerple_power": "kv", "kerple_log3": "kv", "fastrpb": "kv", "shaw": "kv"}


@pytest.mark.parametrize("family", sorted(EXPECTED_STATE))
def test_dispatch_chooses_the_decode_state_with_reasons(family):
    mha = fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_terms(family, "nprf"), causal=True)
    choice = mha.decoder()
    assert choice.name == EXPECTED_STATE[family] == mha.decode_state
    if choice.name == "kv":  # every constant-size state says why not
        assert set(choice.refused) == {"linear", "band", "soe"} and all(choice.refused.values())
        assert "refused" in str(choice)
    soft = fr.nn.MultiheadAttention(E, H, kernel="softmax", position=_terms(family, "softmax"), causal=True)
    assert soft.decode_state == "kv" and "softmax" in str(soft.decoder())
    forced = fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_terms(family, "nprf"), causal=True,
                                      backend="dense")
    assert forced.decode_state == "kv" and "backend='dense' is forced" in str(forced.decoder())


@pytest.mark.parametrize("family,kind", [("t5", fr.nn.BandState), ("alibi", fr.nn.LinearState)])
def test_constant_size_state_stays_constant(family, kind):
    mha = fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_terms(family, "nprf"), causal=True).double()
    x = torch.randn(1, 130, E, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x)
        out, st = mha.step(x[:, :3])
        outs, sizes = [out], []
        for t in range(3, 130):
            o, st = mha.step(x[:, t:t + 1], st)
            outs.append(o)
            sizes.append(st.nbytes())
    assert isinstance(st, kind) and st.length == 130
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-10)
    W = mha.position.finite_support() if family == "t5" else 0
    assert W < 120 and sizes[-1] == max(sizes) == sizes[120 - 3]  # no growth once the band is full


def test_step_under_autocast_matches_the_forward_pass():
    """The decode ops run like the forward: autocast off inside, output in the input's dtype."""
    torch.manual_seed(0)
    for family in ("t5", "alibi"):
        mha = fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_terms(family, "nprf"), causal=True)
        x = torch.randn(2, 30, E)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            full = mha(x)
            out, st = mha.step(x[:, :10])
            outs = [out]
            for t in range(10, 30):
                o, st = mha.step(x[:, t:t + 1], st)
                outs.append(o)
        dec = torch.cat(outs, 1)
        assert dec.dtype == full.dtype
        torch.testing.assert_close(dec.float(), full.float(), rtol=2e-2, atol=2e-2)


SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero")


@pytest.mark.parametrize("family,backend,kind", [("alibi", "auto", "LinearState"), ("t5", "auto", "BandState"),
                                                 ("kerple_log", "soe", "SoEState"), ("alibi", "dense", "KVCache")])
def test_a_decode_step_never_reads_a_tensor_on_the_host(monkeypatch, family, backend, kind):
    """One `step` after the prompt converts no tensor to a Python value: on a GPU each such
    read drains the stream, and it would stop the step from being captured as a CUDA graph
    (what `bench --suite gpu` times as `graph_seconds`). The input check's non-finite test is
    exempt: it runs on CPU tensors only (`_validate.check_qkv`)."""
    import sys

    torch.manual_seed(0)
    mha = fr.nn.MultiheadAttention(E, H, kernel="nprf", position=_terms(family, "nprf"), causal=True,
                                   backend=backend).double()
    x = torch.randn(1, 40, E, dtype=torch.float64)
    with torch.no_grad():
        _, st = mha.step(x[:, :39], max_length=64)
        mha.step(x[:, 39:], st)  # warm: memos and fits happen once, before the hot path
        assert type(st).__name__ == kind
        originals = {n: getattr(torch.Tensor, n) for n in SYNCS}

        def forbid(name):
            def read(*args, **kwargs):
                if sys._getframe(1).f_code.co_filename.endswith("_validate.py"):
                    return originals[name](*args, **kwargs)
                raise AssertionError(f"host read in a decode step: Tensor.{name}")
            return read

        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, forbid(name))
        out, st2 = mha.step(x[:, 39:], st)
        monkeypatch.undo()
    assert st2.length == 40 and torch.isfinite(out).all()
