"""Transformer encoder with a classification head (ListOps, text classification).

Notation: B batch, L length, E width, C classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import FastRPEError, check_tokens
from .block import ABSOLUTE, Block, init_weights, layer_seed, sinusoidal
from .config import ConfigMixin


@dataclass
class EncoderConfig(ConfigMixin):
    """Encoder classifier. `position`: "none", "sinusoidal", "learned_abs" (a trainable
    absolute embedding per position, up to `max_len`), "rotary", "shaw" or a positions
    family name. `num_features`, `feature_seed`: as in `LMConfig`."""

    vocab_size: int = 32
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.0
    kernel: str = "softmax"
    position: str = "kerple_log"
    fastrpb: bool = False
    backend: str = "auto"
    max_len: int = 4096
    pad_id: int = 0
    num_features: int | None = None
    feature_seed: int = 0


class EncoderClassifier(nn.Module):
    """Bidirectional encoder, mean-pooled over non-padding tokens, then a linear head."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        learned = cfg.position == "learned_abs"
        self.pos_embed = nn.Parameter(torch.zeros(cfg.max_len, cfg.d_model)) if learned else None
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, kernel=cfg.kernel, position="none" if learned else cfg.position,
                  causal=False, cross=False,
                  dropout=cfg.dropout, ff_mult=cfg.ff_mult, backend=cfg.backend, max_len=cfg.max_len,
                  num_features=cfg.num_features, seed=layer_seed(cfg.feature_seed, "layer", i))
            for i in range(cfg.n_layers)
        )
        if cfg.fastrpb:
            from ..positions import FastRPB1D

            for blk in self.blocks:
                blk.attn.positions.append(FastRPB1D(cfg.n_heads, cfg.max_len))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        init_weights(self)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """`tokens: [B, L]`, `padding_mask: [B, L]` bool (True = pad; default `tokens == pad_id`) -> `[B, C]`."""
        check_tokens(tokens, self.cfg.vocab_size, "tokens", "EncoderClassifier")
        if padding_mask is not None and (not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool
                                         or padding_mask.shape != tokens.shape):
            raise FastRPEError(f"EncoderClassifier: padding_mask must be a bool tensor of the tokens' shape "
                               f"{tuple(tokens.shape)} (True = pad), got {getattr(padding_mask, 'dtype', type(padding_mask))} "
                               f"{tuple(getattr(padding_mask, 'shape', ()))}")
        if padding_mask is None:
            padding_mask = tokens == self.cfg.pad_id
        x = self.embed(tokens)
        if self.cfg.position in ABSOLUTE:
            x = x + sinusoidal(torch.arange(tokens.shape[1], device=tokens.device), self.cfg.d_model).to(x.dtype)
        elif self.pos_embed is not None:
            if tokens.shape[1] > self.cfg.max_len:
                raise FastRPEError(f"EncoderClassifier: tokens have length {tokens.shape[1]}, more than max_len "
                                   f"{self.cfg.max_len} of the learned absolute positions")
            x = x + self.pos_embed[:tokens.shape[1]].to(x.dtype)
        kpm = padding_mask if bool(padding_mask.any()) else None
        for blk in self.blocks:
            x = blk(x, padding_mask=kpm)
        x = self.ln_f(x)
        keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (B, L, 1)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.head(pooled)
