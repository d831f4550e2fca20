"""Causal decoding ops: a few new tokens after a constant-size state, one op per state kind
(flash-linear-attention's `fused_recurrent` beside `chunk`). Each returns the numerator,
denominator (and log-scale) of the new queries and the state after the new keys; the
naive sibling, `recurrent_naive`, walks the tokens one by one from the definition.

A call's tokens sit right after the state: queries and keys at `length .. length + L - 1`.

The `*_token` ops are the one-token bodies of the steps, on values that already carry the
denominator's column (`vv = [v, 1]`) and with the per-head constants precomputed, so that
a decoding layer can build those once (`MultiheadAttention.step` does); they return the
packed row `y = [num, den]`, which `divide_packed` turns into the output. At a
constant-size state a step is a few dozen tiny launches, so each one saved shows.

Notation: B batch, H heads, L new tokens, F features, C = Dv + 1, W band width, n keys in
the band (the buffered ones and the new one), K sum-of-exponentials terms.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..common import safe_divide, underflow_threshold
from .band import kernelized_num_den_band
from .chunked import kernelized_num_den_chunked
from .soe import soe_step  # noqa: F401  (the sum-of-exponentials step lives beside its op)
from .state import BandState, LinearState, SoEState

__all__ = ["linear_step", "band_step", "soe_step", "recurrent_naive", "linear_token", "band_token",
           "band_token_weights", "soe_token", "divide_packed"]


def _vv(v: Tensor, dt: torch.dtype) -> Tensor:
    return torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)  # (B, H, L, C)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` over `[B, H, i, j]` operands as one bmm (matmul's broadcasting adds views)."""
    return torch.bmm(a.flatten(0, 1), b.flatten(0, 1)).unflatten(0, a.shape[:2])


def _baddbmm(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """`acc + a @ b` over `[B, H, i, j]` operands, one launch (matmul then add are two)."""
    return torch.baddbmm(acc.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1)).view(acc.shape)


def _add_outer(S: Tensor, k: Tensor, vv: Tensor) -> Tensor:
    """`S + Σ_j k_j ⊗ vv_j`: `S [B, H, F, C]`, `k [B, H, j, F]`, `vv [B, H, j, C]`."""
    return _baddbmm(S, k.transpose(-1, -2), vv)


def linear_token(phi_q: Tensor, phi_k: Tensor, vv: Tensor, S: Tensor, gamma: Tensor | None = None):
    """One token after the geometric state `S`: `S <- γ_h·S + φk ⊗ vv`, `y = φq·S`.

    Args:
        phi_q, phi_k: `[B, H, 1, F]`; vv: `[B, H, 1, C]` (`[v, 1]`); S: `[B, H, F, C]`;
            gamma: `[H, 1, 1]` in S's dtype, or None (no decay).

    Returns:
        `(y [B, H, 1, C], S [B, H, F, C])`.
    """
    kv = phi_k.transpose(-1, -2) * vv  # (B, H, F, C)
    S = kv + S if gamma is None else torch.addcmul(kv, gamma, S)
    return _bmm(phi_q, S), S


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
        y, S = linear_token(phi_q, phi_k, _vv(v, dt), state.S.to(dt),
                            None if gamma is None else gamma.to(dt)[:, None, None])
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
    if L == 1:
        if state is None:  # a one-token prompt: an empty band
            B, H, _, F = phi_k.shape
            state = BandState(phi_k.new_zeros(B, H, F, v.shape[3] + 1), phi_k[:, :, :0], v[:, :, :0].to(dt), W, 0)
        state = replace(state, S=state.S.to(dt), keys=state.keys.to(dt), values=state.values.to(dt))
        n = state.keys.shape[2] + 1
        w, tail, m = band_token_weights(b.to(dt), n, W)
        y, new = band_token(phi_q, phi_k, _vv(v, dt), state, w, tail)
        return y[..., :-1], y[..., -1], m, new
    keys, values = phi_k, v.to(dt)
    nb = 0
    if state is not None:
        nb = state.keys.shape[2]
        keys, values = torch.cat([state.keys.to(dt), phi_k], 2), torch.cat([state.values.to(dt), values], 2)
    full = state is not None and nb == W  # the tail sum is nonempty only once W keys are buffered
    # offsets r = -(L-1+nb) .. L-1 of this call (r > 0 is masked: causal)
    r = torch.arange(-(L - 1 + nb), L, device=phi_q.device)
    lc = b.to(dt)[:, (-r).clamp(0, W)]  # (H, R)
    num, den, log_scale = kernelized_num_den_band(phi_q, keys, values, lc, window=W, causal=True, q_offset=nb,
                                                  initial_state=state.S.to(dt) if full else None)
    # keep the last W keys; the older ones join the tail sum
    out = keys.shape[2] - W
    S = phi_k.new_zeros(*phi_k.shape[:2], phi_k.shape[3], values.shape[3] + 1) if state is None else state.S.to(dt)
    if out > 0:
        S = _add_outer(S, keys[:, :, :out], _vv(values[:, :, :out], dt))
    new = BandState(S, keys[:, :, max(out, 0):], values[:, :, max(out, 0):], W,
                    (0 if state is None else state.length) + L)
    return num, den, log_scale, new


def band_token_weights(b: Tensor, n: int, window: int):
    """The per-head constants of a one-token band step over `n` keys (`n <= W + 1`, oldest
    first, the last one the new token's): they depend on `b` and `n` only.

    Args:
        b: `[H, W+1]` log-coefficients `b(-d)`, `d = 0..W`, in the step's dtype.

    Returns:
        `(w [H, n], tail [H, 1] or None, m [H, 1])`: `w_j = exp(b(-d_j) - m)` for key j at
        distance `d_j = n-1-j`; `tail = exp(b(-W) - m)`, the tail sum's weight once the band
        is full (`n = W + 1`), else None; `m` the largest of those exponents (detached; 0 if
        none is finite), the row's log-scale.
    """
    W = int(window)
    bb = b[:, (n - 1 - torch.arange(n, device=b.device)).clamp_max(W)]  # (H, n)
    m = bb.detach().amax(-1, keepdim=True)  # (H, 1)
    if n > W:
        m = torch.maximum(m, b.detach()[:, W:])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(bb - m), (torch.exp(b[:, W:] - m) if n > W else None), m


def band_token(phi_q: Tensor, phi_k: Tensor, vv: Tensor, state: BandState, w: Tensor, tail: Tensor | None):
    """One token after `state`: `y = Σ_j w_j (φq·k_j) vv_j + tail·φq·S` over the buffered keys
    and the new one, then the oldest key joins the tail sum once more than W are buffered.

    Args:
        phi_q, phi_k: `[B, H, 1, F]`; vv: `[B, H, 1, C]` (`[v, 1]`); state: in the step's
            dtype; w, tail: `band_token_weights(b, n, W)` with `n = state.keys.shape[2] + 1`.

    Returns:
        `(y [B, H, 1, C], BandState)`; y is scaled by `exp(-m)` of `band_token_weights`.
    """
    W = state.window
    keys = torch.cat([state.keys, phi_k], 2)  # (B, H, n, F)
    values = torch.cat([torch.cat([state.values, torch.ones_like(state.values[..., :1])], -1), vv], 2)  # (B, H, n, C)
    att = _bmm(phi_q, keys.transpose(-1, -2)) * w[:, None, :]  # (B, H, 1, n)
    y = _bmm(att, values)  # (B, H, 1, C)
    if tail is not None:
        y = torch.addcmul(y, tail[:, :, None], _bmm(phi_q, state.S))
    out = keys.shape[2] - W
    S = _add_outer(state.S, keys[:, :, :out], values[:, :, :out]) if out > 0 else state.S
    # the values kept are a view of the C-wide buffer: one copy fewer per step
    new = BandState(S, keys[:, :, max(out, 0):], values[:, :, max(out, 0):, :-1], W, state.length + 1)
    return y, new


def soe_token_coefficients(plan, n: int, dtype: torch.dtype):
    """The constants of `soe_token` over `n <= W` band keys, from `plan` (a `SoEPlan`):
    `(gamma [K, 1, 1], a [H, K, 1], cw [H, n])`, cw the band corrections `corr(d_j)` of key j
    at distance `d_j = n-1-j`."""
    return (plan.gamma.to(dtype)[:, None, None], plan.a.to(dtype)[:, :, None],
            plan.corr.to(dtype)[:, :n].flip(-1))


def soe_token(phi_q: Tensor, phi_k: Tensor, vv: Tensor, state: SoEState, gamma: Tensor, a: Tensor, cw: Tensor):
    """One token after the sum-of-exponentials `state` (the one-token body of `soe_step`):
    every term's state decays by its rate and takes the new key, `y = Σ_k a_k φq·S_k` plus
    the exact band over the buffered keys and the new one.

    Args:
        phi_q, phi_k: `[B, H, 1, F]`; vv: `[B, H, 1, C]` (`[v, 1]`); state: in the step's
            dtype; gamma, a, cw: `soe_token_coefficients(plan, n, dtype)`, `n = state.keys.shape[2] + 1`.

    Returns:
        `(y [B, H, 1, C], SoEState)`.
    """
    S = torch.addcmul((phi_k.transpose(-1, -2) * vv)[:, :, None], gamma, state.S)  # (B, H, K, F, C)
    B, H, K, F, C = S.shape
    y = _bmm((a * phi_q).view(B, H, 1, K * F), S.view(B, H, K * F, C))  # (B, H, 1, C)
    keys, values = torch.cat([state.keys, phi_k], 2), torch.cat([state.values, vv], 2)  # (B, H, n, F|C)
    y = _baddbmm(y, _bmm(phi_q, keys.transpose(-1, -2)) * cw[:, None, :], values)
    tail = slice(max(0, keys.shape[2] - (state.plan.window - 1)), None)
    return y, SoEState(S, keys[:, :, tail], values[:, :, tail], state.plan, state.length + 1)


def divide_packed(y: Tensor) -> Tensor:
    """`num / den` of packed rows `y = [num, den]` (`[..., Dv+1]` -> `[..., Dv]`), 0 where
    `|den|` is below `underflow_threshold` (an empty row), as `safe_divide`. Without autograd
    it is one division and a masked fill (`safe_divide`'s masking keeps the gradient finite
    and costs five launches more)."""
    num, den = y[..., :-1], y[..., -1:]
    if torch.is_grad_enabled() and y.requires_grad:
        return safe_divide(num, den[..., 0])
    return (num / den).masked_fill_(den.abs() < underflow_threshold(y.dtype), 0.0)


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
