"""Non-causal kernelized attention without a multiplicative positional term, in linear time.

Katharopoulos et al., "Transformers are RNNs: Fast Autoregressive Transformers with Linear
Attention" (2020), Eq. 4-5; Scaleformer's bidirectional case (Favier & Dal'Maz Silva, 2021,
§5): with every pair weighted 1, the sums over keys do not depend on the query,

    num_i = φ(q_i)ᵀ · Σ_j φ(k_j) v_jᵀ,    den_i = φ(q_i)ᵀ · Σ_j φ(k_j),

so one `[F, Dv]` summary replaces the `[Lq, Lk]` weights: O((Lq + Lk)·F·Dv) time and
O(F·Dv) extra memory. The naive sibling is `naive.kernelized_num_den_naive` with no
coefficients.

Notation: B batch, H heads, F features, Dv value width.
"""
from __future__ import annotations

import torch
from torch import Tensor


def kernelized_num_den_bidirectional(phi_q: Tensor, phi_k: Tensor, v: Tensor, *,
                                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Args:
        phi_q: `[B, H, Lq, F]`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        key_padding_mask: `[B, Lk]` bool, True = padding (ignored keys).

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])`, the log-scale all zeros.
    """
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    kv = torch.einsum("bhjf,bhjd->bhfd", phi_k, v.to(phi_k.dtype))  # (B, H, F, Dv)
    num = phi_q @ kv  # (B, H, Lq, Dv)
    den = phi_q @ phi_k.sum(2)[..., None]  # (B, H, Lq, 1)
    return num, den[..., 0], phi_q.new_zeros(phi_q.shape[1], phi_q.shape[2])
