"""FastRPB's additive term `W·v` by FFT ("FastRPB: a Scalable Relative Positional Encoding
for Long Sequence Tasks", Zubkov & Gavrilov, ICLR 2022 submission): O(L log L) per channel.

Causal calls do not mask the coefficients and run one FFT: an FFT mixes every value into
every output through round-off, so a later value (a huge one, say) could change an earlier
row. They use the same divide and conquer as the kernelized FFT path instead (dense
diagonal leaves, FFT products of earlier keys against later queries), so no output row's
computation ever reads a later value. O(L log² L).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..linear.fft import causal_segments
from ..toeplitz.fft import toeplitz_matmul_fft
from ..toeplitz.naive import toeplitz_matmul_naive
from .naive import check_fastrpb_inputs


def fastrpb_fft(w_coeff: Tensor, v: Tensor, Lq: int, *, causal: bool = False, q_offset: int = 0) -> Tensor:
    """Same signature and result as `fastrpb_naive`: `[H, Lq+Lk-1]`, `[B, H, Lk, Dv]` ->
    `[B, H, Lq, Dv]`. FFTs run in float32 (float64 for float64 inputs); the result is in v's dtype."""
    check_fastrpb_inputs(w_coeff, v, Lq)
    if not causal:
        return toeplitz_matmul_fft(w_coeff, v, Lq)
    Lk = v.shape[2]
    rows, parts = [], []
    for kind, qa, qb, ka, kb in causal_segments(Lq, Lk, q_offset):
        s = ka - qb + Lq  # offsets of queries qa..qb-1 against keys ka..kb-1 start here in w_coeff
        w = w_coeff[..., s: s + (qb - qa) + (kb - ka) - 1]
        if kind == "leaf":  # a diagonal block: mask keys after the query
            r = torch.arange(-(qb - qa - 1), kb - ka, device=v.device) + (ka - qa - q_offset)  # r = j - i
            part = toeplitz_matmul_naive(w * (r <= 0).to(w.dtype), v[:, :, ka:kb], qb - qa)
        else:  # every key strictly before every query
            part = toeplitz_matmul_fft(w, v[:, :, ka:kb], qb - qa)
        rows.append(torch.arange(qa, qb, device=v.device))
        parts.append(part.to(v.dtype))
    out = v.new_zeros(*v.shape[:2], Lq, v.shape[-1])
    if not parts:  # no query has a key at or before it
        return out
    return out.index_add(2, torch.cat(rows), torch.cat(parts, dim=2))
