"""Transformer blocks shared by the models, and turning a position name into a term.

Notation: B batch, L length, E model width.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import positions as P
from .attention import KVCache, LinearState, MultiheadAttention

#: position names handled by the model rather than by attention
ABSOLUTE = ("sinusoidal",)
#: rotary: applied to q/k inside attention
ROTARY = ("rotary",)


def position_term(name: str, num_heads: int, *, causal: bool, max_len: int):
    """A fresh positional term for one attention layer, or None for "none"/absolute/rotary."""
    if name in ("none", *ABSOLUTE, *ROTARY):
        return None
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
    """Pre-norm block: self-attention, optional cross-attention, MLP."""

    def __init__(self, dim: int, heads: int, *, kernel, position: str, causal: bool, cross: bool, dropout: float,
                 ff_mult: int, backend: str, max_len: int, cross_position: str | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MultiheadAttention(dim, heads, kernel, position_term(position, heads, causal=causal, max_len=max_len),
                                       causal=causal, dropout=dropout, rotary=position in ROTARY, backend=backend)
        self.cross = None
        if cross:
            cp = position if cross_position is None else cross_position
            self.ln_c = nn.LayerNorm(dim)
            self.cross = MultiheadAttention(dim, heads, kernel, position_term(cp, heads, causal=False, max_len=max_len),
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
