"""One decoding step of causal kernelized attention with a geometric decay, fused into one
Triton kernel (the fast sibling of `recurrent.linear_step` for one token):

    S <- γ_h·S + φ(k) ⊗ [v, 1]        (state `[B, H, F, Dv+1]`, float32)
    y  = φ(q)·S,  num = y[:Dv],  den = y[Dv]

The PyTorch step is four launches (decay, outer product, add, read); at a constant-size
state a step is launch-bound, so one launch may pay. Measure on the GPU whether it does
before `auto`/dispatch prefers it; nothing selects it yet. Inference only (no autograd).

Notation: B batch, H heads, F features, Dv value width, C = Dv + 1, BF/BC tile widths.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._validate import FastRPEError
from .triton_chunked import HAS_TRITON, _pow2, triton_unavailable_reason

if HAS_TRITON:
    import triton
    import triton.language as tl

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
