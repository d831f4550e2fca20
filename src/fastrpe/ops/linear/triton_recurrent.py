"""One decoding step of causal kernelized attention after a constant-size state, fused into
one Triton kernel (the fast siblings of `recurrent`'s one-token ops). The geometric state:

    S <- γ_h·S + φ(k) ⊗ [v, 1]        (state `[B, H, F, Dv+1]`, float32)
    y  = φ(q)·S,  num = y[:Dv],  den = y[Dv]

`linear_step_triton` takes the features. The `prf_*_token_triton` ops also compute them,
PRF/NPRF's map (`kernels.PRF.features`), and the quotient `num/den`, one per state kind:
`prf_linear_token_triton` (the geometric state, `recurrent.linear_token`),
`prf_band_token_triton` (a finite-support term, `recurrent.band_token`: the last W keys
and a tail sum) and `prf_soe_token_triton` (a sum of exponentials, `recurrent.soe_token`:
K geometric states and the last W - 1 keys). `nn.MultiheadAttention`'s step takes their `*_packed` twins, on
its fused q/k/v row with the map's constants checked once (`PRFStep`): three launches (the
matmul, the kernel, the output projection) against the PyTorch step's 39 to 46. A step at a
constant-size state is host-bound (`benchmarks/decode_ops.py`). Inference only.

The band and SoE steps write the new window (the old one shifted by a row, the new key
last: oldest first, as the PyTorch ops keep it) to new tensors: a state stays what it was
after a step, and a copy of W rows of F + Dv floats per head is small beside a launch.

Notation: B batch, H heads, D head width, M projections, F features (M, or 2M two-sided),
Dv value width, C = Dv + 1, NB keys buffered in the window, W its width, K terms,
BD/BF/BC/BJ tile widths.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..._validate import FastRPEError
from ..common import underflow_threshold
from .state import BandState, SoEState
from .triton_chunked import HAS_TRITON, INTERPRETED, _pow2, on_device_of, triton_unavailable_reason

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_chunked import _store_tile

    @triton.jit
    def _step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, s_ptr, out_s_ptr, y_ptr, H, F, Dv,
                     BF: tl.constexpr, BC: tl.constexpr):
        """Grid (B·H, C/BC): the new state's columns c of one head and y[c]."""
        bh = tl.program_id(0).to(tl.int64)
        ic = tl.program_id(1)
        C = Dv + 1
        f = tl.arange(0, BF)
        c = ic * BC + tl.arange(0, BC)
        fm, cm = f < F, c < C
        g = tl.load(g_ptr + bh % H).to(tl.float32)
        q = tl.load(q_ptr + bh * F + f, mask=fm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + bh * F + f, mask=fm, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + bh * Dv + c, mask=c < Dv, other=0.0).to(tl.float32)
        vv = tl.where(c == Dv, 1.0, vv)  # the denominator's column
        off = bh * F * C + f[:, None] * C + c[None, :]
        m = fm[:, None] & cm[None, :]
        S = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
        S = g * S + k[:, None] * vv[None, :]
        tl.store(out_s_ptr + off, S, mask=m)
        tl.store(y_ptr + bh * C + c, tl.sum(q[:, None] * S, 0), mask=cm)


    @triton.jit
    def _prf_exponents(x, w, scale, NORMALIZE: tl.constexpr):
        """`[BF]`: `w_f·xs − ‖xs‖²/2`, `xs = scale·x̂` (x̂ = x/max(‖x‖, 1e-12) with NORMALIZE,
        as `F.normalize`; else x). `w: [BF, BD]` (two-sided rows already negated), `x: [BD]`."""
        if NORMALIZE:
            x = x / tl.maximum(tl.sqrt(tl.sum(x * x, 0)), 1e-12)
        xs = x * scale
        return tl.sum(w * xs[None, :], 1) - tl.sum(xs * xs, 0) / 2

    @triton.jit
    def _prf_qk(q_ptr, k_ptr, w_ptr, shift_ptr, b, h, D, M, F, sq_b, sq_h, sk_b, sk_h, sw_h, scale, inv_sqrt_f,
                BD: tl.constexpr, BF: tl.constexpr, NORMALIZE: tl.constexpr):
        """`(φq [BF], φk [BF])` of head h of row b, as `kernels.PRF.features` (0 past F)."""
        d, f = tl.arange(0, BD), tl.arange(0, BF)
        dm, fm = d < D, f < F
        # feature f projects on row f mod M, negated in the second half (two-sided: F = 2M)
        sign = tl.where(f < M, 1.0, -1.0)
        w = tl.load(w_ptr + h * sw_h + (f % M)[:, None] * D + d[None, :], mask=fm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32) * sign[:, None]
        q = tl.load(q_ptr + b * sq_b + h * sq_h + d, mask=dm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + d, mask=dm, other=0.0).to(tl.float32)
        eq = tl.where(fm, _prf_exponents(q, w, scale, NORMALIZE), float("-inf"))
        pq = tl.exp(eq - tl.max(eq, 0)) * inv_sqrt_f  # a query subtracts its own maximum
        pk = tl.where(fm, tl.exp(_prf_exponents(k, w, scale, NORMALIZE) - tl.load(shift_ptr + h)) * inv_sqrt_f, 0.0)
        return pq, pk

    @triton.jit
    def _store_quotient(o_ptr, y, c, Dv, tiny, O_BF16: tl.constexpr):
        """`o[c] = y[c] / y[Dv]` for c < Dv, 0 where |den| < tiny (`divide_packed`)."""
        den = tl.sum(tl.where(c == Dv, y, 0.0), 0)
        empty = tl.abs(den) < tiny
        _store_tile(o_ptr + c, tl.where(empty, 0.0, y / tl.where(empty, 1.0, den)), c < Dv, O_BF16)

    @triton.jit
    def _prf_step_kernel(q_ptr, k_ptr, vv_ptr, w_ptr, shift_ptr, g_ptr, s_ptr, out_s_ptr, o_ptr,
                         H, D, M, F, Dv, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sw_h, scale, inv_sqrt_f, tiny,
                         BD: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr,
                         NORMALIZE: tl.constexpr, HAS_G: tl.constexpr, O_BF16: tl.constexpr):
        """Grid (B·H,): one head's features, new state and `num/den` (0 where |den| < tiny;
        O_BF16: o_ptr is the int16 view of a bf16 o, rounded to nearest as the GPU rounds)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        f, c = tl.arange(0, BF), tl.arange(0, BC)
        C = Dv + 1
        fm, cm = f < F, c < C
        pq, pk = _prf_qk(q_ptr, k_ptr, w_ptr, shift_ptr, b, h, D, M, F, sq_b, sq_h, sk_b, sk_h, sw_h, scale,
                         inv_sqrt_f, BD, BF, NORMALIZE)
        vv = tl.load(vv_ptr + b * sv_b + h * sv_h + c, mask=cm, other=0.0).to(tl.float32)
        off = bh * F * C + f[:, None] * C + c[None, :]
        m = fm[:, None] & cm[None, :]
        S = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
        if HAS_G:
            S = tl.load(g_ptr + h).to(tl.float32) * S
        S = S + pk[:, None] * vv[None, :]
        tl.store(out_s_ptr + off, S, mask=m)
        _store_quotient(o_ptr + bh * Dv, tl.sum(pq[:, None] * S, 0), c, Dv, tiny, O_BF16)

    @triton.jit
    def _band_window(pq, keys_ptr, vals_ptr, cw_ptr, out_keys_ptr, out_vals_ptr, b, h, bh, NB, F, C,
                     skb_b, skb_h, skb_j, skb_f, svb_b, svb_h, svb_j, svb_c, DROP: tl.constexpr,
                     ONE_IMPLIED: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, BJ: tl.constexpr):
        """`Σ_j cw_j (φq·k_j) [v_j, 1]` over the NB buffered keys (`[BC]`); key j and its value
        are copied to row j - DROP of the new window (`[B, H, NB + 1 - DROP, F | VW]`,
        contiguous), the DROP oldest to none. ONE_IMPLIED: the values are VW = C - 1 wide
        (BandState's), else C (the 1 stored, SoEState's)."""
        f, c = tl.arange(0, BF), tl.arange(0, BC)
        fm = f < F
        if ONE_IMPLIED:
            VW = C - 1
        else:
            VW = C
        keep = NB + 1 - DROP
        y = tl.zeros([BC], dtype=tl.float32)
        for j0 in range(0, NB, BJ):
            j = j0 + tl.arange(0, BJ)
            jm = j < NB
            kt = tl.load(keys_ptr + b * skb_b + h * skb_h + j[:, None] * skb_j + f[None, :] * skb_f,
                         mask=jm[:, None] & fm[None, :], other=0.0).to(tl.float32)  # (BJ, BF)
            vt = tl.load(vals_ptr + b * svb_b + h * svb_h + j[:, None] * svb_j + c[None, :] * svb_c,
                         mask=jm[:, None] & (c < VW)[None, :], other=0.0).to(tl.float32)  # (BJ, BC)
            out = (j >= DROP) & jm  # written back as read: an implied 1 is not stored
            row = bh * keep + (j - DROP)
            tl.store(out_keys_ptr + row[:, None] * F + f[None, :], kt, mask=out[:, None] & fm[None, :])
            tl.store(out_vals_ptr + row[:, None] * VW + c[None, :], vt, mask=out[:, None] & (c < VW)[None, :])
            if ONE_IMPLIED:
                vt = tl.where((c == VW)[None, :], 1.0, vt)  # the denominator's column
            s = tl.sum(kt * pq[None, :], 1) * tl.load(cw_ptr + h * (NB + 1) + j, mask=jm, other=0.0)  # (BJ,)
            y += tl.sum(s[:, None] * vt, 0)
        return y

    @triton.jit
    def _prf_band_step_kernel(q_ptr, k_ptr, vv_ptr, w_ptr, shift_ptr, s_ptr, keys_ptr, vals_ptr, bw_ptr, tail_ptr,
                              out_s_ptr, out_keys_ptr, out_vals_ptr, o_ptr,
                              H, D, M, F, Dv, NB, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sw_h,
                              skb_b, skb_h, skb_j, skb_f, svb_b, svb_h, svb_j, svb_c, scale, inv_sqrt_f, tiny,
                              BD: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, BJ: tl.constexpr,
                              NORMALIZE: tl.constexpr, DROP: tl.constexpr, O_BF16: tl.constexpr):
        """Grid (B·H,): `recurrent.band_token` with PRF's features and the quotient, one head.
        bw: `[H, NB + 1]` the band's weights; DROP (the band is full, NB = W): the tail sum S is
        read with weight `tail[h]`, then the oldest key joins it (out_s) and leaves the window."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        f, c = tl.arange(0, BF), tl.arange(0, BC)
        C = Dv + 1
        fm, cm = f < F, c < C
        pq, pk = _prf_qk(q_ptr, k_ptr, w_ptr, shift_ptr, b, h, D, M, F, sq_b, sq_h, sk_b, sk_h, sw_h, scale,
                         inv_sqrt_f, BD, BF, NORMALIZE)
        vv = tl.load(vv_ptr + b * sv_b + h * sv_h + c, mask=cm, other=0.0).to(tl.float32)
        y = _band_window(pq, keys_ptr, vals_ptr, bw_ptr, out_keys_ptr, out_vals_ptr, b, h, bh, NB, F, C,
                         skb_b, skb_h, skb_j, skb_f, svb_b, svb_h, svb_j, svb_c, DROP, True, BF, BC, BJ)
        # the new key, at distance 0
        y += tl.load(bw_ptr + h * (NB + 1) + NB) * tl.sum(pq * pk, 0) * vv
        row = bh * (NB + 1 - DROP) + NB - DROP
        tl.store(out_keys_ptr + row * F + f, pk, mask=fm)
        tl.store(out_vals_ptr + row * Dv + c, vv, mask=c < Dv)
        if DROP:
            off = bh * F * C + f[:, None] * C + c[None, :]
            m = fm[:, None] & cm[None, :]
            S = tl.load(s_ptr + off, mask=m, other=0.0)
            y += tl.load(tail_ptr + h) * tl.sum(pq[:, None] * S, 0)
            # the oldest key, now W + 1 tokens back, joins the tail sum
            k0 = tl.load(keys_ptr + b * skb_b + h * skb_h + f * skb_f, mask=fm, other=0.0)
            v0 = tl.load(vals_ptr + b * svb_b + h * svb_h + c * svb_c, mask=c < Dv, other=0.0)
            tl.store(out_s_ptr + off, S + k0[:, None] * tl.where(c == Dv, 1.0, v0)[None, :], mask=m)
        _store_quotient(o_ptr + bh * Dv, y, c, Dv, tiny, O_BF16)

    @triton.jit
    def _prf_soe_step_kernel(q_ptr, k_ptr, vv_ptr, w_ptr, shift_ptr, s_ptr, keys_ptr, vals_ptr, g_ptr, a_ptr, cw_ptr,
                             out_s_ptr, out_keys_ptr, out_vals_ptr, o_ptr,
                             H, D, M, F, Dv, K, NB, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sw_h,
                             skb_b, skb_h, skb_j, skb_f, svb_b, svb_h, svb_j, svb_c, scale, inv_sqrt_f, tiny,
                             BD: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr, BJ: tl.constexpr,
                             NORMALIZE: tl.constexpr, DROP: tl.constexpr, O_BF16: tl.constexpr):
        """Grid (B·H,): `recurrent.soe_token` with PRF's features and the quotient, one head:
        the K states `S_k <- γ_k·S_k + φk ⊗ vv`, `y = Σ_k a_k φq·S_k` + the band `cw` over
        the NB buffered keys and the new one; DROP (the window holds W - 1): the oldest leaves."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        f, c = tl.arange(0, BF), tl.arange(0, BC)
        C = Dv + 1
        fm, cm = f < F, c < C
        pq, pk = _prf_qk(q_ptr, k_ptr, w_ptr, shift_ptr, b, h, D, M, F, sq_b, sq_h, sk_b, sk_h, sw_h, scale,
                         inv_sqrt_f, BD, BF, NORMALIZE)
        vv = tl.load(vv_ptr + b * sv_b + h * sv_h + c, mask=cm, other=0.0).to(tl.float32)
        kv = pk[:, None] * vv[None, :]
        m = fm[:, None] & cm[None, :]
        y = tl.zeros([BC], dtype=tl.float32)
        for kk in range(K):
            off = (bh * K + kk) * F * C + f[:, None] * C + c[None, :]
            S = tl.load(g_ptr + kk) * tl.load(s_ptr + off, mask=m, other=0.0) + kv
            tl.store(out_s_ptr + off, S, mask=m)
            y += tl.load(a_ptr + h * K + kk) * tl.sum(pq[:, None] * S, 0)
        y += _band_window(pq, keys_ptr, vals_ptr, cw_ptr, out_keys_ptr, out_vals_ptr, b, h, bh, NB, F, C,
                          skb_b, skb_h, skb_j, skb_f, svb_b, svb_h, svb_j, svb_c, DROP, False, BF, BC, BJ)
        y += tl.load(cw_ptr + h * (NB + 1) + NB) * tl.sum(pq * pk, 0) * vv  # the new key, at distance 0
        row = bh * (NB + 1 - DROP) + NB - DROP
        tl.store(out_keys_ptr + row * F + f, pk, mask=fm)
        tl.store(out_vals_ptr + row * C + c, vv, mask=cm)
        _store_quotient(o_ptr + bh * Dv, y, c, Dv, tiny, O_BF16)


@on_device_of(0)
def linear_step_triton(phi_q: Tensor, phi_k: Tensor, v: Tensor, state: Tensor, *, gamma: Tensor | None = None):
    """One token after `state`, by one Triton launch.

    Args:
        phi_q, phi_k: `[B, H, 1, F]`; v: `[B, H, 1, Dv]`; state: `[B, H, F, Dv+1]`
            `Σ_j γ^(t-1-j) φ(k_j) ⊗ [v_j, 1]` of the t earlier keys; gamma: `[H]` or None (1).

    Returns:
        `(num [B, H, 1, Dv], den [B, H, 1], new_state [B, H, F, Dv+1])`, float32.
    """
    why = triton_unavailable_reason(phi_q.device)
    if why is not None:
        raise FastRPEError(f"phi_q: the triton kernels cannot run on {phi_q.device}: {why}")
    B, H, L, F = phi_q.shape
    Dv = v.shape[3]
    if L != 1:
        raise FastRPEError(f"phi_q: one token per step, got {L} (the chunked op runs a prompt)")
    if state.shape != (B, H, F, Dv + 1):
        raise FastRPEError(f"state: expected shape {(B, H, F, Dv + 1)}, got {tuple(state.shape)}")
    g = torch.ones(H, device=phi_q.device) if gamma is None else gamma.detach()
    g = g.to(torch.float32).contiguous()
    S = state.detach().to(torch.float32).contiguous()
    new = torch.empty_like(S)
    y = torch.empty(B, H, Dv + 1, dtype=torch.float32, device=phi_q.device)
    BC = min(_pow2(Dv + 1), 64)
    _step_kernel[(B * H, triton.cdiv(Dv + 1, BC))](phi_q.detach().contiguous(), phi_k.detach().contiguous(),
                                                   v.detach().contiguous(), g, S, new, y, H, F, Dv,
                                                   BF=_pow2(F), BC=BC)
    return y[:, :, None, :Dv], y[:, :, None, Dv], new


#: the fused steps' kernels launched through their compiled binaries once Triton's JIT has
#: launched each specialization (`_launch`): `JITFunction.run` binds and specializes every
#: argument of every launch (25 to 38 here), 19-29 µs of a step's 68-89 µs of host time on a
#: 2-core CPU (Triton 3.6's launch path up to the driver, timed with a driver that runs nothing:
#: `benchmarks/decode_ops.py --host-jit`, results/decode_ops-host-jit.json), and an eager step on
#: the H100 is its host time. False (the JIT every launch)
#: until a GPU has compared and timed it: the bench's decode rows "..., fast launch" check it
#: against the JIT's launch bit for bit before timing it. Never under the interpreter.
FAST_LAUNCH = False

#: (kernel, grid, specialization) -> the compiled kernel's launcher (`CompiledKernel[grid]`)
_LAUNCHERS: dict = {}


def _specialization(args) -> tuple:
    """What Triton's JIT specializes a launch on, of `args` that it may see change: a tensor's
    dtype and 16-byte alignment, an int's value (1, multiples of 16, 64-bit range: the exact
    value keys them all); floats are not specialized."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor) else a if type(a) is int else None
                 for a in args)


def _launch(kernel, grid: tuple, args: tuple, consts: dict, **options) -> None:
    """`kernel[grid](*args, **consts, **options)`, or, with `FAST_LAUNCH`, the same binary
    launched directly once the JIT has launched this specialization (its `CompiledKernel`,
    whose launcher takes every argument in signature order, constexprs included)."""
    if not FAST_LAUNCH or INTERPRETED:
        kernel[grid](*args, **consts, **options)
        return
    # the device too: a compiled kernel's binary is loaded on the device of its first launch
    key = (kernel, grid, args[0].device, _specialization(args), tuple(consts.items()), tuple(options.items()))
    run = _LAUNCHERS.get(key)
    if run is not None:
        run(*args, *consts.values())
        return
    compiled = kernel[grid](*args, **consts, **options)
    names = getattr(kernel, "arg_names", None)  # (a wrapped kernel keeps the JIT's launch every time)
    if hasattr(compiled, "__getitem__") and names is not None and list(consts) == names[len(args):]:
        if len(_LAUNCHERS) >= 1024:
            _LAUNCHERS.clear()
        # (the binary's runner reads grid[0], grid[1] and grid[2]: the JIT pads a grid to three,
        # and a shorter one stopped every fast-launch row on the H100 with an IndexError, 2026-11-28)
        _LAUNCHERS[key] = compiled[tuple(grid) + (1,) * (3 - len(grid))]


class PRFStep(NamedTuple):
    """What a fused step's launch reads of PRF's feature map, checked once (`prf_step`): a
    layer builds it once per parameter state and steps token after token with it
    (`prf_*_token_packed`), so no step checks or converts the map again."""

    w: Tensor  # [M, D] or [H, M, D], float32, contiguous
    key_shift: Tensor  # [H], float32, contiguous
    scale: float  # PRF's input_scale
    normalize: bool
    out_dtype: torch.dtype
    H: int
    D: int
    M: int
    F: int  # M, or 2M two-sided
    sw_h: int  # w's head stride (0: one w for every head)
    inv_sqrt_f: float
    tiny: float  # `underflow_threshold(float32)`: a row below it is empty
    BD: int  # tile widths of D and F
    BF: int


def prf_step(w: Tensor, key_shift: Tensor, H: int, D: int, *, input_scale: float, normalize: bool,
             two_sided: bool, out_dtype: torch.dtype | None = None) -> PRFStep:
    """The `PRFStep` of PRF's map (`kernels.PRF`: `w`, `key_shift`, `input_scale`, `normalize`,
    `two_sided`) for H heads of width D, checked: w `[M, D]` or `[H, M, D]` and key_shift
    `[H]`, float32 and contiguous, on a device the kernels run on."""
    why = triton_unavailable_reason(w.device)
    if why is not None:
        raise FastRPEError(f"w: the triton kernels cannot run on {w.device}: {why}")
    if w.shape[-1] != D or w.dim() not in (2, 3) or (w.dim() == 3 and w.shape[0] != H):
        raise FastRPEError(f"w: expected [M, {D}] or [{H}, M, {D}], got {tuple(w.shape)}")
    if key_shift.shape != (H,) or not (w.is_contiguous() and key_shift.is_contiguous()) \
            or w.dtype != torch.float32 or key_shift.dtype != torch.float32:
        raise FastRPEError(f"w, key_shift: float32 and contiguous, key_shift [{H}]; got {w.dtype} "
                           f"{tuple(w.shape)}, {key_shift.dtype} {tuple(key_shift.shape)}")
    M = w.shape[-2]
    F = 2 * M if two_sided else M
    return PRFStep(w, key_shift, float(input_scale), bool(normalize), out_dtype or torch.float32, H, D, M, F,
                   M * D if w.dim() == 3 else 0, F ** -0.5, underflow_threshold(torch.float32), _pow2(D), _pow2(F))


def _rows(q: Tensor, k: Tensor, vv: Tensor, H: int) -> tuple:
    """`(B, C, (sq_b, sq_h, sk_b, sk_h, sv_b, sv_h))` of q, k `[B, H, D]` and vv `[B, H, C]`,
    each with unit stride in its last dim."""
    if q.dim() != 3 or q.shape[1] != H or k.shape != q.shape or vv.shape[:2] != q.shape[:2] \
            or q.stride(-1) != 1 or k.stride(-1) != 1 or vv.stride(-1) != 1:
        raise FastRPEError(f"q, k: [B, {H}, D], vv: [B, {H}, Dv+1], unit stride in the last dim; got "
                           f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(vv.shape)}")
    return q.shape[0], vv.shape[2], (q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1))


def _packed_rows(p: PRFStep, qkv: Tensor) -> tuple:
    """`(B, C, q, k, vv, strides)` of a fused q/k/v row per batch, `qkv: [B, 2·H·D + H·C]`
    (`[q, k, [v, 1]]`, each head's columns together; unit stride): the three as pointers
    into it, and `_rows`' strides."""
    E = p.H * p.D
    n = qkv.shape[-1]
    C = (n - 2 * E) // p.H
    if qkv.dim() != 2 or C < 2 or n != 2 * E + p.H * C or qkv.stride(1) != 1:
        raise FastRPEError(f"qkv: expected [B, {2 * E} + {p.H}·(Dv+1)] with unit stride, got {tuple(qkv.shape)}")
    s = qkv.stride(0)
    return qkv.shape[0], C, qkv, qkv[:, E:], qkv[:, 2 * E:], (s, p.D, s, p.D, s, C)


def _check_state_S(S: Tensor, shape: tuple) -> None:
    if S.shape != shape or S.dtype != torch.float32 or not S.is_contiguous():
        raise FastRPEError(f"S: expected float32 {shape}, contiguous; got {S.dtype} {tuple(S.shape)}")


def _output(p: PRFStep, B: int, C: int, device) -> tuple[Tensor, Tensor, bool]:
    """`(o [B, H, Dv], what the kernel writes, O_BF16)`: a bf16 o is written through its int16 view."""
    o = torch.empty(B, p.H, C - 1, dtype=p.out_dtype, device=device)
    bf16 = p.out_dtype == torch.bfloat16
    return o, (o.view(torch.int16) if bf16 else o), bf16


def _linear_launch(p: PRFStep, q, k, vv, B: int, C: int, rows: tuple, S: Tensor, gamma: Tensor | None):
    _check_state_S(S, (B, p.H, p.F, C))
    if gamma is not None and (gamma.shape != (p.H,) or gamma.dtype != torch.float32 or not gamma.is_contiguous()):
        raise FastRPEError(f"gamma: expected float32 [{p.H}], contiguous, got {gamma.dtype} {tuple(gamma.shape)}")
    new = torch.empty_like(S)
    o, o_out, bf16 = _output(p, B, C, S.device)
    _launch(_prf_step_kernel, (B * p.H,),
            (q, k, vv, p.w, p.key_shift, S if gamma is None else gamma, S, new, o_out, p.H, p.D, p.M, p.F, C - 1,
             *rows, p.sw_h, p.scale, p.inv_sqrt_f, p.tiny),
            dict(BD=p.BD, BF=p.BF, BC=_pow2(C), NORMALIZE=p.normalize, HAS_G=gamma is not None, O_BF16=bf16))
    return o, new


@on_device_of(0)
def prf_linear_token_triton(q: Tensor, k: Tensor, vv: Tensor, S: Tensor, *, w: Tensor, key_shift: Tensor,
                            input_scale: float, normalize: bool, two_sided: bool, gamma: Tensor | None = None,
                            out_dtype: torch.dtype | None = None):
    """One token after the geometric state `S`, PRF features included, by one Triton launch:
    `φ = PRF(q)`, `PRF(k)` (`kernels.PRF.features`: a query minus its own largest exponent,
    a key minus `key_shift`), `S <- γ_h·S + φ(k) ⊗ vv`, `o = num/den` of `φ(q)·S`.

    Args:
        q, k: `[B, H, D]`, unit stride in D (views of a fused q/k/v row are fine), any float
            dtype (computed in float32). vv: `[B, H, C]` `[v, 1]`, `C = Dv + 1`, unit stride in C.
        S: `[B, H, F, C]` float32, contiguous; w: `[M, D]` or `[H, M, D]` float32 contiguous,
            `F = 2M` if two_sided else M; key_shift: `[H]` float32; gamma: `[H]` float32 or None.
        input_scale, normalize, two_sided: as `PRF`'s.
        out_dtype: dtype of o (default float32).

    Returns:
        `(o [B, H, Dv], S [B, H, F, C])`, `o` 0 for a row with no weight (as `divide_packed`).
    """
    p = prf_step(w, key_shift, q.shape[1], q.shape[-1], input_scale=input_scale, normalize=normalize,
                 two_sided=two_sided, out_dtype=out_dtype)
    B, C, rows = _rows(q, k, vv, p.H)
    return _linear_launch(p, q, k, vv, B, C, rows, S, gamma)


@on_device_of(1)
def prf_linear_token_packed(p: PRFStep, qkv: Tensor, S: Tensor, gamma: Tensor | None = None):
    """`prf_linear_token_triton` on the fused q/k/v matmul's output, `qkv: [B, 2·H·D + H·(Dv+1)]`
    (`[q, k, [v, 1]]`, unit stride), with the feature map's `p` (`prf_step`) built once:
    `nn.MultiheadAttention`'s one-token step, which checks only the state per step."""
    B, C, q, k, vv, rows = _packed_rows(p, qkv)
    return _linear_launch(p, q, k, vv, B, C, rows, S, gamma)


#: keys per iteration over a band's window: a [16, C] tile of values at a time
_BJ = 16

#: warps of the band and SoE steps: at Triton's default 4, ptxas (sm_90, D = 64, F = 32,
#: C = 65 in 128-wide tiles) spills 284 B of the SoE step's 255 registers; at 8 it uses 234
#: and the band step 115-128, none spilled (tests/test_triton_compile.py compiles them so)
_WARPS = 8


def _band_launch(p: PRFStep, q, k, vv, B: int, C: int, rows: tuple, state: BandState, weights: Tensor,
                 tail: Tensor | None, W: int):
    """`prf_band_token_triton`'s checks of the state and the weights, and its launch; `W` the band."""
    H, F = p.H, p.F
    S, keys, values = state.S, state.keys, state.values
    nb = keys.shape[2]
    _check_state_S(S, (B, H, F, C))
    if keys.shape != (B, H, nb, F) or values.shape != (B, H, nb, C - 1) \
            or keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise FastRPEError(f"state: expected float32 keys {(B, H, nb, F)}, values {(B, H, nb, C - 1)}; "
                           f"got {tuple(keys.shape)}, {tuple(values.shape)}")
    full = nb == W
    if nb > W or (tail is None) == full or weights.shape != (H, nb + 1) or not weights.is_contiguous() \
            or weights.dtype != torch.float32 \
            or (tail is not None and (tail.numel() != H or not tail.is_contiguous() or tail.dtype != torch.float32)):
        raise FastRPEError(f"weights, tail: band_token_weights(b, {nb + 1}, {W}) in float32 for {nb} buffered "
                           f"keys of a {W}-wide band, got {tuple(weights.shape)} and tail "
                           f"{None if tail is None else tuple(tail.shape)}")
    keep = nb + 1 - int(full)
    new_keys = torch.empty(B, H, keep, F, dtype=torch.float32, device=S.device)
    new_values = torch.empty(B, H, keep, C - 1, dtype=torch.float32, device=S.device)
    new_S = torch.empty_like(S) if full else S  # until the band is full, no key reaches the tail sum
    o, o_out, bf16 = _output(p, B, C, S.device)
    _launch(_prf_band_step_kernel, (B * H,),
            (q, k, vv, p.w, p.key_shift, S, keys, values, weights, weights if tail is None else tail, new_S, new_keys,
             new_values, o_out, H, p.D, p.M, F, C - 1, nb, *rows, p.sw_h, *keys.stride(), *values.stride(), p.scale,
             p.inv_sqrt_f, p.tiny),
            dict(BD=p.BD, BF=p.BF, BC=_pow2(C), BJ=_BJ, NORMALIZE=p.normalize, DROP=int(full), O_BF16=bf16),
            num_warps=_WARPS)
    return o, BandState(new_S, new_keys, new_values, W, state.length + 1)


@on_device_of(0)
def prf_band_token_triton(q: Tensor, k: Tensor, vv: Tensor, state: BandState, weights: Tensor,
                          tail: Tensor | None, *, w: Tensor, key_shift: Tensor, input_scale: float, normalize: bool,
                          two_sided: bool, out_dtype: torch.dtype | None = None):
    """One token after the finite-support `state`, PRF features included, by one Triton launch:
    `recurrent.band_token` on `φq = PRF(q)`, `φk = PRF(k)` (as `prf_linear_token_triton`'s),
    then `o = num/den` (as `divide_packed`). The new window is written to new tensors, oldest
    first, so the state means what `band_token`'s means; its tail sum is `state.S` itself
    (not copied) until the band is full.

    Args:
        q, k: `[B, H, D]`; vv: `[B, H, Dv+1]` (`[v, 1]`), as `prf_linear_token_triton`'s.
        state: float32 `BandState`, `S` contiguous, `nb <= W` buffered keys (`window` W).
        weights, tail: `band_token_weights(b, nb + 1, W)`'s `w [H, nb+1]` and `tail [H, 1]`
            (None unless nb = W), float32.
        w, key_shift, input_scale, normalize, two_sided, out_dtype: as `prf_linear_token_triton`'s.

    Returns:
        `(o [B, H, Dv], BandState)`, `o` 0 for a row with no weight.
    """
    p = prf_step(w, key_shift, q.shape[1], q.shape[-1], input_scale=input_scale, normalize=normalize,
                 two_sided=two_sided, out_dtype=out_dtype)
    B, C, rows = _rows(q, k, vv, p.H)
    return _band_launch(p, q, k, vv, B, C, rows, state, weights, tail, state.window)


@on_device_of(1)
def prf_band_token_packed(p: PRFStep, qkv: Tensor, state: BandState, weights: Tensor, tail: Tensor | None,
                          window: int):
    """`prf_band_token_triton` on a fused q/k/v row (as `prf_linear_token_packed`'s), for a band
    of `window` distances (the term's: the state's own `window` is not read)."""
    B, C, q, k, vv, rows = _packed_rows(p, qkv)
    return _band_launch(p, q, k, vv, B, C, rows, state, weights, tail, window)


def _soe_launch(p: PRFStep, q, k, vv, B: int, C: int, rows: tuple, state: SoEState, gamma: Tensor, a: Tensor,
                cw: Tensor):
    """`prf_soe_token_triton`'s checks of the state and the coefficients, and its launch."""
    H, F = p.H, p.F
    S, keys, values, W = state.S, state.keys, state.values, state.plan.window
    nb, K = keys.shape[2], gamma.numel()
    _check_state_S(S, (B, H, K, F, C))
    if keys.shape != (B, H, nb, F) or values.shape != (B, H, nb, C) \
            or keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise FastRPEError(f"state: expected float32 keys {(B, H, nb, F)}, values {(B, H, nb, C)}; "
                           f"got {tuple(keys.shape)}, {tuple(values.shape)}")
    if nb > W - 1 or a.numel() != H * K or cw.shape != (H, nb + 1) \
            or not (gamma.is_contiguous() and a.is_contiguous() and cw.is_contiguous()) \
            or not (gamma.dtype == a.dtype == cw.dtype == torch.float32):
        raise FastRPEError(f"gamma, a, cw: soe_token_coefficients(plan, {nb + 1}, float32) for {nb} buffered keys "
                           f"of a {W}-wide band, got {tuple(gamma.shape)}, {tuple(a.shape)}, {tuple(cw.shape)}")
    drop = int(nb == W - 1)
    keep = nb + 1 - drop
    new_keys = torch.empty(B, H, keep, F, dtype=torch.float32, device=S.device)
    new_values = torch.empty(B, H, keep, C, dtype=torch.float32, device=S.device)
    new_S = torch.empty_like(S)
    o, o_out, bf16 = _output(p, B, C, S.device)
    _launch(_prf_soe_step_kernel, (B * H,),
            (q, k, vv, p.w, p.key_shift, S, keys, values, gamma, a, cw, new_S, new_keys, new_values, o_out, H, p.D,
             p.M, F, C - 1, K, nb, *rows, p.sw_h, *keys.stride(), *values.stride(), p.scale, p.inv_sqrt_f, p.tiny),
            dict(BD=p.BD, BF=p.BF, BC=_pow2(C), BJ=_BJ, NORMALIZE=p.normalize, DROP=drop, O_BF16=bf16),
            num_warps=_WARPS)
    return o, SoEState(new_S, new_keys, new_values, state.plan, state.length + 1)


@on_device_of(0)
def prf_soe_token_triton(q: Tensor, k: Tensor, vv: Tensor, state: SoEState, gamma: Tensor, a: Tensor,
                         cw: Tensor, *, w: Tensor, key_shift: Tensor, input_scale: float, normalize: bool,
                         two_sided: bool, out_dtype: torch.dtype | None = None):
    """One token after the sum-of-exponentials `state`, PRF features included, by one Triton
    launch: `recurrent.soe_token` on `φq = PRF(q)`, `φk = PRF(k)` (as
    `prf_linear_token_triton`'s), then `o = num/den` (as `divide_packed`). The new states and
    window (oldest first) are new tensors.

    Args:
        q, k: `[B, H, D]`; vv: `[B, H, Dv+1]` (`[v, 1]`), as `prf_linear_token_triton`'s.
        state: float32 `SoEState`, `S` contiguous, `nb <= W - 1` buffered keys (`plan.window` W).
        gamma, a, cw: `soe_token_coefficients(plan, nb + 1, torch.float32)` (any shapes holding
            `[K]`, `[H, K]` and `[H, nb+1]`).
        w, key_shift, input_scale, normalize, two_sided, out_dtype: as `prf_linear_token_triton`'s.

    Returns:
        `(o [B, H, Dv], SoEState)`, `o` 0 for a row with no weight.
    """
    p = prf_step(w, key_shift, q.shape[1], q.shape[-1], input_scale=input_scale, normalize=normalize,
                 two_sided=two_sided, out_dtype=out_dtype)
    B, C, rows = _rows(q, k, vv, p.H)
    return _soe_launch(p, q, k, vv, B, C, rows, state, gamma, a, cw)


@on_device_of(1)
def prf_soe_token_packed(p: PRFStep, qkv: Tensor, state: SoEState, gamma: Tensor, a: Tensor, cw: Tensor):
    """`prf_soe_token_triton` on a fused q/k/v row (as `prf_linear_token_packed`'s)."""
    B, C, q, k, vv, rows = _packed_rows(p, qkv)
    return _soe_launch(p, q, k, vv, B, C, rows, state, gamma, a, cw)
