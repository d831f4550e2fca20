"""GPU tests at realistic sizes (issue 12, item 4): skipped without CUDA.

* every registered backend (read from `fastrpe.dispatch.BACKENDS`, so backends added later
  are covered) against a float64 reference written here from the formulas, at L=4096,
  H=8, D=64 (32 features for the kernelized calls), bf16 inputs, output and the gradients
  of q, k, v, judged as STYLE.md rule 9 says: the backend's error against float64 within
  `LOWP_FACTOR` of the dense backend's own bf16 error;
* every linear-time and FFT backend, forward+backward, under
  `torch.cuda.set_sync_debug_mode("error")`, its own hot path (`Backend.run`) and the public
  call (`fastrpe.attention`, input checks included): a host synchronization fails.
"""
import pytest
import torch

import fastrpe as fr
from fastrpe.bench.gpu import SOFTMAX_ONLY_BACKENDS, _watch_syncs, family_causal, make_position
from fastrpe.dispatch import BACKENDS
from fastrpe.ops.linear.fft import static_schedule
from fastrpe.testing import LOWP_FACTOR, TRITON_CASES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

B, H, L, D, F = 1, 8, 4096, 64, 32
FAMILIES = ("alibi", "kerple_log", "kerple_power", "t5", "learned", "learned_full")
KERNELS = ("nprf", "softmax")
DEV = "cuda"


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    return [t.to(DEV, dtype).requires_grad_() for t in (q, k, v)]


def _kernel(name):
    kern = fr.kernels.get_kernel(name, head_dim=D, num_features=F) if name != "softmax" else "softmax"
    return kern.to(DEV) if isinstance(kern, torch.nn.Module) else kern


def reference64(q, k, v, kern, pos, causal: bool):
    """float64, materialized. Softmax: `softmax(q·kᵀ/√D + b(j-i))`; kernelized (Luo et al.,
    NeurIPS 2021, Eq. 10): `Σ_j φ(q_i)·φ(k_j)·exp(b(j-i))·v_j / Σ_j φ(q_i)·φ(k_j)·exp(b(j-i))`;
    causal keeps `j ≤ i`."""
    b = pos.materialize(L, L).to(DEV, torch.float64)  # (H, L, L)
    mask = torch.ones(L, L, dtype=torch.bool, device=DEV).tril() if causal else None
    if kern == "softmax":
        s = q @ k.transpose(-1, -2) * D ** -0.5 + b
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, -1) @ v
    b = b - b.amax(-1, keepdim=True)  # a constant per row cancels in Eq. 10
    c = torch.exp(b) if mask is None else torch.exp(b) * mask
    w = (kern(q, is_query=True) @ kern(k, is_query=False).transpose(-1, -2)) * c
    return (w @ v) / w.sum(-1, keepdim=True)


def _grads(out, inputs, weight):
    return torch.autograd.grad((out.double() * weight).sum(), inputs)


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("mode", ["bf16x3", "bf16-features", "tf32x3"])
@pytest.mark.parametrize("backend,family", TRITON_CASES, ids=[b for b, _ in TRITON_CASES])
def test_sixteen_bit_products_match_float64_at_4096(backend, family, mode):
    """The products of a bf16 call's float32 features, each mode named: bf16x3 (the default
    since 2026-11-28) and bf16 features, whose key-tile gradient kernels once fed `tl.dot` a
    transposed product rounded to 16 bits, which Triton 3.4-3.7.0 miscompiles on Hopper
    (`triton_chunked.HOPPER_TRANS_NOTE`: an illegal memory access with bf16x3 on the H100,
    2026-11-27; dk/dv far off in fla's case), and tf32x3 (the default before): bf16x3 and tf32x3
    within LOWP_FACTOR of dense bf16's error; bf16 features within twice that (their rounding:
    dq up to 6.1x dense bf16's under the interpreter at L = 1,024, tests/test_triton_lowp.py), a
    miscompile's error being orders of magnitude beyond either. (`gpu_run.sh first` runs this
    test first, before the default modes' float64 checks.)"""
    from fastrpe import backends_triton as bt

    setting = bt.use_lowp_features("bfloat16") if mode == "bf16-features" else bt.use_float32_products(mode)
    with setting:
        _check_against_float64(backend, family, "nprf", LOWP_FACTOR * (2 if mode == "bf16-features" else 1))


#: the backends with the PRF maps' backward in their gradient kernels (`backends_triton.FUSED_MAPS`):
#: (backend, family, module, entry point)
FUSED_CASES = [("triton_chunked", "alibi", "triton_chunked_prf", "prf_chunked_attention"),
               ("triton_soe", "kerple_log", "triton_soe_prf", "prf_soe_attention"),
               ("triton_band", "t5", "triton_soe_prf", "prf_soe_attention")]


def _fused_entry(module, count_calls, name):
    import importlib

    return count_calls(importlib.import_module(f"fastrpe.ops.linear.{module}"), name)


@pytest.mark.parametrize("mode", ["bf16x3", "tf32x3"])
@pytest.mark.parametrize("backend,family,module,entry", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_maps_match_float64_at_4096(backend, family, module, entry, mode, count_calls):
    """triton_chunked (ALiBi), triton_soe (KERPLE-log) and triton_band (T5) with the PRF maps'
    backward in their gradient kernels (`backends_triton.FUSED_MAPS`, `triton_chunked_prf`,
    `triton_soe_prf`), NPRF, bf16: within LOWP_FACTOR of dense bf16's error, as the unfused
    path is; and the fused path ran."""
    from fastrpe import backends_triton as bt

    calls = _fused_entry(module, count_calls, entry)
    with bt.use_fused_maps(True), bt.use_float32_products(mode):
        _check_against_float64(backend, family, "nprf", LOWP_FACTOR)
    assert len(calls) == 1


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "dense"])
def test_backend_matches_float64_reference_at_4096_bf16(backend, family, kernel):
    _check_against_float64(backend, family, kernel, LOWP_FACTOR)


def _check_against_float64(backend, family, kernel, factor):
    """`backend`'s bf16 output and q/k/v gradients at L = 4,096 against the float64 reference:
    each within `factor` times the dense backend's own bf16 error (plus an approximate
    backend's own budget)."""
    causal = family_causal(family)
    pos = make_position(family, H, L).to(DEV)
    kern = _kernel(kernel)
    q, k, v = _inputs(torch.bfloat16)

    def run(name, q, k, v):
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=name)

    try:
        out = run(backend, q, k, v)
    except fr.FastRPEError as e:
        pytest.skip(f"{backend} refuses: {e}")
    naive = run("dense", q, k, v)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference64(q64, k64, v64, kern, pos, causal)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    approx = 0.0 if BACKENDS[backend].exact else 1e-3  # an approximate backend's own budget (issue 12)
    pairs = [("out", out, naive, ref)]
    for name, a, n, r in zip(("dq", "dk", "dv"), _grads(out, (q, k, v), weight), _grads(naive, (q, k, v), weight),
                             _grads(ref, (q64, k64, v64), weight)):
        pairs.append((name, a, n, r))
    for name, fast, nv, r in pairs:
        scale = max(1.0, r.abs().max().item())
        e_fast, e_naive = _err(fast, r), _err(nv, r)
        assert e_fast <= factor * e_naive + (1e-6 + approx) * scale, (
            f"{backend} {family} {kernel} {name}: error {e_fast:.3g} vs float64 > {factor} x dense bf16's "
            f"{e_naive:.3g}")


@pytest.fixture(params=["tiled", "recursion"])
def fft_chunks(request, monkeypatch):
    """The causal FFT path at 4,096 tokens cut into 8 chunks of 512 positions, so that the
    blocked product runs (`fft.causal.BLOCKED`; the plan takes one chunk there, all tiled), each
    chunk's own pairs by triton_tiled or by the recursion down to 256-position leaves
    (`fft.causal.LOCAL`)."""
    import fastrpe.ops.linear.fft as fftmod
    from fastrpe.ops.linear.fft import causal

    monkeypatch.setattr(fftmod, "causal_leaf", lambda *a, **k: 256)
    monkeypatch.setattr(causal, "chunk_on", lambda *a, **k: 512)
    monkeypatch.setattr(causal, "LOCAL", "cuda" if request.param == "tiled" else "never")
    return request.param


@pytest.fixture(params=["torch", "lag-kernels"])
def lag_route(request, monkeypatch):
    """The blocked product's sums over chunks on the torch path or in its Triton kernels
    (`fft.blocked.KERNEL`, `triton_blocked.py`)."""
    from fastrpe.ops.linear.fft import blocked

    monkeypatch.setattr(blocked, "KERNEL", "cuda" if request.param == "lag-kernels" else "never")
    return request.param


def test_fft_blocked_product_matches_float64_at_4096(fft_chunks, lag_route):
    """The causal learned table through the blocked product: bf16 output and q/k/v gradients
    against the float64 reference, as every backend's."""
    _check_against_float64("fft", "learned", "nprf", LOWP_FACTOR)


def test_no_host_sync_in_the_fft_blocked_product(fft_chunks, lag_route):
    test_no_host_sync_in_the_backend_hot_path("fft", "learned")


def test_dense_bf16_itself_is_close_to_float64():
    """The yardstick above is sane: dense bf16 within bf16's tolerance of float64."""
    pos = make_position("kerple_log", H, L).to(DEV)
    kern = _kernel("nprf")
    q, k, v = _inputs(torch.bfloat16)
    out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="dense")
    ref = reference64(*(t.detach().double() for t in (q, k, v)), kern, pos, True)
    assert _err(out, ref) <= 2e-2 * max(1.0, ref.abs().max().item())


SYNC_BACKENDS = [b for b in BACKENDS if b not in SOFTMAX_ONLY_BACKENDS]


def _sync_error(fn):
    """None if `fn()` (after a warm-up call outside the watch) runs without a host sync."""
    return _watch_syncs(fn, torch.device(DEV))


def test_sync_debug_mode_catches_an_item_call():
    """The watch below can fail: `.item()` in the hot path is reported."""
    x = torch.randn(100, device=DEV)
    assert _sync_error(lambda: (x * 2).sum().item()) is not None
    assert _sync_error(lambda: (x * 2).sum()) is None


def _setup(backend, family):
    from fastrpe.api import _problem

    causal = family_causal(family)
    pos = make_position(family, H, L).to(DEV)
    kern = _kernel("nprf")
    q, k, v = _inputs(torch.bfloat16)
    prob, kpm = _problem(q, k, v, kern, pos, causal, None, None, None)
    reasons = BACKENDS[backend].not_supported_reasons(prob)
    if reasons:
        pytest.skip(f"{backend} refuses: {'; '.join(reasons)}")
    return q, k, v, kern, pos, causal, prob, kpm


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", SYNC_BACKENDS)
def test_no_host_sync_in_the_backend_hot_path(backend, family):
    """`Backend.run` on a validated problem, forward+backward: no host synchronization."""
    q, k, v, kern, pos, causal, prob, kpm = _setup(backend, family)

    def fwd_bwd():
        with static_schedule():  # the FFT path's eager fallback syncs once by design; this is its sync-free mode
            BACKENDS[backend].run(q, k, v, prob, kpm).float().sum().backward()

    err = _sync_error(fwd_bwd)
    assert err is None, f"{backend} {family}: {err}"


@pytest.mark.parametrize("backend,family,module,entry", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_no_host_sync_with_the_fused_maps(backend, family, module, entry, count_calls):
    """The backends with the PRF maps' backward in their kernels (`FUSED_MAPS`), through the
    public call, forward+backward: no host synchronization, and the fused path ran."""
    from fastrpe import backends_triton as bt

    q, k, v, kern, pos, causal, _, _ = _setup(backend, family)
    calls = _fused_entry(module, count_calls, entry)

    def fwd_bwd():
        with bt.use_fused_maps(True):
            fr.attention(q, k, v, kernel=kern, position=pos, causal=causal,
                         backend=backend).float().sum().backward()

    err = _sync_error(fwd_bwd)
    assert err is None, f"fused maps: {err}"
    assert len(calls) >= 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", SYNC_BACKENDS)
def test_no_host_sync_through_the_public_call(backend, family):
    """`fastrpe.attention(..., backend=...)` end to end, its input checks included."""
    q, k, v, kern, pos, causal, _, _ = _setup(backend, family)

    def fwd_bwd():
        with static_schedule():
            fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend).float().sum().backward()

    err = _sync_error(fwd_bwd)
    assert err is None, f"{backend} {family}: {err}"


def test_flex_compiles_nothing_per_decoding_step_and_once_for_all_offsets():
    """fastrpe's `flex` on CUDA: a decoding step (one query, a longer cache at every step) runs
    eager FlexAttention and compiles nothing; 128 queries at four offsets compile at most once
    (the offset is a tensor in the compiled path). Every output equals `dense`'s. Compiles are
    graphs through AOTAutograd (Inductor's way in): eager FlexAttention traces its score_mod
    with Dynamo's eager backend, which adds to Dynamo's `unique_graphs` (two for the first key
    lengths, then a dynamic one) and compiles nothing, so that count failed here on the H100
    (2026-11-27; reproduced on the CPU, tests/test_flex.py)."""
    from torch._dynamo.utils import counters

    def compiles():
        return counters["aot_autograd"]["total"]

    pos = make_position("t5", H, L).to(DEV)
    q, k, v = (t.detach().float() for t in _inputs(torch.bfloat16))

    def both(qq, Lk, off):
        kw = {"kernel": "softmax", "position": pos, "causal": True, "q_offset": off}
        qq, kk, vv = (t.contiguous() for t in (qq, k[:, :, :Lk], v[:, :, :Lk]))  # as a KV cache holds them
        with torch.no_grad():
            out = fr.attention(qq, kk, vv, backend="flex", **kw)
            ref = fr.attention(qq, kk, vv, backend="dense", **kw)
        assert (out - ref).abs().max().item() < 1e-4

    graphs = compiles()
    for Lk in range(300, 305):
        both(q[:, :, Lk - 1:Lk], Lk, Lk - 1)
    assert compiles() == graphs, "a decoding step compiled"
    for off in (100, 200, 300, 384):
        both(q[:, :, off:off + 128], 512, off)
    assert compiles() <= graphs + 1, "an offset compiled anew"


@pytest.mark.parametrize("backend", SYNC_BACKENDS)
def test_forward_replays_as_a_cuda_graph(backend):
    """Issue 12: the linear-time and FFT paths work under CUDA graphs. `fastrpe.attention`'s
    forward (the first family the backend takes), captured once after a warm-up off the capture
    stream, then replayed on new inputs copied into the captured ones: each replay equals an
    eager call on those inputs."""
    from fastrpe.api import _problem

    for family in FAMILIES:
        causal, pos, kern = family_causal(family), make_position(family, H, L).to(DEV), _kernel("nprf")
        q, k, v = (t.detach() for t in _inputs(torch.bfloat16))
        if not BACKENDS[backend].not_supported_reasons(_problem(q, k, v, kern, pos, causal, None, None, None)[0]):
            break
    else:
        pytest.skip(f"{backend} takes none of {FAMILIES}")

    def call():
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: autotuning, plans, fits, caches, off the capture
            for _ in range(2):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for seed in (5, 6):
            g = torch.Generator().manual_seed(seed)
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=g).to(DEV, t.dtype))
            graph.replay()
            want = call()
            err = (out.float() - want.float()).abs().max().item()
            assert err <= 1e-3 * max(1.0, want.float().abs().max().item()), f"{backend} {family}: replay {err:.3g}"


#: a Triton backend and a family it takes (the bench's `+compiled` rows)
COMPILED_ROWS = (("triton_chunked", "alibi"), ("triton_soe", "kerple_log"), ("triton_band", "t5"),
                 ("triton_tiled", "learned_full"))


def _compiled_case(backend: str, family: str):
    """`(call, q, k, v, weight)`: the bench's call of `backend` on `family` at L = 4,096 in
    bf16, its inputs, and a fixed weight for the gradients."""
    pos, kern, causal = make_position(family, H, L).to(DEV), _kernel("nprf"), family_causal(family)
    q, k, v = _inputs(torch.bfloat16)

    def call(q, k, v):
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend=backend)

    weight = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEV)
    return call, q, k, v, weight


def _out_and_grads(out, inputs, weight) -> list:
    return [t.float() for t in (out.detach(), *_grads(out, inputs, weight))]


def _assert_bf16_close(got: list, want: list, what: str):
    for a, b, name in zip(got, want, ("output", "dq", "dk", "dv")):
        scale = b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * max(scale, 1e-6), f"{what} {name}: {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("backend,family", COMPILED_ROWS, ids=[b for b, _ in COMPILED_ROWS])
def test_triton_backend_compiled_by_inductor_equals_eager(backend, family):
    """`torch.compile(fullgraph=True)` with Inductor around a Triton backend (its kernels are
    custom ops in the graph, `triton_chunked.compile_opaque`; the feature maps are Inductor's):
    output and the gradients of q, k, v as eager's, to bf16's rounding, at L = 4,096."""
    call, q, k, v, weight = _compiled_case(backend, family)
    want = _out_and_grads(call(q, k, v), [q, k, v], weight)
    got = _out_and_grads(torch.compile(call, fullgraph=True, dynamic=False)(q, k, v), [q, k, v], weight)
    _assert_bf16_close(got, want, f"{backend} {family}")


@pytest.mark.parametrize("backend,family", COMPILED_ROWS, ids=[b for b, _ in COMPILED_ROWS])
def test_triton_backend_compiled_with_cuda_graphs_is_captured_and_replays_eagers_result(backend, family):
    """mode="reduce-overhead" (the bench's `+compiled+cudagraphs` rows at 4k): Inductor
    captures the forward and the backward as CUDA graphs, logging no "skipping cudagraphs" (a
    graph it cannot capture runs without them, silently but for that line; the CPU tests find
    no op it refuses, tests/test_compile.py), and the replays give eager's output and
    gradients."""
    from fastrpe.bench import gpu

    call, q, k, v, weight = _compiled_case(backend, family)
    want = _out_and_grads(call(q, k, v), [q, k, v], weight)
    mark = gpu.cudagraph_skips_mark()
    f = torch.compile(call, fullgraph=True, dynamic=False, mode="reduce-overhead")
    for _ in range(3):  # warm-up, capture, replay
        torch.compiler.cudagraph_mark_step_begin()
        got = _out_and_grads(f(q, k, v), [q, k, v], weight)
    assert gpu.cudagraph_skips_since(mark) == {}, gpu.cudagraph_skips_since(mark)
    _assert_bf16_close(got, want, f"{backend} {family}")


@pytest.mark.parametrize("backend", ["soe", "triton_soe"])
def test_no_host_sync_in_a_training_step_with_a_trainable_term(backend):
    """Training: each optimizer step is a new parameter state of the term. After the first
    call's verdict, a step (forward, backward, optimizer) reads nothing on the host: the fit's
    check runs on the GPU and is read at a later call."""
    pos = fr.positions.KerpleLog(H).to(DEV)
    kern = _kernel("nprf")
    q, k, v = _inputs(torch.bfloat16)
    opt = torch.optim.SGD(pos.parameters(), lr=1e-3)

    def step():
        fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=backend).float().sum().backward()
        opt.step()
        opt.zero_grad()

    try:
        step()
    except fr.FastRPEError as e:
        pytest.skip(f"{backend} refuses: {e}")
    err = _sync_error(step)
    assert err is None, f"{backend}: {err}"
