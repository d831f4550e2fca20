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
    (`dim` = feature width F); softmax adds `scale·q_i·RP[t]` to the logits (`dim` = D).
    `S_ij` can be negative, so a kernelized denominator can approach 0.

    Args:
        num_heads: H.
        dim: width of each vector (F for kernelized attention, D for softmax).
        max_distance: k.
        init_std: normal initialization std.

    Parameter `rp: [H, 2k+1, dim]`.
    """

    def __init__(self, num_heads: int, dim: int, max_distance: int, init_std: float = 0.02):
        super().__init__(num_heads)
        if max_distance < 0 or dim <= 0:
            raise ValueError(f"ShawRelative needs dim > 0 and max_distance >= 0, got {dim}, {max_distance}")
        self.dim, self.max_distance = dim, max_distance
        self.rp = nn.Parameter(torch.randn(num_heads, 2 * max_distance + 1, dim) * init_std)

    def _check(self, x: Tensor, what: str) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"position: ShawRelative has dim={self.dim} but the {what} have width {x.shape[-1]}")

    def num_den(self, phi_q: Tensor, v: Tensor, Lk: int, causal: bool, q_offset: int,
                key_padding_mask: Tensor | None = None, naive: bool = False) -> tuple[Tensor, Tensor]:
        """Contributions `[B, H, Lq, Dv]`, `[B, H, Lq]` to a kernelized numerator/denominator."""
        from ..ops.shaw.linear import shaw_num_den_linear
        from ..ops.shaw.naive import shaw_num_den_naive

        self._check(phi_q, "query features")
        fn = shaw_num_den_naive if naive else shaw_num_den_linear
        return fn(phi_q, v, self.rp, Lk=Lk, causal=causal, q_offset=q_offset, key_padding_mask=key_padding_mask)

    def logits(self, q: Tensor, Lk: int, q_offset: int, scale: float) -> Tensor:
        """`[B, H, Lq, Lk]` softmax logit term `scale·q_i·RP[clip(i-j)]`."""
        from ..ops.shaw.naive import shaw_scores_naive

        self._check(q, "queries")
        return shaw_scores_naive(q, self.rp, Lk, q_offset) * scale

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, dim={self.dim}, max_distance={self.max_distance}"
