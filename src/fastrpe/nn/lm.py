"""Causal decoder language model.

Notation: B batch, L length, V vocabulary, E width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import FastRPEError, check_tokens
from .attention import KVCache, global_offset, group_size
from .block import ABSOLUTE, POSITION_NAMES, Block, init_weights, layer_seed, sinusoidal
from .config import ConfigMixin


@dataclass
class LMConfig(ConfigMixin):
    """Decoder LM. `position`: "none", "sinusoidal", "rotary", "shaw" or a `fastrpe.positions`
    family name. `num_features`: random projections of a random feature map (None: the
    kernel's default). `feature_seed`: layer l draws its random features from
    `layer_seed(feature_seed, "layer", l)`."""

    vocab_size: int = 259
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 4
    dropout: float = 0.0
    kernel: str = "softmax"
    position: str = "kerple_log"
    backend: str = "auto"
    max_len: int = 4096
    num_features: int | None = None
    feature_seed: int = 0

    def validate(self) -> None:
        super().validate()
        if self.position not in POSITION_NAMES:  # checked when made, not when the model is built
            raise FastRPEError(f"LMConfig: field 'position': unknown name {self.position!r}; known: "
                               f"{', '.join(POSITION_NAMES)}")


def _upcast(x: Tensor) -> Tensor:
    """At least float32 for the loss (bf16/fp16 logits are upcast; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def sequence_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """`(start, end)` of slice `index` when `length` positions are cut into `parts` contiguous
    slices in order, the first `length % parts` of them one position longer."""
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


class DecoderLM(nn.Module):
    """A GPT-style causal LM whose attention is `fastrpe.nn.MultiheadAttention`.

    `group`: a `torch.distributed` process group for context parallelism (None: off). With
    N > 1 ranks, `forward` takes this rank's contiguous slice of the sequence and returns its
    logits, and `loss` takes the whole windows and computes this rank's slice of them
    (`sequence_bounds`); attention runs across the group, everything else locally."""

    def __init__(self, cfg: LMConfig, group=None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, kernel=cfg.kernel, position=cfg.position, causal=True, cross=False,
                  dropout=cfg.dropout, ff_mult=cfg.ff_mult, backend=cfg.backend, max_len=cfg.max_len,
                  num_features=cfg.num_features, seed=layer_seed(cfg.feature_seed, "layer", i))
            for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        init_weights(self)
        self.group = group

    @property
    def group(self):
        """The context-parallel process group of every attention layer (None: off)."""
        return self._group

    @group.setter
    def group(self, group) -> None:
        self._cp = group_size(group)
        self._group = group
        for blk in self.blocks:
            blk.attn.group = group

    def _embed(self, tokens: Tensor, offset: int) -> Tensor:
        x = self.embed(tokens)  # (B, L, E)
        if self.cfg.position in ABSOLUTE:
            pos = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
            x = x + sinusoidal(pos, self.cfg.d_model).to(x.dtype)
        return x

    def forward(self, tokens: Tensor) -> Tensor:
        """`tokens: [B, L]` -> logits `[B, L, V]` (with a group: this rank's slice of the sequence
        and its logits; the ranks' slices may differ in length)."""
        check_tokens(tokens, self.cfg.vocab_size, "tokens", "DecoderLM")
        offset = 0
        if self._cp > 1 and self.cfg.position in ABSOLUTE:
            offset = global_offset(tokens.shape[1], self.group, tokens.device)
        return self._logits(tokens, offset)

    def _logits(self, tokens: Tensor, offset: int) -> Tensor:
        x = self._embed(tokens, offset)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: Tensor, reduction: str = "mean") -> Tensor:
        """Next-token cross-entropy on `tokens: [B, L+1]` (inputs `[:, :-1]`, targets `[:, 1:]`).

        With a context-parallel group, every rank passes the same whole windows; rank r
        computes the logits of its slice `[s, e)` of the L inputs (`tokens[:, s:e+1]`: the
        target of its last input included). The value returned on every rank is the loss of
        the whole windows ("mean" over all B·L targets, or "sum"); its gradient is this
        rank's part, so summing parameter gradients over the group gives the gradient of the
        whole loss (what `fastrpe.train` does)."""
        check_tokens(tokens, self.cfg.vocab_size, "tokens", "DecoderLM.loss")
        if self._cp == 1:
            logits = self(tokens[:, :-1])
            return nn.functional.cross_entropy(_upcast(logits.flatten(0, 1)), tokens[:, 1:].flatten(),
                                               reduction=reduction)
        import torch.distributed as dist

        if reduction not in ("mean", "sum"):
            raise FastRPEError(f"DecoderLM.loss: reduction must be 'mean' or 'sum' with a context-parallel group "
                               f"(each rank holds a slice of the targets), got {reduction!r}")
        B, L = tokens.shape[0], tokens.shape[1] - 1
        if L < self._cp:
            raise FastRPEError(f"DecoderLM.loss: tokens has {L} targets per row, fewer than the {self._cp} "
                               "context-parallel ranks")
        s, e = sequence_bounds(L, self._cp, dist.get_rank(self.group))
        logits = self._logits(tokens[:, s:e], s)  # (B, e - s, V)
        part = nn.functional.cross_entropy(_upcast(logits.flatten(0, 1)), tokens[:, s + 1:e + 1].flatten(),
                                           reduction="sum")
        total = part.detach().clone()
        dist.all_reduce(total, group=self.group)
        if reduction == "mean":
            part, total = part / (B * L), total / (B * L)
        return total + (part - part.detach())  # the value of the whole loss, the gradient of this rank's part

    def step(self, tokens: Tensor, caches: list[KVCache] | None = None) -> tuple[Tensor, list[KVCache]]:
        """Decode: `tokens: [B, L]` new tokens -> logits `[B, L, V]` and the extended caches."""
        check_tokens(tokens, self.cfg.vocab_size, "tokens", "DecoderLM.step")
        if self._cp > 1:
            raise FastRPEError("DecoderLM.step: decoding is not context-parallel; set model.group = None to decode")
        caches = caches or [KVCache() for _ in self.blocks]
        x = self._embed(tokens, caches[0].length)
        new = []
        for blk, c in zip(self.blocks, caches):
            x, c = blk(x, cache=c)
            new.append(c)
        return self.head(self.ln_f(x)), new

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Continue `prompt: [B, P]` by `max_new_tokens` through the decode API.
        `temperature=0` is greedy; otherwise sample (optionally from the top_k)."""
        logits, caches = self.step(prompt)
        out = [prompt]
        for i in range(max_new_tokens):
            nxt = sample(logits[:, -1], temperature, top_k, generator)  # (B, 1)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits, caches = self.step(nxt, caches)
        return torch.cat(out, dim=1)


def sample(logits: Tensor, temperature: float, top_k: int | None, generator) -> Tensor:
    """`logits: [B, V]` -> next token `[B, 1]`."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
