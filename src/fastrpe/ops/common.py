"""Small helpers shared by the ops.

Notation: B batch, H heads, Lq queries, Lk keys, F features, Dv value width,
R = Lq + Lk - 1 offsets.
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal_offset_mask(Lq: int, Lk: int, q_offset: int, device=None) -> Tensor:
    """`[R]` bool over offsets `r = -(Lq-1+q_offset) .. Lk-1-q_offset`: True where `r <= 0` (kept by causal)."""
    r = torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, device=device)
    return r <= 0


def stable_coefficients(log_coeff: Tensor, keep: Tensor | None = None) -> Tensor:
    """`c = exp(b - max b)` over the last dim, with `b = -inf` allowed everywhere.

    `log_coeff: [..., R]`; `keep: [R]` bool (False entries become 0). The
    per-head maximum cancels in kernelized attention's ratio; a head whose
    entries are all `-inf` gives all zeros, never NaN (forward or backward).
    """
    b = log_coeff
    if keep is not None:
        b = b.masked_fill(~keep, float("-inf"))
    m = b.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(b - m)


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """`num: [B, H, Lq, Dv]` / `den: [B, H, Lq]`; rows with `den == 0` give 0 (and zero gradient)."""
    zero = den == 0
    den_safe = torch.where(zero, torch.ones_like(den), den)
    out = num / den_safe.unsqueeze(-1)
    return torch.where(zero.unsqueeze(-1), torch.zeros_like(out), out)
