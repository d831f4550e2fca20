"""`torch.compile(..., fullgraph=True)` through fastrpe (issue 16, item 4).

`fullgraph=True` raises on any graph break, so every test here that compiles also checks
that the path has none: no host reads of tensor values, no data-dependent shapes, no
untraceable Python (the dispatch cache). Compiled outputs and every gradient (input,
projections, positional parameters) must equal eager ones: the same ops run, so the
tolerance is tighter than the table's for two different algorithms.

`aot_eager` (dynamo + autograd tracing, no code generation) checks float64 equality on
every path; one inductor test per path compiles real kernels in float32. Sizes are small
and odd (B=2, L=63, E=32, H=4) so that each test stays within seconds on 2 cores.
"""
from __future__ import annotations

import gc
import os
import time

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P

#: compiled vs eager: the same ops in the same order (inductor may fuse and reorder in float32)
COMPILE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

B, L, E, H = 2, 63, 32, 4

#: id -> (kernel, position factory, backend forced or "auto", the backend that must run)
PATHS = {
    "sdpa-none": ("softmax", lambda: None, "auto", "sdpa"),
    "sdpa-alibi": ("softmax", lambda: P.ALiBi(H), "auto", "sdpa"),
    "sdpa-kerple_log": ("softmax", lambda: P.KerpleLog(H), "sdpa", "sdpa"),
    "chunked-nprf-alibi": ("nprf", lambda: P.ALiBi(H), "chunked", "chunked"),
    "chunked-elu-none": ("elu", lambda: None, "chunked", "chunked"),
    "soe-nprf-kerple_log": ("nprf", lambda: P.KerpleLog(H), "soe", "soe"),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # earlier tests' modules collected first (when the SoE verdict memo was a module-level
    # WeakKeyDictionary, an entry whose position was collected between a trace and its guards'
    # build failed that build, "list index out of range": the memo lives on its position now,
    # `test_another_positions_verdict_recompiles_nothing`; kept, cheap, for any other such memo)
    gc.collect()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(path: str, dtype) -> fr.nn.MultiheadAttention:
    kernel, pos, backend, _ = PATHS[path]
    torch.manual_seed(0)
    return fr.nn.MultiheadAttention(E, H, kernel, pos(), causal=True, backend=backend).to(dtype)


def _fwd_bwd(f, module, x):
    """Output, d(x) and d(every parameter) of `sum(f(x) * w)` for a fixed random w."""
    x = x.detach().requires_grad_(True)
    out = f(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * w).sum(), [x, *params])
    return out.detach(), grads


def _assert_same(got, want, dtype, what):
    (o1, g1), (o2, g2) = got, want
    tol = COMPILE_TOL[dtype]
    torch.testing.assert_close(o1, o2, atol=tol, rtol=tol, msg=f"{what}: output")
    assert len(g1) == len(g2)
    for i, (a, b) in enumerate(zip(g1, g2)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{what}: gradient {i}")


@pytest.mark.parametrize("path", list(PATHS))
def test_layer_compiles_fullgraph_and_matches_eager(path, ran):
    """MultiheadAttention, float64, aot_eager: no graph break, forward and every gradient equal."""
    m = _layer(path, torch.float64)
    x = torch.randn(B, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    eager = _fwd_bwd(m, m, x)
    assert ran == [PATHS[path][3]]
    ran.clear()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    _assert_same(_fwd_bwd(compiled, m, x), eager, torch.float64, path)
    assert set(ran) == {PATHS[path][3]}, ran  # the compiled graph runs the eager backend
    # causal: changing the future leaves the past as it was (the same graph, no recompile)
    x2 = x.clone()
    x2[:, 40:] = torch.randn(B, L - 40, E, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out2 = compiled(x2.requires_grad_(True)).detach()  # as the first call's x: the same guards
    torch.testing.assert_close(out2[:, :40], eager[0][:, :40], atol=1e-12, rtol=1e-12)


#: inductor generates and compiles C++ for every kernel: from a cold cache one path took 38-136 s
#: on the 2-core machine (8-15 s warm), over the suite's 30-s budget per test, so these run when
#: FASTRPE_INDUCTOR_CHECK=1 is set: `FASTRPE_INDUCTOR_CHECK=1 python -m pytest -q tests/test_compile.py`
needs_inductor_check = pytest.mark.skipif(os.environ.get("FASTRPE_INDUCTOR_CHECK") != "1",
                                          reason="inductor compiles C++ for minutes; set FASTRPE_INDUCTOR_CHECK=1")


@pytest.mark.slow
@needs_inductor_check
@pytest.mark.parametrize("path", ["sdpa-kerple_log", "chunked-nprf-alibi", "soe-nprf-kerple_log"])
def test_layer_inductor_float32(path):
    """One inductor compilation per path (real generated kernels), float32, fwd + bwd."""
    m = _layer(path, torch.float32)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))
    eager = _fwd_bwd(m, m, x)
    t0 = time.perf_counter()
    got = _fwd_bwd(torch.compile(m, fullgraph=True), m, x)
    print(f"{path}: inductor compile + first fwd/bwd {time.perf_counter() - t0:.1f} s")
    _assert_same(got, eager, torch.float32, path)


def test_auto_under_compile_picks_the_eager_choice(ran):
    """Under tracing, auto's decision is made without the dispatch cache and must be the
    cached eager one: at L=128 nprf + ALiBi goes to chunked (dense below that)."""
    torch.manual_seed(0)
    m = fr.nn.MultiheadAttention(E, H, "nprf", P.ALiBi(H), causal=True).double()
    x = torch.randn(1, 128, E, dtype=torch.float64)
    ref = m(x)
    assert ran == ["chunked"]
    ran.clear()
    out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert ran and set(ran) == {"chunked"}
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kernel,position,backend", [("softmax", "kerple_log", "auto"), ("nprf", "alibi", "chunked"),
                                                     ("nprf", "kerple_log", "soe")],
                         ids=["sdpa", "chunked", "soe"])
def test_decoder_lm_compiles_fullgraph(kernel, position, backend):
    """The whole LM (embedding, blocks through MultiheadAttention, tied head) under
    `torch.compile(model, fullgraph=True)`: logits and parameter gradients equal eager."""
    torch.manual_seed(0)
    cfg = fr.nn.LMConfig(vocab_size=61, d_model=E, n_layers=1, n_heads=H, kernel=kernel, position=position,
                         backend=backend, max_len=64)
    model = fr.nn.DecoderLM(cfg).double()
    tokens = torch.randint(0, 61, (B, 26), generator=torch.Generator().manual_seed(4))

    def run(f):
        logits = f(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        return logits.detach(), torch.autograd.grad(loss, list(model.parameters()))

    eager = run(model)
    _assert_same(run(torch.compile(model, fullgraph=True, backend="aot_eager")), eager, torch.float64, backend)


@pytest.mark.parametrize("dynamic,lengths", [(False, (32, 47, 32, 47, 47)), (None, (32, 47, 40, 63))],
                         ids=["static", "automatic_dynamic"])
def test_two_graphs_for_many_lengths(dynamic, lengths):
    """`dynamic=False`: one graph per length and none more (the dispatch decision is traced
    once per graph; nothing in the path recompiles per call). Default (`dynamic=None`): the
    second length compiles a shape-generic graph that serves every later length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("aot_eager")
    m = _layer("chunked-nprf-alibi", torch.float64)
    f = torch.compile(m, fullgraph=True, dynamic=dynamic, backend=cnt)
    for n in lengths:
        x = torch.randn(1, n, E, dtype=torch.float64)
        torch.testing.assert_close(f(x), m(x), atol=1e-10, rtol=1e-10)
    assert cnt.frame_count == 2, cnt.frame_count


def test_soe_fit_refusal_becomes_an_assert_under_compile():
    """Eagerly a forced soe backend refuses a term it cannot fit (FastRPEError before running);
    under compile the value-dependent check is an in-graph assert: never a silent result."""
    g = torch.Generator().manual_seed(0)
    pos = P.LearnedTable(H, max_distance=200, causal=True)
    with torch.no_grad():
        pos.table.copy_(6 * torch.rand(H, 201, generator=g) - 3)  # noise beyond the band: no fit
    m = fr.nn.MultiheadAttention(E, H, "elu", pos, causal=True, backend="soe")
    x = torch.randn(1, 70, E)
    with pytest.raises(fr.FastRPEError, match="misplaces"):
        m(x)
    with pytest.raises(RuntimeError, match="misplaces more than"):
        torch.compile(m, fullgraph=True, backend="aot_eager")(x)


def test_another_positions_verdict_recompiles_nothing():
    """The SoE fit's verdict, read under compile, is kept on its own position
    (`_memo.OnOwner`): other positions' verdicts made or collected after a layer compiled do
    not touch its guards (with a module-level memo each one recompiled it)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastrpe.ops.linear import soe

    m = _layer("soe-nprf-kerple_log", torch.float64)
    x = torch.randn(B, L, E, dtype=torch.float64)
    m(x)  # eagerly: the verdict made
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(m, fullgraph=True, backend=cnt)
    f(x)
    others = [P.KerpleLog(H) for _ in range(3)]
    for o in others:
        soe.soe_terms(o, L)
    f(x)
    del others, o
    gc.collect()
    f(x)
    assert cnt.frame_count == 1, cnt.frame_count


def test_value_checks_stay_eager():
    """The checks skipped under compile (non-finite inputs, token ids) still raise eagerly."""
    m = _layer("sdpa-none", torch.float32)
    with pytest.raises(fr.FastRPEError, match="non-finite"):
        m(torch.full((1, 5, E), float("nan")))
    lm = fr.nn.DecoderLM(fr.nn.LMConfig(vocab_size=11, d_model=E, n_heads=H, n_layers=1))
    with pytest.raises(fr.FastRPEError, match="outside the vocabulary"):
        lm(torch.tensor([[3, 11]]))


@pytest.mark.parametrize("name", P.NAMES)
def test_every_position_family_traces_without_breaks(name):
    """auto's decision asks every exact backend about the term (geometric decay, finite
    support, ...): none of those questions may read tensor values under tracing (T5's support
    and KERPLE power's fixed p once did). Forward only, no code generation."""
    torch.manual_seed(0)
    m = fr.nn.MultiheadAttention(E, H, "nprf", P.make(name, H, causal=True, max_len=64), causal=True)
    x = torch.randn(1, 17, E)
    tol = COMPILE_TOL[torch.float32]
    torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="eager")(x), m(x), atol=tol, rtol=tol)


def test_auto_looks_up_no_module_per_call(monkeypatch):
    """Dynamo in torch 2.11 refuses to trace `importlib.util.find_spec` ("marked as skipped"), so
    a reason that looked for triton on every call broke every fullgraph compile through `auto`
    there (2.13 traces it). Every backend's reasons, asked afresh, look up no module."""
    import importlib.util

    def find_spec(*a, **k):
        raise AssertionError(f"importlib.util.find_spec{a} called while choosing a backend")

    q, k, v = (torch.randn(1, H, L, 8) for _ in range(3))
    fr.dispatch.clear_dispatch_cache()
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for kernel, pos in (("nprf", P.ALiBi(H)), ("nprf", P.KerpleLog(H)), ("softmax", P.T5Bias(H))):
        fr.explain(q, k, v, kernel=kernel, position=pos, causal=True)
        fr.attention(q, k, v, kernel=kernel, position=pos, causal=True, backend="auto")


# ---------------------------------------------------------------- the Triton backends under compile

#: id -> (kernel, position factory, causal, the Triton backend forced): every Triton family,
#: positional parameters learnable (their gradients cross the custom ops too)
TRITON_PATHS = {
    "triton_chunked-alibi": ("nprf", lambda: P.ALiBi(H), True, "triton_chunked"),
    "triton_chunked-geometric-bidirectional": ("nprf", lambda: P.GeometricDecay(H), False, "triton_chunked"),
    "triton_soe-kerple_log": ("nprf", lambda: P.KerpleLog(H), True, "triton_soe"),
    "triton_band-t5": ("nprf", lambda: P.T5Bias(H, bidirectional=False), True, "triton_band"),
    "triton_tiled-learned": ("nprf", lambda: P.LearnedTable(H, max_distance=L - 1, causal=False), False,
                             "triton_tiled"),
}


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_backends_compile_fullgraph_as_custom_ops(path, ran, monkeypatch):
    """A layer on a Triton backend (under the interpreter here) compiles with no graph break:
    each autograd function's halves are the custom ops `fastrpe::*` in the forward and the
    backward graph (`triton_chunked.compile_opaque`), and output and every gradient equal
    eager's in float64. Neither graph holds an op Inductor refuses to capture as a CUDA graph
    (mode="reduce-overhead" would run it without, logging one line)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    kernel, pos, causal, backend = TRITON_PATHS[path]
    torch.manual_seed(0)
    m = fr.nn.MultiheadAttention(E, H, kernel, pos(), causal=causal, backend=backend).double()
    x = torch.randn(1, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    eager = _fwd_bwd(m, m, x)
    assert ran == [backend]
    ran.clear()
    graphs, refused = [], []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        refused.append(get_first_incompatible_cudagraph_node(gm))
        return make_boxed_func(gm)

    compiled = torch.compile(m, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    _assert_same(_fwd_bwd(compiled, m, x), eager, torch.float64, path)
    assert set(ran) == {backend}
    op = backend if backend != "triton_band" else "triton_soe"  # the band runs the fused kernel
    assert len(graphs) == 2, graphs
    assert f"fastrpe.{op}_forward" in graphs[0] and f"fastrpe.{op}_backward" in graphs[1], graphs
    assert refused == [None, None], refused


def test_triton_soe_with_kept_states_compiles_fullgraph(ran, monkeypatch):
    """KERPLE-log's states kept for the backward (`triton_soe.SAVE_STATES_BYTES`) cross from
    the forward's custom op to the backward's (T5's band keeps its one term's by default, in
    the test above)."""
    from fastrpe.ops.linear import triton_soe as ts

    monkeypatch.setattr(ts, "SAVE_STATES_BYTES", 1 << 30)
    made, real = [], ts._soe_states
    monkeypatch.setattr(ts, "_soe_states", lambda *a: made.append(1) or real(*a))
    test_triton_backends_compile_fullgraph_as_custom_ops("triton_soe-kerple_log", ran, monkeypatch)
    assert len(made) == 2  # eager and compiled: one pass each, in their forwards


def test_triton_soe_walked_compiles_fullgraph(ran, monkeypatch):
    """The far field walked (`triton_soe.FAR_FIELD = "walk"`): its blocks' carries cross from
    the forward's custom op to the backward's (their fake's shapes, `carries_shapes`), and the
    compiled call equals eager's."""
    from fastrpe.ops.linear import triton_soe as ts
    from fastrpe.ops.linear import triton_soe_walk as tw

    monkeypatch.setattr(ts, "FAR_FIELD", "walk")
    walks, real = [], tw.far_backward
    monkeypatch.setattr(tw, "far_backward", lambda *a: walks.append(a[-1] is not None) or real(*a))
    test_triton_backends_compile_fullgraph_as_custom_ops("triton_soe-kerple_log", ran, monkeypatch)
    assert walks == [True, True]  # eager and compiled: each backward from its forward's carries


@pytest.mark.parametrize("path", ["triton_chunked-alibi", "triton_soe-kerple_log"])
def test_triton_backends_serve_many_lengths_with_two_graphs(path, monkeypatch):
    """The custom ops' shapes follow symbolic lengths (their fake functions compute the chunk
    count and the term groups from the inputs' shapes): after the first length's graph, one
    shape-generic graph serves every other, as for the PyTorch paths."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastrpe import backends_triton

    monkeypatch.setattr(backends_triton, "INTERPRET_ON_CPU", True)
    kernel, pos, causal, backend = TRITON_PATHS[path]
    torch.manual_seed(0)
    m = fr.nn.MultiheadAttention(E, H, kernel, pos(), causal=causal, backend=backend).double()
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(m, fullgraph=True, backend=cnt)
    for n in (32, 47, 63):
        x = torch.randn(1, n, E, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(f(x), m(x), atol=1e-10, rtol=1e-10)
    assert cnt.frame_count == 2, cnt.frame_count
