"""Softmax attention through PyTorch's FlexAttention with the positional term
as a `score_mod` (no materialized bias)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

try:  # FlexAttention exists from PyTorch 2.5 on
    from torch.nn.attention.flex_attention import BlockMask
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - depends on the installed torch
    _flex_attention = BlockMask = None

_compiled = None

#: A call with fewer queries runs FlexAttention eagerly: a decoding step brings a new key length
#: at every call, and a static-shape compile per length would compile at every step; its
#: `[Lq, Lk]` scores are small. It is also the least a causal `BlockMask` pays for.
COMPILE_MIN_QUERIES = 128
#: Dynamo's recompile limit while the compiled FlexAttention runs: it compiles once per shape,
#: term class and mask, and the default (8) would send the ninth silently to eager
#: FlexAttention, which materializes the scores. Raised for this call only.
RECOMPILE_LIMIT = 64
#: Block size of the causal `BlockMask` (FlexAttention's default sparse block)
MASK_BLOCK = 128

#: FlexAttention's tiles where the score_mod gathers from a table (`Position.score_mod_gathers`:
#: T5 buckets, learned tables, 2D grids), on CUDA. Inductor's default for bf16 and head
#: dimension 64 on an H100 (128 x 128 tiles, 3 stages) asked for 245,760 bytes of shared memory
#: with such a gather, over the H100's 232,448: "No valid triton configs ... out of resource",
#: every T5 and learned-table call on the H100 image (torch 2.11; benchmarks/results/gpu/
#: h100-2026-11-26.json); terms computed from the offset alone (ALiBi, KERPLE) compiled with
#: the default. 64 x 64 tiles and 2 stages, forward and backward, divide the 128-token mask
#: blocks and take about a quarter of that memory. Not yet timed on a GPU.
GATHER_KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2,
                         "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}


def kernel_options_for(position) -> dict | None:
    """The fused kernels' options for `position`'s score_mod: `GATHER_KERNEL_OPTIONS` where it
    gathers from a table (`Position.score_mod_gathers`), else None (Inductor's own)."""
    return GATHER_KERNEL_OPTIONS if getattr(position, "score_mod_gathers", False) else None


#: (Lq, Lk, q_offset, device) -> BlockMask; a few shapes at most
_BLOCK_MASKS: dict = {}


def flex_available() -> bool:
    return _flex_attention is not None


def flex_fused(device: torch.device, Lq: int) -> bool:
    """Whether a call on `device` with `Lq` queries runs FlexAttention's fused kernels (CUDA,
    compiled here for `COMPILE_MIN_QUERIES` queries or more, or by an enclosing
    `torch.compile`), rather than eager FlexAttention, which materializes the scores."""
    return device.type == "cuda" and (Lq >= COMPILE_MIN_QUERIES or torch.compiler.is_compiling())


def _flex():
    """`torch.compile(flex_attention)`, static shapes (one compile per shape)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_attention, dynamic=False)
    return _compiled


def _recompile_limit():
    """A context raising Dynamo's recompile limit to `RECOMPILE_LIMIT` (never lowering it)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(getattr(cfg, name), RECOMPILE_LIMIT)})


def _offset(q_offset: int, device: torch.device, compiled: bool):
    """`q_offset` as the score_mod and mask_mod see it: a 0-d tensor in the compiled path
    (Dynamo specializes on an int, and would compile anew for each offset), else the int."""
    if compiled and q_offset != 0:
        return torch.full((), q_offset, dtype=torch.int64, device=device)
    return q_offset


def causal_block_mask(Lq: int, Lk: int, q_offset: int, device) -> object:
    """The `BlockMask` keeping keys `j <= q_offset + i`, cached per shape and offset.

    Built from the block indices, which are known in closed form: nothing is compiled (no
    Dynamo entry per shape, no recompile limit) and no `[Lq, Lk]` mask is materialized, so it
    costs O((Lq/128)·(Lk/128)). A block is full when it is whole and all its keys are at or
    before its first query; partial when some key is at or before its last query. These are
    exactly the blocks `create_block_mask` finds by reading the mask (`tests/test_flex.py`),
    ordered as it orders them.
    """
    key = (Lq, Lk, q_offset, str(device))
    if key not in _BLOCK_MASKS:
        if len(_BLOCK_MASKS) >= 4:  # at 1M tokens a mask's block indices take ~1 GB: hold a few
            _BLOCK_MASKS.clear()
        n = MASK_BLOCK
        i = torch.arange(-(-Lq // n), device=device)[:, None]
        j = torch.arange(-(-Lk // n), device=device)[None, :]
        first_q, last_q = i * n + q_offset, torch.clamp((i + 1) * n, max=Lq) - 1 + q_offset
        first_k, last_k = j * n, torch.clamp((j + 1) * n, max=Lk) - 1
        whole = ((i + 1) * n <= Lq) & ((j + 1) * n <= Lk)  # a ragged block has padding: never full
        full = whole & (last_k <= first_q)
        partial = (first_k <= last_q) & ~full

        def ordered(blocks):  # (count per row, the rows' block indices, present ones first)
            blocks = blocks.to(torch.int32)[None, None]
            order = torch.argsort(blocks, dim=-1, descending=True, stable=True)
            return blocks.sum(-1).to(torch.int32), order.to(torch.int32)

        o = _offset(q_offset, device, compiled=True)  # a tensor: one compile for every offset

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + o

        _BLOCK_MASKS[key] = BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=n,
                                                     mask_mod=mask_mod, seq_lengths=(Lq, Lk))
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
    kernel_options: dict | None = None,
) -> Tensor:
    """Softmax attention with `score_mod(score, b, h, q_pos, kv_idx)` adding the bias, where
    `q_pos = q_offset + q_idx` is the query's position in the sequence (so a position's
    `score_mod()`, offset 0, serves every offset).

    Compiled here on CUDA for `COMPILE_MIN_QUERIES` queries or more (inside an enclosing
    `torch.compile`, that one compiles it), one compile per shape and term: the offset is a
    tensor there, so a new offset compiles nothing. Otherwise eager FlexAttention.

    Causality is a `BlockMask` (`block_mask`; default: where compiled), so blocks above the
    diagonal are skipped, not computed and masked: about half the work. Otherwise it is folded
    into the score_mod as `-inf`, as the key padding mask always is; rows with no admissible
    key return 0 (FlexAttention's convention, the same as the naive reference).

    `kernel_options` go to the fused kernels (e.g. `GATHER_KERNEL_OPTIONS`); eager
    FlexAttention has no tiles and does not get them.
    """
    if _flex_attention is None:
        raise RuntimeError("FlexAttention is not available in this PyTorch")
    kpm = key_padding_mask
    Lq, Lk = q.shape[2], k.shape[2]
    compiled = flex_fused(q.device, Lq) and not torch.compiler.is_compiling()  # compiled here
    if block_mask is None:  # only where it is compiled: the mask pays for itself in fused kernels
        block_mask = compiled
    bm = causal_block_mask(Lq, Lk, q_offset, q.device) if causal and block_mask else None
    fold_causal = causal and bm is None
    off = _offset(q_offset, q.device, compiled)

    def mod(score, b, h, q_idx, kv_idx):
        q_pos = q_idx + off  # the query's position in the sequence
        if score_mod is not None:
            score = score_mod(score, b, h, q_pos, kv_idx)
        if fold_causal:
            score = torch.where(kv_idx > q_pos, float("-inf"), score)
        if kpm is not None:
            score = torch.where(kpm[b, kv_idx], float("-inf"), score)
        return score

    opts = {"kernel_options": dict(kernel_options)} if kernel_options and flex_fused(q.device, Lq) else {}
    if compiled:
        with _recompile_limit():
            return _flex()(q, k, v, score_mod=mod, block_mask=bm, scale=scale, **opts)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode advice
        return _flex_attention(q, k, v, score_mod=mod, block_mask=bm, scale=scale, **opts)
