"""Saving: a model, its optimizer, RNG states and the caller's JSON into one checkpoint file."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..._io import atomic_write
from .format import _CODES, MODEL, OPT_GROUP, OPT_STATE, RNG, encode_checkpoint
from .rng import RngState


def _jsonable(x: Any, where: str) -> Any:
    """`x` with tuples as lists; raises for anything JSON cannot hold."""
    if x is None or isinstance(x, (bool, int, str, float)):
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, where) for v in x]
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v, where) for k, v in x.items()}
    if isinstance(x, torch.dtype):
        return str(x)
    raise TypeError(f"save_checkpoint: {where} holds a {type(x).__name__}, which a JSON checkpoint cannot store")


def _cpu_tensor(t: Tensor, seen: set[int]) -> Tensor:
    """Detached contiguous CPU tensor; copied when its storage is already saved (tied weights)."""
    t = t.detach().cpu().contiguous()
    if t.dtype not in _CODES:
        raise TypeError(f"save_checkpoint: dtype {t.dtype} is not supported")
    if t.numel():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
    return t


def _optimizer_parts(optimizer: torch.optim.Optimizer, seen) -> tuple[dict, dict[str, Tensor]]:
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        jg = {}
        for key, val in group.items():
            if isinstance(val, Tensor):
                tensors[f"{OPT_GROUP}{g}/{key}"] = _cpu_tensor(val, seen)
            else:
                jg[key] = _jsonable(val, f"optimizer param group {g} {key!r}")
        groups.append(jg)
    scalars: dict[str, dict[str, Any]] = {}
    for i, st in sd["state"].items():
        scalars[str(i)] = {}
        for key, val in st.items():
            if "/" in key:
                raise TypeError(f"save_checkpoint: optimizer state name {key!r} contains '/'")
            if isinstance(val, Tensor):
                tensors[f"{OPT_STATE}{i}/{key}"] = _cpu_tensor(val, seen)
            else:
                scalars[str(i)][key] = _jsonable(val, f"optimizer state {i} {key!r}")
    meta = {"class": type(optimizer).__name__, "param_groups": groups, "state": scalars}
    return meta, tensors


def _rng_parts(states: list[RngState]) -> tuple[list[dict], dict[str, Tensor]]:
    metas, tensors = [], {}
    for r, s in enumerate(states):
        tensors[f"{RNG}{r}/torch_cpu"] = s.torch_cpu.detach().cpu().contiguous()
        for i, c in enumerate(s.cuda):
            tensors[f"{RNG}{r}/cuda/{i}"] = c.detach().cpu().contiguous()
        metas.append({"python": s.python, "numpy": s.numpy, "cuda_devices": len(s.cuda)})
    return metas, tensors


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, config: Any = None, schedule: Any = None, data: dict | None = None,
                    scaler: Any = None, rng: bool | list[RngState] = True, extra: dict | None = None) -> Path:
    """Write a checkpoint atomically and return its path.

    The file depends only on what is saved (no time stamp: its mtime says when), so two runs
    with the same seed and settings write byte-identical checkpoints.

    Args:
        path: file to write (conventionally `*.safetensors`).
        model: its `state_dict()` is saved (tied weights are stored once per name).
        optimizer: its state (tensors flattened, see the package docstring); None to skip.
        step: completed optimizer steps.
        config: a `TrainConfig` or a JSON-able dict, stored for reference.
        schedule: a `Schedule` (or dict), stored for reference.
        data: the data position (JSON); the training loop stores `{"step": step}`.
        scaler: a `torch.amp.GradScaler` whose state is stored.
        rng: True captures this process's RNG state; a list stores one state per rank; False none.
        extra: any JSON-able dict of the caller's.
    """
    seen: set = set()
    tensors = {MODEL + k: _cpu_tensor(v, seen) for k, v in model.state_dict().items()}
    meta: dict[str, Any] = {"step": int(step), "torch": torch.__version__}
    meta["config"] = _jsonable(config.to_dict() if hasattr(config, "to_dict") else config, "config")
    meta["schedule"] = _jsonable(schedule.to_dict() if hasattr(schedule, "to_dict") else schedule, "schedule")
    meta["data"] = _jsonable(data if data is not None else {"step": int(step)}, "data")
    meta["extra"] = _jsonable(extra or {}, "extra")
    meta["optimizer"] = None
    if optimizer is not None:
        meta["optimizer"], t = _optimizer_parts(optimizer, seen)
        tensors.update(t)
    meta["scaler"] = _jsonable(scaler.state_dict(), "scaler") if scaler is not None and scaler.is_enabled() else None
    states = [RngState.capture()] if rng is True else (list(rng) if rng else [])
    meta["rng"], t = _rng_parts(states)
    tensors.update(t)
    path = Path(path)
    atomic_write(path, encode_checkpoint(meta, tensors))
    return path
