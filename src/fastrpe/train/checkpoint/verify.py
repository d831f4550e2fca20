"""Reading and loading: every check passes before anything is copied into a model or optimizer."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .format import Checkpoint, CheckpointError, decode_checkpoint


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read and verify a checkpoint file without loading it into anything."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from None
    ckpt = decode_checkpoint(data, str(path))
    ckpt.path = path
    return ckpt


def _check_model(ckpt: Checkpoint, model: nn.Module, where: str) -> dict[str, Tensor]:
    saved = ckpt.model_state()
    expected = model.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s), e.g. {unexpected[:3]}")
        raise CheckpointError(f"{where}: model keys do not match: {'; '.join(parts)}")
    for k, t in expected.items():
        if tuple(saved[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: model tensor {k!r} has shape {tuple(saved[k].shape)} in the "
                                  f"checkpoint, {tuple(t.shape)} in the model")
        if saved[k].is_floating_point() != t.is_floating_point():
            raise CheckpointError(f"{where}: model tensor {k!r} is {saved[k].dtype} in the checkpoint, "
                                  f"{t.dtype} in the model")
    return saved


_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum")


def _check_optimizer(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, where: str) -> dict:
    om = ckpt.meta.get("optimizer")
    if om is None:
        raise CheckpointError(f"{where}: the checkpoint holds no optimizer state")
    if om.get("class") != type(optimizer).__name__:
        raise CheckpointError(f"{where}: optimizer is {om.get('class')} in the checkpoint, "
                              f"{type(optimizer).__name__} here")
    try:
        sd = ckpt.optimizer_state()
    except (KeyError, ValueError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{where}: optimizer metadata is malformed ({e!r})") from None
    groups = optimizer.param_groups
    if len(sd["param_groups"]) != len(groups):
        raise CheckpointError(f"{where}: optimizer has {len(groups)} param group(s), the checkpoint "
                              f"{len(sd['param_groups'])}")
    params: dict[int, Tensor] = {}
    for g, (saved, group) in enumerate(zip(sd["param_groups"], groups)):
        ids = saved.get("params")
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            raise CheckpointError(f"{where}: param group {g} has {len(group['params'])} parameters here, "
                                  f"{len(ids) if isinstance(ids, list) else '?'} in the checkpoint")
        params.update(zip(ids, group["params"]))
        for key, val in group.items():  # JSON turned tuples (betas) into lists
            if isinstance(val, tuple) and isinstance(saved.get(key), list):
                saved[key] = tuple(saved[key])
    for i, st in sd["state"].items():
        if i not in params:
            raise CheckpointError(f"{where}: optimizer state for unknown parameter index {i}")
        for key, val in st.items():
            if key in _PARAM_SHAPED and isinstance(val, Tensor) and tuple(val.shape) != tuple(params[i].shape):
                raise CheckpointError(f"{where}: optimizer state {key!r} of parameter {i} has shape "
                                      f"{tuple(val.shape)}, the parameter {tuple(params[i].shape)}")
    return sd


def load_checkpoint(path: str | os.PathLike | Checkpoint, model: nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
                    restore_rng: bool = False, rank: int = 0) -> Checkpoint:
    """Verify a checkpoint, then load it into `model` (and `optimizer`, `scaler`, RNG).

    Everything is read into memory and checked first (file integrity, model keys and shapes,
    optimizer groups and state shapes, RNG states); if any check fails, `CheckpointError` is
    raised and nothing has been modified.

    Args:
        path: a checkpoint file, or a `Checkpoint` from `read_checkpoint`.
        model: receives the model state (strict: same keys, same shapes).
        optimizer: receives the optimizer state, when given.
        scaler: a `GradScaler` that receives the saved loss scale, when given and saved.
        restore_rng: restore the RNG state saved for `rank` (torch, CUDA, random, numpy).
        rank: whose RNG state to restore (distributed runs save one per rank).

    Returns:
        The verified `Checkpoint` (its `step`, `meta`, `extra`).
    """
    ckpt = path if isinstance(path, Checkpoint) else read_checkpoint(path)
    where = str(ckpt.path) if ckpt.path is not None else "checkpoint"
    model_sd = _check_model(ckpt, model, where) if model is not None else None
    opt_sd = _check_optimizer(ckpt, optimizer, where) if optimizer is not None else None
    rng = None
    if restore_rng:
        rng = ckpt.rng_state(rank)
        if rng is None:
            n = len(ckpt.meta.get("rng") or [])
            if n == 0:
                raise CheckpointError(f"{where}: the checkpoint holds no RNG state")
            warnings.warn(f"{where}: no RNG state for rank {rank} ({n} saved); using rank {rank % n}'s", stacklevel=2)
            rng = ckpt.rng_state(rank % n)
        why = rng.problem()
        if why:
            raise CheckpointError(f"{where}: {why}")
    # all checks passed: now modify
    if model_sd is not None:
        model.load_state_dict(model_sd, strict=True)
    if opt_sd is not None:
        optimizer.load_state_dict(opt_sd)
    if scaler is not None and ckpt.meta.get("scaler"):
        scaler.load_state_dict(ckpt.meta["scaler"])
    if rng is not None:
        rng.restore()
    return ckpt
