"""Causal kernelized attention by prefix sums (Scaleformer, Favier & Dal'Maz Silva 2021,
Algorithm 1), in plain PyTorch: `S_i = Σ_{j<=i} φ(k_j) ⊗ [v_j, 1]` by `cumsum`.

A reference-quality baseline: it materializes every prefix state, `[B, H, L, F, Dv+1]`,
so memory is O(L·F·Dv) — the blow-up the chunked form avoids. No positional term.
"""
from __future__ import annotations

import torch
from torch import Tensor


def kernelized_num_den_prefix(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, q_offset: int = 0,
                              key_padding_mask: Tensor | None = None):
    """Causal `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])`, queries at
    positions `q_offset + 0..Lq-1` (a query past the last key sees every key)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(phi_q.dtype), torch.ones_like(v[..., :1], dtype=phi_q.dtype)], -1)  # (B, H, Lk, C)
    S = torch.einsum("bhjf,bhjc->bhjfc", phi_k, vv).cumsum(2)  # (B, H, Lk, F, C): state after key j
    last = (torch.arange(Lq, device=phi_q.device) + q_offset).clamp_max(Lk - 1)  # last key each query sees
    y = torch.einsum("bhif,bhifc->bhic", phi_q, S[:, :, last])
    return y[..., :Dv], y[..., Dv], phi_q.new_zeros(H, Lq)
