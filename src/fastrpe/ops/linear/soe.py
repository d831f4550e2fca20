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

import torch
from torch import Tensor

from .chunked import kernelized_num_den_chunked

DEFAULT_WINDOW = 64
DEFAULT_TERMS = 16


#: coefficients this far below c(0) = 1 are fitted in absolute, not relative, error
#: (e^-20 ≈ 2e-9 per key: far below the 1e-3 output target even summed over 10^5 keys)
FIT_FLOOR_NATS = 20.0


def soe_rates(window: int, max_len: int, num_terms: int, dtype=torch.float64, device=None) -> Tensor:
    """`[K]` rates: γ = 1 (a constant tail) and K-1 time scales `1/(1-γ)` log-spaced from
    1 to 4·max_len."""
    hi = math.log(4.0 * max(max_len, window))
    tau = torch.exp(torch.linspace(0.0, hi, num_terms - 1, dtype=dtype, device=device))
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
    # ridge-regularized normal equations: well-posed for nearly collinear exponentials, differentiable
    AtA = A.transpose(-1, -2) @ A
    lam = 1e-10 * AtA.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True)[..., None]
    eye = torch.eye(gamma.numel(), dtype=gamma.dtype, device=gamma.device)
    return torch.linalg.solve(AtA + lam * eye, A.transpose(-1, -2) @ ones)[..., 0]  # (H, K)


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


def kernelized_num_den_soe(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_coeff: Tensor, *, q_offset: int = 0,
                           key_padding_mask: Tensor | None = None, window: int = DEFAULT_WINDOW,
                           num_terms: int = DEFAULT_TERMS, chunk_size: int = 64):
    """Causal `(num, den, log_scale)` like `kernelized_num_den_naive(..., causal=True)`, with
    the coefficients beyond distance `window` replaced by their sum-of-exponentials fit.

    Args:
        log_coeff: `[H, Lq+Lk-1]` in the usual offset order (only `r <= 0` is used).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt = phi_q.dtype
    dev = phi_q.device
    L = max(Lk, q_offset + Lq)  # largest distance + 1
    # b(-d) for d = 0..L-1 (offset r = -d sits at index Lq-1+q_offset-d; clamp for d past the vector)
    d = torch.arange(L, device=dev)
    idx = (Lq - 1 + q_offset - d).clamp_min(0)
    b = log_coeff[:, idx]  # (H, L)
    b = b - b.detach().amax(-1, keepdim=True)
    W = min(window, L)
    gamma = soe_rates(W, L, num_terms, device=dev)  # (K,) float64
    if L > W:
        rs = _far_samples(W, L).to(dev)
        a = fit_soe(b.to(torch.float64)[:, rs], rs, gamma)  # (H, K)
    else:
        a = torch.zeros(H, num_terms, dtype=torch.float64, device=dev)
    num = phi_q.new_zeros(B, H, Lq, Dv)
    den = phi_q.new_zeros(B, H, Lq)
    # far field: one linear-time geometric pass per term (weights per head)
    for kk in range(num_terms):
        g = gamma[kk].to(dt).expand(H)
        n_k, d_k, _ = kernelized_num_den_chunked(phi_q, phi_k, v, gamma=g, q_offset=q_offset,
                                                 key_padding_mask=key_padding_mask, chunk_size=chunk_size)
        w = a[:, kk].to(dt)[None, :, None]
        num = num + n_k * w[..., None]
        den = den + d_k * w
    # band: exact coefficients minus what the exponentials already put there
    dW = torch.arange(W, device=dev, dtype=torch.float64)
    fitted = (a[:, None, :] * gamma[None, None, :] ** dW[None, :, None]).sum(-1).to(dt)  # (H, W)
    corr = torch.exp(b[:, :W].to(dt)) - fitted  # (H, W): coefficient at distance 0..W-1
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)
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
        y = att @ vv[:, :, k0:k1]
        num = num.index_add(2, torch.arange(s, e, device=dev), y[..., :Dv])
        den = den.index_add(2, torch.arange(s, e, device=dev), y[..., Dv])
    return num, den, phi_q.new_zeros(H, Lq)
