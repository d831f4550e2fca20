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
    logits (`dim` = head width D). Note the sign: `t` is query minus key position. The
    term holds the table; `fastrpe.ops.kernelized` applies it (`vectors()` hands it over).

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

    def vectors(self, width: int, kernelized: bool) -> Tensor:
        """`[H, 2k+1, width]`: the table the ops use, row `t + k` holds `RP[t]` — `elu(RP) + 1`
        for kernelized attention when `positive`, RP as is otherwise (softmax logits).

        Args:
            width: F (kernelized attention) or D (softmax) of the call; must equal `dim`.
            kernelized: the table pairs with query features `φ(q)` (else with q).
        """
        if width != self.dim:
            what = "query features" if kernelized else "queries"
            raise ValueError(f"position: ShawRelative has dim={self.dim} but the {what} have width {width}")
        return torch.nn.functional.elu(self.rp) + 1 if (kernelized and self.positive) else self.rp

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, dim={self.dim}, max_distance={self.max_distance}, positive={self.positive}"
