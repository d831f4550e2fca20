"""Synthetic sequence-to-sequence tasks for an encoder-decoder (`fastrpe.nn.Seq2Seq`).

A source is a random string of `num_symbols` symbols with a length drawn uniformly from
`min_len..max_len`; the target is a function of it:

| task | target |
|---|---|
| `copy` | the source |
| `reverse` | the source reversed |
| `sort` | the source sorted (ascending symbol id) |
| `shift` | every symbol moved `offset` places along the alphabet, modulo `num_symbols` (copy with offset) |

Ids follow `Seq2SeqConfig`: `pad = 0`, `bos = 1`, `eos = 2`, symbols `3 .. 3 + num_symbols - 1`
(`vocab_size = num_symbols + 3`). A batch holds `src [B, S]` (the symbols, padded) and
`tgt [B, T+1]` = `bos, target..., eos` padded — the layout `Seq2Seq.loss(src, tgt)` takes —
and their padding masks (True = padding). Sample `i` is drawn from a generator seeded by
`(seed, split, i)`: deterministic, and any sample can be made alone.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

PAD_ID, BOS_ID, EOS_ID, FIRST_SYMBOL = 0, 1, 2, 3
TASKS = ("copy", "reverse", "sort", "shift")


def target_of(task: str, src: Tensor, num_symbols: int, offset: int = 1) -> Tensor:
    """The target symbols (without bos/eos) for source symbols `src: [S]` (ids >= 3)."""
    if task == "copy":
        return src.clone()
    if task == "reverse":
        return src.flip(0)
    if task == "sort":
        return src.sort().values
    if task == "shift":
        return (src - FIRST_SYMBOL + offset) % num_symbols + FIRST_SYMBOL
    raise ValueError(f"task: unknown {task!r}; known: {', '.join(TASKS)}")


class Seq2SeqBatch(NamedTuple):
    src: Tensor  # [B, S] int64, padded with PAD_ID
    tgt: Tensor  # [B, T+1] int64: bos, target, eos, then PAD_ID
    src_padding_mask: Tensor  # [B, S] bool, True = padding
    tgt_padding_mask: Tensor  # [B, T+1] bool, True = padding


def collate(items: list[tuple[Tensor, Tensor]]) -> Seq2SeqBatch:
    """Pad `(src [S_b], tgt [T_b + 2])` pairs to the longest of the batch."""
    src = torch.nn.utils.rnn.pad_sequence([s for s, _ in items], batch_first=True, padding_value=PAD_ID)
    tgt = torch.nn.utils.rnn.pad_sequence([t for _, t in items], batch_first=True, padding_value=PAD_ID)
    return Seq2SeqBatch(src, tgt, src == PAD_ID, tgt == PAD_ID)


class Seq2SeqDataset(Dataset):
    """Items `(src [S] int64, tgt [T+2] int64)`; `collate` pads them into a `Seq2SeqBatch`.

    Args:
        task: one of `TASKS`.
        num_samples: number of samples in this split.
        min_len, max_len: source length range (inclusive). Train short and test long to
            measure length extrapolation (e.g. train 8..32, test 64..128).
        num_symbols: alphabet size.
        offset: the shift of task `shift`.
        split, seed: together they seed every sample.
    """

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    def __init__(self, task: str = "reverse", num_samples: int = 10_000, *, min_len: int = 8, max_len: int = 32,
                 num_symbols: int = 16, offset: int = 1, split: str = "train", seed: int = 0):
        if task not in TASKS:
            raise ValueError(f"task: unknown {task!r}; known: {', '.join(TASKS)}")
        if not 1 <= min_len <= max_len or num_symbols < 2:
            raise ValueError(f"need 1 <= min_len <= max_len and num_symbols >= 2, got {min_len}, {max_len}, {num_symbols}")
        self.task, self.num_samples, self.min_len, self.max_len = task, num_samples, min_len, max_len
        self.num_symbols, self.offset, self.split, self.seed = num_symbols, offset, split, seed
        self.vocab_size = num_symbols + FIRST_SYMBOL
        digest = hashlib.sha256(f"seq2seq|{task}|{split}|{seed}".encode()).digest()
        self._base = int.from_bytes(digest[:7], "little")  # per-split seed; sample i adds i

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self._base + i)
        n = int(torch.randint(self.min_len, self.max_len + 1, (), generator=g))
        src = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + self.num_symbols, (n,), generator=g)
        tgt = target_of(self.task, src, self.num_symbols, self.offset)
        return src, torch.cat([torch.tensor([BOS_ID]), tgt, torch.tensor([EOS_ID])])

    collate = staticmethod(collate)

    def loader(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, **kw) -> DataLoader:
        """A DataLoader of padded `Seq2SeqBatch`es (shuffled by a generator seeded with `seed`)."""
        g = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(self, batch_size=batch_size, shuffle=shuffle, generator=g, collate_fn=collate, **kw)
