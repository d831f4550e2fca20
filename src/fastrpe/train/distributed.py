"""Data-parallel training across processes started by `torchrun` (gloo on CPU, NCCL on GPU).

    torchrun --nproc_per_node=2 my_train.py        # or: python -m torch.distributed.run ...

    info = init_from_env()                  # reads RANK, WORLD_SIZE, LOCAL_RANK; no-op for 1 process
    model = build_model().to(info.device)
    train(model, loss_fn, batches, cfg)     # finds the process group by itself
    cleanup()

Semantics are those of `DistributedDataParallel`: every rank starts from rank 0's weights,
computes gradients of the mean loss over its shard of the global batch, and the gradients
are averaged over ranks before the (identical) optimizer step on every rank. With equal
shards, 2 ranks with global batch N take the same steps as 1 rank with batch N, up to the
order of floating-point sums.

Gradients are averaged by an explicit all-reduce after `backward` (bucketed, flattened)
rather than by wrapping the model in `DistributedDataParallel`: the loop calls an arbitrary
`loss_fn(model, batch)` that may use any method of the model, while DDP only synchronizes
gradients of calls that go through its own `forward`.

Context parallelism (`init_from_env(context_parallel=N)`): the world is DP × N ranks, rank
`r = dp * N + cp`. The N ranks of a context-parallel (CP) group share the same rows of the
batch; a model built with `info.cp_group` (`DecoderLM(cfg, group=...)`) computes one contiguous
slice of every sequence on each of them, its attention running across the group. Each
CP rank's gradient is its part of the gradient of the group's loss, so gradients are summed
over the CP group and averaged over the DP groups: one all-reduce over the world divided by
DP (`allreduce_gradients(params, replicas=info.dp_size)`), the same numbers as a sum within
each CP group followed by a mean over DP, in one collective.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

_BUCKET_BYTES = 32 * 2**20


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: `rank` of `world_size`, its `local_rank` and `device`; with
    context parallelism, `context_parallel` ranks per sequence (`cp_rank` within `cp_group`) and
    `dp_size` data-parallel replicas (`dp_rank` within `dp_group`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    context_parallel: int = 1
    cp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def cp_rank(self) -> int:
        """Position of this rank's slice in the sequence (0 .. context_parallel - 1)."""
        return self.rank % self.context_parallel

    @property
    def dp_rank(self) -> int:
        """Which rows of the global batch this rank's CP group takes (0 .. dp_size - 1)."""
        return self.rank // self.context_parallel

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (world_size / context_parallel)."""
        return self.world_size // self.context_parallel


# the context-parallel layout made by init_from_env (current() reports it)
_LAYOUT: dict[str, Any] = {}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def init_from_env(backend: str | None = None, device: str | torch.device | None = None, *,
                  context_parallel: int = 1) -> DistInfo:
    """Join the process group that `torchrun` describes in the environment.

    Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (defaults 0, 1, 0: a plain `python script.py` is a
    world of one and initializes nothing). With `WORLD_SIZE > 1`, initializes
    `torch.distributed` (backend: "nccl" when CUDA is available, else "gloo"), and on CUDA
    selects device `cuda:LOCAL_RANK`.

    Args:
        context_parallel: N ranks per sequence (must divide `WORLD_SIZE`). With N > 1, makes
            one process group per CP group (ranks `dp*N .. dp*N + N-1`) and per DP group (ranks
            `cp, cp + N, ...`), on every rank in the same order as `new_group` requires.

    Returns:
        `DistInfo(rank, world_size, local_rank, device, backend, context_parallel, cp_group, dp_group)`.
    """
    from .._validate import FastRPEError

    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if not (0 <= rank < world):
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise FastRPEError(f"context_parallel: must be an int >= 1, got {context_parallel!r}")
    if world % context_parallel:
        raise FastRPEError(f"context_parallel: {context_parallel} ranks per sequence do not divide the "
                           f"{world} process(es) (WORLD_SIZE)")
    if device is None:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    from .._validate import check_device

    device = check_device(device, "device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return DistInfo(0, 1, local, device, None)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world, **kw)
    cp_group, dp_group = make_groups(context_parallel)
    return DistInfo(rank, world, local, device, dist.get_backend(), context_parallel, cp_group, dp_group)


def make_groups(context_parallel: int) -> tuple[Any, Any]:
    """This rank's (CP group, DP group) for N = `context_parallel` ranks per sequence, in the
    initialized world (rank `r = dp * N + cp`); `(None, None)` for N = 1. Every rank must call
    it (each `new_group` is collective); `current()` reports the layout afterwards."""
    _LAYOUT.clear()
    if context_parallel == 1:
        return None, None
    world, rank = dist.get_world_size(), dist.get_rank()
    n, dp = context_parallel, world // context_parallel
    cp_group = dp_group = None
    for d in range(dp):  # every rank creates every group, in the same order
        g = dist.new_group([d * n + c for c in range(n)])
        if rank // n == d:
            cp_group = g
    for c in range(n):
        g = dist.new_group([d * n + c for d in range(dp)])
        if rank % n == c:
            dp_group = g
    _LAYOUT.update(context_parallel=n, cp_group=cp_group, dp_group=dp_group, world=world)
    return cp_group, dp_group


def current() -> DistInfo:
    """`DistInfo` of the initialized process group (a world of one when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    layout = {k: v for k, v in _LAYOUT.items() if k != "world"} if _LAYOUT.get("world") == world else {}
    return DistInfo(dist.get_rank(), world, _env_int("LOCAL_RANK", 0), device, backend, **layout)


def cleanup() -> None:
    """Leave the process group (if any), after a barrier: a rank that tore down its
    connections while a peer was still finishing its last collective made that peer abort."""
    if dist.is_available() and dist.is_initialized():
        try:
            if dist.get_world_size() > 1:
                dist.barrier()
        finally:
            _LAYOUT.clear()
            dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _comm_device() -> torch.device:
    """Device that collectives of the current backend need their tensors on."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------
# batches


def shard_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rows `[rank * B / W, (rank + 1) * B / W)` of every tensor in `batch` (a tensor, or tuples,
    lists and dicts nesting tensors); non-tensors and 0-d tensors are passed through.

    Raises `ValueError` when a tensor's first dimension `B` is not a multiple of `world_size`
    (unequal shards would weight some rows more than others in the averaged gradient).
    """
    if world_size == 1:
        return batch
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return batch
        B = batch.shape[0]
        if B % world_size:
            raise ValueError(f"batch dimension {B} is not divisible into {world_size} equal shards")
        n = B // world_size
        return batch[rank * n:(rank + 1) * n]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(shard_batch(b, rank, world_size) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard_batch(b, rank, world_size) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, shard_batch(v, rank, world_size)) for k, v in batch.items())
    return batch


# ----------------------------------------------------------------------------------------
# parameters and gradients


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank (as DDP does at construction).

    Each tensor receives the value through an in-place copy, which bumps its version counter:
    a collective writing into `.data` directly would not, and caches keyed on `_version` (the
    decode step's constants, the soe fit) would keep the old values."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    dev = _comm_device()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            buf = t.detach().to(dev, copy=True)
            dist.broadcast(buf, src)
            t.copy_(buf)


def allreduce_gradients(params: Iterable[nn.Parameter], replicas: int | None = None) -> None:
    """Sum `.grad` over ranks and divide by `replicas` (default: the world size, an average),
    in flattened buckets of one dtype.

    With context parallelism pass `replicas = dp_size`: the sum over a CP group is the
    gradient of its sequences (each rank holds a part), the division averages over DP.
    A parameter without a gradient on every rank keeps `grad=None`; one with a gradient on
    some ranks only gets the average with zeros elsewhere, as DDP does.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    world = dist.get_world_size() if replicas is None else replicas
    params = [p for p in params if p.requires_grad]
    dev = _comm_device()
    # which parameters have a gradient anywhere
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has)
    live = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[list[nn.Parameter]]] = {}
    for p in live:
        key = (p.grad.dtype, p.grad.device)
        lst = buckets.setdefault(key, [[]])
        if lst[-1] and sum(q.grad.numel() for q in lst[-1]) * p.grad.element_size() > _BUCKET_BYTES:
            lst.append([])
        lst[-1].append(p)
    for groups in buckets.values():
        for group in groups:
            flat = torch.cat([p.grad.reshape(-1) for p in group]).to(dev)
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n


def all_reduce_mean(values: Tensor) -> Tensor:
    """Mean of `values` over ranks (returned on the input's device)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    buf = values.detach().to(_comm_device(), torch.float64)
    dist.all_reduce(buf)
    return (buf / dist.get_world_size()).to(values.device)


def all_reduce_sum(value: float) -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    buf = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(buf)
    return float(buf.item())


def gather_json(obj: Any) -> list[Any] | None:
    """Every rank's JSON-able `obj`, on rank 0 (None elsewhere); sent as UTF-8 JSON, not pickle."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [int(s.item()) for s in _all_gather(torch.tensor([data.numel()], dtype=torch.int64))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:data.numel()] = data
    got = _all_gather(padded)
    if dist.get_rank() != 0:
        return None
    return [json.loads(bytes(t[:n].tolist()).decode()) for t, n in zip(got, sizes)]


def gather_tensors(t: Tensor) -> list[Tensor] | None:
    """Every rank's `t` (same shape and dtype on all ranks), as CPU tensors on rank 0; None elsewhere."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [t.detach().cpu()]
    out = _all_gather(t)
    return out if dist.get_rank() == 0 else None


def _all_gather(t: Tensor) -> list[Tensor]:
    # all_gather rather than gather: NCCL and gloo both support it
    buf = t.detach().to(_comm_device()).contiguous()
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(out, buf)
    return [o.cpu() for o in out]
