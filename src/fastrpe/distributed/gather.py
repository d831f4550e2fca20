"""The gathered path: exact context-parallel attention for any 1D term, by gathering keys.

Every rank holds a contiguous slice of the sequence (rank order is sequence order; slices
may differ in length). This path gathers the key side, `k` and `v` (and the key padding
mask), from every rank with a differentiable all-gather, and runs the single-process
`fastrpe.attention` for this rank's query rows against the gathered keys with
`q_offset` = this rank's global offset. The single-process op is exact for every term
(arbitrary Toeplitz tables by FFT, T5, KERPLE, Shaw, FastRPB), so this path is too: its
output rows are the single-process rows, and its gradients flow back through the gather.

Causal calls gather only what they may see: rank r keeps the keys of ranks 0..r, so a later
rank's keys never enter an earlier rank's output (bit for bit).

Communication, per rank per layer (B batch, H heads, L the whole sequence, D and Dv head
widths, P ranks, `b` bytes per element):
* forward: one all-gather of `k, v`: receives `B·H·(L − L_r)·(D + Dv)·b` bytes (plus the
  `[B, L]` padding mask when there is one and a few numbers of metadata);
* backward: one all-reduce of the `[B, H, L, D + Dv]` key-side gradient (gloo has no
  reduce-scatter): `~2·B·H·L·(D + Dv)·b` bytes.
So the volume grows with L, O(L·(D + Dv)) per rank, where the state-passing linear-time
paths (`fastrpe.distributed.linear`) send one `[F, Dv + 1]` state per head, O(F·Dv),
independent of L; and the compute per rank is the op on `[L_r, L]`, not `[L_r, L_r]`.
Gathering `k, v` costs less than gathering the feature channels `φ(k)⊗[v, 1]`
(`F·(Dv + 1)` per position) whenever `D + Dv < F·(Dv + 1)`, which is always.

The ring (`fastrpe.distributed.ring`) computes the same rows for arbitrary tables by
block-Toeplitz products between rank pairs with one key block in memory, but slower (each
off-diagonal block is a full FFT product, and its backward recomputes the forward): `auto`
gathers when the gathered keys and the op fit the memory limit (`gather_bytes`), rings
otherwise, and gathers whatever the ring does not run (additive terms, SIKF `exp`,
trainable feature maps, a forced single-process backend other than fft).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._validate import FastRPEError
from . import comm


def seq_all_gather(x: Tensor, lengths: list[int], group) -> Tensor:
    """Concatenate every rank's `[B, H, L_r, C]` slice along the sequence: `[B, H, L, C]`.
    Differentiable (`comm.all_gather_varlen`): the backward sums every rank's gradient and
    keeps this rank's slice."""
    return torch.cat(comm.all_gather_varlen(x, 2, lengths, group), dim=2)


def gather_mask(mask: Tensor | None, lengths: list[int], group) -> Tensor | None:
    """`[B, L]` bool padding mask from every rank's `[B, L_r]` (None if this rank has none:
    the caller passes zeros where another rank has one)."""
    if mask is None:
        return None
    m = mask.to(torch.uint8)  # gloo has no bool collectives
    return torch.cat(comm.all_gather_varlen(m, 1, lengths, group), dim=1).bool()


def gathered_attention(q: Tensor, k: Tensor, v: Tensor, kernel, position, *, causal: bool,
                       key_padding_mask: Tensor | None, scale: float | None, backend: str,
                       lengths: list[int], group) -> Tensor:
    """This rank's rows of attention over the whole sequence, keys gathered from every rank.

    Args:
        q, k, v: this rank's slice, `[B, H, L_r, D]`, `[B, H, L_r, D]`, `[B, H, L_r, Dv]`.
        kernel, position, scale: as `fastrpe.attention`.
        causal: rank r sees the keys of ranks 0..r only (nothing later is even used).
        key_padding_mask: `[B, L_r]` bool or None (None on every rank, or given on every rank).
        backend: the single-process backend the rows run on ("auto" or a name).
        lengths: every rank's `L_r`, in rank order; group: the process group.

    Returns:
        `[B, H, L_r, Dv]`, this rank's rows.
    """
    from ..api import attention as _attention

    rank = comm.world(group)[0]
    off = sum(lengths[:rank])
    k_all = seq_all_gather(k, lengths, group)  # (B, H, L, D)
    v_all = seq_all_gather(v, lengths, group)  # (B, H, L, Dv)
    kpm = gather_mask(key_padding_mask, lengths, group)  # (B, L) or None
    if causal:  # keys after this rank's last query are never seen
        end = off + lengths[rank]
        k_all, v_all = k_all[:, :, :end], v_all[:, :, :end]
        kpm = None if kpm is None else kpm[:, :end]
    try:
        return _attention(q, k_all, v_all, kernel, position, causal=causal, q_offset=off, key_padding_mask=kpm,
                          scale=scale, backend=backend)
    except FastRPEError as e:
        raise FastRPEError(f"distributed gather path, rank {rank} (rows {off}..{off + lengths[rank] - 1}): {e}") from None
