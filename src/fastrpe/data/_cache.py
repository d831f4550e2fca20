"""The on-disk cache shared by the data modules, and the messages for missing optional data.

Everything under `cache_dir()` is derived data (corpus bytes, converted arrays, trained
tokenizers) that can be deleted at any time; it is rebuilt from installed packages, never
downloaded.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """`$FASTRPE_CACHE`, or `~/.cache/fastrpe`; created on first use."""
    d = Path(os.environ.get("FASTRPE_CACHE") or Path.home() / ".cache" / "fastrpe")
    d.mkdir(parents=True, exist_ok=True)
    return d


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a concurrent reader sees the old file or the whole new
    one, never a prefix (a unique temporary name, then `os.replace`)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MissingDataError(RuntimeError):
    """An optional data set whose package is not installed. The message says how to install it."""

    def __init__(self, what: str, install: str, extra: str = ""):
        self.install = install
        super().__init__(f"{what} is not installed; install it with: {install}" + (f" ({extra})" if extra else ""))
