"""ListOps: nested list operations on digits, classified by their value (10 classes).

Nangia & Bowman, *ListOps: A Diagnostic Dataset for Latent Tree Learning* (2018), as
generated for Long Range Arena (Tay et al., *Long Range Arena*, 2021): operators MAX, MIN,
MED (median, rounded down) and SM (sum modulo 10) over digits 0-9, e.g.

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->  5

LRA's generator, reproduced here: a node below `max_depth` is an operator with probability
`operator_p` (0.25) and a digit otherwise; an operator takes 2..`max_args` (10) arguments;
trees whose token count is strictly between `min_length` (500) and `max_length` (2000) are
kept, the rest redrawn. Sample `i` of a split is drawn from its own generator, seeded by
`(seed, split, i)`, so a data set is deterministic, needs no storage, and any sample can be
made alone (also inside DataLoader workers). Splits use different seeds; a repeat across
splits has negligible probability at LRA's lengths (not at tiny ones).

Tokens (LRA drops its parentheses; so does this): `pad = 0`, digits `0..9` -> `1..10`,
`[MAX [MIN [MED [SM` -> `11..14`, `]` -> `15`; `VOCAB[id]` is the token's text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

OPERATORS = ("MAX", "MIN", "MED", "SM")
VOCAB = ["<pad>", *map(str, range(10)), *(f"[{op}" for op in OPERATORS), "]"]
PAD_ID, CLOSE_ID = 0, len(VOCAB) - 1
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
VOCAB_SIZE, NUM_CLASSES = len(VOCAB), 10
LRA_SIZES = {"train": 96_000, "validation": 2_000, "test": 2_000}

Tree = int | tuple[str, list["Tree"]]  # a digit, or (operator, arguments)


@dataclass(frozen=True)
class ListOpsConfig:
    """Generator settings; the defaults are LRA's."""

    min_length: int = 500  # kept trees have min_length < tokens < max_length (LRA's strict bounds)
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    operator_p: float = 0.25  # LRA's VALUE_P: chance that a node above max_depth is an operator
    operators: tuple[str, ...] = OPERATORS

    def __post_init__(self):
        if not set(self.operators) <= set(OPERATORS) or not self.operators:
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {self.operators}")
        if self.max_args < 2 or self.max_depth < 2 or not 0 < self.operator_p <= 1:
            raise ValueError("need max_args >= 2, max_depth >= 2, 0 < operator_p <= 1")
        if self.max_length - self.min_length < 2:
            raise ValueError(f"no length lies strictly between {self.min_length} and {self.max_length}")


class _TooLong(Exception):
    pass


def _grow(rng: random.Random, depth: int, cfg: ListOpsConfig, budget: list[int]) -> Tree:
    # Same draws, in the same order, as LRA's generate_tree; aborts as soon as the tree
    # reaches max_length tokens (it would be rejected anyway).
    r = rng.random() if depth < cfg.max_depth else 1.0
    if r > cfg.operator_p:
        budget[0] -= 1
        if budget[0] <= 0:
            raise _TooLong
        return rng.choice(range(10))
    budget[0] -= 2  # the operator token and its closing bracket
    n = rng.randint(2, cfg.max_args)
    args = [_grow(rng, depth + 1, cfg, budget) for _ in range(n)]
    return (rng.choice(cfg.operators), args)


def generate_tree(rng: random.Random, cfg: ListOpsConfig = ListOpsConfig(), max_tries: int = 1_000_000) -> Tree:
    """A random tree whose token count lies strictly between `cfg.min_length` and `cfg.max_length`."""
    for _ in range(max_tries):
        budget = [cfg.max_length]
        try:
            tree = _grow(rng, 1, cfg, budget)
        except _TooLong:
            continue
        if cfg.max_length - budget[0] > cfg.min_length:
            return tree
    raise RuntimeError(f"no tree of length in ({cfg.min_length}, {cfg.max_length}) after {max_tries} tries: {cfg}")


def evaluate(tree: Tree) -> int:
    """The value of a tree: MAX, MIN, MED = int(median), SM = sum % 10 (as LRA's to_value)."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = sorted(evaluate(a) for a in args)
    if op == "MAX":
        return vals[-1]
    if op == "MIN":
        return vals[0]
    if op == "MED":
        n = len(vals)
        return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) // 2
    return sum(vals) % 10  # SM


def tokens(tree: Tree) -> list[str]:
    """Prefix token list, e.g. `['[MAX', '2', '9', ']']`."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [f"[{op}", *(t for a in args for t in tokens(a)), "]"]


def encode(toks: list[str]) -> Tensor:
    return torch.tensor([TOKEN_ID[t] for t in toks], dtype=torch.long)


def decode(ids: Tensor) -> str:
    return " ".join(VOCAB[int(i)] for i in ids if int(i) != PAD_ID)


class ListOpsBatch(NamedTuple):
    tokens: Tensor  # [B, L] int64, padded with PAD_ID
    labels: Tensor  # [B] int64 in 0..9
    lengths: Tensor  # [B] int64, tokens before the padding

    @property
    def padding_mask(self) -> Tensor:
        """`[B, L]` bool, True = padding (the convention of `fastrpe.nn`)."""
        return torch.arange(self.tokens.shape[1])[None, :] >= self.lengths[:, None]


def collate(items: list[tuple[Tensor, int, int]], pad_to_multiple: int = 1) -> ListOpsBatch:
    """Pad `(tokens, label, length)` items to the longest (rounded up to a multiple)."""
    L = max(n for _, _, n in items)
    L = -(-L // pad_to_multiple) * pad_to_multiple
    out = torch.full((len(items), L), PAD_ID, dtype=torch.long)
    for b, (t, _, n) in enumerate(items):
        out[b, :n] = t
    return ListOpsBatch(out, torch.tensor([y for _, y, _ in items]), torch.tensor([n for _, _, n in items]))


class ListOpsDataset(Dataset):
    """ListOps samples `(tokens [n] int64, label int, length int)`; `collate` pads a batch.

    Args:
        split: `"train"`, `"validation"` or `"test"`.
        num_samples: default LRA's 96,000 / 2,000 / 2,000.
        seed: changes every sample of every split.
        config: a `ListOpsConfig` (LRA's settings by default; e.g.
            `ListOpsConfig(min_length=20, max_length=100, max_depth=4)` for a quick run).
        memoize: keep generated samples in memory (a sample takes ~1 ms to generate at
            LRA's lengths).
    """

    vocab_size, num_classes, pad_id = VOCAB_SIZE, NUM_CLASSES, PAD_ID

    def __init__(self, split: str = "train", num_samples: int | None = None, seed: int = 0,
                 config: ListOpsConfig | None = None, *, memoize: bool = True, **config_kw):
        if split not in LRA_SIZES:
            raise ValueError(f"split must be one of {list(LRA_SIZES)}, got {split!r}")
        if config is not None and config_kw:
            raise ValueError(f"give either config or its fields, not both: {sorted(config_kw)}")
        self.split, self.seed = split, seed
        self.config = config or ListOpsConfig(**config_kw)
        self.num_samples = LRA_SIZES[split] if num_samples is None else num_samples
        self._memo: dict[int, tuple[Tensor, int]] | None = {} if memoize else None

    def __len__(self) -> int:
        return self.num_samples

    def tree(self, i: int) -> Tree:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        return generate_tree(random.Random(f"listops|{self.seed}|{self.split}|{i}"), self.config)

    def expression(self, i: int) -> str:
        """Sample `i` as text, e.g. `"[MAX 2 9 [MIN 4 7 ] 0 ]"`."""
        return " ".join(tokens(self.tree(i)))

    def __getitem__(self, i: int) -> tuple[Tensor, int, int]:
        if self._memo is not None and i in self._memo:
            t, y = self._memo[i]
        else:
            tree = self.tree(i)
            t, y = encode(tokens(tree)).to(torch.uint8), evaluate(tree)
            if self._memo is not None:
                self._memo[i] = (t, y)
        return t.long(), y, t.numel()

    collate = staticmethod(collate)

    def loader(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, **kw) -> DataLoader:
        """A DataLoader of padded `ListOpsBatch`es (shuffled by a generator seeded with `seed`)."""
        g = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(self, batch_size=batch_size, shuffle=shuffle, generator=g, collate_fn=collate, **kw)
