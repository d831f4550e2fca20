"""The on-disk cache shared by the data modules, and the messages for missing optional data.

Everything under `cache_dir()` is derived data (corpus bytes, converted arrays, trained
tokenizers) that can be deleted at any time; it is rebuilt from installed packages, never
downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path

from .._io import atomic_write  # noqa: F401  (one implementation: fsync'ed, umask-respecting)


def cache_dir() -> Path:
    """`$FASTRPE_CACHE`, or `~/.cache/fastrpe`; created on first use."""
    d = Path(os.environ.get("FASTRPE_CACHE") or Path.home() / ".cache" / "fastrpe")
    d.mkdir(parents=True, exist_ok=True)
    return d


class MissingDataError(RuntimeError):
    """An optional data set whose package is not installed. The message says how to install it."""

    def __init__(self, what: str, install: str, extra: str = ""):
        self.install = install
        super().__init__(f"{what} is not installed; install it with: {install}" + (f" ({extra})" if extra else ""))
