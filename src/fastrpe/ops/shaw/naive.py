"""Shaw relative vectors in kernelized attention, by materializing `S` (the reference).

Shaw et al., "Self-Attention with Relative Position Representations" (NAACL 2018), in the
kernelized form of Scaleformer (Favier & Dal'Maz Silva, 2021, Eq. 10):
`S_ij = φ(q_i)·RP[clip(i - j, -k, k)]`, added to the numerator and the denominator.
Note the paper's sign: `i - j` is query position minus key position (`-r`).
"""
from __future__ import annotations

import torch
from torch import Tensor


def clipped_index(Lq: int, Lk: int, k: int, q_offset: int, device=None) -> Tensor:
    """`[Lq, Lk]` index `clip(i - j, -k, k) + k` into the `2k+1` relative vectors."""
    i = torch.arange(Lq, device=device)[:, None] + q_offset
    j = torch.arange(Lk, device=device)[None, :]
    return (i - j).clamp(-k, k) + k


def shaw_scores_naive(x: Tensor, rp: Tensor, Lk: int, q_offset: int) -> Tensor:
    """`S_ij = x_i·RP[clip(i-j)]`: `x: [B, H, Lq, F]`, `rp: [H, 2k+1, F]` -> `[B, H, Lq, Lk]`."""
    k = (rp.shape[1] - 1) // 2
    s = torch.einsum("bhif,htf->bhit", x, rp.to(x.dtype))  # (B, H, Lq, 2k+1)
    idx = clipped_index(x.shape[2], Lk, k, q_offset, device=x.device)  # (Lq, Lk)
    return torch.gather(s, 3, idx[None, None].expand(*s.shape[:2], -1, -1))


def shaw_num_den_naive(phi_q: Tensor, v: Tensor, rp: Tensor, *, Lk: int, causal: bool = False, q_offset: int = 0,
                       key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Shaw's contribution to the numerator `[B, H, Lq, Dv]` and denominator `[B, H, Lq]`.

    Args:
        phi_q: `[B, H, Lq, F]` query features; v: `[B, H, Lk, Dv]`; rp: `[H, 2k+1, F]`.
        causal: only keys `j <= q_offset + i`; key_padding_mask: `[B, Lk]`, True = padding.
    """
    S = shaw_scores_naive(phi_q, rp, Lk, q_offset)  # (B, H, Lq, Lk)
    if causal:
        i = torch.arange(phi_q.shape[2], device=S.device)[:, None] + q_offset
        S = S.masked_fill(torch.arange(Lk, device=S.device)[None, :] > i, 0.0)
    if key_padding_mask is not None:
        S = S.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return S @ v.to(S.dtype), S.sum(-1)
