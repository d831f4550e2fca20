"""The built-in backends: dense reference, SDPA, FlexAttention and the FFT Toeplitz path.

Notation: B batch, H heads, Lq/Lk lengths, D head dim, Dv value dim, F features.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .dispatch import Backend, Cost, Problem, machine_time, register_backend
from .ops.common import safe_divide
from .ops.linear.naive import kernelized_num_den_naive
from .ops.softmax.flex import flex_available, softmax_attention_flex
from .ops.softmax.naive import softmax_attention_naive
from .ops.softmax.sdpa import softmax_attention_sdpa


def _is_shaw(t) -> bool:
    return type(t).__name__ == "ShawRelative"


def _is_fastrpb(t) -> bool:
    return type(t).__name__ in ("FastRPB1D", "FastRPB2D")


def _masked_v(v: Tensor, kpm: Tensor | None) -> Tensor:
    return v if kpm is None else v.masked_fill(kpm[:, None, :, None], 0.0)


def add_fastrpb(out: Tensor, v: Tensor, p: Problem, kpm: Tensor | None, naive: bool) -> Tensor:
    """`out += W·v` for every FastRPB term (padding keys contribute nothing)."""
    terms = [t for t in p.additive if _is_fastrpb(t)]
    if not terms:
        return out
    vm = _masked_v(v.to(out.dtype), kpm)
    for t in terms:
        if getattr(t, "is_grid", False):  # 2D: W·v over the grid (bidirectional, Lq = Lk = N)
            out = out + (t.materialize().to(out.dtype) @ vm if naive else t(vm).to(out.dtype))
        elif naive:
            from .ops.fastrpb.naive import fastrpb_naive

            w = t.coefficients(p.Lq, p.Lk, p.q_offset).to(out.dtype)
            out = out + fastrpb_naive(w, vm, p.Lq, causal=p.causal, q_offset=p.q_offset)
        else:
            out = out + t(vm, p.Lq, q_offset=p.q_offset, causal=p.causal).to(out.dtype)
    return out


def kernelized_attention(q: Tensor, k: Tensor, v: Tensor, p: Problem, kpm: Tensor | None, num_den, naive: bool) -> Tensor:
    """Feature maps, the Toeplitz-weighted numerator/denominator from `num_den`, Shaw, FastRPB.

    Runs with autocast off: features, sums and FFTs are float32 (float64 for float64 inputs)
    whatever the caller's autocast says. Under fp16 autocast a feature product of two
    keys with norm 1e3 overflows fp16; the output comes back in q's dtype."""
    with torch.autocast(q.device.type, enabled=False):
        return _kernelized_attention(q, k, v, p, kpm, num_den, naive)


def _kernelized_attention(q: Tensor, k: Tensor, v: Tensor, p: Problem, kpm: Tensor | None, num_den,
                          naive: bool) -> Tensor:
    phi_q = p.kernel(q, is_query=True)  # (B, H, Lq, F), float32/64
    phi_k = p.kernel(k, is_query=False)  # (B, H, Lk, F)
    vv = v.to(phi_q.dtype)
    lc = None
    if p.position is not None and not _is_grid(p):
        lc = p.position.log_coefficients(p.Lq, p.Lk, p.q_offset).to(phi_q.dtype)  # (H, R)
    num, den, log_scale = num_den(phi_q, phi_k, vv, lc, causal=p.causal, q_offset=p.q_offset, key_padding_mask=kpm)
    shaw = [t for t in p.additive if _is_shaw(t)]
    if shaw:
        # the Toeplitz part is in units of exp(log_scale) per row, Shaw's in units of 1:
        # bring both to units of exp(u), u = max(log_scale, 0), so neither can overflow
        u = log_scale.clamp_min(0.0)
        a, s = torch.exp(log_scale - u)[None], torch.exp(-u)[None]  # (1, H, Lq)
        num, den = num * a[..., None], den * a
        for t in shaw:
            n2, d2 = t.num_den(phi_q, vv, p.Lk, p.causal, p.q_offset, kpm, naive=naive)
            num, den = num + n2 * s[..., None], den + d2 * s
    out = safe_divide(num, den)
    return add_fastrpb(out, vv, p, kpm, naive).to(q.dtype)


def softmax_bias(q: Tensor, p: Problem) -> Tensor | None:
    """Dense `[H, Lq, Lk]` (or `[B, H, Lq, Lk]` with Shaw) bias for the materializing softmax backends."""
    bias = None
    if p.position is not None:
        bias = p.position.materialize(p.Lq, p.Lk, p.q_offset)
    scale = p.D ** -0.5 if p.scale is None else p.scale
    for t in p.additive:
        if _is_shaw(t):
            s = t.logits(q, p.Lk, p.q_offset, scale)
            bias = s if bias is None else bias + s
    return bias


def _is_grid(p: Problem) -> bool:
    return bool(getattr(p.position, "is_grid", False))


def _grid_reasons(p: Problem) -> list[str]:
    """A 2D grid term covers exactly its N = cls + Hg·Wg tokens, bidirectionally."""
    grids = [t for t in (p.position, *p.additive) if getattr(t, "is_grid", False)]
    if not grids:
        return []
    r = []
    N = grids[0].seq_len
    if p.Lq != N or p.Lk != N:
        r.append(f"the 2D grid term is for {N} tokens, got Lq={p.Lq}, Lk={p.Lk}")
    if p.causal or p.q_offset:
        r.append("a 2D grid term is bidirectional (no causal mask, no q_offset)")
    return r


def _grid_num_den(op, position):
    """Adapt a grid op to the `num_den(phi_q, phi_k, vv, lc, ...)` call of `kernelized_attention`."""

    def num_den(phi_q, phi_k, vv, lc, *, causal, q_offset, key_padding_mask):
        return op(phi_q, phi_k, vv, position.table().to(phi_q.dtype), position.grid,
                  None if position.cls_coefficients() is None else position.cls_coefficients().to(phi_q.dtype),
                  key_padding_mask=key_padding_mask)

    return num_den


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
        return Cost(machine_time(p.device, flops, 3 * mem, calls=12), mem)

    def run(self, q, k, v, p, kpm):
        if p.softmax:
            # the reference computes scores in float32 whatever autocast says: under fp16
            # autocast, q·k at norm 1e3 (2.5e5) overflowed fp16 and the row became NaN
            with torch.autocast(q.device.type, enabled=False):
                weight = p.position.materialize_weight(p.Lq, p.Lk, p.q_offset) if p.position is not None else None
                out = softmax_attention_naive(q, k, v, softmax_bias(q, p), causal=p.causal, q_offset=p.q_offset,
                                              key_padding_mask=kpm, scale=p.scale, weight=weight)
                return add_fastrpb(out, v, p, kpm, naive=True).to(q.dtype)
        if _is_grid(p):
            from .ops.linear.grid import kernelized_num_den_grid_naive

            return kernelized_attention(q, k, v, p, kpm, _grid_num_den(kernelized_num_den_grid_naive, p.position),
                                        naive=True)
        return kernelized_attention(q, k, v, p, kpm, kernelized_num_den_naive, naive=True)


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
        return Cost(machine_time(p.device, flops, bytes_moved, calls=4), mem)

    def run(self, q, k, v, p, kpm):
        out = softmax_attention_sdpa(q, k, v, softmax_bias(q, p), causal=p.causal, q_offset=p.q_offset,
                                     key_padding_mask=kpm, scale=p.scale)
        return add_fastrpb(out, v, p, kpm, naive=False).to(q.dtype)


class FlexBackend(Backend):
    """FlexAttention with the positional term's `score_mod` (compiled on GPU)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=True) + _grid_reasons(p)
        if not flex_available():
            r.append("FlexAttention is not in this PyTorch")
        if p.device.type == "cpu" and p.requires_grad:
            r.append("FlexAttention has no backward on CPU")
        if any(_is_shaw(t) for t in p.additive):
            r.append("Shaw vectors depend on q, which score_mod cannot see")
        return r

    def cost(self, p: Problem) -> Cost:
        pairs = p.B * p.H * p.Lq * p.Lk
        if p.causal:
            pairs //= 2
        flops = 2 * pairs * (p.D + p.Dv) * (2.5 if p.requires_grad else 1) + 20 * pairs
        if p.device.type == "cpu":  # eager CPU FlexAttention materializes the scores
            flops *= 4
        mem = p.B * p.H * p.Lq * (p.Dv + 2) * p.bytes_per_el
        seconds = machine_time(p.device, flops, mem, calls=2)
        if p.device.type == "cpu":
            seconds += 5e-3  # eager CPU FlexAttention: Python-level overhead per call
        return Cost(seconds, mem)

    def run(self, q, k, v, p, kpm):
        mod = p.position.score_mod(p.q_offset) if p.position is not None else None
        out = softmax_attention_flex(q, k, v, mod, causal=p.causal, q_offset=p.q_offset,
                                     key_padding_mask=kpm, scale=p.scale)
        return add_fastrpb(out, v, p, kpm, naive=False).to(q.dtype)


class FFTBackend(Backend):
    """Kernelized attention with the Toeplitz RPE multiplied by FFT (Luo et al. 2021), in blocks of channels."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if p.position is not None and p.position.softmax_only:
            r.append(p.position.kernelized_refusal or f"{type(p.position).__name__} is softmax only")
        if _is_grid(p):
            r.append("a 2D grid term needs the 2D FFT (backend 'grid_fft')")
        return r + _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.fft import causal_leaf, estimate_fft_cost

        flops, peak = estimate_fft_cost(p.B, p.H, p.Lq, p.Lk, p.F, p.Dv, p.dtype)
        if p.requires_grad:
            flops *= 3
        if p.causal:  # divide and conquer: about one full-length product per level
            leaf = causal_leaf(p.B, p.H, p.dtype)
            flops *= 1 + 0.6 * max(0.0, math.log2(max(p.Lq, p.Lk) / leaf))
        # FFTs are memory-bound: ~7x below the flop rate (measured: benchmarks/fft_memory.py)
        return Cost(machine_time(p.device, 7 * flops, 2 * peak, calls=30), peak)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.fft import kernelized_num_den_fft

        return kernelized_attention(q, k, v, p, kpm, kernelized_num_den_fft, naive=False)


class ChunkedBackend(Backend):
    """Causal kernelized attention in linear time: dense chunks and a running state
    (no positional term, or a geometric decay: ALiBi, KERPLE power with fixed p = 1)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not p.causal:
            r.append("causal only")
        if p.position is not None and p.position.geometric_decay() is None:
            r.append(f"{type(p.position).__name__} is not a geometric decay γ^|r| (needs an exact linear-time form)")
        return r + _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.chunked import DEFAULT_CHUNK

        T, C, F = DEFAULT_CHUNK, p.Dv + 1, p.F
        L = max(p.Lk, p.q_offset + p.Lq)
        flops = p.B * p.H * (2 * L * T * (F + C) + 6 * L * F * C) * (3 if p.requires_grad else 1)
        mem = p.B * p.H * (L * T + (L // T + 1) * F * C * 2 + L * (F + C)) * p.bytes_per_el * (2 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, 2 * mem, calls=10 + 2 * L // T), mem)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.chunked import kernelized_num_den_chunked

        gamma = p.position.geometric_decay() if p.position is not None else None

        def num_den(phi_q, phi_k, vv, lc, *, causal, q_offset, key_padding_mask):
            return kernelized_num_den_chunked(phi_q, phi_k, vv, gamma=gamma, q_offset=q_offset,
                                              key_padding_mask=key_padding_mask)

        return kernelized_attention(q, k, v, p, kpm, num_den, naive=False)


class PrefixBackend(Backend):
    """Scaleformer's prefix-sum causal linear attention: a baseline (O(L·F·Dv) memory)."""

    def not_supported_reasons(self, p: Problem) -> list[str]:
        r = _kernel_kind_reasons(p, want_softmax=False)
        if not p.causal:
            r.append("causal only")
        if p.position is not None:
            r.append(f"runs without a multiplicative positional term, got {type(p.position).__name__} "
                     "(chunked runs geometric decays exactly, soe the others)")
        return r + _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        C, F = p.Dv + 1, p.F
        mem = p.B * p.H * p.Lk * F * C * p.bytes_per_el * (2 if p.requires_grad else 1)
        flops = 4 * p.B * p.H * (p.Lk + p.Lq) * F * C * (3 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, 3 * mem, calls=6), mem)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.prefix import kernelized_num_den_prefix

        def num_den(phi_q, phi_k, vv, lc, *, causal, q_offset, key_padding_mask):
            return kernelized_num_den_prefix(phi_q, phi_k, vv, q_offset=q_offset, key_padding_mask=key_padding_mask)

        return kernelized_attention(q, k, v, p, kpm, num_den, naive=False)


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
        from .ops.linear.grid import kernelized_num_den_grid_fft

        return kernelized_attention(q, k, v, p, kpm, _grid_num_den(kernelized_num_den_grid_fft, p.position),
                                    naive=False)


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
        elif p.position.geometric_decay() is not None:
            r.append(f"{type(p.position).__name__} is a geometric decay: chunked runs it exactly")
        else:
            r += self._fit_reasons(p)
        return r + _grid_reasons(p)

    @staticmethod
    def _fit_reasons(p: Problem) -> list[str]:
        from .ops.linear.soe import soe_fit_refusal

        with torch.no_grad():
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
        from .ops.linear.soe import SOE_FIT_LENGTH, causal_log_coefficients, kernelized_num_den_soe, soe_plan

        def num_den(phi_q, phi_k, vv, lc, *, causal, q_offset, key_padding_mask):
            # fitted from the term itself over max(L, SOE_FIT_LENGTH) distances, not from this
            # call's coefficients: the same fit for every length up to SOE_FIT_LENGTH
            fit_length = max(p.Lk, q_offset + p.Lq, SOE_FIT_LENGTH)
            plan = soe_plan(causal_log_coefficients(p.position, fit_length))
            return kernelized_num_den_soe(phi_q, phi_k, vv, q_offset=q_offset, key_padding_mask=key_padding_mask,
                                          plan=plan)

        return kernelized_attention(q, k, v, p, kpm, num_den, naive=False)


for _b in (
    DenseBackend("dense", description="materialized weights; the reference for everything"),
    SDPABackend("sdpa", description="torch scaled_dot_product_attention, bias materialized"),
    FlexBackend("flex", description="torch FlexAttention with a score_mod"),
    FFTBackend("fft", description="kernelized, Toeplitz RPE by FFT in channel blocks"),
    ChunkedBackend("chunked", description="causal kernelized, geometric decay, linear time"),
    PrefixBackend("prefix", description="causal kernelized by cumulative sums (Scaleformer), baseline"),
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
        return r + _grid_reasons(p)

    def cost(self, p: Problem) -> Cost:
        from .ops.linear.band import DEFAULT_CHUNK

        T = max(DEFAULT_CHUNK, p.position.finite_support())
        X, tails = (2 * T, 1) if p.causal else (3 * T, 2)
        C, F = p.Dv + 1, p.F
        flops = p.B * p.H * (2 * p.Lq * X * (F + C) + 2 * p.Lk * F * C + 2 * tails * p.Lq * F * C)
        flops *= 3 if p.requires_grad else 1
        mem = (p.B * p.H * (2 * p.Lq * X + (p.Lk // T + 3) * F * C * (1 + tails) + p.Lq * (F + C))
               + p.H * p.Lq * X) * p.bytes_per_el * (2 if p.requires_grad else 1)
        return Cost(machine_time(p.device, flops, 2 * mem, calls=30), mem)

    def run(self, q, k, v, p, kpm):
        from .ops.linear.band import kernelized_num_den_band

        W = p.position.finite_support()

        def num_den(phi_q, phi_k, vv, lc, *, causal, q_offset, key_padding_mask):
            return kernelized_num_den_band(phi_q, phi_k, vv, lc, window=W, causal=causal, q_offset=q_offset,
                                           key_padding_mask=key_padding_mask)

        return kernelized_attention(q, k, v, p, kpm, num_den, naive=False)


register_backend(BandBackend("band", description="kernelized, finite-support term (T5, clipped table): "
                                                 "exact band + constant tails, linear time"))

from .backends_triton import register as _register_triton  # noqa: E402  (imports no triton until a call runs)
_register_triton()
