"""Collectives for context parallelism, on `torch.distributed` (NCCL on GPU, gloo on CPU).

The sequence is split into contiguous slices, one per rank of `group`, in rank order
(slices may differ in length). What this module gives the distributed attention paths:

* `world(group)`: `(rank, size)`, `(0, 1)` when no process group is initialized;
* `slice_lengths(length, group)`, `global_offset(...)`: every rank's slice length (one
  all-gather of an integer) and this rank's position in the sequence;
* differentiable collectives, written only with collectives gloo has (no reduce-scatter):
  - `all_gather(x, group) -> [P, *x.shape]`: backward all-reduces the gradient of the whole
    stack (every rank's loss reads every rank's piece) and keeps this rank's slice;
  - `all_gather_varlen(x, dim, group) -> list[Tensor]`: pieces of different lengths along
    `dim` (padded to the longest for transport, trimmed after);
  - `all_reduce_sum(x, group)`: backward all-reduces the gradient (every rank's output is
    the same sum, so each input receives the sum of every rank's gradient);
  - `exclusive_prefix(x, weight, group)` / `exclusive_suffix(...)`: `Σ_{s<r} w_s·x_s` and
    `Σ_{s>r} w_s·x_s` from one all-gather (the state passed from earlier/later ranks);
* `all_reduce_max(x, group)`: not differentiable (shifts taken out before `exp` are detached);
* `tie(out, *deps)`: `out` unchanged, with `deps` made part of its autograd graph, so a
  collective's backward runs on every rank even where this rank's output did not depend on
  what it received (rank 0 reads nothing from earlier ranks): every rank must take part in
  every backward collective, or the others wait forever;
* `counting()`: a context manager recording, per collective call, the bytes this rank sent.

Bytes counted are what the usual ring algorithms send from each rank: all-gather of an
`n`-byte piece `(P-1)·n`, all-reduce of `n` bytes `2·(P-1)/P·n`; backward collectives are
counted under their own names (`"all_gather.backward"` ...). With `P = 1` nothing is sent.

As with DistributedDataParallel, every rank must run the same sequence of calls (forward and
backward), and a parameter replicated on every rank (a positional term) gets on each rank the
part of its gradient that rank computed: sum them over the group (all-reduce) for the
gradient of the whole sequence's loss.

Notation: P ranks in the group, r this rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["world", "slice_lengths", "global_offset", "all_gather", "all_gather_varlen", "all_reduce_sum",
           "all_reduce_max", "exclusive_prefix", "exclusive_suffix", "tie", "counting", "CommCounter"]


# ---------------------------------------------------------------------------------------------
# Group and byte counting


def world(group=None) -> tuple[int, int]:
    """`(rank, size)` of this process in `group` (the default group if None); `(0, 1)` when
    torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass
class CommCounter:
    """Bytes this rank sent, one `(name, bytes)` record per collective call."""

    records: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.records)

    def by_op(self) -> dict[str, int]:
        """Bytes per collective name."""
        out: dict[str, int] = {}
        for name, b in self.records:
            out[name] = out.get(name, 0) + b
        return out

    def calls(self) -> dict[str, int]:
        """Number of calls per collective name."""
        out: dict[str, int] = {}
        for name, _ in self.records:
            out[name] = out.get(name, 0) + 1
        return out


_COUNTERS: list[CommCounter] = []


@contextlib.contextmanager
def counting() -> Iterator[CommCounter]:
    """Record the bytes this rank sends in every collective of this module, forward and
    backward, while the block runs (nested blocks each see every call)::

        with comm.counting() as c:
            out = fastrpe.distributed.attention(...)
            out.sum().backward()
        print(c.total, c.by_op())
    """
    c = CommCounter()
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        _COUNTERS.remove(c)


def _record(name: str, nbytes: float) -> None:
    for c in _COUNTERS:
        c.records.append((name, int(round(nbytes))))


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


# ---------------------------------------------------------------------------------------------
# Slice bookkeeping


def slice_lengths(length: int, group=None, device=None) -> list[int]:
    """Every rank's slice length, in rank order (one all-gather of one integer).

    Args:
        length: this rank's slice length; device: where the collective runs (CUDA for NCCL).
    """
    rank, size = world(group)
    if size == 1:
        return [int(length)]
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
    mine = torch.tensor([int(length)], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    _record("slice_lengths", (size - 1) * _nbytes(mine))
    return [int(t.item()) for t in out]


def global_offset(lengths: Sequence[int], rank: int) -> int:
    """Position of the first token of `rank`'s slice: the sum of the earlier slices' lengths."""
    return int(sum(lengths[:rank]))


# ---------------------------------------------------------------------------------------------
# Differentiable collectives


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group):
        rank, size = world(group)
        ctx.group, ctx.rank = group, rank
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x, group=group)
        _record("all_gather", (size - 1) * _nbytes(x))
        return torch.stack(out)  # (P, *x.shape)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()
        size = g.shape[0]
        dist.all_reduce(g, group=ctx.group)  # gloo has no reduce-scatter: reduce all, keep ours
        _record("all_gather.backward", 2 * (size - 1) / size * _nbytes(g))
        return g[ctx.rank], None


def all_gather(x: Tensor, group=None) -> Tensor:
    """`[P, *x.shape]`: every rank's `x` (same shape on every rank), differentiable.

    The gradient of this rank's `x` is the sum over ranks of the gradients their losses
    send to piece `r` (an all-reduce of the stacked gradient, then this rank's slice)."""
    if world(group)[1] == 1:
        return x[None]
    return _AllGather.apply(x, group)


def all_gather_varlen(x: Tensor, dim: int, lengths: Sequence[int], group=None) -> list[Tensor]:
    """Every rank's `x`, whose sizes along `dim` are `lengths` (all other dims equal), as a
    list in rank order; differentiable. Transported padded to `max(lengths)`."""
    rank, size = world(group)
    dim = dim % x.dim()
    if x.shape[dim] != lengths[rank]:
        raise ValueError(f"all_gather_varlen: x has {x.shape[dim]} along dim {dim}, lengths[{rank}] = {lengths[rank]}")
    top = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, top - x.shape[dim]]
    st = all_gather(torch.nn.functional.pad(x, pad), group)  # (P, ..., top, ...)
    return [st[s].narrow(dim, 0, lengths[s]) for s in range(size)]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group):
        ctx.group = group
        size = world(group)[1]
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        _record("all_reduce", 2 * (size - 1) / size * _nbytes(y))
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        size = world(ctx.group)[1]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        _record("all_reduce.backward", 2 * (size - 1) / size * _nbytes(g))
        return g, None


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """`Σ_ranks x` on every rank, differentiable (backward: the sum of every rank's gradient)."""
    if world(group)[1] == 1:
        return x
    return _AllReduceSum.apply(x, group)


def all_reduce_max(x: Tensor, group=None) -> Tensor:
    """Elementwise maximum over ranks, detached (for shifts taken out before `exp`)."""
    size = world(group)[1]
    y = x.detach().contiguous().clone()
    if size > 1:
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
        _record("all_reduce_max", 2 * (size - 1) / size * _nbytes(y))
    return y


def exclusive_prefix(x: Tensor, weight: Callable[[int], Tensor | float], group=None) -> Tensor:
    """`Σ_{s<r} weight(s)·x_s` (zeros on rank 0), from one differentiable all-gather.

    `weight(s)` must broadcast against `x` (e.g. the decay from rank s's last key to this
    rank's first query). The result is tied to the gathered stack, so the backward
    collective runs on every rank."""
    rank, _ = world(group)
    st = all_gather(x, group)
    acc = torch.zeros_like(x)
    for s in range(rank):
        acc = acc + weight(s) * st[s]
    return tie(acc, st)


def exclusive_suffix(x: Tensor, weight: Callable[[int], Tensor | float], group=None) -> Tensor:
    """`Σ_{s>r} weight(s)·x_s` (zeros on the last rank), from one differentiable all-gather."""
    rank, size = world(group)
    st = all_gather(x, group)
    acc = torch.zeros_like(x)
    for s in range(rank + 1, size):
        acc = acc + weight(s) * st[s]
    return tie(acc, st)


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: Tensor, *deps: Tensor):
        ctx.shapes = [(d.shape, d.dtype, d.device) for d in deps]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        return (g, *(torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in ctx.shapes))


def tie(out: Tensor, *deps: Tensor) -> Tensor:
    """`out`, unchanged, whose backward also reaches `deps` (with a zero gradient): every
    rank then runs the backward collectives behind `deps`, whether or not its output used
    them. A no-op when nothing requires grad."""
    deps = tuple(d for d in deps if d.requires_grad)
    if not deps or not torch.is_grad_enabled():
        return out
    return _Tie.apply(out, *deps)
