"""Softmax attention through PyTorch's FlexAttention with the positional term
as a `score_mod` (no materialized bias)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

try:  # FlexAttention exists from PyTorch 2.5 on
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    _flex_attention = create_block_mask = None

_compiled = None

#: (Lq, Lk, q_offset, device, compiled) -> (BlockMask, how it was built); a few shapes at most
_BLOCK_MASKS: dict = {}


def flex_available() -> bool:
    return _flex_attention is not None


def _flex():
    """Compiled FlexAttention on GPU (its fast path); eager elsewhere."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_attention, dynamic=False)
    return _compiled


def causal_block_mask(Lq: int, Lk: int, q_offset: int, device, compiled: bool = True) -> tuple[object, str]:
    """A `BlockMask` keeping keys `j <= q_offset + i`, and how it was built; cached per shape
    (building one reads the mask block by block). Compiled construction where this torch
    offers it: the plain one materializes the `[Lq, Lk]` mask and runs out of memory first."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + q_offset

    key = (Lq, Lk, q_offset, str(device), compiled)
    if key not in _BLOCK_MASKS:
        if len(_BLOCK_MASKS) >= 4:  # at 1M tokens a mask's block indices take ~1 GB: hold a few
            _BLOCK_MASKS.clear()
        if compiled:
            try:
                _BLOCK_MASKS[key] = (create_block_mask(mask_mod, None, None, Lq, Lk, device=device, _compile=True),
                                     "create_block_mask(_compile=True)")
            except TypeError:  # no _compile argument in this torch
                compiled = False
        if not compiled:
            _BLOCK_MASKS[key] = (create_block_mask(mask_mod, None, None, Lq, Lk, device=device), "create_block_mask")
    return _BLOCK_MASKS[key]


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
    block_mask: bool | None = None,
) -> Tensor:
    """Softmax attention with `score_mod(score, b, h, q_idx, kv_idx)` adding the bias.

    Causality is a `BlockMask` (`block_mask`; default: on CUDA outside `torch.compile`, for
    128 queries or more), so blocks above the diagonal are skipped, not computed and masked:
    about half the work. Otherwise it is folded into the score_mod as `-inf`, as the key
    padding mask always is; rows with no admissible key return 0 (FlexAttention's
    convention, the same as the naive reference).
    """
    if _flex_attention is None:
        raise RuntimeError("FlexAttention is not available in this PyTorch")
    kpm = key_padding_mask
    if block_mask is None:
        # not inside a traced graph (the cache is Python state), nor for a few queries (a
        # decode step skips no block and would build a mask per step)
        block_mask = q.is_cuda and not torch.compiler.is_compiling() and q.shape[2] >= 128
    bm = None
    if causal and block_mask:
        bm, _ = causal_block_mask(q.shape[2], k.shape[2], q_offset, q.device, compiled=q.is_cuda)
    fold_causal = causal and bm is None

    def mod(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        if fold_causal:
            score = torch.where(kv_idx > q_idx + q_offset, float("-inf"), score)
        if kpm is not None:
            score = torch.where(kpm[b, kv_idx], float("-inf"), score)
        return score

    fn = _flex() if q.is_cuda else _flex_attention
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode advice printed on CPU
        return fn(q, k, v, score_mod=mod, block_mask=bm, scale=scale)
