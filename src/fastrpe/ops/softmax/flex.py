"""Softmax attention through PyTorch's FlexAttention with the positional term
as a `score_mod` (no materialized bias)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

try:  # FlexAttention exists from PyTorch 2.5 on
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    _flex_attention = None

_compiled = None


def flex_available() -> bool:
    return _flex_attention is not None


def _flex():
    """Compiled FlexAttention on GPU (its fast path); eager elsewhere."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_attention, dynamic=False)
    return _compiled


def softmax_attention_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Callable | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Softmax attention with `score_mod(score, b, h, q_idx, kv_idx)` adding the bias.

    Masks are folded into the score_mod as `-inf`; rows with no admissible key
    return 0 (FlexAttention's convention, the same as the naive reference).
    """
    if _flex_attention is None:
        raise RuntimeError("FlexAttention is not available in this PyTorch")
    kpm = key_padding_mask

    def mod(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        if causal:
            score = torch.where(kv_idx > q_idx + q_offset, float("-inf"), score)
        if kpm is not None:
            score = torch.where(kpm[b, kv_idx], float("-inf"), score)
        return score

    fn = _flex() if q.is_cuda else _flex_attention
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode advice printed on CPU
        return fn(q, k, v, score_mod=mod, scale=scale)
