"""Causal decoding ops: a few new tokens after a constant-size state, one op per state kind
(flash-linear-attention's `fused_recurrent` beside `chunk`). Each returns the numerator,
denominator (and log-scale) of the new queries and the state after the new keys; the
naive sibling, `recurrent_naive`, walks the tokens one by one from the definition.

A call's tokens sit right after the state: queries and keys at `length .. length + L - 1`.

Notation: B batch, H heads, L new tokens, F features, C = Dv + 1, W band width.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .band import kernelized_num_den_band
from .chunked import kernelized_num_den_chunked
from .soe import soe_step  # noqa: F401  (the sum-of-exponentials step lives beside its op)
from .state import BandState, LinearState

__all__ = ["linear_step", "band_step", "soe_step", "recurrent_naive"]


def _vv(v: Tensor, dt: torch.dtype) -> Tensor:
    return torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)  # (B, H, L, C)


def linear_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, state: LinearState | None = None, *,
                gamma: Tensor | None = None):
    """Geometric decay `γ_h^(p_i - j)` (None: 1) after `state`.

    Args:
        phi_q, phi_k: `[B, H, L, F]`; v: `[B, H, L, Dv]`; gamma: `[H]`.

    Returns:
        `(num [B, H, L, Dv], den [B, H, L], LinearState)`.
    """
    start = 0 if state is None else state.length
    L, Dv, dt = phi_q.shape[2], v.shape[3], phi_q.dtype
    if L == 1 and state is not None:
        # S <- γ S + φk ⊗ [v, 1]; y = φq · S
        g = 1.0 if gamma is None else gamma.to(dt)[None, :, None, None]
        S = g * state.S.to(dt) + torch.einsum("bhf,bhc->bhfc", phi_k[:, :, 0], _vv(v, dt)[:, :, 0])
        y = torch.einsum("bhf,bhfc->bhc", phi_q[:, :, 0], S)[:, :, None]
        return y[..., :Dv], y[..., Dv], LinearState(S, start + 1)
    num, den, _, S = kernelized_num_den_chunked(phi_q, phi_k, v, gamma=gamma, return_state=True,
                                                initial_state=None if state is None else state.S)
    return num, den, LinearState(S, start + L)


def band_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, state: BandState | None = None, *, b: Tensor,
              window: int):
    """A finite-support term (`b(r) = b(-W)` for `r <= -W`) after `state`, exactly.

    Args:
        phi_q, phi_k: `[B, H, L, F]`; v: `[B, H, L, Dv]`.
        b: `[H, W+1]` log-coefficients `b(-d)` for `d = 0..W`.
        window: W.

    Returns:
        `(num [B, H, L, Dv], den [B, H, L], log_scale [H, L], BandState)`.
    """
    W, L, dt = int(window), phi_q.shape[2], phi_q.dtype
    keys, values = phi_k, v.to(dt)
    nb = 0
    if state is not None:
        nb = state.keys.shape[2]
        keys, values = torch.cat([state.keys.to(dt), phi_k], 2), torch.cat([state.values.to(dt), values], 2)
    full = state is not None and nb == W  # the tail sum is nonempty only once W keys are buffered
    if L == 1:
        # one token: its n <= W+1 keys at distances n-1..0 (distance W is the tail's constant)
        n = keys.shape[2]
        bb = b.to(dt)[:, (n - 1 - torch.arange(n, device=phi_q.device)).clamp_max(W)]  # (H, n)
        m = bb.detach().amax(-1, keepdim=True)  # (H, 1)
        if full:
            m = torch.maximum(m, b.detach().to(dt)[:, W:])
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        att = torch.einsum("bhf,bhjf->bhj", phi_q[:, :, 0], keys) * torch.exp(bb - m)[None]  # (B, H, n)
        y = torch.einsum("bhj,bhjc->bhc", att, _vv(values, dt))
        if full:
            y = y + torch.exp(b.to(dt)[:, W:] - m)[None] * torch.einsum("bhf,bhfc->bhc", phi_q[:, :, 0], state.S.to(dt))
        num, den, log_scale = y[:, :, None, :-1], y[:, :, None, -1], m
    else:
        # offsets r = -(L-1+nb) .. L-1 of this call (r > 0 is masked: causal)
        r = torch.arange(-(L - 1 + nb), L, device=phi_q.device)
        lc = b.to(dt)[:, (-r).clamp(0, W)]  # (H, R)
        num, den, log_scale = kernelized_num_den_band(phi_q, keys, values, lc, window=W, causal=True, q_offset=nb,
                                                      initial_state=state.S.to(dt) if full else None)
    # keep the last W keys; the older ones join the tail sum
    out = keys.shape[2] - W
    S = phi_k.new_zeros(*phi_k.shape[:2], phi_k.shape[3], values.shape[3] + 1) if state is None else state.S.to(dt)
    if out > 0:
        S = S + torch.einsum("bhjf,bhjc->bhfc", keys[:, :, :out], _vv(values[:, :, :out], dt))
    new = BandState(S, keys[:, :, max(out, 0):], values[:, :, max(out, 0):], W,
                    (0 if state is None else state.length) + L)
    return num, den, log_scale, new


def recurrent_naive(phi_q: Tensor, phi_k: Tensor, v: Tensor, coeff: Tensor, *, q_offset: int = 0):
    """The reference: query i at position `q_offset + i` sums keys `j <= q_offset + i` with
    weight `coeff[:, q_offset + i - j]`, one query at a time (a loop over time).

    Args:
        phi_q: `[B, H, Lq, F]`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        coeff: `[H, N]` the coefficient `c(d)` at distance `d = 0..N-1` (`N > q_offset + Lq - 1`).

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq])`.
    """
    nums, dens = [], []
    for i in range(phi_q.shape[2]):
        p = q_offset + i
        j = torch.arange(min(p + 1, phi_k.shape[2]), device=phi_q.device)
        w = torch.einsum("bhf,bhjf->bhj", phi_q[:, :, i], phi_k[:, :, j]) * coeff[None, :, p - j]
        nums.append(torch.einsum("bhj,bhjd->bhd", w, v[:, :, j].to(w.dtype)))
        dens.append(w.sum(-1))
    return torch.stack(nums, 2), torch.stack(dens, 2)
