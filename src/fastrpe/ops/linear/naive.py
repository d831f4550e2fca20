"""Kernelized attention with a Toeplitz RPE, by materializing the weights.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding" (NeurIPS 2021), Eq. 10:
`out_i = Σ_j φ(q_i)·φ(k_j)·c(j-i)·v_j / Σ_j φ(q_i)·φ(k_j)·c(j-i)`.

This is the reference every fast kernelized backend is tested against.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import causal_offset_mask, finite_max, toeplitz_index


def kernelized_num_den_naive(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    key_log_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Numerator and denominator of kernelized attention with a Toeplitz RPE.

    Args:
        phi_q: `[B, H, Lq, F]` query features (non-negative for PRF-type maps).
        phi_k: `[B, H, Lk, F]` key features.
        v: `[B, H, Lk, Dv]` values.
        log_coeff: `[H, Lq+Lk-1]` log-coefficients `b_h(r)` for
            `r = -(Lq-1+q_offset) .. Lk-1-q_offset`, or None for no RPE.
            `-inf` is allowed (coefficient 0).
        causal: keep only keys with `j <= i` (offset `r <= 0`).
        q_offset: position of the first query.
        key_padding_mask: `[B, Lk]` bool, True marks padding keys (ignored).
        key_log_scale: `[B, H, Lk]` or None: the true key features are
            `phi_k·exp(key_log_scale)` (keys stabilized by a running maximum, causal SIKF).

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` and `log_scale: [H, Lq]` (`[B, H, Lq]` with
        `key_log_scale`): the true numerator is `num·exp(log_scale)` (each row's largest
        log-coefficient, key scale included, is taken out before `exp`, so no row underflows
        because of another row's scale); `out = num / den`.
    """
    B, H, Lq, _ = phi_q.shape
    Lk = phi_k.shape[2]
    R = Lq + Lk - 1
    dev = phi_q.device
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k)  # (B, H, Lq, Lk)
    keep = causal_offset_mask(Lq, Lk, q_offset, device=dev) if causal else None
    if log_coeff is None:
        lc = torch.zeros(H, R, dtype=a.dtype, device=dev)
    else:
        lc = log_coeff.to(a.dtype)
    if keep is not None:
        lc = lc.masked_fill(~keep, float("-inf"))
    b = lc[:, toeplitz_index(Lq, Lk, device=dev)]  # (H, Lq, Lk)
    if key_log_scale is not None:
        b = b + key_log_scale.to(a.dtype)[:, :, None, :]  # (B, H, Lq, Lk)
        if key_padding_mask is not None:
            b = b.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    m = finite_max(b)  # (H, Lq, 1) or (B, H, Lq, 1): each row's own largest, so no row underflows
    a = a * torch.exp(b - m)  # (B, H, Lq, Lk)
    if key_padding_mask is not None:
        a = a.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    num = a @ v.to(a.dtype)
    den = a.sum(-1)
    return num, den, m[..., 0]
