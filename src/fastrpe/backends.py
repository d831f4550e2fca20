"""The built-in backends: dense reference, SDPA, FlexAttention and the FFT Toeplitz path.

Backends declare what they support and what it costs, and choose the inner-product
algorithm; the attention math is in the ops (`ops/kernelized.py` composes kernelized
attention: Luo Eq. 10, Scaleformer Eq. 10, FastRPB). Here a backend only hands the ops the
parameters of the call's terms (`_Terms`).

Notation: B batch, H heads, Lq/Lk lengths, D head dim, Dv value dim, F features.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ._memo import kept, parameter_state, takes_grad
from .dispatch import Backend, Cost, Problem, machine_time, register_backend
from .kernels import FeatureMap
from .ops import kernelized as kops
from .ops.softmax.flex import (
    flex_available,
    flex_fused,
    kernel_options_for,
    softmax_attention_flex,
)
from .ops.softmax.naive import softmax_attention_naive
from .ops.softmax.sdpa import softmax_attention_sdpa
from .positions.fastrpb import FastRPB1D
from .positions.grid import FastRPB2D, GridPosition, GridTerm
from .positions.shaw import ShawRelative


@dataclass
class _Terms:
    """The parameters of a call's positional terms, as the ops take them."""

    shaw: list  # Shaw tables [H, 2k+1, width]
    fastrpb: list  # kops.FastRPB1DTerm / kops.FastRPB2DTerm

    @staticmethod
    def of(p: Problem, width: int, kernelized: bool) -> "_Terms":
        shaw, rpb = [], []
        for t in p.additive:
            if isinstance(t, ShawRelative):
                shaw.append(t.vectors(width, kernelized))
            elif isinstance(t, FastRPB2D):
                rpb.append(kops.FastRPB2DTerm(*t.coefficients(), grid=t.grid))
            elif isinstance(t, FastRPB1D):
                rpb.append(kops.FastRPB1DTerm(t.coefficients(p.Lq, p.Lk, p.q_offset)))
            else:
                raise TypeError(f"no backend knows the additive term {type(t).__name__}")
        return _Terms(shaw, rpb)


#: position -> {(Lq, Lk, q_offset, dtype, parameter state): table}: the log-coefficient tables
#: of terms that take no gradient (`_coefficients`), the last `TABLE_MEMO_ENTRIES` of at most
#: `TABLE_MEMO_BYTES` each
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
TABLE_MEMO_ENTRIES = 4
TABLE_MEMO_BYTES = 64 << 20
#: the decays of geometric terms that take no gradient (`_decay`), apart from the tables so that
#: neither evicts the other
_DECAYS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _coefficients(p: Problem, dtype):
    """`[H, Lq+Lk-1]` log-coefficients of the call's 1D position, or None.

    A term that takes no gradient here (frozen, or autograd off) keeps its table per shape and
    parameter state: T5's bucketing alone is about 35 small launches, which a GPU call would
    pay every time. A term in training is evaluated in the graph on every call."""
    pos = p.position
    if pos is None:
        return None
    if takes_grad(pos) or torch.compiler.is_compiling():
        return pos.log_coefficients(p.Lq, p.Lk, p.q_offset).to(dtype)

    @torch.no_grad()
    def table():
        return pos.log_coefficients(p.Lq, p.Lk, p.q_offset).to(dtype)

    return kept(_TABLES, pos, (p.Lq, p.Lk, p.q_offset, dtype, parameter_state(pos)), table,
                entries=TABLE_MEMO_ENTRIES, keep=lambda t: t.numel() * t.element_size() <= TABLE_MEMO_BYTES)


def _decay(p: Problem):
    """`[H]` decays γ of the call's geometric term (`Position.geometric_decay`), or None. A term
    that takes no gradient keeps them per parameter state, as `_coefficients` keeps its table
    (three launches a call otherwise); a term in training makes them in the graph."""
    pos = p.position
    if pos is None:
        return None
    if takes_grad(pos) or torch.compiler.is_compiling():
        return pos.geometric_decay()
    return kept(_DECAYS, pos, parameter_state(pos), torch.no_grad()(pos.geometric_decay), entries=2)


def _grid_coefficients(p: Problem) -> kops.GridCoefficients:
    pos = p.position
    return kops.GridCoefficients(pos.table(), pos.grid, pos.cls_coefficients())


def _math_dtype(p: Problem):
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _kernelized(q, k, v, p: Problem, kpm, num_den, coeffs, naive: bool = False):
    """Run the kernelized composition with the inner-product algorithm `num_den`."""
    terms = _Terms.of(p, p.F, kernelized=True)
    return kops.kernelized_attention(q, k, v, p.kernel, num_den, coeffs, shaw=terms.shaw, fastrpb=terms.fastrpb,
                                     causal=p.causal, q_offset=p.q_offset, key_padding_mask=kpm, naive=naive)


def _softmax_bias(q, p: Problem):
    """Dense `[H, Lq, Lk]` (or `[B, H, Lq, Lk]` with Shaw) bias for the materializing softmax backends."""
    bias = p.position.materialize(p.Lq, p.Lk, p.q_offset) if p.position is not None else None
    scale = p.D ** -0.5 if p.scale is None else p.scale
    return kops.shaw_logit_bias(q, _Terms.of(p, p.D, kernelized=False).shaw, p.Lk, p.q_offset, scale, bias)


def _add_fastrpb(out, v, p: Problem, kpm, naive: bool):
    return kops.add_fastrpb(out, v, _Terms.of(p, p.D, kernelized=False).fastrpb, causal=p.causal, q_offset=p.q_offset,
                         key_padding_mask=kpm, naive=naive)


def _is_grid(p: Problem) -> bool:
    return isinstance(p.position, GridPosition)


def _grid_reasons(p: Problem) -> list[str]:
    """A 2D grid term covers exactly its N = cls + Hg·Wg tokens, bidirectionally."""
    grids = [t for t in (p.position, *p.additive) if isinstance(t, GridTerm)]
    if not grids:
        return []
    r = []
    N = grids[0].seq_len
    if p.Lq != N or p.Lk != N:
        r.append(f"the 2D grid term is for {N} tokens, got Lq={p.Lq}, Lk={p.Lk}")
    if p.causal or p.q_offset:
        r.append("a 2D grid term is bidirectional (no causal mask, no q_offset)")
    return r


def _running_max_reasons(p: Problem) -> list[str]:
    """Causal SIKF (`exp`) keys have no data-independent bound: only the dense algorithm
    rescales rows by a running maximum."""
    if p.causal and isinstance(p.kernel, FeatureMap) and p.kernel.per_key_shift_when_causal:
        return [f"causal {p.kernel.name!r} needs a running maximum over keys (online-softmax rescaling), "
                "which 'dense' and 'triton_tiled' (CUDA) implement; use the normalized form (e.g. 'nexp') for "
                "linear time"]
    return []


def _kernel_kind_reasons(p: Problem, want_softmax: bool) -> list[str]:
    if want_softmax and not p.softmax:
        return [f"only exact softmax (kernel is {type(p.kernel).__name__})"]
    if not want_softmax and p.softmax:
        return ["only kernelized attention (kernel is softmax)"]
    return []


class DenseBackend(Backend):
    """Materializes the `[Lq, Lk]` weights: the reference, any kernel, any position."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        return _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        F = p.F
        pairs = p.B * p.H * p.Lq * p.Lk
        flops = 2 * pairs * (F + p.Dv) + 10 * pairs
        mem = pairs * p.bytes_per_el * (4 if p.requires_grad else 2) + p.H * p.Lq * p.Lk * p.bytes_per_el
        return Cost(machine_time(p.device, flops, 3 * mem, calls=12, working_set=mem), mem)

    def run(self, q, k, v, p, kpm):
        if p.softmax:
            # the reference computes scores in float32 whatever autocast says: under fp16
            # autocast, q·k at norm 1e3 (2.5e5) overflowed fp16 and the row became NaN
            with torch.autocast(q.device.type, enabled=False):
                weight = p.position.materialize_weight(p.Lq, p.Lk, p.q_offset) if p.position is not None else None
                out = softmax_attention_naive(q, k, v, _softmax_bias(q, p), causal=p.causal, q_offset=p.q_offset,
                                              key_padding_mask=kpm, scale=p.scale, weight=weight)
                return _add_fastrpb(out, v, p, kpm, naive=True).to(q.dtype)
        if _is_grid(p):
            return _kernelized(q, k, v, p, kpm, kops.num_den_grid_dense, _grid_coefficients(p), naive=True)
        return _kernelized(q, k, v, p, kpm, kops.num_den_dense, _coefficients(p, _math_dtype(p)), naive=True)


class SDPABackend(Backend):
    """`scaled_dot_product_attention`; the positional term as a materialized float mask."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=True) + _grid_reasons(p)
        if p.position is not None and p.position.weight is not None:
            r.append(f"{type(p.position).__name__} weighs the logits; SDPA only adds a bias")
        return r

    def cost(self, p: Problem) -> Cost:
        pairs = p.B * p.H * p.Lq * p.Lk
        flops = 2 * pairs * (p.D + p.Dv)
        materialized = p.position is not None or p.additive or p.has_padding_mask or p.q_offset
        if materialized:
            mem = pairs * p.bytes_per_el * (3 if p.requires_grad else 1) + p.H * p.Lq * p.Lk * p.bytes_per_el
            bytes_moved = 3 * mem
        else:  # fused kernel, no score matrix
            mem = p.B * p.H * p.Lq * (p.Dv + 2) * p.bytes_per_el
            bytes_moved = mem + p.B * p.H * p.Lk * (p.D + p.Dv) * p.bytes_per_el
        return Cost(machine_time(p.device, flops, bytes_moved, calls=4, working_set=mem), mem)

    def run(self, q, k, v, p, kpm):
        out = softmax_attention_sdpa(q, k, v, _softmax_bias(q, p), causal=p.causal, q_offset=p.q_offset,
                                     key_padding_mask=kpm, scale=p.scale)
        return _add_fastrpb(out, v, p, kpm, naive=False).to(q.dtype)


class FlexBackend(Backend):
    """FlexAttention with the positional term's `score_mod` (compiled on GPU)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=True) + _grid_reasons(p)
        if not flex_available():
            r.append("FlexAttention is not in this PyTorch")
        if p.device.type == "cpu" and p.requires_grad:
            r.append("FlexAttention has no backward on CPU")
        if any(isinstance(t, ShawRelative) for t in p.additive):
            r.append("Shaw vectors depend on q, which score_mod cannot see")
        return r

    def cost(self, p: Problem) -> Cost:
        pairs = p.B * p.H * p.Lq * p.Lk
        if p.causal:
            pairs //= 2
        flops = 2 * pairs * (p.D + p.Dv) * (2.5 if p.requires_grad else 1) + 20 * pairs
        mem = p.B * p.H * p.Lq * (p.Dv + 2) * p.bytes_per_el
        if not flex_fused(p.device, p.Lq):  # eager FlexAttention materializes the score matrix
            scores = p.B * p.H * p.Lq * p.Lk * p.bytes_per_el
            return Cost(machine_time(p.device, 4 * flops, 8 * scores, calls=2, working_set=scores)
                        + 5e-3, mem)  # + Python-level overhead per call
        seconds = machine_time(p.device, flops, mem, calls=2)
        return Cost(seconds, mem)

    def run(self, q, k, v, p, kpm):
        mod = p.position.score_mod() if p.position is not None else None  # the op adds q_offset
        out = softmax_attention_flex(q, k, v, mod, causal=p.causal, q_offset=p.q_offset,
                                     key_padding_mask=kpm, scale=p.scale, kernel_options=kernel_options_for(p.position))
        return _add_fastrpb(out, v, p, kpm, naive=False).to(q.dtype)


class FFTBackend(Backend):
    """Kernelized attention with the Toeplitz RPE multiplied by FFT (Luo et al. 2021), in blocks of channels."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if p.position is not None and p.position.softmax_only:
            r.append(p.position.kernelized_refusal or f"{type(p.position).__name__} is softmax only")
        if _is_grid(p):
            r.append("a 2D grid term needs the 2D FFT (backend 'grid_fft')")
        return r + _grid_reasons(p) + _running_max_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .backends_triton import tiled_work
        from .ops.linear.fft import causal_leaf, estimate_fft_cost
        from .ops.linear.fft.causal import chunk_on, kernels_on, local_on
        from .ops.linear.fft.plan import Shape, causal_levels, device_budget, element_size, local_levels

        budget = device_budget(p.device)  # what the op takes on p's device
        flops, peak = estimate_fft_cost(p.B, p.H, p.Lq, p.Lk, p.F, p.Dv, p.dtype, budget)
        grad = 3 if p.requires_grad else 1
        flops *= grad
        if not p.causal:
            # FFTs are memory-bound: ~7x below the flop rate (measured: benchmarks/fft_memory.py)
            return Cost(machine_time(p.device, 7 * flops, 2 * peak, calls=30, working_set=peak), peak)
        # dense diagonal leaves (every row sees up to `leaf` keys), and about 0.6 of a
        # full-length FFT product per level above them (the recursion's, or the blocked
        # product's worth: `plan.causal_levels`); a call no longer than one leaf is all leaf
        # (auto_cpu_check: L = 1024 ran 32 ms, not a full product's 260)
        L = max(p.Lq, p.Lk)
        leaf = causal_leaf(p.B, p.H, p.dtype, budget)
        shape = Shape(p.B, p.H, p.F, p.Dv, p.dtype, budget)
        local = local_on(p.device, p.Lq, p.Lk, p.q_offset)
        chunk = chunk_on(p.device, p.Lq, p.q_offset, leaf, shape, local)
        levels = causal_levels(p.Lq, p.q_offset, leaf, chunk, shape, kernels_on(p.device, shape), local)
        if local and chunk is not None:
            # each chunk's own pairs by triton_tiled's kernels, priced as its backend prices them
            # (TritonTiledBackend.cost), the blocked product's levels as below, and the path's own
            # ops around them (scales, certificates, recomputed rows: 30 launches at the least)
            levels -= local_levels(chunk, shape)
            local_flops, local_bytes, _ = tiled_work(p.B, p.H, p.B * p.H * p.Lq * min(L, chunk) / 2, L, L, p.F, p.Dv,
                                                     element_size(p.dtype), p.requires_grad, rows=min(L, chunk))
            seconds = machine_time(p.device, local_flops, local_bytes + 2 * peak, calls=30)
            if levels > 0:
                seconds += machine_time(p.device, 7 * flops * 0.6 * levels, 2 * peak, calls=30, working_set=peak)
            return Cost(seconds, peak)
        pairs = p.B * p.H * p.Lq * min(L, leaf)
        leaf_grad = 4 if p.requires_grad else 1  # leaves are checkpointed: backward runs them again
        leaf_flops = leaf_grad * pairs * (2 * (p.F + p.Dv + 1) + 10)
        leaf_bytes = leaf_grad * 3 * pairs * p.bytes_per_el
        leaf_set = p.B * p.H * min(L, leaf) ** 2 * p.bytes_per_el * 3
        seconds = machine_time(p.device, leaf_flops, leaf_bytes, calls=100, working_set=leaf_set)
        if levels > 0:
            seconds += machine_time(p.device, 7 * flops * 0.6 * levels, 2 * peak, calls=30, working_set=peak)
        return Cost(seconds, peak)

    def run(self, q, k, v, p, kpm):
        return _kernelized(q, k, v, p, kpm, kops.num_den_fft, _coefficients(p, _math_dtype(p)))


class ChunkedBackend(Backend):
    """Causal kernelized attention in linear time: dense chunks and a running state
    (no positional term, or a geometric decay: ALiBi, KERPLE power with fixed p = 1)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not p.causal:
            r.append("causal only")
        if p.position is not None and _decay(p) is None:
            r.append(f"{type(p.position).__name__} is not a geometric decay γ^|r| (needs an exact linear-time form)")
        return r + _grid_reasons(p) + _running_max_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.chunked import DEFAULT_CHUNK

        T, C, F = DEFAULT_CHUNK, p.Dv + 1, p.F
        L = max(p.Lk, p.q_offset + p.Lq)
        flops = p.B * p.H * (2 * L * T * (F + C) + 6 * L * F * C) * (3 if p.requires_grad else 1)
        mem = p.B * p.H * (L * T + (L // T + 1) * F * C * 2 + L * (F + C)) * p.bytes_per_el * (2 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, 2 * mem, calls=10 + 2 * L // T), mem)

    def run(self, q, k, v, p, kpm):
        gamma = _decay(p)
        return _kernelized(q, k, v, p, kpm, kops.num_den_chunked, gamma)


class PrefixBackend(Backend):
    """Scaleformer's prefix-sum causal linear attention: a baseline (O(L·F·Dv) memory)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not p.causal:
            r.append("causal only")
        if p.position is not None:
            r.append(f"runs without a multiplicative positional term, got {type(p.position).__name__} "
                     "(chunked runs geometric decays exactly, soe the others)")
        return r + _grid_reasons(p) + _running_max_reasons(p)

    def cost(self, p: Problem) -> Cost:
        C, F = p.Dv + 1, p.F
        mem = p.B * p.H * p.Lk * F * C * p.bytes_per_el * (2 if p.requires_grad else 1)
        flops = 4 * p.B * p.H * (p.Lk + p.Lq) * F * C * (3 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, 3 * mem, calls=6), mem)

    def run(self, q, k, v, p, kpm):
        return _kernelized(q, k, v, p, kpm, kops.num_den_prefix, None)


class BidirectionalBackend(Backend):
    """Non-causal kernelized attention without a multiplicative positional term in linear time:
    one `[F, Dv]` key summary (Katharopoulos et al. 2020; Scaleformer's bidirectional case).
    Additive terms (Shaw, FastRPB) ride on the composition as everywhere."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if p.causal:
            r.append("non-causal only (chunked and prefix are the causal forms)")
        if p.position is not None:
            r.append(f"runs without a multiplicative positional term, got {type(p.position).__name__}")
        return r + _grid_reasons(p) + _running_max_reasons(p)

    def cost(self, p: Problem) -> Cost:
        C, F = p.Dv + 1, p.F
        flops = 2 * p.B * p.H * (p.Lq + p.Lk) * F * C * (3 if p.requires_grad else 1)
        mem = p.B * p.H * (F * C + p.Lq * C) * p.bytes_per_el * (2 if p.requires_grad else 1)
        moved = p.B * p.H * (p.Lq + p.Lk) * (F + C) * p.bytes_per_el * (3 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, moved, calls=4), mem)

    def run(self, q, k, v, p, kpm):
        return _kernelized(q, k, v, p, kpm, kops.num_den_bidirectional, None)


class GridFFTBackend(Backend):
    """Kernelized attention over an image grid: the 2D offset table applied by a 2D FFT
    (Toeplitz-block-Toeplitz), class token added exactly."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not _is_grid(p):
            r.append("only 2D grid positional terms")
        return r + _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.grid import estimate_grid_fft_cost

        flops, peak = estimate_grid_fft_cost(p.B, p.H, p.position.grid, p.F, p.Dv, p.dtype)
        return Cost(machine_time(p.device, 7 * flops * (3 if p.requires_grad else 1), 2 * peak, calls=30), peak)

    def run(self, q, k, v, p, kpm):
        return _kernelized(q, k, v, p, kpm, kops.num_den_grid_fft, _grid_coefficients(p))


class SoEBackend(Backend):
    """Causal kernelized attention in linear time for any decaying term: exact band plus a
    sum-of-exponentials far field. APPROXIMATE: auto uses it only when allowed."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not p.causal:
            r.append("causal only")
        if p.position is None:
            r.append("needs a positional term (use chunked without one)")
        elif p.position.softmax_only or _is_grid(p):
            r.append(f"{type(p.position).__name__} has no 1D kernelized form")
        elif _decay(p) is not None:
            r.append(f"{type(p.position).__name__} is a geometric decay: chunked runs it exactly")
        else:
            r += self._fit_reasons(p)
        return r + _grid_reasons(p) + _running_max_reasons(p)

    @staticmethod
    def _fit_reasons(p: Problem) -> list[str]:
        from .ops.linear.soe import soe_fit_refusal

        if torch.compiler.is_compiling():
            # the fit's quality depends on the term's parameter values: reading them on the host
            # breaks the graph, so under torch.compile `run` asserts it inside the graph instead
            return []
        # the verdict reads the fit's error on the host (a GPU stream sync): `soe_terms` does it
        # once per parameter state, so a frozen term pays it on its first call only, and a term
        # in training on a GPU on its first call only (in the call's own grad mode: that decides)
        why = soe_fit_refusal(p.position, max(p.Lk, p.q_offset + p.Lq))
        return [why] if why else []

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.chunked import DEFAULT_CHUNK
        from .ops.linear.soe import DEFAULT_TERMS, DEFAULT_WINDOW

        T, C, F, K, W = DEFAULT_CHUNK, p.Dv + 1, p.F, DEFAULT_TERMS, DEFAULT_WINDOW
        L = max(p.Lk, p.q_offset + p.Lq)
        per_pass = p.B * p.H * (2 * L * T * (F + C) + 6 * L * F * C)
        flops = (K * per_pass + 2 * p.B * p.H * L * (T + W) * (F + C)) * (3 if p.requires_grad else 1)
        mem = p.B * p.H * (L * (T + W) + (L // T + 1) * F * C * 2 + L * (F + C)) * p.bytes_per_el * 2
        return Cost(machine_time(p.device, flops, 2 * mem, calls=K * (10 + 2 * L // T)), mem)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.soe import causal_log_coefficients, soe_assert_fit, soe_fit_length, soe_plan_for

        # fitted from the term itself (soe_fit_length: the same fit for every length up to 4,096)
        L = max(p.Lk, p.q_offset + p.Lq)
        with torch.autocast(q.device.type, enabled=False):
            plan = soe_plan_for(p.position, L)
            if torch.compiler.is_compiling():  # the refusal `_fit_reasons` skipped under compile
                soe_assert_fit(causal_log_coefficients(p.position, soe_fit_length(L)), plan)
        return _kernelized(q, k, v, p, kpm, kops.num_den_soe, plan)


for _b in (
    DenseBackend("dense", description="materialized weights; the reference for everything"),
    SDPABackend("sdpa", description="torch scaled_dot_product_attention, bias materialized"),
    FlexBackend("flex", description="torch FlexAttention with a score_mod"),
    FFTBackend("fft", description="kernelized, Toeplitz RPE by FFT in channel blocks"),
    ChunkedBackend("chunked", description="causal kernelized, geometric decay, linear time"),
    PrefixBackend("prefix", description="causal kernelized by cumulative sums (Scaleformer), baseline"),
    BidirectionalBackend("bidirectional", description="non-causal kernelized, no multiplicative term, linear time"),
    GridFFTBackend("grid_fft", description="kernelized over an image grid, 2D table by 2D FFT"),
    SoEBackend("soe", exact=False, description="causal kernelized, any decaying term, linear time (approximate)"),
):
    register_backend(_b)


# --- finite-support terms: exact band plus constant tails (ops/linear/band.py) ---
class BandBackend(Backend):
    """Kernelized attention with a finite-support term (T5 buckets, a clipped learned table):
    an exact band `|r| < W` plus constant tails as running sums. Exact, linear time, causal or not."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if p.position is None:
            r.append("needs a finite-support positional term (chunked runs none)")
        elif p.position.softmax_only or _is_grid(p):
            r.append(f"{type(p.position).__name__} has no 1D kernelized form")
        elif p.position.finite_support() is None:
            r.append(f"{type(p.position).__name__} is not constant beyond a finite distance")
        return r + _grid_reasons(p) + _running_max_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.band import DEFAULT_CHUNK

        T = max(DEFAULT_CHUNK, p.position.finite_support())
        X, tails = (2 * T, 1) if p.causal else (3 * T, 2)
        C, F = p.Dv + 1, p.F
        flops = p.B * p.H * (2 * p.Lq * X * (F + C) + 2 * p.Lk * F * C + 2 * tails * p.Lq * F * C)
        flops *= 3 if p.requires_grad else 1
        mem = (p.B * p.H * (2 * p.Lq * X + (p.Lk // T + 3) * F * C * (1 + tails) + p.Lq * (F + C))
               + p.H * p.Lq * X) * p.bytes_per_el * (2 if p.requires_grad else 1)
        seconds = machine_time(p.device, flops, 2 * mem, calls=30)
        if p.device.type == "cpu":  # the band windows' gathers: measured ~2x this count (auto_cpu_check)
            seconds *= 2
        return Cost(seconds, mem)

    def run(self, q, k, v, p, kpm):
        coeffs = kops.BandCoefficients(_coefficients(p, _math_dtype(p)), p.position.finite_support())
        return _kernelized(q, k, v, p, kpm, kops.num_den_band, coeffs)


register_backend(BandBackend("band", description="kernelized, finite-support term (T5, clipped table): "
                                                 "exact band + constant tails, linear time"))

from .backends_triton import register as _register_triton  # noqa: E402  (imports no triton until a call runs)
_register_triton()
