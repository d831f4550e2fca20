"""Softmax attention through `torch.nn.functional.scaled_dot_product_attention`
with the positional bias materialized as a float mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import score_mask


def softmax_attention_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Same signature and result as `softmax_attention_naive` (output in q's dtype)."""
    Lq, Lk = q.shape[2], k.shape[2]
    mask = score_mask(Lq, Lk, causal=causal, q_offset=q_offset, key_padding_mask=key_padding_mask,
                      device=q.device)
    if bias is None and mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if causal and bias is None and key_padding_mask is None and q_offset == 0 and Lq <= Lk:
        # top-left causal is SDPA's own is_causal: lets it use its fused kernels
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    attn = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    empty = None
    if mask is not None:
        # rows with no admissible key: give them an all-zero mask, then zero their output
        empty = mask.all(-1, keepdim=True)  # (B|1, 1, Lq, 1)
        attn = attn.masked_fill(mask & ~empty, float("-inf"))
    if attn.dim() == 3:
        attn = attn.unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out
