"""Causal kernelized attention with a finite-support positional term (T5 buckets, a clipped
learned table), exactly, in linear time, by the fused Triton kernel of `triton_soe.py`: the
fast sibling of `band.py` (both are checked against `naive.py`).

A term constant beyond a distance W has coefficients

    c(d) = exp(b(-d))    for d < W,        c(d) = exp(b(-W)) = a    for d >= W,

which is a sum of exponentials with a single rate γ = 1 and weight `a`, plus the exact band
`corr(d) = c(d) - a` for `d < W`. Nothing is fitted, so the fused kernel (near field with the
exact coefficients, far field from one undecayed state: the keys' running sum) computes it
exactly, forward and backward; gradients reach the table through `a` and `corr`.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, W support.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._memo import ByIdentity, kept
from .soe import SoEPlan
from .triton_chunked import DEFAULT_CHUNK
from .triton_soe import kernelized_num_den_triton_soe

#: `SoEPlan.fit_length` of an exact plan: every distance is represented, none was fitted
EXACT = 1 << 62

#: the plans of tables that take no gradient, per table: a frozen term's table is kept
#: (`backends._coefficients`), and so, here, is its plan, whose kernel tables `triton_soe` keeps
_PLANS = ByIdentity()


def band_plan(b: Tensor) -> SoEPlan:
    """The exact one-term plan of `b: [H, W+1]`, `b(-d)` for `d = 0..W` (the term is
    `b(-W)` at every larger distance): `γ = 1`, `a = c(W)`, `corr(d) = c(d) - a`, with
    `c = exp(b - max b)` per head (a constant per head cancels between Luo et al.'s Eq. 10
    numerator and denominator, and the plan's `shift` keeps it for Shaw's sums). float64,
    differentiable in `b`.

    Every row is scaled by its head's largest coefficient over `d <= W`, so a row whose own
    coefficients all lie more than ~87 nats below it would underflow in float32 (the `band`
    backend rescales row by row); T5 and learned tables span a few nats."""
    W = b.shape[1] - 1
    if W < 1:
        raise ValueError(f"b: needs b(-d) for d = 0..W with W >= 1, got {b.shape[1]} values")
    b = b.to(torch.float64)
    m = b.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a head with every entry -inf: all zeros
    c = torch.exp(b - m)  # (H, W+1)
    a = c[:, W:]  # (H, 1)
    return SoEPlan(torch.ones(1, dtype=torch.float64, device=b.device), a, c[:, :W] - a, W, EXACT, m[:, 0])


def band_plan_of(log_coeff: Tensor, window: int, Lq: int, q_offset: int) -> SoEPlan:
    """The exact plan (`band_plan`) of a call's `log_coeff` (`[H, Lq+Lk-1]`, as
    `kernelized_num_den_triton_band` takes it) for a support of `window` distances; built on
    every call where `log_coeff` is in the graph, else kept per table (`_PLANS`)."""
    W = int(window)
    if W < 1:
        raise ValueError(f"window must be >= 1, got {window}")

    def plan():
        # b(-d), d = 0..W: offset -d sits at index Lq-1+q_offset-d; distances past the vector
        # (longer than any pair of this call) take its last entry, which no pair reads
        d = torch.arange(W + 1, device=log_coeff.device)
        return band_plan(log_coeff[:, (Lq - 1 + q_offset - d).clamp_min(0)])

    if (torch.is_grad_enabled() and log_coeff.requires_grad) or torch.compiler.is_compiling():
        return plan()
    return kept(_PLANS, log_coeff, (Lq, q_offset, W, log_coeff.data_ptr(), log_coeff._version), plan, entries=4)


def kernelized_num_den_triton_band(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor,
    *,
    window: int,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    out_dtype: torch.dtype | None = None,
    precision: str = "ieee",
    state_dtype: torch.dtype | None = None,
    divide: torch.dtype | None = None,
):
    """Causal `(num, den, log_scale)` exactly as `kernelized_num_den_naive(..., causal=True)`
    for a term with `b(r) = b(-W)` for all `r <= -W` (`W = window`), in one fused Triton pass.

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`;
            v: `[B, H, Lk, Dv]`.
        log_coeff: `[H, Lq+Lk-1]` `b(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset`, as
            `band.kernelized_num_den_band` takes it (differentiable; only `-W <= r <= 0` is read).
        window: W >= 1, the term's finite support.
        key_padding_mask: `[B, Lk]` bool, True = padding.
        chunk_size: T (the near field spans `near_chunks(W, T)` chunks: 3 for T5's 113
            distances at T = 64).
        out_dtype, precision, state_dtype, divide: as `kernelized_num_den_triton_soe`.

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])`: the true sums are
        `num·exp(log_scale)` (log_scale: each head's largest `b(-d)`, `d <= W`); with
        `divide`, the quotient `num/den` in place of num.
    """
    p = band_plan_of(log_coeff, window, phi_q.shape[2], q_offset)
    return kernelized_num_den_triton_soe(phi_q, phi_k, v, p, q_offset=q_offset,
                                         key_padding_mask=key_padding_mask, chunk_size=chunk_size,
                                         out_dtype=out_dtype, precision=precision, state_dtype=state_dtype,
                                         divide=divide)
