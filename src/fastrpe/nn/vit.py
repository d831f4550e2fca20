"""Vision Transformer on patches, with 2D relative positions on the patch grid.

Dosovitskiy et al., *An Image is Worth 16x16 Words: Transformers for Image Recognition at
Scale* (ICLR 2021): an image is cut into `p × p` patches, each patch is a token (a linear
map of its pixels), an optional class token goes first, and a Transformer encoder with a
linear head classifies. Positions here can be absolute (learned or 2D sinusoidal) or
relative on the patch grid: a 2D table `b_h(Δrow, Δcol)` (`Table2D`, Swin-style) and/or
FastRPB's additive 2D term `W·v` with `W = w(Δrow) + w(Δcol)` (`FastRPB2D`). Non-square
images and grids are fine.

Notation: B batch, C channels, H×W pixels, p patch side, (Hg, Wg) patch grid,
P = Hg·Wg patches, N = cls + P tokens, E model width, K classes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import FastRPEError, check_same_dtype
from ..data.images import patchify
from ..positions.grid import FastRPB2D, Table2D
from .block import Block, init_weights, layer_seed, sinusoidal
from .config import ConfigMixin

#: values of `ViTConfig.position`
VIT_POSITIONS = ("none", "learned_abs", "sinusoidal2d", "table2d")


@dataclass
class ViTConfig(ConfigMixin):
    """Vision Transformer.

    `image_size`: `(H, W)` or one int for square images; each side must be a multiple of
    `patch_size`. `position`: "none", "learned_abs" (a learned embedding per patch),
    "sinusoidal2d" (half the width encodes the row, half the column) or "table2d" (a
    learned `b_h(Δrow, Δcol)` per layer: added to softmax scores, a factor `exp(b)` for
    kernelized attention). `fastrpb2d` adds FastRPB's 2D term to every layer (combines with
    any `position`). `cls_token`: classify from a class token, else mean-pool the patches.
    """

    image_size: tuple[int, int] | int = (28, 28)
    patch_size: int = 4
    channels: int = 1
    num_classes: int = 10
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.0
    kernel: str = "softmax"
    position: str = "table2d"
    fastrpb2d: bool = False
    cls_token: bool = True
    backend: str = "auto"
    feature_seed: int = 0  # layer l draws its random features from layer_seed(feature_seed, "layer", l)

    @property
    def image_hw(self) -> tuple[int, int]:
        """`image_size` as `(H, W)`."""
        s = self.image_size
        return (s, s) if isinstance(s, int) else (int(s[0]), int(s[1]))

    @property
    def grid(self) -> tuple[int, int]:
        """`(Hg, Wg)`: the patch grid."""
        H, W = self.image_hw
        return H // self.patch_size, W // self.patch_size

    def validate(self) -> None:
        name = type(self).__name__
        s = self.image_size
        pair = (s, s) if isinstance(s, int) and not isinstance(s, bool) else s
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in pair)):
            raise ValueError(f"{name}: field 'image_size' must be a positive int or a pair (H, W) of them, got {s!r}")
        if isinstance(s, list):  # from JSON
            self.image_size = tuple(s)
        super().validate()
        for f in ("patch_size", "channels", "num_classes", "n_layers", "ff_mult"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{name}: field {f!r} must be positive, got {getattr(self, f)}")
        H, W = self.image_hw
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"{name}: field 'image_size' ({H}×{W}) must be divisible by "
                             f"field 'patch_size' ({self.patch_size})")
        if self.position not in VIT_POSITIONS:
            raise ValueError(f"{name}: field 'position' must be one of {', '.join(VIT_POSITIONS)}, "
                             f"got {self.position!r}")
        for f in ("fastrpb2d", "cls_token"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{name}: field {f!r} must be a bool, got {getattr(self, f)!r}")
        if not isinstance(self.kernel, str):
            raise ValueError(f"{name}: field 'kernel' must be a kernel name, got {self.kernel!r}")
        from ..kernels import get_kernel

        try:
            get_kernel(self.kernel, head_dim=self.d_model // self.n_heads)
        except ValueError as e:
            raise ValueError(f"{name}: field 'kernel': {e}") from None


def sinusoidal_2d(grid: tuple[int, int], dim: int) -> Tensor:
    """Absolute 2D sinusoidal encoding of a row-major grid: `[Hg·Wg, dim]`, the first
    `dim // 2` channels encode the row, the rest the column."""
    Hg, Wg = grid
    p = torch.arange(Hg * Wg)
    half = dim // 2
    return torch.cat([sinusoidal(p // Wg, half), sinusoidal(p % Wg, dim - half)], dim=-1)


class VisionTransformer(nn.Module):
    """ViT classifier: patch embedding, optional class token, pre-norm blocks whose
    attention carries the configured 2D terms, final LayerNorm, linear head.

    Args:
        cfg: a `ViTConfig` (validated here).
    """

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        E, p = cfg.d_model, cfg.patch_size
        self.grid = cfg.grid
        P = self.grid[0] * self.grid[1]
        self.patch_embed = nn.Linear(cfg.channels * p * p, E)
        self.cls = nn.Parameter(torch.zeros(1, 1, E)) if cfg.cls_token else None
        if cfg.position == "learned_abs":
            self.pos_embed = nn.Parameter(torch.zeros(1, P, E))
        elif cfg.position == "sinusoidal2d":
            self.register_buffer("pos_embed", sinusoidal_2d(self.grid, E)[None], persistent=False)
        else:
            self.pos_embed = None
        self.blocks = nn.ModuleList(
            Block(E, cfg.n_heads, kernel=cfg.kernel, position="none", causal=False, cross=False,
                  dropout=cfg.dropout, ff_mult=cfg.ff_mult, backend=cfg.backend, max_len=P + 1,
                  seed=layer_seed(cfg.feature_seed, "layer", i))
            for i in range(cfg.n_layers)
        )
        for blk in self.blocks:
            if cfg.position == "table2d":
                blk.attn.positions.append(Table2D(cfg.n_heads, self.grid, cls_token=cfg.cls_token))
            if cfg.fastrpb2d:
                blk.attn.positions.append(FastRPB2D(cfg.n_heads, self.grid, cls_token=cfg.cls_token))
        self.ln_f = nn.LayerNorm(E)
        self.head = nn.Linear(E, cfg.num_classes)
        init_weights(self)
        for prm in (self.cls, self.pos_embed if cfg.position == "learned_abs" else None):
            if prm is not None:
                nn.init.normal_(prm, std=0.02)

    def embed(self, images: Tensor) -> Tensor:
        """`images: [B, C, H, W]` -> tokens `[B, N, E]` (class token first when configured)."""
        if not isinstance(images, Tensor):
            raise FastRPEError(f"VisionTransformer: images must be a torch.Tensor, got {type(images).__name__}")
        if images.dim() != 4 or tuple(images.shape[1:]) != (self.cfg.channels, *self.cfg.image_hw):
            raise FastRPEError(f"VisionTransformer: expected images [B, {self.cfg.channels}, "
                               f"{self.cfg.image_hw[0]}, {self.cfg.image_hw[1]}], got {list(images.shape)}")
        if not images.is_floating_point():
            raise FastRPEError(f"VisionTransformer: images must be floating point (e.g. uint8 pixels / 255), "
                               f"got dtype {images.dtype}")
        check_same_dtype(images, self.patch_embed.weight, "images", "VisionTransformer")
        x = self.patch_embed(patchify(images, self.cfg.patch_size).patches)  # (B, P, E)
        if self.pos_embed is not None:
            x = x + self.pos_embed.to(x.dtype)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, N, E)
        return x

    def forward_tokens(self, x: Tensor) -> Tensor:
        """Blocks, LayerNorm, pooling and head on tokens `[B, N, E]` -> logits `[B, K]`
        (mean over all tokens without a class token)."""
        N = self.grid[0] * self.grid[1] + (self.cls is not None)
        if not isinstance(x, Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (N, self.cfg.d_model):
            raise FastRPEError(f"VisionTransformer.forward_tokens: expected tokens [B, {N}, {self.cfg.d_model}], "
                               f"got {list(getattr(x, 'shape', [type(x).__name__]))}")
        for blk in self.blocks:
            x = blk(x)
        x = self.ln_f(x)
        pooled = x[:, 0] if self.cls is not None else x.mean(1)  # (B, E)
        return self.head(pooled)

    def forward(self, images: Tensor) -> Tensor:
        """`images: [B, C, H, W]` -> logits `[B, K]`."""
        return self.forward_tokens(self.embed(images))
