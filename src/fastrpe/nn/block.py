"""Transformer blocks shared by the models, and turning a position name into a term.

Notation: B batch, L length, E model width.
"""
from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

from .. import positions as P
from .._validate import FastRPEError
from ..kernels import FeatureMap, get_kernel
from .attention import KVCache, LinearState, MultiheadAttention

#: position names handled by the model rather than by attention
ABSOLUTE = ("sinusoidal",)
#: rotary: applied to q/k inside attention
ROTARY = ("rotary",)
#: Shaw's clipped relative vectors (an additive term whose width follows the kernel)
SHAW = ("shaw",)
#: Shaw's clipping distance k in the models (Shaw et al. 2018 use k = 16; Scaleformer's Fig. 4 k = 10)
SHAW_MAX_DISTANCE = 16
#: every position name a model config takes
POSITION_NAMES = ("none", *ABSOLUTE, *ROTARY, *SHAW, *P.NAMES)


def layer_seed(model_seed: int, *path) -> int:
    """A 63-bit seed for one layer's random features, e.g. `layer_seed(seed, "dec", 3, "cross")`:
    distinct for distinct (model seed, path), the same in every process (Performer draws an
    independent projection per layer)."""
    text = "fastrpe-features:" + ":".join(str(x) for x in (model_seed, *path))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def layer_kernel(spec, head_dim: int, num_heads: int, *, num_features: int | None = None, seed: int = 0):
    """The content kernel of one attention layer: `get_kernel(spec, ...)` with this layer's seed;
    a random map draws an independent projection per head (as Performer does)."""
    return get_kernel(spec, head_dim=head_dim, num_features=num_features, seed=seed, num_heads=num_heads)


def position_term(name: str, num_heads: int, *, causal: bool, max_len: int, kernel=None, head_dim: int | None = None):
    """A fresh positional term for one attention layer, or None for "none"/absolute/rotary.

    "shaw" is `ShawRelative` with k = `SHAW_MAX_DISTANCE`, as wide as the layer's kernel
    features (softmax: `head_dim`), positive (`elu(RP) + 1`, as Scaleformer's code applies
    its feature map to RP) under a feature map; it needs `kernel` and `head_dim`."""
    if name in ("none", *ABSOLUTE, *ROTARY):
        return None
    if name not in SHAW and name not in P.NAMES:
        raise ValueError(f"position: unknown name {name!r}; known: {', '.join(POSITION_NAMES)}")
    if name in SHAW:
        if head_dim is None:
            raise ValueError("position 'shaw' needs the layer's head_dim (and kernel)")
        fmap = isinstance(kernel, FeatureMap)
        dim = kernel.num_features(head_dim) if fmap else head_dim
        return P.ShawRelative(num_heads, dim=dim, max_distance=SHAW_MAX_DISTANCE, positive=fmap)
    return P.make(name, num_heads, causal=causal, max_len=max_len)


def sinusoidal(positions: Tensor, dim: int) -> Tensor:
    """Absolute sinusoidal encoding (Vaswani et al. 2017): `[L] -> [L, dim]`."""
    half = dim // 2
    inv = torch.exp(-math.log(10000.0) * torch.arange(half, device=positions.device, dtype=torch.float32) / max(half, 1))
    ang = positions.float()[:, None] * inv[None]
    pe = torch.cat([ang.sin(), ang.cos()], dim=-1)
    return torch.nn.functional.pad(pe, (0, dim - 2 * half))


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style: normal(0, std) for linear and embedding weights, zero biases. Positional
    terms keep their own initialization."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm block: self-attention, optional cross-attention, MLP.

    `kernel`/`num_features` configure the self-attention, `cross_kernel`/`cross_num_features`
    the cross-attention (default: the same). Random feature maps are drawn from
    `layer_seed(seed, "self")` and `layer_seed(seed, "cross")`: give each block its own `seed`.
    `group`: a context-parallel process group for the self-attention (see
    `MultiheadAttention`); the norms and the MLP act on this rank's slice alone.
    """

    def __init__(self, dim: int, heads: int, *, kernel, position: str, causal: bool, cross: bool, dropout: float,
                 ff_mult: int, backend: str, max_len: int, cross_position: str | None = None,
                 num_features: int | None = None, cross_kernel=None, cross_num_features: int | None = None,
                 seed: int = 0, group=None):
        super().__init__()
        hd = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        kern = layer_kernel(kernel, hd, heads, num_features=num_features, seed=layer_seed(seed, "self"))
        self.attn = MultiheadAttention(
            dim, heads, kern, position_term(position, heads, causal=causal, max_len=max_len, kernel=kern, head_dim=hd),
            causal=causal, dropout=dropout, rotary=position in ROTARY, backend=backend, group=group)
        self.cross = None
        if cross:
            if group is not None:
                raise FastRPEError("Block: cross-attention is not context-parallel; group must be None")
            cp = position if cross_position is None else cross_position
            ck = layer_kernel(kernel if cross_kernel is None else cross_kernel, hd, heads,
                              num_features=num_features if cross_num_features is None else cross_num_features,
                              seed=layer_seed(seed, "cross"))
            self.ln_c = nn.LayerNorm(dim)
            self.cross = MultiheadAttention(
                dim, heads, ck, position_term(cp, heads, causal=False, max_len=max_len, kernel=ck, head_dim=hd),
                causal=False, dropout=dropout, backend=backend)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, ff_mult * dim, dropout)

    def forward(self, x: Tensor, *, padding_mask: Tensor | None = None, memory: Tensor | None = None,
                memory_mask: Tensor | None = None, cache: KVCache | LinearState | None = None, q_offset: int = 0):
        """`x: [B, L, E]`. With `cache` (decoding), returns `(x, cache)`."""
        h = self.ln1(x)
        new_cache = None
        if cache is not None:
            a, new_cache = self.attn.step(h, None if isinstance(cache, KVCache) and cache.k is None else cache)
        else:
            a = self.attn(h, key_padding_mask=padding_mask)
        x = x + a
        if self.cross is not None:
            x = x + self.cross(self.ln_c(x), memory, key_padding_mask=memory_mask, q_offset=q_offset)
        x = x + self.mlp(self.ln2(x))
        return (x, new_cache) if cache is not None else x
