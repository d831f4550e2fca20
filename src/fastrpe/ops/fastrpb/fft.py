"""FastRPB's additive term `W·v` by FFT ("FastRPB: a Scalable Relative Positional Encoding
for Long Sequence Tasks", ICLR 2022 submission).

Causal calls use the same divide and conquer as the kernelized FFT path, so no output
row's computation ever reads a later value (no leak even through round-off)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..linear.fft import causal_segments
from ..toeplitz.fft import toeplitz_matmul_fft
from ..toeplitz.naive import toeplitz_matmul_naive


def fastrpb_fft(w_coeff: Tensor, v: Tensor, Lq: int, *, causal: bool = False, q_offset: int = 0) -> Tensor:
    """Same signature and result as `fastrpb_naive`."""
    if not causal:
        return toeplitz_matmul_fft(w_coeff, v, Lq)
    Lk = v.shape[2]
    rows, parts = [], []
    for kind, qa, qb, ka, kb in causal_segments(Lq, Lk, q_offset):
        s = ka - qb + Lq  # offsets of queries qa..qb-1 against keys ka..kb-1
        w = w_coeff[..., s: s + (qb - qa) + (kb - ka) - 1]
        if kind == "leaf":
            r = torch.arange(-(qb - qa - 1), kb - ka, device=v.device) + (ka - qa - q_offset)  # r = j - i
            part = toeplitz_matmul_naive(w * (r <= 0).to(w.dtype), v[:, :, ka:kb], qb - qa)
        else:
            part = toeplitz_matmul_fft(w, v[:, :, ka:kb], qb - qa)
        rows.append(torch.arange(qa, qb, device=v.device))
        parts.append(part)
    return v.new_zeros(*v.shape[:2], Lq, v.shape[-1]).index_add(2, torch.cat(rows), torch.cat(parts, dim=2))
