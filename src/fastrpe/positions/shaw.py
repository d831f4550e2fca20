"""Shaw's clipped relative vectors as a positional term."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import AdditiveTerm


class ShawRelative(AdditiveTerm):
    """Learned vectors `RP[t]`, `t = clip(i - j, -k, k)` (Shaw et al., "Self-Attention with
    Relative Position Representations", NAACL 2018; linear-time kernelized form from
    Scaleformer, Favier & Dal'Maz Silva 2021).

    Kernelized attention adds `S_ij = φ(q_i)·RP[t]` to the numerator and denominator
    (Scaleformer Eq. 10; `dim` = feature width F); softmax adds `scale·q_i·RP[t]` to the
    logits (`dim` = head width D). Note the sign: `t` is query minus key position.

    By default RP is not constrained (DESIGN.md's form), so `S_ij` can be negative and a
    kernelized denominator can be 0 or negative; the caller divides with `safe_divide`.
    `positive=True` uses `elu(RP) + 1 > 0` instead, as Scaleformer's own code does (it
    applies its feature map to RP): with non-negative query features the added weights
    are then non-negative and the denominator cannot change sign.

    Args:
        num_heads: H.
        dim: width of each vector (F for kernelized attention, D for softmax).
        max_distance: k; offsets beyond share the vector of distance k.
        init_std: normal initialization std.
        positive: use `elu(RP) + 1` (kernelized attention; softmax logits use RP as is).

    Parameter `rp: [H, 2k+1, dim]`, row `t + k` holds `RP[t]`.
    """

    def __init__(self, num_heads: int, dim: int, max_distance: int, init_std: float = 0.02, positive: bool = False):
        super().__init__(num_heads)
        if not isinstance(max_distance, int) or max_distance < 0 or dim <= 0:
            raise ValueError(f"ShawRelative needs dim > 0 and an int max_distance >= 0, got {dim}, {max_distance!r}")
        self.dim, self.max_distance, self.positive = dim, max_distance, bool(positive)
        self.rp = nn.Parameter(torch.randn(num_heads, 2 * max_distance + 1, dim) * init_std)

    def _check(self, x: Tensor, what: str) -> None:
        if x.dim() != 4 or x.shape[1] != self.num_heads:
            raise ValueError(f"position: ShawRelative has {self.num_heads} heads; the {what} must be "
                             f"[B, H, L, {self.dim}], got {list(x.shape)}")
        if x.shape[-1] != self.dim:
            raise ValueError(f"position: ShawRelative has dim={self.dim} but the {what} have width {x.shape[-1]}")

    def num_den(self, phi_q: Tensor, v: Tensor, Lk: int, causal: bool = False, q_offset: int = 0,
                key_padding_mask: Tensor | None = None, naive: bool = False) -> tuple[Tensor, Tensor]:
        """Contributions to a kernelized numerator and denominator, in linear time
        (`shaw_num_den_linear`) or by materializing S (`naive=True`).

        Args:
            phi_q: `[B, H, Lq, F]` query features (positions `q_offset + 0..Lq-1`).
            v: `[B, H, Lk, Dv]` values (positions `0..Lk-1`).
            Lk: number of keys.
            causal: only keys `j <= q_offset + i`.
            q_offset: position of the first query.
            key_padding_mask: `[B, Lk]` bool, True = padding.

        Returns:
            `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` (den may be <= 0).
        """
        from ..ops.shaw.linear import shaw_num_den_linear
        from ..ops.shaw.naive import shaw_num_den_naive

        self._check(phi_q, "query features")
        fn = shaw_num_den_naive if naive else shaw_num_den_linear
        rp = torch.nn.functional.elu(self.rp) + 1 if self.positive else self.rp
        return fn(phi_q, v, rp, Lk=Lk, causal=causal, q_offset=q_offset, key_padding_mask=key_padding_mask)

    def logits(self, q: Tensor, Lk: int, q_offset: int = 0, scale: float = 1.0) -> Tensor:
        """`[B, H, Lq, Lk]` softmax logit term `scale·q_i·RP[clip(i - j, -k, k)]` for `q: [B, H, Lq, D]`."""
        from ..ops.shaw.naive import shaw_logits

        self._check(q, "queries")
        return shaw_logits(q, self.rp, Lk, q_offset) * scale

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, dim={self.dim}, max_distance={self.max_distance}, positive={self.positive}"
