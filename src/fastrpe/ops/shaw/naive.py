"""Shaw relative vectors, by materializing the score matrix `S` (the reference).

Shaw et al., "Self-Attention with Relative Position Representations" (NAACL 2018), in the
kernelized form of Scaleformer (Favier & Dal'Maz Silva, 2021, Eq. 10):
`S_ij = φ(q_i)·RP[clip(i - j, -k, k)]`, added to the numerator and the denominator.

Sign: the index is `i - j`, query position minus key position (`-r`), as in Scaleformer's
text; its Algorithm 2 effectively indexes by `j - i`. The table is learned, so the two are
the same model with RP flipped; fastrpe uses `i - j` everywhere (DESIGN.md).

Notation: B batch, H heads, Lq/Lk lengths, F feature (or head) width, Dv value width,
t = `clip(i - j, -k, k)`, table row `t + k`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_shaw_inputs(x: Tensor, rp: Tensor, v: Tensor | None = None, Lk: int | None = None,
                      key_padding_mask: Tensor | None = None) -> int:
    """Check `x: [B, H, Lq, F]`, `rp: [H, 2k+1, F]` (and `v: [B, H, Lk, Dv]`,
    `key_padding_mask: [B, Lk]`); return k."""
    if x.dim() != 4:
        raise ValueError(f"query features must be [B, H, Lq, F], got {list(x.shape)}")
    B, H, _, F = x.shape
    if rp.dim() != 3 or rp.shape[0] != H or rp.shape[1] % 2 != 1 or rp.shape[2] != F:
        raise ValueError(f"rp must be [H, 2k+1, F] with H={H}, F={F}, got {list(rp.shape)}")
    if v is not None and (v.dim() != 4 or tuple(v.shape[:3]) != (B, H, Lk)):
        raise ValueError(f"v must be [B={B}, H={H}, Lk={Lk}, Dv], got {list(v.shape)}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, Lk):
        raise ValueError(f"key_padding_mask must be [B, Lk] = {[B, Lk]}, got {list(key_padding_mask.shape)}")
    return (rp.shape[1] - 1) // 2


def clipped_index(Lq: int, Lk: int, k: int, q_offset: int = 0, device=None) -> Tensor:
    """`[Lq, Lk]` index `clip(i - j, -k, k) + k` into the `2k+1` relative vectors."""
    i = torch.arange(Lq, device=device)[:, None] + q_offset
    j = torch.arange(Lk, device=device)[None, :]
    return (i - j).clamp(-k, k) + k


def shaw_scores_naive(x: Tensor, rp: Tensor, Lk: int, q_offset: int = 0) -> Tensor:
    """`S_ij = x_i·RP[clip(i - j, -k, k)]`: `x: [B, H, Lq, F]`, `rp: [H, 2k+1, F]` -> `[B, H, Lq, Lk]`.

    Only the `2k+1` distinct dot products are computed, then gathered."""
    k = check_shaw_inputs(x, rp)
    s = torch.einsum("bhif,htf->bhit", x, rp.to(x.dtype))  # (B, H, Lq, 2k+1)
    idx = clipped_index(x.shape[2], Lk, k, q_offset, device=x.device)  # (Lq, Lk)
    return torch.gather(s, 3, idx[None, None].expand(*s.shape[:2], -1, -1))


def shaw_logits(q: Tensor, rp: Tensor, Lk: int, q_offset: int = 0) -> Tensor:
    """Shaw's softmax logit term `q_i·RP[clip(i - j, -k, k)]`, dense, unscaled.

    For the materializing softmax backends (dense, SDPA with a bias): the caller multiplies
    by the logit scale and adds it to `scale·q_i·k_j`.

    Args:
        q: `[B, H, Lq, D]` queries (positions `q_offset + 0..Lq-1`).
        rp: `[H, 2k+1, D]`, row `t + k` holds `RP[t]`.
        Lk: number of keys (positions `0..Lk-1`).
        q_offset: position of the first query.

    Returns:
        `[B, H, Lq, Lk]` in q's dtype.
    """
    return shaw_scores_naive(q, rp, Lk, q_offset)


def shaw_num_den_naive(phi_q: Tensor, v: Tensor, rp: Tensor, *, Lk: int, causal: bool = False, q_offset: int = 0,
                       key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Shaw's contribution to a kernelized numerator and denominator (Scaleformer Eq. 10):
    `num_i = Σ_j S_ij·v_j`, `den_i = Σ_j S_ij` with `S_ij = φ(q_i)·RP[clip(i - j, -k, k)]`.

    `S` can be negative (RP is not constrained), so `den` can be `<= 0`; nothing here divides.

    Args:
        phi_q: `[B, H, Lq, F]` query features, queries at positions `q_offset + 0..Lq-1`.
        v: `[B, H, Lk, Dv]` values, keys at positions `0..Lk-1`.
        rp: `[H, 2k+1, F]` relative vectors, row `t + k` holds `RP[t]`.
        Lk: number of keys (must equal `v.shape[2]`).
        causal: only keys `j <= q_offset + i`.
        q_offset: position of the first query.
        key_padding_mask: `[B, Lk]` bool, True = padding (contributes nothing).

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]`, in phi_q's dtype.
    """
    check_shaw_inputs(phi_q, rp, v, Lk, key_padding_mask)
    S = shaw_scores_naive(phi_q, rp, Lk, q_offset)  # (B, H, Lq, Lk)
    if causal:
        i = torch.arange(phi_q.shape[2], device=S.device)[:, None] + q_offset
        S = S.masked_fill(torch.arange(Lk, device=S.device)[None, :] > i, 0.0)
    if key_padding_mask is not None:
        S = S.masked_fill(key_padding_mask[:, None, None, :], 0.0)
    return S @ v.to(S.dtype), S.sum(-1)
