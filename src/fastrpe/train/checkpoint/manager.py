"""A directory of checkpoints: `step-XXXXXXXX.safetensors` files and a `latest` pointer."""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from ..._io import atomic_write
from .format import Checkpoint, CheckpointError
from .save import save_checkpoint
from .verify import read_checkpoint


class CheckpointManager:
    """`directory/step-00000100.safetensors`, ..., and `directory/latest` naming the newest.

    `save` writes the checkpoint atomically, then the `latest` pointer atomically, then
    deletes all but the newest `keep_last` checkpoints. A crash at any point leaves `latest`
    naming a complete file; a file damaged later (a bad disk, a copy cut short) is skipped
    by `latest()` for the previous one that verifies, with a warning.
    """

    _NAME = re.compile(r"^step-(\d{8,})\.safetensors$")

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.safetensors"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        out = []
        for p in self.directory.iterdir():
            m = self._NAME.match(p.name)
            if m and p.is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def _candidates(self) -> list[Path]:
        """Newest first: the file `latest` names (or the highest step without a pointer), then
        every older checkpoint. A pointer that names anything but a checkpoint file of this
        directory is refused (no paths out of it)."""
        found = self.checkpoints()
        pointer = self.directory / "latest"
        if not pointer.is_file():
            return [p for _, p in reversed(found)]
        name = pointer.read_text().strip()
        m = self._NAME.match(name)
        if not m:  # a bare file name only
            raise CheckpointError(f"{pointer}: does not name a checkpoint file: {name!r}")
        newest = int(m.group(1))
        older = [p for s, p in reversed(found) if s < newest]
        target = self.directory / name
        if not target.is_file():
            if not older:
                raise CheckpointError(f"{pointer}: names {name}, which does not exist")
            warnings.warn(f"{pointer}: names {name}, which does not exist; falling back to {older[0].name}",
                          stacklevel=3)
            return older
        return [target, *older]

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, read into memory (None when there is none).

        A newest file that fails verification is skipped for the previous one, with a
        warning naming both; when none verifies, the newest one's `CheckpointError` is raised
        (a run never silently starts over)."""
        candidates = self._candidates()
        first_error: CheckpointError | None = None
        for i, path in enumerate(candidates):
            try:
                return read_checkpoint(path)
            except CheckpointError as e:
                first_error = first_error or e
                if i + 1 < len(candidates):
                    warnings.warn(f"{e}; falling back to the previous checkpoint {candidates[i + 1].name}",
                                  stacklevel=2)
        if first_error is not None:
            raise first_error
        return None

    def latest(self) -> Path | None:
        """The path of `latest_checkpoint()` (verified; None when the directory has none)."""
        ckpt = self.latest_checkpoint()
        return None if ckpt is None else ckpt.path

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **kw) -> Path:
        """`save_checkpoint` to `path_for(step)`, then update `latest` and prune."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = save_checkpoint(self.path_for(step), model, optimizer, step=step, **kw)
        atomic_write(self.directory / "latest", (path.name + "\n").encode())
        for _, old in self.checkpoints()[: -self.keep_last]:
            if old != path:
                old.unlink(missing_ok=True)
        for pattern in (".step-*.tmp", ".latest.*.tmp"):  # left by a writer killed mid-write
            for tmp in self.directory.glob(pattern):
                tmp.unlink(missing_ok=True)
        return path
