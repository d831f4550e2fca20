"""Writing files so that a crash or a full disk never leaves half of one.

One `atomic_write` for the whole package (checkpoints, run records, the data cache).
"""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

_umask_lock = threading.Lock()


def current_umask() -> int:
    """The process umask (read from /proc where possible: `os.umask` can only be read by setting it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    A temporary file in the same directory is written and fsync'ed, given the mode a plain
    `open(path, "w")` would give (0666 minus the umask; `mkstemp` makes 0600), then
    `os.replace`d over `path`; the directory is fsync'ed so that the rename survives a crash.
    On any failure (a full disk, an interrupt) the temporary file is removed and `path` is
    untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename or a new file) where the OS supports it."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
