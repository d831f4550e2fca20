"""FastRPB 1D: a learned Toeplitz term added to the attention output."""
from __future__ import annotations

from torch import Tensor, nn

from .base import AdditiveTerm, init_normal, offsets, toeplitz_index


class FastRPB1D(AdditiveTerm):
    """`out += W·v` with `W_ij = w_h(j - i)` learned per head, multiplied by FFT; not normalized.

    From "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks"
    (Zubkov & Gavrilov, ICLR 2022 submission). The term is independent of the attention
    kernel, so it serves softmax and kernelized attention alike.

    Offsets outside the table (`|r| >= max_len`) have weight 0 rather than an error: the
    term is a plain sum, so 0 means "those keys add nothing", and a model trained at
    `max_len` still runs (without positional signal that far) on longer inputs.

    The term holds the table; `fastrpe.ops.kernelized.add_fastrpb` applies it (by FFT) with
    the coefficients of each call (`coefficients()`).

    Args:
        num_heads: H.
        max_len: offsets `|r| < max_len` have a weight.
        init_std: normal initialization std (default 0: the term starts switched off and
            the model starts as plain attention).

    Parameter `w: [H, 2*max_len-1]`, entry `max_len - 1 + r` holds `w(r)`.
    """

    def __init__(self, num_heads: int, max_len: int, init_std: float = 0.0):
        super().__init__(num_heads)
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be an int >= 1, got {max_len!r}")
        self.max_len = max_len
        self.w = nn.Parameter(init_normal(num_heads, 2 * max_len - 1, std=init_std))

    def coefficients(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq+Lk-1]`: `w_h(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset` (0 where `|r| >= max_len`)."""
        r = offsets(Lq, Lk, q_offset, device=self.w.device)
        inside = r.abs() < self.max_len
        idx = (r + self.max_len - 1).clamp(0, 2 * self.max_len - 2)
        return self.w[:, idx] * inside.to(self.w.dtype)

    def materialize(self, Lq: int, Lk: int, q_offset: int = 0) -> Tensor:
        """`[H, Lq, Lk]` dense W (`W_ij = w_h(j - i - q_offset)`), for tests and debugging only."""
        return self.coefficients(Lq, Lk, q_offset)[:, toeplitz_index(Lq, Lk, device=self.w.device)]

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_len={self.max_len}"
