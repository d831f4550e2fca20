"""Causal kernelized attention with any decaying positional term in linear time, by a
sum of exponentials: an exact band `|r| < W` plus `Σ_k a_k·γ_k^|r|` beyond.

`c(r) = exp(b(r) - max b)` for `r <= 0` is written as
`c(r) = Σ_k a_k γ_k^|r| + [|r| < W]·(c(r) - Σ_k a_k γ_k^|r|)`:
each exponential is one pass of the chunked (linear-time) geometric form, and the band
correction is exact and dense over W offsets. Only the far field `|r| >= W` is
approximated; `soe_fit_error` reports how well. The rates `γ_k` sit on a fixed log-spaced
grid of time scales and the weights `a_k` solve a least-squares fit in relative error,
so they are differentiable functions of the positional parameters (refitted every call).

Notation: B batch, H heads, L length, F features, C = Dv + 1, K terms, W band width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .chunked import kernelized_num_den_chunked

DEFAULT_WINDOW = 64
DEFAULT_TERMS = 16


#: coefficients this far below c(0) = 1 are fitted in absolute, not relative, error
#: (e^-20 ≈ 2e-9 per key: far below the 1e-3 output target even summed over 10^5 keys)
FIT_FLOOR_NATS = 20.0


def soe_rates(window: int, max_len: int, num_terms: int, dtype=torch.float64, device=None) -> Tensor:
    """`[K]` rates: γ = 1 (a constant tail) and K-1 time scales `τ` (`γ = e^(-1/τ)`)
    log-spaced from `window/16` to `4·max_len`: a faster rate is below e^-16 over the whole
    far field `d >= window`, so it could only fit noise."""
    lo, hi = math.log(max(1.0, window / 16)), math.log(4.0 * max(max_len, window))
    tau = torch.exp(torch.linspace(lo, hi, num_terms - 1, dtype=dtype, device=device))
    return torch.cat([torch.exp(-1.0 / tau), torch.ones(1, dtype=dtype, device=device)])


def fit_soe(log_c_far: Tensor, r_far: Tensor, gamma: Tensor) -> Tensor:
    """Weights `a: [H, K]` with `Σ_k a_k γ_k^r ≈ exp(log_c_far)` in relative error.

    Args:
        log_c_far: `[H, N]` log-coefficients at distances `r_far: [N]` (all >= W).
        gamma: `[K]` rates.
    """
    A = gamma[None, None, :] ** r_far[None, :, None].to(gamma.dtype)  # (1, N, K)
    # relative error (divide rows by c(r)), down to a floor below which errors cannot matter
    w = torch.exp(-log_c_far.to(gamma.dtype).clamp_min(-FIT_FLOOR_NATS))
    A = A * w[..., None]  # (H, N, K)
    ones = torch.ones(*w.shape, 1, dtype=gamma.dtype, device=gamma.device)
    # unit columns first: the relative weights reach e^20, so slow rates' columns are ~1e7
    # times the fast ones', and a ridge scaled to their mean flattened the fast terms
    # (KERPLE-log r1=2, r2=0.5 misplaced 3e-4 of a row's weight; 8e-7 with unit columns)
    # (a column far below the others keeps its scale: a unit column would take a huge weight
    # that cancels, catastrophically, against the exact band correction)
    s = A.norm(dim=-2, keepdim=True)  # (H, 1, K)
    s = torch.maximum(s, 1e-6 * s.amax(-1, keepdim=True)).clamp_min(torch.finfo(gamma.dtype).tiny)
    A = A / s
    # ridge-regularized normal equations: well-posed for nearly collinear exponentials, differentiable
    eye = torch.eye(gamma.numel(), dtype=gamma.dtype, device=gamma.device)
    x = torch.linalg.solve(A.transpose(-1, -2) @ A + 1e-12 * eye, A.transpose(-1, -2) @ ones)[..., 0]
    return x / s[..., 0, :]  # (H, K)


def _far_samples(window: int, max_len: int, n: int = 256) -> Tensor:
    """Distances W..max_len-1, log-spaced (plus the ends), to fit and to check the fit."""
    if max_len <= window:
        return torch.zeros(0, dtype=torch.long)
    r = torch.unique(torch.round(torch.logspace(math.log10(window), math.log10(max_len - 1), n)).long())
    return r.clamp(window, max_len - 1)


def soe_fit_error(log_coeff_causal: Tensor, window: int = DEFAULT_WINDOW, num_terms: int = DEFAULT_TERMS) -> float:
    """Max absolute error of the fitted far field over every distance `W <= |r| < L`, in
    units of the largest coefficient (c normalized so that max c = 1).
    `log_coeff_causal: [H, L]` holds `b(-d)` for `d = 0..L-1`."""
    H, L = log_coeff_causal.shape
    if L <= window:
        return 0.0
    lc = log_coeff_causal.detach().double()
    lc = lc - lc.amax(-1, keepdim=True)
    gamma = soe_rates(window, L, num_terms)
    rs = _far_samples(window, L)
    a = fit_soe(lc[:, rs], rs, gamma)
    d = torch.arange(window, L, dtype=torch.float64)
    approx = (a[:, None, :] * gamma[None, None, :] ** d[None, :, None]).sum(-1)
    exact = torch.exp(lc[:, window:])
    return float((approx - exact).abs().max())


#: the far field is fitted over distances up to max(L, SOE_FIT_LENGTH): one fit serves every
#: call up to this length, so a prefix's outputs do not depend on how long the sequence
#: is, and decoding (which fits once) reproduces the full forward pass
SOE_FIT_LENGTH = 4096


@dataclass
class SoEPlan:
    """A fitted sum of exponentials for `c(d) = exp(b(-d) - max b)`, `d = 0..fit_length-1`.

    `gamma: [K]` rates, `a: [H, K]` weights (float64, differentiable in the positional
    parameters), `corr: [H, W]` the exact coefficients minus the fitted ones on the band
    `d < W` (float64)."""

    gamma: Tensor
    a: Tensor
    corr: Tensor
    window: int
    fit_length: int

    @property
    def num_terms(self) -> int:
        return self.gamma.numel()


def causal_log_coefficients(position, length: int) -> Tensor:
    """`[H, length]`: `b(-d)` for `d = 0..length-1` from a 1D positional term."""
    return position.log_coefficients(length, 1, 0).flip(-1)


def soe_plan(b: Tensor, window: int = DEFAULT_WINDOW, num_terms: int = DEFAULT_TERMS) -> SoEPlan:
    """Fit the far field of `b: [H, N]` (`b(-d)`, `d = 0..N-1`; N is the fit length)."""
    H, N = b.shape
    dev = b.device
    b = (b - b.detach().amax(-1, keepdim=True)).to(torch.float64)
    W = min(window, N)
    gamma = soe_rates(W, N, num_terms, device=dev)  # (K,) float64
    if N > W:
        rs = _far_samples(W, N).to(dev)
        a = fit_soe(b[:, rs], rs, gamma)  # (H, K)
    else:
        a = torch.zeros(H, num_terms, dtype=torch.float64, device=dev)
    dW = torch.arange(W, device=dev, dtype=torch.float64)
    fitted = (a[:, None, :] * gamma[None, None, :] ** dW[None, :, None]).sum(-1)  # (H, W)
    return SoEPlan(gamma, a, torch.exp(b[:, :W]) - fitted, W, N)


#: the `soe` backend refuses a term whose fit misplaces more than this fraction of any
#: row's positional weight (`soe_weight_error`); measured, a weight error e moves the
#: output by at most ~2e (benchmarks/soe_accuracy.py), so 1e-4 keeps outputs under 1e-3
SOE_MAX_WEIGHT_ERROR = 1e-4


def soe_weight_error(b: Tensor, plan: SoEPlan | None = None) -> Tensor:
    """`[H]`: the worst fraction of a row's positional weight the fit misplaces,
    `max_n Σ_{d<n} |ĉ(d) - c(d)| / Σ_{d<n} c(d)` over every row length n <= N.

    A causal row at position n - 1 sees distances `d < n`; its output moves with the
    misplaced weight relative to its total weight. `b: [H, N]` holds `b(-d)`, `d < N`.
    """
    with torch.no_grad():
        plan = soe_plan(b.detach()) if plan is None else plan
        bb = b.detach().to(torch.float64)
        c = torch.exp(bb - bb.amax(-1, keepdim=True))  # (H, N)
        N, W = c.shape[-1], plan.window
        if N <= W:
            return c.new_zeros(c.shape[0])
        d = torch.arange(W, N, dtype=torch.float64, device=c.device)
        fitted = (plan.a[:, None, :] * plan.gamma[None, None, :] ** d[None, :, None]).sum(-1)  # (H, N-W)
        miss = torch.cat([c.new_zeros(c.shape[0], W), (fitted - c[:, W:]).abs()], -1)
        ratio = miss.cumsum(-1) / c.cumsum(-1).clamp_min(torch.finfo(torch.float64).tiny)
        return ratio.amax(-1)


def soe_fit_refusal(position, length: int) -> str | None:
    """Why the `soe` form must not run `position` for rows up to `length` (None: it may).
    A term the sum of exponentials cannot represent (steps, noise beyond the exact band)
    would make the output silently wrong rather than approximately right."""
    fit_length = max(length, SOE_FIT_LENGTH)
    err = float(soe_weight_error(causal_log_coefficients(position, fit_length).detach()).max())
    if not err <= SOE_MAX_WEIGHT_ERROR:  # NaN refuses too
        return (f"the sum-of-exponentials fit of {type(position).__name__} misplaces {err:.1e} of a row's "
                f"positional weight (> {SOE_MAX_WEIGHT_ERROR:g}); fft is exact")
    return None


def _far_field(phi_q, phi_k, v, plan: SoEPlan, *, q_offset, key_padding_mask, chunk_size, states=None,
               return_state=False):
    """`Σ_k a_k·(geometric pass with γ_k)`: one linear-time chunked pass per term.
    `states: [B, H, K, F, C]` continue from earlier keys (decoding)."""
    B, H, Lq, _ = phi_q.shape
    Dv, dt = v.shape[3], phi_q.dtype
    num, den, new_states = phi_q.new_zeros(B, H, Lq, Dv), phi_q.new_zeros(B, H, Lq), []
    for kk in range(plan.num_terms):
        g = plan.gamma[kk].to(dt).expand(H)
        res = kernelized_num_den_chunked(phi_q, phi_k, v, gamma=g, q_offset=q_offset, key_padding_mask=key_padding_mask,
                                         chunk_size=chunk_size, initial_state=None if states is None else states[:, :, kk],
                                         return_state=return_state)
        w = plan.a[:, kk].to(dt)[None, :, None]  # (1, H, 1)
        num = num + res[0] * w[..., None]
        den = den + res[1] * w
        if return_state:
            new_states.append(res[3])
    return num, den, (torch.stack(new_states, 2) if return_state else None)


def _band(phi_q, phi_k, vv, corr: Tensor, *, q_offset: int, chunk_size: int):
    """Exact band correction: `Σ_{0 <= p_i - j < W} corr(p_i - j)·(φq_i·φk_j)·vv_j`, `[B, H, Lq, C]`."""
    B, H, Lq, _ = phi_q.shape
    Lk, W, dt, dev = phi_k.shape[2], corr.shape[1], phi_q.dtype, phi_q.device
    corr = corr.to(dt)
    y = phi_q.new_zeros(B, H, Lq, vv.shape[-1])
    pos_q = torch.arange(Lq, device=dev) + q_offset
    for s in range(0, Lq, chunk_size):
        e = min(Lq, s + chunk_size)
        k0, k1 = max(0, int(pos_q[s]) - W + 1), min(Lk, int(pos_q[e - 1]) + 1)
        if k1 <= k0:
            continue
        dist = pos_q[s:e, None] - torch.arange(k0, k1, device=dev)[None, :]  # (T, nk)
        ok = (dist >= 0) & (dist < W)
        cband = torch.where(ok[None], corr[:, dist.clamp(0, W - 1)], torch.zeros((), dtype=dt, device=dev))
        att = torch.einsum("bhif,bhjf->bhij", phi_q[:, :, s:e], phi_k[:, :, k0:k1]) * cband[None]
        y = y.index_add(2, torch.arange(s, e, device=dev), att @ vv[:, :, k0:k1])
    return y


def kernelized_num_den_soe(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_coeff: Tensor | None = None, *,
                           q_offset: int = 0, key_padding_mask: Tensor | None = None, window: int = DEFAULT_WINDOW,
                           num_terms: int = DEFAULT_TERMS, chunk_size: int = 64, plan: SoEPlan | None = None):
    """Causal `(num, den, log_scale)` like `kernelized_num_den_naive(..., causal=True)`, with
    the coefficients beyond distance `window` replaced by their sum-of-exponentials fit.

    Args:
        log_coeff: `[H, Lq+Lk-1]` in the usual offset order (only `r <= 0` is used); the fit
            then covers the distances of this call only. Or pass
        plan: a fit from `soe_plan` (what the backend does, fitted to `max(L, SOE_FIT_LENGTH)`).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt, dev = phi_q.dtype, phi_q.device
    if plan is None:
        L = max(Lk, q_offset + Lq)  # largest distance + 1
        # b(-d) for d = 0..L-1 (offset r = -d sits at index Lq-1+q_offset-d; clamp for d past the vector)
        d = torch.arange(L, device=dev)
        plan = soe_plan(log_coeff[:, (Lq - 1 + q_offset - d).clamp_min(0)], window, num_terms)
    num, den, _ = _far_field(phi_q, phi_k, v, plan, q_offset=q_offset, key_padding_mask=key_padding_mask,
                             chunk_size=chunk_size)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)
    y = _band(phi_q, phi_k, vv, plan.corr, q_offset=q_offset, chunk_size=chunk_size)
    return num + y[..., :Dv], den + y[..., Dv], phi_q.new_zeros(H, Lq)


@dataclass
class SoEState:
    """Constant-size decode state of the sum-of-exponentials form after `length` tokens:
    one geometric state per term, `S: [B, H, K, F, Dv+1]`, and the features and values of
    the last `W - 1` tokens for the exact band, `keys: [B, H, <W, F]`, `values: [B, H, <W, Dv+1]`."""

    S: Tensor
    keys: Tensor
    values: Tensor
    plan: SoEPlan
    length: int

    def select(self, index: Tensor) -> SoEState:
        return SoEState(self.S[index], self.keys[index], self.values[index], self.plan, self.length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.S, self.keys, self.values))


def soe_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, plan: SoEPlan, state: SoEState | None = None,
             chunk_size: int = 64):
    """Decode `L` new tokens (features `phi_q, phi_k: [B, H, L, F]`, `v: [B, H, L, Dv]`) after
    `state`: returns `(num, den, new_state)`; memory independent of how many tokens came before."""
    dt = phi_q.dtype
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)
    if phi_q.shape[2] == 1 and state is not None:
        # one token: every term's state decays by its rate and takes the new key (distance 0)
        g = plan.gamma.to(dt)[None, None, :, None, None]  # (1, 1, K, 1, 1)
        S = g * state.S + torch.einsum("bhf,bhc->bhfc", phi_k[:, :, 0], vv[:, :, 0])[:, :, None]
        y = torch.einsum("bhf,bhkfc,hk->bhc", phi_q[:, :, 0], S, plan.a.to(dt))[:, :, None]  # (B, H, 1, C)
        num, den = y[..., :-1], y[..., -1]
    else:
        num, den, S = _far_field(phi_q, phi_k, v, plan, q_offset=0, key_padding_mask=None, chunk_size=chunk_size,
                                 states=None if state is None else state.S, return_state=True)
    keys, values = phi_k, vv
    if state is not None:
        keys, values = torch.cat([state.keys, phi_k], 2), torch.cat([state.values, vv], 2)
    n_prev = keys.shape[2] - phi_k.shape[2]
    y = _band(phi_q, keys, values, plan.corr, q_offset=n_prev, chunk_size=chunk_size)
    keep = plan.window - 1
    tail = slice(max(0, keys.shape[2] - keep), None)
    new = SoEState(S, keys[:, :, tail], values[:, :, tail], plan, (0 if state is None else state.length) + phi_q.shape[2])
    return num + y[..., :v.shape[3]], den + y[..., v.shape[3]], new
