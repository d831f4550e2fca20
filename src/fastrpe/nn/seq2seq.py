"""Encoder-decoder Transformer (self, causal self and cross attention, RPE in all three),
as in Scaleformer's and Luo et al.'s machine-translation settings.

Notation: B batch, S source length, T target length, E width, V vocabulary, K beams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import check_tokens
from .attention import KVCache
from .block import ABSOLUTE, Block, init_weights, layer_seed, sinusoidal
from .config import ConfigMixin
from .lm import sample


@dataclass
class Seq2SeqConfig(ConfigMixin):
    """Encoder-decoder. `kernel`/`num_features` are the defaults of all three attentions;
    `enc_kernel`, `dec_kernel` (decoder self-attention) and `cross_kernel`, with their
    `*_num_features`, override them one by one (None: the default), e.g. Luo et al.'s
    Table 3: `enc_kernel="softmax", dec_kernel="prf", cross_kernel="prf"`. `position` and
    `cross_position`: as `LMConfig.position` ("shaw" included). `feature_seed`: each layer
    and attention draws its own random features from it (see `fastrpe.nn.block.layer_seed`)."""

    vocab_size: int = 32
    d_model: int = 64
    n_enc_layers: int = 2
    n_dec_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 2
    dropout: float = 0.0
    kernel: str = "softmax"
    position: str = "kerple_log"
    cross_position: str = "kerple_log"
    backend: str = "auto"
    max_len: int = 1024
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    num_features: int | None = None
    enc_kernel: str | None = None
    dec_kernel: str | None = None
    cross_kernel: str | None = None
    enc_num_features: int | None = None
    dec_num_features: int | None = None
    cross_num_features: int | None = None
    feature_seed: int = 0

    def kernels(self) -> dict[str, tuple[str, int | None]]:
        """`{"enc" | "dec" | "cross": (kernel, num_features)}` after the defaults."""
        def pick(k, f):
            return (self.kernel if k is None else k, self.num_features if f is None else f)

        return {"enc": pick(self.enc_kernel, self.enc_num_features), "dec": pick(self.dec_kernel, self.dec_num_features),
                "cross": pick(self.cross_kernel, self.cross_num_features)}


class Seq2Seq(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        kern = cfg.kernels()
        common = dict(dropout=cfg.dropout, ff_mult=cfg.ff_mult, backend=cfg.backend, max_len=cfg.max_len)
        self.encoder = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, kernel=kern["enc"][0], num_features=kern["enc"][1], position=cfg.position,
                  causal=False, cross=False, seed=layer_seed(cfg.feature_seed, "enc", i), **common)
            for i in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, kernel=kern["dec"][0], num_features=kern["dec"][1], position=cfg.position,
                  causal=True, cross=True, cross_position=cfg.cross_position, cross_kernel=kern["cross"][0],
                  cross_num_features=kern["cross"][1], seed=layer_seed(cfg.feature_seed, "dec", i), **common)
            for i in range(cfg.n_dec_layers))
        self.ln_e, self.ln_d = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.embed.weight
        init_weights(self)

    def _embed(self, tokens: Tensor, offset: int = 0) -> Tensor:
        x = self.embed(tokens)
        if self.cfg.position in ABSOLUTE:
            pos = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
            x = x + sinusoidal(pos, self.cfg.d_model).to(x.dtype)
        return x

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor | None]:
        """`src: [B, S]` -> memory `[B, S, E]` and its padding mask `[B, S]` (None if no padding)."""
        check_tokens(src, self.cfg.vocab_size, "src", "Seq2Seq")
        mask = src == self.cfg.pad_id
        mask = mask if bool(mask.any()) else None
        x = self._embed(src)
        for blk in self.encoder:
            x = blk(x, padding_mask=mask)
        return self.ln_e(x), mask

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_mask: Tensor | None) -> Tensor:
        """Teacher forcing: `tgt_in: [B, T]` -> logits `[B, T, V]`."""
        check_tokens(tgt_in, self.cfg.vocab_size, "tgt_in", "Seq2Seq")
        x = self._embed(tgt_in)
        for blk in self.decoder:
            x = blk(x, memory=memory, memory_mask=memory_mask)
        return self.head(self.ln_d(x))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, mask = self.encode(src)
        return self.decode(tgt_in, memory, mask)

    def loss(self, src: Tensor, tgt: Tensor) -> Tensor:
        """`tgt: [B, T+1]` starting with BOS; padding targets are ignored."""
        check_tokens(tgt, self.cfg.vocab_size, "tgt", "Seq2Seq.loss")
        logits = self(src, tgt[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt[:, 1:].flatten(), ignore_index=self.cfg.pad_id)

    def step(self, tokens: Tensor, memory: Tensor, memory_mask: Tensor | None, caches: list[KVCache] | None):
        """Decode `tokens: [B, L]` (new target tokens) -> logits `[B, L, V]`, extended caches."""
        check_tokens(tokens, self.cfg.vocab_size, "tokens", "Seq2Seq.step")
        caches = caches or [KVCache() for _ in self.decoder]
        off = caches[0].length
        x = self._embed(tokens, off)
        new = []
        for blk, c in zip(self.decoder, caches):
            x, c = blk(x, memory=memory, memory_mask=memory_mask, cache=c, q_offset=off)
            new.append(c)
        return self.head(self.ln_d(x)), new

    @torch.no_grad()
    def generate(self, src: Tensor, max_len: int, *, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """Greedy (temperature 0) or sampled decoding -> `[B, <=max_len+1]` starting with BOS."""
        memory, mask = self.encode(src)
        B = src.shape[0]
        out = torch.full((B, 1), self.cfg.bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        logits, caches = self.step(out, memory, mask, None)
        for _ in range(max_len):
            nxt = sample(logits[:, -1], temperature, top_k, generator)
            nxt = nxt.masked_fill(done[:, None], self.cfg.pad_id)
            out = torch.cat([out, nxt], 1)
            done |= nxt[:, 0] == self.cfg.eos_id
            if bool(done.all()):
                break
            logits, caches = self.step(nxt, memory, mask, caches)
        return out

    @torch.no_grad()
    def beam_search(self, src: Tensor, max_len: int, beam_size: int = 4, length_penalty: float = 1.0) -> Tensor:
        """Beam search with the decode API; returns the best hypothesis per input, `[B, <=max_len+1]`."""
        cfg = self.cfg
        B, K = src.shape[0], beam_size
        memory, mask = self.encode(src)
        memory = memory.repeat_interleave(K, 0)  # (B*K, S, E)
        mask = None if mask is None else mask.repeat_interleave(K, 0)
        seqs = torch.full((B * K, 1), cfg.bos_id, dtype=torch.long, device=src.device)
        scores = torch.zeros(B, K, device=src.device)
        scores[:, 1:] = float("-inf")  # start from one live beam per input
        finished = torch.zeros(B * K, dtype=torch.bool, device=src.device)
        logits, caches = self.step(seqs, memory, mask, None)
        for _ in range(max_len):
            logp = logits[:, -1].float().log_softmax(-1)  # (B*K, V)
            V = logp.shape[-1]
            # a finished beam only extends with PAD at no cost
            pad_row = torch.full_like(logp, float("-inf"))
            pad_row[:, cfg.pad_id] = 0.0
            logp = torch.where(finished[:, None], pad_row, logp)
            cand = (scores.view(B * K, 1) + logp).view(B, K * V)
            top, idx = cand.topk(K, dim=-1)  # (B, K)
            beam = idx // V + torch.arange(B, device=src.device)[:, None] * K
            tok = (idx % V).view(B * K, 1)
            beam = beam.view(-1)
            seqs = torch.cat([seqs[beam], tok], 1)
            finished = finished[beam] | (tok[:, 0] == cfg.eos_id) | (tok[:, 0] == cfg.pad_id)
            scores = top
            caches = [c.select(beam) for c in caches]
            if bool(finished.all()):
                break
            logits, caches = self.step(tok, memory, mask, caches)
        lengths = (seqs != cfg.pad_id).sum(1).float().view(B, K)
        best = (scores / lengths ** length_penalty).argmax(-1)
        return seqs.view(B, K, -1)[torch.arange(B), best]
