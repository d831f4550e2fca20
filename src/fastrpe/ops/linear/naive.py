"""Kernelized attention with a Toeplitz RPE, by materializing the weights.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding" (NeurIPS 2021), Eq. 10:
`out_i = Σ_j φ(q_i)·φ(k_j)·c(j-i)·v_j / Σ_j φ(q_i)·φ(k_j)·c(j-i)`.

This is the reference every fast kernelized backend is tested against.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import causal_offset_mask, check_grid, finite_max, materialize_grid, toeplitz_index


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


def check_grid_num_den_inputs(phi_q: Tensor, phi_k: Tensor, v: Tensor, table: Tensor, grid, cls_coeff: Tensor | None):
    Hg, Wg = check_grid(grid)
    N = Hg * Wg + (cls_coeff is not None)
    B, H = phi_q.shape[:2]
    if phi_q.shape[2] != N or phi_k.shape[2] != N or v.shape[2] != N:
        raise ValueError(
            f"grid {(Hg, Wg)}{' + class token' if cls_coeff is not None else ''} needs N = {N} queries and keys "
            f"(self-attention); got Lq={phi_q.shape[2]}, Lk={phi_k.shape[2]}, Lv={v.shape[2]}")
    if tuple(table.shape) != (H, 2 * Hg - 1, 2 * Wg - 1):
        raise ValueError(f"table must be [H, 2Hg-1, 2Wg-1] = {[H, 2 * Hg - 1, 2 * Wg - 1]}, got {list(table.shape)}")
    if cls_coeff is not None and tuple(cls_coeff.shape) != (H, 3):
        raise ValueError(f"cls_coeff must be [H, 3] = {[H, 3]}, got {list(cls_coeff.shape)}")
    return Hg, Wg, N


def grid_head_max(table: Tensor, cls_coeff: Tensor | None) -> Tensor:
    """`[H, 1]`: per-head largest finite log-coefficient (table and class entries), 0 if none."""
    flat = table.flatten(1)
    if cls_coeff is not None:
        flat = torch.cat([flat, cls_coeff.to(flat.dtype)], dim=1)
    return finite_max(flat)


def kernelized_num_den_grid_naive(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    table: Tensor,
    grid,
    cls_coeff: Tensor | None = None,
    *,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Numerator and denominator of kernelized attention with a 2D RPE, by materializing
    the `[N, N]` weights (the reference).

    Args:
        phi_q: `[B, H, N, F]` query features; phi_k: `[B, H, N, F]` key features.
        v: `[B, H, N, Dv]` values. `N = Hg·Wg`, plus one if `cls_coeff` is given
            (the class token is index 0, patches follow row-major).
        table: `[H, 2Hg-1, 2Wg-1]` log-coefficients `b_h(Δrow, Δcol)` at
            `[Δrow + Hg - 1, Δcol + Wg - 1]` (Δ = key − query); `-inf` allowed.
        grid: `(Hg, Wg)`.
        cls_coeff: `[H, 3]` class-token log-coefficients (cls → patch, patch → cls,
            cls → cls), or None for no class token.
        key_padding_mask: `[B, N]` bool, True marks padding keys (ignored).

    Returns:
        `num: [B, H, N, Dv]`, `den: [B, H, N]` and `log_scale: [H, N]`: the true numerator
        is `num·exp(log_scale)` (a per-head maximum is taken out before `exp`); `out = num / den`.
    """
    check_grid_num_den_inputs(phi_q, phi_k, v, table, grid, cls_coeff)
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k)  # (B, H, N, N)
    lb = materialize_grid(table.to(a.dtype), grid, None if cls_coeff is None else cls_coeff.to(a.dtype))
    m = grid_head_max(lb, None)  # (H, 1)
    a = a * torch.exp(lb - m[..., None])  # (B, H, N, N)
    if key_padding_mask is not None:
        a = a.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    num = a @ v.to(a.dtype)
    den = a.sum(-1)
    return num, den, m.expand(table.shape[0], a.shape[-1])
