"""Kernelized attention with a Toeplitz RPE by FFT, exact, with a static schedule.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding" (NeurIPS 2021), Eq. 10-13. One job per module:

- `plan`: feature blocks, causal leaves and the recomputation capacity, from shapes and the
  memory budget alone;
- `scale`: each row's own largest coefficient and the rescaling of products to it;
- `product`: the FFT product in blocks of feature channels (a custom autograd function);
- `band`: the near band of non-causal products, dense;
- `causal`: causal calls: the pairs across chunks by one blocked product, each chunk's own by
  the divide-and-conquer recursion;
- `blocked`: the blocked product (one FFT per chunk, a lower-triangular sum per frequency);
- `certify`: per-row round-off certificates and the exact recomputation of failing rows.

Nothing in the hot path reads a tensor value on the host: every size and loop comes from
shapes, every decision that depends on values is a tensor operation (no host
synchronization; it can be captured by CUDA graphs and `torch.compile`).

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, C = Dv + 1
channels per feature, R = Lq + Lk - 1 offsets.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...common import causal_offset_mask
from ...toeplitz.fft import fft_dtype_for
from .band import NEAR_BAND, band_covers_all, band_product, band_rows, far_coefficients
from .causal import causal_product, causal_segments, local_products
from .certify import ROW_RTOL, certify_rows, static_schedule, sync_recompute
from .plan import (CAUSAL_LEAF, CAUSAL_LEAF_MAX, DEFAULT_BUDGET, causal_leaf, device_budget, estimate_fft_cost,
                   fft_block_size, fft_channel_block, recompute_capacity)
from .product import scaled_product
from .scale import row_max, sliding_max

__all__ = ["kernelized_num_den_fft", "estimate_fft_cost", "fft_block_size", "fft_channel_block", "causal_leaf",
           "causal_segments", "recompute_capacity", "static_schedule", "sync_recompute", "CAUSAL_LEAF",
           "CAUSAL_LEAF_MAX", "DEFAULT_BUDGET", "ROW_RTOL", "sliding_max", "device_budget"]


def kernelized_num_den_fft(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    memory_budget_bytes: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same signature and results as `kernelized_num_den_naive`, by FFT in feature blocks.

    Args:
        phi_q: `[B, H, Lq, F]`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        log_coeff: `[H, Lq+Lk-1]` log-coefficients (offsets `-(Lq-1+q_offset) .. Lk-1-q_offset`) or None.
        causal, q_offset, key_padding_mask: as in the naive op.
        memory_budget_bytes: bound on one block's temporaries (default `plan.device_budget`:
            512 MiB, on a GPU 1/32 of its memory up to 4 GiB).

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` and `log_scale: [H, Lq]` (true values are
        `num·exp(log_scale)`): each row is scaled by the largest coefficient it sees. The
        FFTs run in float32 (float64 for float64 inputs); results are cast back to phi_q's
        dtype. Every row's `num/den` is within `ROW_RTOL` of exact (rows the FFT cannot
        certify are recomputed densely; see `certify.py`).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    if memory_budget_bytes is None:
        memory_budget_bytes = device_budget(phi_q.device)
    out_dt = phi_q.dtype
    dt = fft_dtype_for(out_dt)
    phi_q, phi_k = phi_q.to(dt), phi_k.to(dt)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], dim=-1)  # (B, H, Lk, C)
    if log_coeff is None and not causal:
        # no positional term: plain linear attention, no FFT needed
        kv = torch.einsum("bhjf,bhjc->bhfc", phi_k, vv)  # (B, H, F, C)
        y = torch.einsum("bhif,bhfc->bhic", phi_q, kv).to(out_dt)
        return y[..., :Dv], y[..., Dv], y.new_zeros(H, Lq)
    lc = torch.zeros(H, Lq + Lk - 1, dtype=dt, device=phi_q.device) if log_coeff is None else log_coeff.to(dt)
    if causal:
        lc = lc.masked_fill(~causal_offset_mask(Lq, Lk, q_offset, device=lc.device), float("-inf"))
    rmax = row_max(lc, Lq, Lk)  # (H, Lq)
    empty = ~torch.isfinite(rmax)  # rows that see no coefficient: exactly 0
    scale = torch.where(empty, torch.zeros_like(rmax), rmax)
    if not causal:
        # the far offsets by FFT (whose noise is then relative to them), the near band densely
        # added to them in place
        lc_fft = far_coefficients(lc, Lq, q_offset, NEAR_BAND)
        if band_covers_all(Lq, Lk, q_offset, NEAR_BAND):
            far, err = None, phi_q.new_zeros(B, H, Lq, Dv + 1)
        else:
            block = (fft_block_size(B, H, Lq, Lk, F, Dv, dt, memory_budget_bytes),
                     fft_channel_block(B, H, Lq, Lk, Dv, dt, memory_budget_bytes))
            far, err = scaled_product(phi_q, phi_k, vv, lc_fft, scale, block)
        y = band_product(phi_q, phi_k, vv, lc, scale, q_offset, NEAR_BAND,
                         band_rows(B, H, F, Dv, dt, memory_budget_bytes), into=far)
    else:
        leaf = causal_leaf(B, H, dt, memory_budget_bytes)
        y, err = causal_product(phi_q, phi_k, vv, lc, scale, q_offset, memory_budget_bytes, leaf,
                                local_products(out_dt))
        lc_fft = lc
    rows, chunk = recompute_capacity(B, H, Lq, Lk, F, Dv, dt, memory_budget_bytes, q_offset)
    y = certify_rows(y, err, phi_q, phi_k, vv, lc, lc_fft, scale, empty, rows, chunk)
    y = y.to(out_dt)
    return y[..., :Dv], y[..., Dv], scale.to(out_dt)
