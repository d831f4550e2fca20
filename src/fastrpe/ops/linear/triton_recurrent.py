"""One decoding step of causal kernelized attention with a geometric decay, fused into one
Triton kernel (the fast sibling of `recurrent.linear_step` for one token):

    S <- γ_h·S + φ(k) ⊗ [v, 1]        (state `[B, H, F, Dv+1]`, float32)
    y  = φ(q)·S,  num = y[:Dv],  den = y[Dv]

Two kernels. `linear_step_triton` takes the features. `prf_linear_token_triton` also computes
them: PRF/NPRF's map (`kernels.PRF.features`) and the quotient `num/den`. A decoding step of
`nn.MultiheadAttention` with PRF features and a geometric state is then three launches: the
fused q/k/v matmul, this kernel and the output projection. The PyTorch step is 39 launches
(`benchmarks/decode_ops.py`). The step is launch-bound at a constant-size state. Eager on an
H100 (2026-11-23, docs/RESULTS.md), 64 launches took 1.9 ms for about 0.1 ms of work.
Inference only (no autograd).

Notation: B batch, H heads, D head width, M projections, F features (M, or 2M two-sided),
Dv value width, C = Dv + 1, BD/BF/BC tile widths.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._validate import FastRPEError
from ..common import underflow_threshold
from .triton_chunked import HAS_TRITON, _pow2, triton_unavailable_reason

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
    def _prf_step_kernel(q_ptr, k_ptr, vv_ptr, w_ptr, shift_ptr, g_ptr, s_ptr, out_s_ptr, o_ptr,
                         H, D, M, F, Dv, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sw_h, scale, inv_sqrt_f, tiny,
                         BD: tl.constexpr, BF: tl.constexpr, BC: tl.constexpr,
                         NORMALIZE: tl.constexpr, HAS_G: tl.constexpr, O_BF16: tl.constexpr):
        """Grid (B·H,): one head's features, new state and `num/den` (0 where |den| < tiny;
        O_BF16: o_ptr is the int16 view of a bf16 o, rounded to nearest as the GPU rounds)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        d, f, c = tl.arange(0, BD), tl.arange(0, BF), tl.arange(0, BC)
        C = Dv + 1
        dm, fm, cm = d < D, f < F, c < C
        # feature f projects on row f mod M, negated in the second half (two-sided: F = 2M)
        sign = tl.where(f < M, 1.0, -1.0)
        w = tl.load(w_ptr + h * sw_h + (f % M)[:, None] * D + d[None, :], mask=fm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32) * sign[:, None]
        q = tl.load(q_ptr + b * sq_b + h * sq_h + d, mask=dm, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + h * sk_h + d, mask=dm, other=0.0).to(tl.float32)
        eq = tl.where(fm, _prf_exponents(q, w, scale, NORMALIZE), float("-inf"))
        pq = tl.exp(eq - tl.max(eq, 0)) * inv_sqrt_f  # a query subtracts its own maximum
        pk = tl.where(fm, tl.exp(_prf_exponents(k, w, scale, NORMALIZE) - tl.load(shift_ptr + h)) * inv_sqrt_f, 0.0)
        vv = tl.load(vv_ptr + b * sv_b + h * sv_h + c, mask=cm, other=0.0).to(tl.float32)
        off = bh * F * C + f[:, None] * C + c[None, :]
        m = fm[:, None] & cm[None, :]
        S = tl.load(s_ptr + off, mask=m, other=0.0).to(tl.float32)
        if HAS_G:
            S = tl.load(g_ptr + h).to(tl.float32) * S
        S = S + pk[:, None] * vv[None, :]
        tl.store(out_s_ptr + off, S, mask=m)
        y = tl.sum(pq[:, None] * S, 0)  # (BC,): [num, den]
        den = tl.sum(tl.where(c == Dv, y, 0.0), 0)
        empty = tl.abs(den) < tiny
        o = tl.where(empty, 0.0, y / tl.where(empty, 1.0, den))
        _store_tile(o_ptr + bh * Dv + c, o, c < Dv, O_BF16)


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
    why = triton_unavailable_reason(q.device)
    if why is not None:
        raise FastRPEError(f"q: the triton kernels cannot run on {q.device}: {why}")
    B, H, D = q.shape
    M = w.shape[-2]
    F, C = (2 * M if two_sided else M), vv.shape[2]
    if w.shape[-1] != D or w.dim() not in (2, 3) or (w.dim() == 3 and w.shape[0] != H):
        raise FastRPEError(f"w: expected [M, {D}] or [{H}, M, {D}], got {tuple(w.shape)}")
    if S.shape != (B, H, F, C) or S.dtype != torch.float32:
        raise FastRPEError(f"S: expected float32 {(B, H, F, C)}, got {S.dtype} {tuple(S.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, vv)) or not (S.is_contiguous() and w.is_contiguous()):
        raise FastRPEError("q, k, vv: unit stride in the last dim; S, w: contiguous")
    new = torch.empty_like(S)
    o = torch.empty(B, H, C - 1, dtype=out_dtype or torch.float32, device=q.device)
    bf16 = o.dtype == torch.bfloat16
    _prf_step_kernel[(B * H,)](q, k, vv, w, key_shift, S if gamma is None else gamma, S, new,
                               o.view(torch.int16) if bf16 else o,
                               H, D, M, F, C - 1, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                               vv.stride(0), vv.stride(1), M * D if w.dim() == 3 else 0, float(input_scale),
                               F ** -0.5, underflow_threshold(torch.float32),
                               BD=_pow2(D), BF=_pow2(F), BC=_pow2(C), NORMALIZE=bool(normalize),
                               HAS_G=gamma is not None, O_BF16=bf16)
    return o, new
