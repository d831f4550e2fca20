"""FastRPB 1D: a learned Toeplitz term added to the attention output."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import AdditiveTerm, offsets


class FastRPB1D(AdditiveTerm):
    """`out += W·v` with `W_ij = w_h(j - i)` learned per head, multiplied by FFT; not normalized.

    From "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks"
    (ICLR 2022 submission).

    Args:
        num_heads: H.
        max_len: offsets `|r| < max_len` have a weight; beyond, `w = 0`.
        init_std: normal initialization std (0: the term starts switched off).

    Parameter `w: [H, 2*max_len-1]`, entry `max_len - 1 + r` holds `w(r)`.
    """

    def __init__(self, num_heads: int, max_len: int, init_std: float = 0.0):
        super().__init__(num_heads)
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.w = nn.Parameter(torch.randn(num_heads, 2 * max_len - 1) * init_std)

    def coefficients(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq+Lk-1]`: `w_h(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset` (0 beyond the table)."""
        r = offsets(Lq, Lk, q_offset, device=self.w.device)
        inside = r.abs() < self.max_len
        idx = (r + self.max_len - 1).clamp(0, 2 * self.max_len - 2)
        return self.w[:, idx] * inside.to(self.w.dtype)

    def materialize(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq, Lk]` dense W, for tests and debugging only."""
        from .base import toeplitz_index

        return self.coefficients(Lq, Lk, q_offset)[:, toeplitz_index(Lq, Lk, device=self.w.device)]

    def forward(self, v: Tensor, Lq: int, q_offset: int = 0, causal: bool = False) -> Tensor:
        """`v: [B, H, Lk, Dv]` -> `W·v: [B, H, Lq, Dv]`."""
        from ..ops.fastrpb.fft import fastrpb_fft

        w = self.coefficients(Lq, v.shape[2], q_offset)
        return fastrpb_fft(w.to(v.dtype), v, Lq, causal=causal, q_offset=q_offset)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_len={self.max_len}"
