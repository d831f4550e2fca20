"""Shaw relative vectors in kernelized attention in linear time (Scaleformer, Favier &
Dal'Maz Silva 2021, Algorithm 2).

Beyond distance k the clipped index is constant, so those keys enter through prefix and
suffix sums of `[v, 1]`; the `2k - 1` offsets inside the band are gathered one by one.
O(L·k·(F + Dv)) time, O(L·(k + Dv)) memory.

Notation: B batch, H heads, Lq/Lk lengths, F features, C = Dv + 1, t = clipped `i - j`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def shaw_num_den_linear(phi_q: Tensor, v: Tensor, rp: Tensor, *, Lk: int, causal: bool = False, q_offset: int = 0,
                        key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Same signature and result as `shaw_num_den_naive`, in linear time."""
    B, H, Lq, _ = phi_q.shape
    Dv = v.shape[-1]
    k = (rp.shape[1] - 1) // 2
    dev = phi_q.device
    vv = torch.cat([v.to(phi_q.dtype), torch.ones_like(v[..., :1], dtype=phi_q.dtype)], -1)  # (B, H, Lk, C)
    if key_padding_mask is not None:
        vv = vv.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    s = torch.einsum("bhif,htf->bhit", phi_q, rp.to(phi_q.dtype))  # (B, H, Lq, 2k+1): φ(q_i)·RP[t]
    P = torch.nn.functional.pad(vv.cumsum(2), (0, 0, 1, 0))  # (B, H, Lk+1, C): P[j] = Σ_{j'<j}
    pos = torch.arange(Lq, device=dev) + q_offset  # query positions

    def prefix(end: Tensor) -> Tensor:  # Σ_{j < end} vv_j, end clamped to [0, Lk]
        return P[:, :, end.clamp(0, Lk)]  # (B, H, Lq, C)

    if k == 0:  # every pair has index 0
        U = prefix(pos + 1) if causal else P[:, :, Lk:].expand(B, H, Lq, -1)
        y = s[..., 0:1] * U
        return y[..., :Dv], y[..., Dv]
    # t = k: keys j <= pos - k ; t = -k: keys j >= pos + k (none when causal)
    y = s[..., 2 * k: 2 * k + 1] * prefix(pos - k + 1)
    if not causal:
        y = y + s[..., 0:1] * (P[:, :, Lk:] - prefix(pos + k))
    # the band |t| < k: key j = pos - t
    for t in range(0 if causal else -(k - 1), k):
        j = pos - t
        ok = ((j >= 0) & (j < Lk)).to(vv.dtype)[None, None, :, None]
        y = y + s[..., t + k: t + k + 1] * vv[:, :, j.clamp(0, Lk - 1)] * ok
    return y[..., :Dv], y[..., Dv]
