"""Checkpoints as single safetensors files: verified on load, written atomically, never pickled.

File format (one `.safetensors` file; any safetensors reader can open it):

* tensors
    - `model/<state_dict key>`              every entry of `model.state_dict()` (params and buffers)
    - `optim/state/<i>/<name>`              tensor state of the optimizer's i-th parameter (AdamW:
                                            `exp_avg`, `exp_avg_sq`, `step`), i in param-group order
    - `optim/group/<g>/<key>`               tensor-valued hyper-parameters of param group g (rare)
    - `rng/<rank>/torch_cpu`                `torch.get_rng_state()` (uint8) of each rank
    - `rng/<rank>/cuda/<device>`            `torch.cuda.get_rng_state(device)`, when CUDA was used
* header metadata: one entry `fastrpe` (written through safetensors' `metadata=`) holding a JSON
  object of three strings (version 1 files, with these as three entries, are still read)
    - `format`: `"fastrpe.train.checkpoint/2"`
    - `meta`: one JSON document: `step`, `config`, `schedule`, `data` (data position), `optimizer`
      (class, param groups, non-tensor state), `rng` (per rank: python `random` and numpy
      states as JSON lists, number of CUDA devices), `scaler` (fp16 loss scale), `extra`
      (caller's JSON), and `tensors`: a catalog `{name: [dtype, shape]}`
    - `sha256`: hex digest of `meta` (UTF-8) followed by every tensor's bytes in name order

Loading reads the file into memory, checks the header, the size of every tensor against the
file size, the checksum and the catalog, then checks every key and shape against the model
and optimizer; only when all of that passes is anything copied into them. Any failure raises
`CheckpointError`. Nothing here calls `pickle` or `torch.load`.

Modules, one job each: `rng` (capturing and restoring RNG states), `format` (bytes <->
verified `Checkpoint`), `save` (a model and optimizer into a file), `verify` (reading a file,
checking it against a model and optimizer, loading), `manager` (a directory of them).
"""
from __future__ import annotations

import os  # noqa: F401  (tests patch os.replace through this module)

from ..._io import atomic_write
from .format import FORMAT, MODEL, OPT_GROUP, OPT_STATE, RNG, Checkpoint, CheckpointError, decode_checkpoint, \
    encode_checkpoint
from .manager import CheckpointManager
from .rng import RngState
from .save import save_checkpoint
from .verify import load_checkpoint, read_checkpoint

__all__ = [
    "FORMAT", "MODEL", "OPT_GROUP", "OPT_STATE", "RNG", "Checkpoint", "CheckpointError", "CheckpointManager",
    "RngState", "atomic_write", "decode_checkpoint", "encode_checkpoint", "load_checkpoint", "read_checkpoint",
    "save_checkpoint",
]
