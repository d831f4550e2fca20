"""Checkpoints as single safetensors files: verified on load, written atomically, never pickled.

File format (one `.safetensors` file; any safetensors reader can open it):

* tensors
    - `model/<state_dict key>`              every entry of `model.state_dict()` (params and buffers)
    - `optim/state/<i>/<name>`              tensor state of the optimizer's i-th parameter (AdamW:
                                            `exp_avg`, `exp_avg_sq`, `step`), i in param-group order
    - `optim/group/<g>/<key>`               tensor-valued hyper-parameters of param group g (rare)
    - `rng/<rank>/torch_cpu`                `torch.get_rng_state()` (uint8) of each rank
    - `rng/<rank>/cuda/<device>`            `torch.cuda.get_rng_state(device)`, when CUDA was used
* header metadata (`__metadata__`, all strings)
    - `format`: `"fastrpe.train.checkpoint/1"`
    - `meta`: one JSON document: `step`, `config`, `schedule`, `data` (data position), `optimizer`
      (class, param groups, non-tensor state), `rng` (per rank: python `random` and numpy
      states as JSON lists, number of CUDA devices), `scaler` (fp16 loss scale), `extra`
      (caller's JSON), and `tensors`: a catalog `{name: [dtype, shape]}`
    - `sha256`: hex digest of `meta` (UTF-8) followed by the whole tensor payload

Loading reads the file into memory, checks the header, the size of every tensor against the
file size, the checksum and the catalog, then checks every key and shape against the model
and optimizer; only when all of that passes is anything copied into them. Any failure raises
`CheckpointError`. Nothing here calls `pickle` or `torch.load`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import struct
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FORMAT = "fastrpe.train.checkpoint/1"
MODEL, OPT_STATE, OPT_GROUP, RNG = "model/", "optim/state/", "optim/group/", "rng/"
_MAX_HEADER = 100 * 2**20

# safetensors dtype codes <-> torch dtypes (itemsize for the size check)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, is corrupted, or does not fit the model/optimizer."""


# ----------------------------------------------------------------------------------------
# RNG state


@dataclass
class RngState:
    """The random state of one process: torch CPU (and CUDA), python `random`, numpy."""

    torch_cpu: Tensor
    cuda: list[Tensor] = field(default_factory=list)
    python: Any = None
    numpy: Any = None

    @classmethod
    def capture(cls) -> RngState:
        cuda = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        v, internal, gauss = random.getstate()
        py = [v, list(internal), gauss]
        np_state = None
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            np_state = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
        return cls(torch.get_rng_state(), cuda, py, np_state)

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.cuda and torch.cuda.is_available():
            for i, s in enumerate(self.cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        if self.python is not None:
            v, internal, gauss = self.python
            random.setstate((v, tuple(internal), gauss))
        if self.numpy is not None:
            try:
                import numpy as np
            except ImportError:
                return
            name, keys, pos, has_gauss, cached = self.numpy
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def _check(self, where: str) -> None:
        ref = torch.get_rng_state()
        if self.torch_cpu.dtype != torch.uint8 or self.torch_cpu.shape != ref.shape:
            raise CheckpointError(f"{where}: torch RNG state has dtype {self.torch_cpu.dtype} and shape "
                                  f"{tuple(self.torch_cpu.shape)}, expected uint8 {tuple(ref.shape)}")
        if self.python is not None:
            ok = (isinstance(self.python, list) and len(self.python) == 3 and isinstance(self.python[1], list)
                  and all(isinstance(x, int) for x in self.python[1]))
            if not ok:
                raise CheckpointError(f"{where}: python RNG state is malformed")
        if self.numpy is not None:
            ok = (isinstance(self.numpy, list) and len(self.numpy) == 5 and isinstance(self.numpy[1], list)
                  and len(self.numpy[1]) == 624)
            if not ok:
                raise CheckpointError(f"{where}: numpy RNG state is malformed")


# ----------------------------------------------------------------------------------------
# the in-memory checkpoint


@dataclass
class Checkpoint:
    """A verified checkpoint in memory: `tensors` (CPU) and the JSON `meta`."""

    path: Path | None
    meta: dict[str, Any]
    tensors: dict[str, Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def config(self) -> dict | None:
        return self.meta.get("config")

    @property
    def extra(self) -> dict:
        return self.meta.get("extra") or {}

    def model_state(self) -> dict[str, Tensor]:
        """The model's `state_dict` (CPU tensors)."""
        return {k[len(MODEL):]: v for k, v in self.tensors.items() if k.startswith(MODEL)}

    def optimizer_state(self) -> dict | None:
        """The optimizer's `state_dict` in `torch.optim.Optimizer.load_state_dict` form, or None."""
        om = self.meta.get("optimizer")
        if om is None:
            return None
        state: dict[int, dict[str, Any]] = {}
        for i, scalars in om["state"].items():
            state[int(i)] = dict(scalars)
        groups = [dict(g) for g in om["param_groups"]]
        for name, t in self.tensors.items():
            if name.startswith(OPT_STATE):
                i, key = name[len(OPT_STATE):].split("/", 1)
                state.setdefault(int(i), {})[key] = t
            elif name.startswith(OPT_GROUP):
                g, key = name[len(OPT_GROUP):].split("/", 1)
                groups[int(g)][key] = t
        return {"state": state, "param_groups": groups}

    def rng_state(self, rank: int = 0) -> RngState | None:
        entries = self.meta.get("rng") or []
        if rank >= len(entries):
            return None
        e = entries[rank]
        cuda = [self.tensors[f"{RNG}{rank}/cuda/{i}"] for i in range(int(e.get("cuda_devices", 0)))]
        return RngState(self.tensors[f"{RNG}{rank}/torch_cpu"], cuda, e.get("python"), e.get("numpy"))


# ----------------------------------------------------------------------------------------
# saving


def _jsonable(x: Any, where: str) -> Any:
    """`x` with tuples as lists; raises for anything JSON cannot hold."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
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


def encode_checkpoint(meta: dict[str, Any], tensors: dict[str, Tensor]) -> bytes:
    """The bytes of a checkpoint file holding `tensors` (CPU, contiguous) and JSON `meta`."""
    from safetensors.torch import save

    meta = dict(meta)
    meta["format"] = FORMAT
    meta["tensors"] = {k: [_CODES[t.dtype], list(t.shape)] for k, t in sorted(tensors.items())}
    meta_json = json.dumps(meta, sort_keys=True, allow_nan=True)
    raw = save(tensors, metadata={"format": FORMAT, "meta": meta_json})
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    payload = raw[8 + n:]
    header["__metadata__"]["sha256"] = hashlib.sha256(meta_json.encode() + payload).hexdigest()
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)  # safetensors aligns the payload to 8 bytes
    return struct.pack("<Q", len(hbytes)) + hbytes + payload


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part.

    A temp file in the same directory is written and fsync'ed, then `os.replace`d over `path`,
    and the directory is fsync'ed so that the rename itself survives a crash.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int, config: Any = None, schedule: Any = None, data: dict | None = None,
                    scaler: Any = None, rng: bool | list[RngState] = True, extra: dict | None = None) -> Path:
    """Write a checkpoint atomically and return its path.

    Args:
        path: file to write (conventionally `*.safetensors`).
        model: its `state_dict()` is saved (tied weights are stored once per name).
        optimizer: its state (tensors flattened, see the module docstring); None to skip.
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
    meta: dict[str, Any] = {"step": int(step), "created": time.time(), "torch": torch.__version__}
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


# ----------------------------------------------------------------------------------------
# reading and verifying


def decode_checkpoint(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """Parse and verify checkpoint bytes; raises `CheckpointError` on any inconsistency."""
    size = len(data)
    if size < 8:
        raise CheckpointError(f"{where}: file is {size} bytes, too short for a safetensors header (truncated?)")
    if data[:2] == b"PK" or data[:1] == b"\x80":
        raise CheckpointError(f"{where}: this is a pickle / torch.save file, not a safetensors checkpoint; "
                              "fastrpe never unpickles files (they can run arbitrary code)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > size - 8 or n > _MAX_HEADER:
        raise CheckpointError(f"{where}: header length {n} does not fit in a file of {size} bytes "
                              "(truncated, or not a safetensors file)")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: header is not valid JSON (corrupted?): {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CheckpointError(f"{where}: header has no __metadata__ (not a fastrpe checkpoint?)")
    md = header.pop("__metadata__")
    if md.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format is {md.get('format')!r}, expected {FORMAT!r}")
    meta_json, digest = md.get("meta"), md.get("sha256")
    if not isinstance(meta_json, str) or not isinstance(digest, str):
        raise CheckpointError(f"{where}: metadata lacks 'meta' or 'sha256'")

    # every tensor's byte range must match its dtype and shape, and together fill the payload exactly
    payload_size = size - 8 - n
    end = 0
    for name, info in header.items():
        try:
            dtype, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
            nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: header entry for tensor {name!r} is malformed ({e!r})") from None
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b) or b - a != nbytes:
            raise CheckpointError(f"{where}: tensor {name!r} has byte range {a}..{b} but {dtype}{shape} "
                                  f"needs {nbytes} bytes")
        end = max(end, b)
    if end != payload_size:
        raise CheckpointError(f"{where}: size mismatch: the header describes {end} payload bytes, the file has "
                              f"{payload_size} (truncated or padded)")

    got = hashlib.sha256(meta_json.encode() + data[8 + n:]).hexdigest()
    if got != digest:
        raise CheckpointError(f"{where}: checksum mismatch (sha256 {got[:16]}… != stored {digest[:16]}…): "
                              "the file is corrupted")
    try:
        meta = json.loads(meta_json)
    except json.JSONDecodeError as e:  # cannot happen when the checksum matched, unless written so
        raise CheckpointError(f"{where}: metadata is not valid JSON: {e}") from None
    catalog = meta.get("tensors", {})
    described = {k: [v["dtype"], list(v["shape"])] for k, v in header.items()}
    if catalog != described:
        diff = sorted(set(catalog) ^ set(described)) or sorted(k for k in catalog if catalog[k] != described[k])
        raise CheckpointError(f"{where}: tensor headers disagree with the checksummed catalog "
                              f"(first: {diff[0]!r}); the header is corrupted")
    if not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{where}: metadata has no integer 'step'")

    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as e:  # noqa: BLE001 - any parser failure is a corrupted file
        raise CheckpointError(f"{where}: safetensors could not parse the file: {e}") from None
    return Checkpoint(None, meta, tensors)


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
        rng._check(where)
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


# ----------------------------------------------------------------------------------------
# a directory of checkpoints


class CheckpointManager:
    """`directory/step-00000100.safetensors`, ..., and `directory/latest` naming the newest.

    `save` writes the checkpoint atomically, then the `latest` pointer atomically, then
    deletes all but the newest `keep_last` checkpoints. A crash at any point leaves `latest`
    naming a complete, verified-on-load file.
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

    def latest(self) -> Path | None:
        """The checkpoint `latest` names (or the highest step when the pointer is missing)."""
        pointer = self.directory / "latest"
        if pointer.is_file():
            name = pointer.read_text().strip()
            if not self._NAME.match(name):  # a bare file name only: no paths out of the directory
                raise CheckpointError(f"{pointer}: does not name a checkpoint file: {name!r}")
            p = self.directory / name
            if not p.is_file():
                raise CheckpointError(f"{pointer}: names {name}, which does not exist")
            return p
        found = self.checkpoints()
        return found[-1][1] if found else None

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
