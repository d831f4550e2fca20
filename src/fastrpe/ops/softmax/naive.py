"""Exact softmax attention with an additive bias, by materializing the scores.

The reference for every softmax backend. Rows with no admissible key (all
masked) return 0, with zero gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import finite_max, safe_divide


def score_mask(Lq: int, Lk: int, *, causal: bool, q_offset: int, key_padding_mask: Tensor | None,
               device=None) -> Tensor | None:
    """`[B or 1, 1, Lq, Lk]` bool, True where the pair is *excluded*; None if nothing is."""
    mask = None
    if causal:
        i = torch.arange(Lq, device=device)[:, None] + q_offset
        j = torch.arange(Lk, device=device)[None, :]
        mask = (j > i)[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
        mask = kpm if mask is None else (mask | kpm)
    return mask


def softmax_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    weight: Tensor | None = None,
) -> Tensor:
    """`softmax(weight ⊙ scale·q·kᵀ + bias)·v` with masks.

    Args:
        q: `[B, H, Lq, D]`; k: `[B, H, Lk, D]`; v: `[B, H, Lk, Dv]`.
        bias: `[H, Lq, Lk]` or `[B, H, Lq, Lk]` additive bias (may hold `-inf`), or None.
        causal: exclude keys `j > i` (positions, with queries at `q_offset + 0..Lq-1`).
        key_padding_mask: `[B, Lk]` bool, True marks padding keys.
        scale: default `D**-0.5`.
        weight: `[H, Lq, Lk]` positional logit weight (KerpleBiasWeight), or None.

    Returns:
        `[B, H, Lq, Dv]` in the math dtype (float32 for half inputs).
    """
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    s = torch.einsum("bhid,bhjd->bhij", q.to(dt), k.to(dt)) * scale  # (B, H, Lq, Lk)
    if weight is not None:
        s = s * weight.to(dt)
    if bias is not None:
        s = s + bias.to(dt)
    mask = score_mask(q.shape[2], k.shape[2], causal=causal, q_offset=q_offset,
                      key_padding_mask=key_padding_mask, device=q.device)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.exp(s - finite_max(s))
    return safe_divide(p @ v.to(dt), p.sum(-1))
