"""The checkpoint file format: encoding to bytes and verified decoding (no model involved).

A checkpoint is one safetensors file written by the safetensors library with one metadata
string, `fastrpe`: a JSON envelope `{"format", "meta", "sha256"}` (`meta` is itself a JSON
document, see the package docstring). One key, because safetensors writes several metadata
keys in a random order, and equal runs should give equal files. The digest covers `meta` and
every tensor's bytes in name order, so it is computed before the file is serialized and
stored through safetensors' own `metadata=` argument; any flipped bit (payload, tensor
headers, metadata) is refused on reading.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .rng import RngState

FORMAT = "fastrpe.train.checkpoint/2"
METADATA_KEY = "fastrpe"  # the one safetensors metadata entry: {"format", "meta", "sha256"} as JSON
#: version 1 (digest over `meta` and the raw payload, header rewritten by hand) is still read
FORMAT_V1 = "fastrpe.train.checkpoint/1"
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


def _digest(meta_json: str, chunks: Iterable[bytes | bytearray | memoryview]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _tensor_bytes(t: Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor (as safetensors stores them)."""
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def encode_checkpoint(meta: dict[str, Any], tensors: dict[str, Tensor]) -> bytes:
    """The bytes of a checkpoint file holding `tensors` (CPU, contiguous) and JSON `meta`."""
    from safetensors.torch import save

    meta = dict(meta)
    meta["format"] = FORMAT
    meta["tensors"] = {k: [_CODES[t.dtype], list(t.shape)] for k, t in sorted(tensors.items())}
    meta_json = json.dumps(meta, sort_keys=True, allow_nan=True)
    digest = _digest(meta_json, (_tensor_bytes(tensors[k]) for k in sorted(tensors)))
    envelope = json.dumps({"format": FORMAT, "meta": meta_json, "sha256": digest}, sort_keys=True)
    return save(tensors, metadata={METADATA_KEY: envelope})


def _parse_header(data: bytes, where: str) -> tuple[int, dict, dict]:
    """Length prefix, tensor entries and `__metadata__` of safetensors bytes, refusing what
    is truncated, oversized or not a fastrpe checkpoint (before any tensor is parsed)."""
    size = len(data)
    if size < 8:
        raise CheckpointError(f"{where}: file is {size} bytes, too short for a safetensors header (truncated?)")
    # a safetensors header (JSON) starts at byte 8 with "{"; its length prefix may well begin
    # with 0x80 (any header of 128 + 256·k bytes), so the pickle magic alone is not enough
    if data[8:9] != b"{" and (data[:2] == b"PK" or data[:1] == b"\x80"):
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
    if METADATA_KEY in md:
        try:
            md = json.loads(md[METADATA_KEY])
        except (TypeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{where}: metadata is not valid JSON (corrupted?): {e}") from None
        if not isinstance(md, dict) or md.get("format") != FORMAT:
            raise CheckpointError(f"{where}: metadata does not describe a {FORMAT!r} checkpoint (corrupted?)")
    elif md.get("format") != FORMAT_V1:
        raise CheckpointError(f"{where}: format is {md.get('format')!r}, expected {FORMAT!r}")
    return n, header, md


def _check_layout(header: dict, payload_size: int, where: str) -> None:
    """Every tensor's byte range matches its dtype and shape, and together they fill the payload."""
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


def decode_checkpoint(data: bytes, where: str = "checkpoint") -> Checkpoint:
    """Parse and verify checkpoint bytes; raises `CheckpointError` on any inconsistency."""
    import safetensors

    n, header, md = _parse_header(data, where)
    meta_json, digest = md.get("meta"), md.get("sha256")
    if not isinstance(meta_json, str) or not isinstance(digest, str):
        raise CheckpointError(f"{where}: metadata lacks 'meta' or 'sha256'")
    _check_layout(header, len(data) - 8 - n, where)
    try:
        entries = dict(safetensors.deserialize(data))  # the library's own parser and bounds checks
    except Exception as e:  # noqa: BLE001 - any parser failure is a corrupted file
        raise CheckpointError(f"{where}: safetensors could not parse the file: {e}") from None

    if md["format"] == FORMAT_V1:
        got = _digest(meta_json, [data[8 + n:]])
    else:
        got = _digest(meta_json, (entries[k]["data"] for k in sorted(entries)))
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

    tensors = {}
    for name, e in entries.items():
        dtype, shape = _DTYPES[e["dtype"]], list(e["shape"])
        buf = e["data"]
        tensors[name] = (torch.frombuffer(buf, dtype=dtype).reshape(shape) if len(buf)
                         else torch.empty(shape, dtype=dtype))
    return Checkpoint(None, meta, tensors)
