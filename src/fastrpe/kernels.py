"""Content kernels: how `q_i` and `k_j` are compared.

Either exact softmax (`Softmax`) or a feature map `φ` with
`κ(q, k) = φ(q)·φ(k)` (`FeatureMap` subclasses). Layout: inputs
`[B, H, L, D]`, features `[B, H, L, F]`.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class Kernel:
    """Marker base of every content kernel."""

    name: str = "kernel"


class Softmax(Kernel):
    """Exact softmax attention: `score_ij = scale·q_i·k_j (+ b(j-i))`."""

    name = "softmax"

    def __repr__(self) -> str:
        return "Softmax()"


class FeatureMap(nn.Module, Kernel):
    """Base of the feature maps. `forward(x, is_query) -> [B, H, L, F]`.

    Args:
        normalize: l2-normalize `x` over its last dim first (NPRF, Luo et al. 2021 §3.3).
    """

    name = "feature_map"

    def __init__(self, normalize: bool = False):
        nn.Module.__init__(self)
        self.normalize = bool(normalize)

    def num_features(self, head_dim: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _prepare(self, x: Tensor) -> Tensor:
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        return x

    def features(self, x: Tensor, is_query: bool) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor, is_query: bool = True) -> Tensor:
        return self.features(self._prepare(x), is_query)


class EluPlusOne(FeatureMap):
    """`φ(x) = elu(x) + 1` (Katharopoulos et al., "Transformers are RNNs", 2020)."""

    name = "elu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        return torch.nn.functional.elu(x) + 1.0


def get_kernel(spec, head_dim: int | None = None) -> Kernel:
    """Turn a kernel spec (a name or a `Kernel`) into a `Kernel` instance."""
    if isinstance(spec, Kernel):
        return spec
    if spec is None or spec == "softmax":
        return Softmax()
    if spec == "elu":
        return EluPlusOne()
    raise ValueError(f"kernel: unknown kernel {spec!r}")
