"""Shaw relative vectors in kernelized attention in linear time (Scaleformer, Favier &
Dal'Maz Silva 2021, Algorithm 2).

Beyond distance k the clipped index is constant: keys `j <= i - k` all get `RP[k]`, keys
`j >= i + k` all get `RP[-k]`, so they enter through prefix (and suffix) sums of `[v, 1]`.
The `2k - 1` offsets inside the band `|i - j| < k` are added one by one, each as a shifted
slice of `[v, 1]` (a view: autograd saves no copy).

Cost: O(L·k·(F + Dv)) time; O(L·(k + Dv)) extra memory, backward included.

Notation: B batch, H heads, Lq/Lk lengths, F features, C = Dv + 1 (values and a column of
ones for the denominator), t = `clip(i - j, -k, k)`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .naive import check_shaw_inputs


def shaw_num_den_linear(phi_q: Tensor, v: Tensor, rp: Tensor, *, Lk: int, causal: bool = False, q_offset: int = 0,
                        key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Same signature and result as `shaw_num_den_naive`, in linear time.

    Args:
        phi_q: `[B, H, Lq, F]`; v: `[B, H, Lk, Dv]`; rp: `[H, 2k+1, F]`; Lk: `v.shape[2]`.
        causal: only keys `j <= q_offset + i`; key_padding_mask: `[B, Lk]`, True = padding.

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` (den may be <= 0: S is not constrained).
    """
    k = check_shaw_inputs(phi_q, rp, v, Lk, key_padding_mask)
    B, H, Lq, _ = phi_q.shape
    Dv = v.shape[-1]
    dt = phi_q.dtype
    vv = torch.cat([v.to(dt), torch.ones(B, H, Lk, 1, dtype=dt, device=v.device)], -1)  # (B, H, Lk, C)
    if key_padding_mask is not None:
        vv = vv.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    s = torch.einsum("bhif,htf->bhit", phi_q, rp.to(dt))  # (B, H, Lq, 2k+1): φ(q_i)·RP[t]
    P = torch.nn.functional.pad(vv.cumsum(2), (0, 0, 1, 0))  # (B, H, Lk+1, C): P[j] = Σ_{j' < j} vv_j'
    pos = torch.arange(Lq, device=phi_q.device) + q_offset  # query positions

    def prefix(end: Tensor) -> Tensor:  # (B, H, Lq, C): Σ_{j < end} vv_j, end clamped to [0, Lk]
        return P.index_select(2, end.clamp(0, Lk))

    total = P[:, :, Lk:]  # (B, H, 1, C)
    if k == 0:  # every pair has index 0 (the two far terms below would both count j = i)
        y = s * (prefix(pos + 1) if causal else total)
        return y[..., :Dv], y[..., Dv]
    # t = k: keys j <= pos - k (all before the query, so causal needs nothing more)
    y = s[..., 2 * k:] * prefix(pos - k + 1)
    if not causal:  # t = -k: keys j >= pos + k
        y = y + s[..., :1] * (total - prefix(pos + k))
    # the band |t| < k: key j = pos_i - t = i + q_offset - t, a contiguous slice of keys
    for t in range(0 if causal else -(k - 1), k):
        i0, i1 = max(0, t - q_offset), min(Lq, Lk + t - q_offset)  # rows whose key is in 0..Lk-1
        if i0 < i1:
            j0 = i0 + q_offset - t
            y[:, :, i0:i1] += s[:, :, i0:i1, t + k: t + k + 1] * vv[:, :, j0: j0 + (i1 - i0)]
    return y[..., :Dv], y[..., Dv]
