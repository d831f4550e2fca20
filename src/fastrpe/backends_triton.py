"""The Triton backends (extra `[triton]`), registered by one line at the end of `backends.py`.

`triton_chunked`: kernelized attention with no positional term or a geometric decay
`γ_h^|r|` (ALiBi, KERPLE power p = 1, GeometricDecay), causal (any Lq, Lk, q_offset) or
bidirectional (Lq = Lk), by the kernels of `ops/linear/triton_chunked.py`.
`triton_soe`: the `soe` backend's problems (causal, any decaying term, APPROXIMATE beyond
the exact band) by the fused kernel of `ops/linear/triton_soe.py`.
`triton_band`: causal finite-support terms (T5 buckets, clipped tables), EXACT, by the same
fused kernel with one undecayed term (`ops/linear/triton_band.py`).
`triton_tiled`: any 1D Toeplitz term (a learned table over all offsets), causal or not, EXACT,
quadratic time and linear memory in flash-style tiles (`ops/linear/triton_tiled.py`); causal
SIKF (`exp`) too, whose running maximum over keys only `dense` kept before.

The kernel module is imported only when a call runs: `triton.jit` decides when it decorates
whether a kernel is compiled for the GPU or interpreted on the CPU (`TRITON_INTERPRET=1`).
On the CPU the backend refuses unless `INTERPRET_ON_CPU` is set (tests do): the
interpreter is far too slow for `auto` to consider it.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, T chunk.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

from .dispatch import Backend, Cost, Problem, machine_time, register_backend
from .ops.common import MAX_GRID_YZ

#: let the backend run CPU tensors under the Triton interpreter (tests only; needs
#: TRITON_INTERPRET=1 before triton is imported)
INTERPRET_ON_CPU = False

_KERNELS = "fastrpe.ops.linear.triton_chunked"
#: whether triton is installed, looked up once without importing it: a reason asked for under
#: `torch.compile` must not call `importlib.util.find_spec`, which Dynamo (torch 2.11) refuses
#: to trace (every fullgraph compile of a layer failed there)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None

#: How the kernels multiply a bf16/fp16 problem's feature maps on the GPU.
#: "float32" (default): the features stay float32 (as the other backends keep them) and each
#: product runs as three tf32 tensor-core products (two against a bf16 operand), about float32's
#: accuracy.
#: "bfloat16": features and values rounded to bf16 for one tensor-core product (the fastest).
#: The first H100 run's float64 comparison at L = 4,096 (tests/test_gpu.py) failed in this mode
#: for triton_chunked (ALiBi) and triton_soe (KERPLE-log), the two backends whose key-tile
#: gradient kernels then fed `tl.dot` a transposed product rounded to bf16, which the H100's
#: Triton (3.6.0) miscompiles (`triton_chunked.HOPPER_TRANS_NOTE`; no kernel does since). The
#: rounding alone, under the interpreter at L = 1,024, gives dq an error of 4.4x (triton_chunked)
#: and 6.1x (triton_soe) dense bf16's, over the tests' 4x. Which one `bench --suite gpu` should
#: time by default is for the GPU to say (`test_sixteen_bit_products_match_float64_at_4096`).
LOWP_FEATURES = "float32"
#: How those float32 features are multiplied on the tensor cores (`triton_chunked.PRECISIONS`):
#: "tf32x3", three tf32 products, two against a bf16 operand (`_dot_tf32x2`), about
#: float32's accuracy; "bf16x3", bf16 products of each operand's two bf16 halves (three, or two
#: where the other operand is bf16 already, as bf16 values and states are), 16 significant bits:
#: half of tf32x3's tensor-core instructions (a third against a bf16 operand until tf32x3 took
#: two products there, 2026-11-27), and less shared memory and fewer spills
#: (ptxas, sm_90, one stage: triton_tiled's dk/dv kernel spills 120 B where tf32x3 spills 972,
#: triton_soe's 4 where 396; results/ptxas-sm90-bf16x3.json). On an H100 (triton 3.6.0,
#: 2026-11-27, benchmarks/results/gpu/h100-2026-11-27b.json) the `+bf16x3` rows of triton_soe,
#: triton_band and triton_tiled stopped with "an illegal memory access" at 4,096 tokens: their
#: key-tile gradient kernels rounded a transposed product to bf16 halves for the next product,
#: the pattern Triton 3.4-3.7.0 miscompiles on Hopper (`triton_chunked.HOPPER_TRANS_NOTE`). They
#: form that tile directly now, and tests/test_triton_compile.py checks the sm_90 code for the
#: pattern. Since then two H100 sessions (2026-11-27 and 2026-11-28, triton 3.6.0) ran them: the
#: float64 tests of both 16-bit modes passed for all four backends at 4,096 tokens
#: (tests/test_gpu.py::test_sixteen_bit_products_match_float64_at_4096), KERPLE's bf16x3 rows
#: had their tf32x3 twins' errors, and bf16x3 was the faster of the two in every row at 64k, by
#: 5-21% (ALiBi 3.15 against 3.99 ms, KERPLE-power with states kept 6.33 against 7.87, T5 4.10
#: against 4.71; `triton_tiled` at 4k 1.87 against 2.95; at 4k the calls are host time, and
#: KERPLE-log's took 3.03 against 2.77), a 16-bit call's output being rounded to 8 bits anyway.
#: So "bf16x3" is the default (2026-11-28; docs/RESULTS.md, seventh session).
#: The GPU bench's plain Triton rows keep "tf32x3", named; its `auto` rows take the default.
FLOAT32_PRODUCTS = "bf16x3"


#: The PRF maps' backward inside the gradient kernels of triton_chunked (`ops/linear/
#: triton_chunked_prf.py`) and of the fused SoE kernel that triton_soe and triton_band run
#: (`ops/linear/triton_soe_prf.py`): no float32 dφq, dφk written and read again, no separate
#: backward launches of the maps (0.62 of ALiBi's 3.15 ms at 65,536 tokens on the H100,
#: 2026-11-28). Off by default until a GPU has timed it (the bench's `+fused-maps` rows, which
#: time triton_chunked's); where on, calls it does not cover (`triton_chunked_prf.fused_reasons`,
#: `triton_soe_prf.fused_reasons`: e.g. key padding, or triton_soe's walked far field) run the
#: unfused path.
FUSED_MAPS = False

_LOWP = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def _setting(name: str, value):
    """This module's global `name` set to `value` inside the block, restored after it."""
    g = globals()
    before, g[name] = g[name], value
    try:
        yield
    finally:
        g[name] = before


def use_lowp_features(name: str):
    """`LOWP_FEATURES = name` inside the block, restored after it."""
    return _setting("LOWP_FEATURES", name)


def use_float32_products(name: str):
    """`FLOAT32_PRODUCTS = name` inside the block, restored after it."""
    return _setting("FLOAT32_PRODUCTS", name)


def use_fused_maps(on: bool):
    """`FUSED_MAPS = on` inside the block, restored after it."""
    return _setting("FUSED_MAPS", bool(on))


def lowp_dots(p: Problem) -> tuple[torch.dtype | None, str]:
    """`(dot_dtype, precision)` for the kernels: the dtype the features are rounded to before
    the kernels (None: kept) and how float32 operands are multiplied (`triton_chunked.PRECISIONS`)."""
    from ._validate import FastRPEError

    if LOWP_FEATURES not in ("float32", "bfloat16"):
        raise FastRPEError(f"fastrpe.backends_triton.LOWP_FEATURES: 'float32' or 'bfloat16', got {LOWP_FEATURES!r}")
    if FLOAT32_PRODUCTS not in ("tf32x3", "bf16x3"):
        raise FastRPEError(f"fastrpe.backends_triton.FLOAT32_PRODUCTS: 'tf32x3' or 'bf16x3', got {FLOAT32_PRODUCTS!r}")
    if p.device.type != "cuda" or p.dtype not in _LOWP:
        return None, "ieee"
    if LOWP_FEATURES == "bfloat16" and p.dtype == torch.bfloat16:
        return torch.bfloat16, "ieee"
    return None, FLOAT32_PRODUCTS


def _state_dtype(p: Problem) -> torch.dtype | None:
    """Storage of the kernels' chunk states: a low-precision call keeps them in its own dtype,
    whatever its features' (half the bytes; each kernel carries its running state in float32;
    under the interpreter at L = 1,024, no change in any error vs float64 for triton_soe)."""
    return p.dtype if p.dtype in _LOWP else None


def _shared_reasons(p: Problem) -> list[str]:
    """Kernelized only, no 2D grid, no running maximum over keys (as every linear-time path)."""
    from . import backends

    r = backends._kernel_kind_reasons(p, want_softmax=False) + backends._grid_reasons(p)
    return r + backends._running_max_reasons(p)  # causal SIKF


def _triton_reason(p: Problem) -> str | None:
    if not _TRITON_INSTALLED:
        return "needs triton (pip install 'fastrpe[triton]')"
    mod = sys.modules.get(_KERNELS)
    if mod is not None:
        why = mod.triton_unavailable_reason(p.device)
        if why is None and p.device.type == "cpu" and not INTERPRET_ON_CPU:
            return "needs CUDA and triton (the CPU interpreter is for tests: INTERPRET_ON_CPU)"
        return why
    if p.device.type == "cuda":
        return None
    if p.device.type == "cpu" and INTERPRET_ON_CPU and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return "needs CUDA and triton"


def _kernel_reasons(p: Problem) -> list[str]:
    """What every Triton backend adds to its own refusals: triton on the call's device, the dtype."""
    why = _triton_reason(p)
    r = [why] if why else []
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        r.append(f"dtype {p.dtype} is not supported")
    if p.B * p.H > MAX_GRID_YZ:
        r.append(f"B·H = {p.B * p.H} is over the {MAX_GRID_YZ} a CUDA grid's second axis holds (the kernels "
                 f"put batch × heads there)")
    return r


def num_den_triton_chunked(phi_q, phi_k, v, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None,
                           dot_dtype=None, precision="ieee", divide=None, state_dtype=None):
    """The `NumDen` inner-product algorithm by the Triton kernels; coeffs: `[H]` decays γ or
    None (γ = 1). `dot_dtype` (e.g. bfloat16) rounds the features and values for the tensor
    cores; sums stay float32 and num, den come back in phi_q's dtype. `precision`: how float32
    features are multiplied (`lowp_dots`). `divide`: the quotient in that dtype in place of
    num (`NumDen`); inside the causal kernels' backward, after the two scans' sums otherwise.
    `state_dtype`: storage of the chunk states between the kernels (default float32)."""
    from .ops.common import safe_divide
    from .ops.linear import triton_chunked as tk

    if key_log_scale is not None:
        raise ValueError("triton_chunked: keys stabilized per key (a running maximum) need the dense algorithm")
    out_dtype = phi_q.dtype
    if dot_dtype is not None and dot_dtype != phi_q.dtype:
        phi_q, phi_k, v = phi_q.to(dot_dtype), phi_k.to(dot_dtype), v.to(dot_dtype)
    if causal:
        return tk.kernelized_num_den_triton_chunked(phi_q, phi_k, v, gamma=coeffs, q_offset=q_offset,
                                                    key_padding_mask=key_padding_mask, out_dtype=out_dtype,
                                                    precision=precision, divide=divide, state_dtype=state_dtype)
    if q_offset:
        raise ValueError(f"triton_chunked: the bidirectional decay needs q_offset = 0, got {q_offset}")
    num, den, log_scale = tk.kernelized_num_den_triton_bidirectional(phi_q, phi_k, v, gamma=coeffs,
                                                                     key_padding_mask=key_padding_mask,
                                                                     out_dtype=out_dtype, precision=precision,
                                                                     state_dtype=state_dtype)
    return (num, den, log_scale) if divide is None else (safe_divide(num, den).to(divide), den, log_scale)


class TritonChunkedBackend(Backend):
    """Kernelized attention with a geometric decay (or none) in linear time, Triton kernels
    forward and backward; bf16 inputs run bf16 tensor-core products with fp32 sums."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        from . import backends

        r = _shared_reasons(p)
        r += _kernel_reasons(p)
        if p.position is not None and backends._decay(p) is None:
            r.append(f"{type(p.position).__name__} is not a geometric decay γ^|r| (needs an exact linear-time form)")
        if not p.causal and (p.Lq != p.Lk or p.q_offset):
            r.append(f"the bidirectional decay needs Lq == Lk and q_offset = 0, got Lq={p.Lq}, Lk={p.Lk}, "
                     f"q_offset={p.q_offset}")
        return r

    def cost(self, p: Problem) -> Cost:
        T, C, F = 64, p.Dv + 1, p.F
        L = max(p.Lk, p.q_offset + p.Lq)
        passes = 1 if p.causal else 2
        # the chunked model's flops and memory without its Python loop over chunks: 2 kernels
        # forward, 4 backward (states, dk/dv, dq, the denominator's row sums) per pass
        flops = passes * p.B * p.H * (2 * L * T * (F + C) + 6 * L * F * C) * (3 if p.requires_grad else 1)
        el = 2 if lowp_dots(p)[0] is not None else max(4, p.bytes_per_el)  # the features' bytes
        sel = 2 if _state_dtype(p) is not None else 4  # the chunk states' bytes
        mem = passes * p.B * p.H * ((L // T + 1) * F * C * sel * 2 + L * (F + C) * el) * (2 if p.requires_grad else 1)
        seconds = machine_time(p.device, flops, 2 * mem, calls=passes * 6)
        if p.device.type != "cuda":
            seconds *= 1e4  # the interpreter: never `auto`'s choice
        return Cost(seconds, mem)

    def run(self, q, k, v, p, kpm):
        from . import backends

        gamma = backends._decay(p)
        dot_dtype, precision = lowp_dots(p)
        state_dtype = _state_dtype(p)

        def num_den(phi_q, phi_k, vv, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None,
                    divide=None):
            return num_den_triton_chunked(phi_q, phi_k, vv, coeffs, causal=causal, q_offset=q_offset,
                                          key_padding_mask=key_padding_mask, key_log_scale=key_log_scale,
                                          dot_dtype=dot_dtype, precision=precision, divide=divide,
                                          state_dtype=state_dtype)

        def with_feature_maps(q, k, v, kernel, coeffs, *, causal, q_offset, key_padding_mask):
            from .ops.linear import triton_chunked_prf as tcp

            if not FUSED_MAPS or tcp.fused_reasons(q, k, kernel, coeffs, key_padding_mask, causal, dot_dtype):
                return None
            return tcp.prf_chunked_attention(q, k, v, kernel, gamma=coeffs, q_offset=q_offset, precision=precision,
                                             state_dtype=state_dtype)

        num_den.keeps_value_dtype = True  # the kernels widen bf16/fp16 values in registers
        num_den.divides = True
        num_den.with_feature_maps = with_feature_maps
        return _compose(q, k, v, p, kpm, num_den, gamma)


def _compose(q, k, v, p, kpm, num_den, coeffs):
    """The kernelized composition (features, Shaw, FastRPB) around the inner-product algorithm."""
    from . import backends

    return backends._kernelized(q, k, v, p, kpm, num_den, coeffs)


def num_den_triton_fused(phi_q, phi_k, v, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None,
                         dot_dtype=None, precision="ieee", state_dtype=None, divide=None):
    """The `NumDen` inner-product algorithm by the fused kernel of `ops/linear/triton_soe.py`;
    coeffs: an `SoEPlan` (triton_soe) or `BandCoefficients` (triton_band, exact). `divide`:
    the quotient in that dtype in place of num (`NumDen`), inside the kernels' backward."""
    from .ops.kernelized import BandCoefficients

    name = "triton_band" if isinstance(coeffs, BandCoefficients) else "triton_soe"
    if not causal:
        raise ValueError(f"{name}: causal only (got causal=False)")
    if key_log_scale is not None:
        raise ValueError(f"{name}: keys stabilized per key (a running maximum) need the dense algorithm")
    out_dtype = phi_q.dtype
    if dot_dtype is not None and dot_dtype != phi_q.dtype:
        phi_q, phi_k, v = phi_q.to(dot_dtype), phi_k.to(dot_dtype), v.to(dot_dtype)
    kw = dict(q_offset=q_offset, key_padding_mask=key_padding_mask, out_dtype=out_dtype, precision=precision,
              state_dtype=state_dtype, divide=divide)
    if name == "triton_band":
        from .ops.linear.triton_band import kernelized_num_den_triton_band

        return kernelized_num_den_triton_band(phi_q, phi_k, v, coeffs.log_coeff, window=coeffs.window, **kw)
    from .ops.linear.triton_soe import kernelized_num_den_triton_soe

    return kernelized_num_den_triton_soe(phi_q, phi_k, v, coeffs, **kw)


def _run_fused(q, k, v, p, kpm, coeffs):
    """A call of the fused kernel (`num_den_triton_fused`) inside the kernelized composition."""
    dot_dtype, precision = lowp_dots(p)
    state_dtype = _state_dtype(p)

    def num_den(phi_q, phi_k, vv, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None, divide=None):
        return num_den_triton_fused(phi_q, phi_k, vv, coeffs, causal=causal, q_offset=q_offset,
                                    key_padding_mask=key_padding_mask, key_log_scale=key_log_scale,
                                    dot_dtype=dot_dtype, precision=precision, state_dtype=state_dtype,
                                    divide=divide)

    def with_feature_maps(q, k, v, kernel, coeffs, *, causal, q_offset, key_padding_mask):
        from .ops.linear import triton_soe_prf as tsp

        if not FUSED_MAPS or tsp.fused_reasons(q, k, kernel, key_padding_mask, causal, dot_dtype):
            return None
        return tsp.prf_soe_attention(q, k, v, kernel, coeffs, q_offset=q_offset, precision=precision,
                                     state_dtype=state_dtype)

    num_den.keeps_value_dtype = True  # the kernels widen bf16/fp16 values in registers
    num_den.divides = True
    num_den.with_feature_maps = with_feature_maps
    return _compose(q, k, v, p, kpm, num_den, coeffs)


def _fused_cost(p: Problem, window: int, K: int) -> Cost:
    """The fused kernel's cost for a band of `window` exact distances and K terms: NB `[T, T]`
    near products per chunk (`near_chunks`), K state updates and K state reads (no K passes)."""
    from .ops.linear.soe import near_chunks, terms_per_group

    T, NB = near_chunks(window, 64)  # the kernels' DEFAULT_CHUNK (that module imports triton)
    C, F = p.Dv + 1, p.F
    L = max(p.Lk, p.q_offset + p.Lq)
    flops = p.B * p.H * L * (2 * NB * T * (F + C) + 4 * K * F * C) * (3 if p.requires_grad else 1)
    el = 2 if lowp_dots(p)[0] is not None else max(4, p.bytes_per_el)  # the features' bytes
    sel = 2 if _state_dtype(p) is not None else el  # the chunk states' bytes
    # the states of one group of terms at a time (`terms_per_group`); each further group reads
    # the queries (in backward their gradients too) again
    group = terms_per_group(p.B * p.H, L // T + 1, F, C, sel, K)
    launches = -(-K // group)
    mem = p.B * p.H * ((L // T + 1) * group * F * C * sel * 2 + L * (F + C) * el) * (2 if p.requires_grad else 1)
    moved = 2 * mem + (launches - 1) * p.B * p.H * L * (F + C) * el * (3 if p.requires_grad else 1)
    seconds = machine_time(p.device, flops, moved, calls=12 * launches)
    if p.device.type != "cuda":
        seconds *= 1e4  # the interpreter: never `auto`'s choice
    return Cost(seconds, mem)


class TritonSoEBackend(Backend):
    """The `soe` backend's form (exact band, sum-of-exponentials far field: APPROXIMATE) in
    one fused Triton pass, forward and backward; refuses what `soe` refuses."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        from .dispatch import BACKENDS

        soe = BACKENDS.get("soe")
        r = list(soe.not_supported_reasons(p)) if soe is not None else ["needs the soe backend's fit"]
        r = [x.replace("chunked runs it exactly", "chunked/triton_chunked run it exactly") for x in r]
        r += _kernel_reasons(p)
        return r

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.soe import DEFAULT_TERMS, DEFAULT_WINDOW

        return _fused_cost(p, DEFAULT_WINDOW, DEFAULT_TERMS)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.soe import soe_plan_for

        # fitted from the term itself (soe_fit_length: the same fit for every length up to 4,096)
        with torch.autocast(q.device.type, enabled=False):
            plan = soe_plan_for(p.position, max(p.Lk, p.q_offset + p.Lq))
        return _run_fused(q, k, v, p, kpm, plan)


#: the widest finite support `triton_band` takes: three near chunks of 64 (T5's default 113
#: distances); beyond, the chunk would grow (`near_chunks`) and its `[T, T]` tiles with it
#: (at T = 128 the float32-feature gradient kernel needed 295 KB of shared memory on sm_90)
MAX_BAND_WINDOW = 129


class TritonBandBackend(Backend):
    """Kernelized attention with a finite-support term (T5 buckets, a clipped learned table),
    causal, EXACT and linear time: the exact band plus a constant tail as the fused kernel's
    one undecayed term (`ops/linear/triton_band.py`), forward and backward."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        from .dispatch import BACKENDS

        # what `band` refuses (the kernel kind, a term without finite support), as triton_soe
        # takes soe's; then what this kernel adds
        r = [x.replace("chunked runs none", "triton_chunked runs none")
             for x in BACKENDS["band"].not_supported_reasons(p)]
        r += _kernel_reasons(p)
        if not p.causal:
            r.append("causal only (band runs the bidirectional form)")
        W = p.position.finite_support() if p.position is not None else None
        if W is not None and W > MAX_BAND_WINDOW:
            r.append(f"its support of {W} distances is over the kernel's {MAX_BAND_WINDOW} (band runs it)")
        return r

    def cost(self, p: Problem) -> Cost:
        return _fused_cost(p, p.position.finite_support(), 1)

    def run(self, q, k, v, p, kpm):
        from . import backends
        from .ops import kernelized as kops

        coeffs = kops.BandCoefficients(backends._coefficients(p, backends._math_dtype(p)), p.position.finite_support())
        return _run_fused(q, k, v, p, kpm, coeffs)


def num_den_triton_tiled(phi_q, phi_k, v, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None,
                         dot_dtype=None, precision="ieee", divide=None):
    """The `NumDen` inner-product algorithm by the tiled kernels of `ops/linear/triton_tiled.py`;
    coeffs: `[H, Lq+Lk-1]` log-coefficients or None. `key_log_scale` (causal SIKF's running
    maximum) and `divide` as `NumDen`'s."""
    from .ops.linear.triton_tiled import kernelized_num_den_triton_tiled

    out_dtype = phi_q.dtype
    if dot_dtype is not None and dot_dtype != phi_q.dtype:
        phi_q, phi_k, v = phi_q.to(dot_dtype), phi_k.to(dot_dtype), v.to(dot_dtype)
    return kernelized_num_den_triton_tiled(phi_q, phi_k, v, coeffs, causal=causal, q_offset=q_offset,
                                           key_padding_mask=key_padding_mask, key_log_scale=key_log_scale,
                                           out_dtype=out_dtype, precision=precision, divide=divide)


def tiled_work(B: int, H: int, pairs: float, Lq: int, Lk: int, F: int, Dv: int, el: int, requires_grad: bool,
               rows: int | None = None) -> tuple[float, float, int]:
    """`(flops, bytes moved, bytes held)` of triton_tiled's kernels on `pairs` (query, key) pairs
    of B·H slices of Lq queries and Lk keys, their features and values `el` bytes an entry: per
    pair φq·φk (2F), the value product (2C) and exp(b - m); backward recomputes both products
    twice (dq, then dk/dv) and adds two more, and reads each key tile once per query tile of the
    `rows` (default Lq) each key meets, from memory up to 8 times. `TritonTiledBackend.cost`, and
    the FFT path's chunks' own pairs (`FFTBackend.cost`)."""
    flops = pairs * (2 * F + 2 * (Dv + 1) + 10) * (3.5 if requires_grad else 1)
    tiles = max(1, (Lq if rows is None else rows) // 64) if requires_grad else 1
    mem = B * H * (Lq + Lk) * (F + Dv + 2) * el * (2 if requires_grad else 1)
    return flops, mem * min(tiles, 8), mem


class TritonTiledBackend(Backend):
    """Kernelized attention with any 1D Toeplitz term (a learned table over all offsets
    included), EXACT, quadratic time and linear memory: flash-attention-style tiles, Triton
    kernels forward and backward (`ops/linear/triton_tiled.py`). Where no linear-time form
    exists it is what runs at the lengths where the FFT's constant is too large."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        from . import backends

        # what `fft` refuses but causal SIKF, whose running maximum over keys the tiles keep
        r = backends._kernel_kind_reasons(p, want_softmax=False)
        if p.position is not None and p.position.softmax_only:
            r.append(p.position.kernelized_refusal or f"{type(p.position).__name__} is softmax only")
        if backends._is_grid(p):
            r.append("a 2D grid term needs the 2D FFT (backend 'grid_fft')")
        return r + backends._grid_reasons(p) + _kernel_reasons(p)

    def cost(self, p: Problem) -> Cost:
        pairs = p.B * p.H * p.Lq * p.Lk * (0.5 if p.causal else 1.0)
        el = 2 if lowp_dots(p)[0] is not None else max(4, p.bytes_per_el)
        flops, moved, mem = tiled_work(p.B, p.H, pairs, p.Lq, p.Lk, p.F, p.Dv, el, p.requires_grad)
        seconds = machine_time(p.device, flops, moved, calls=4 if p.requires_grad else 1)
        if p.device.type != "cuda":
            seconds *= 1e4  # the interpreter: never `auto`'s choice
        return Cost(seconds, mem)

    def run(self, q, k, v, p, kpm):
        from . import backends

        dot_dtype, precision = lowp_dots(p)

        def num_den(phi_q, phi_k, vv, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None,
                    divide=None):
            return num_den_triton_tiled(phi_q, phi_k, vv, coeffs, causal=causal, q_offset=q_offset,
                                        key_padding_mask=key_padding_mask, key_log_scale=key_log_scale,
                                        dot_dtype=dot_dtype, precision=precision, divide=divide)

        num_den.keeps_value_dtype = True  # the kernels widen bf16/fp16 values in registers
        num_den.divides = True
        return _compose(q, k, v, p, kpm, num_den, backends._coefficients(p, backends._math_dtype(p)))


def register() -> None:
    register_backend(TritonChunkedBackend(
        "triton_chunked", description="kernelized, geometric decay, linear time, Triton kernels (CUDA)"))
    register_backend(TritonSoEBackend(
        "triton_soe", exact=False,
        description="causal kernelized, any decaying term, one fused Triton pass (approximate, CUDA)"))
    register_backend(TritonTiledBackend(
        "triton_tiled", description="kernelized, any 1D Toeplitz term (learned over all offsets), exact, quadratic "
                                    "time in flash-style tiles, linear memory (CUDA)"))
    register_backend(TritonBandBackend(
        "triton_band", description="causal kernelized, finite-support term (T5, clipped table): exact band + "
                                   "constant tail in one fused Triton pass (CUDA)"))
