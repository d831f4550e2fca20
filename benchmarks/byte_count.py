"""Bytes a PyTorch call moves through memory, counted on CPU op by op: a lower bound on its
traffic on a GPU, where each aten op is (at least) one kernel that reads its inputs from and
writes its outputs to device memory.

`ByteCounter` is a `TorchDispatchMode`. Each aten op it sees adds

* what it reads: its tensor inputs, each once, except the ones it only writes (the `out=`
  argument, the target of `zero_`, `fill_` or `copy_`, the template of `new_zeros` or
  `zeros_like`), and for a gather (`index`, `index_select`, `gather`) no more of the source
  than it returns;
* what it writes: its outputs, each once (an in-place op's target is written once, and read
  once besides only where the op reads it, as `mul_` does).

Views, `detach` and the allocations that touch no memory (`empty`, `new_empty`, ...) count
nothing and are no launch. Until 2026-11-28 (seventh CPU session) the count added every
tensor an op named, inputs and outputs alike: an allocation's bytes, `zero_`'s target twice,
an `out=` product's target twice, and so it was not the lower bound the scripts called it
(the FFT path's own zero-padding buffers: about a sixth of its count at 16k).

`by_op` keeps the split per aten op (bytes, launches), for a profile of where they go. Under
`FakeTensorMode` (shapes, no data) the count is the same as with real tensors (tested), at
lengths no CPU could compute (`benchmarks/fft_at_scale.py`).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: allocations that touch no memory
NO_TRAFFIC = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
              aten.new_empty_strided.default, aten.empty_like.default, aten.detach.default,
              aten._unsafe_view.default}
#: ops whose tensor arguments are written or used for their shape and dtype only
WRITE_ONLY = {"zero_", "fill_", "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}
#: gathers: they read at most what they return from their source
GATHERS = {"index", "index_select", "gather"}
#: in-place scatters: they touch as many entries of their target as their source holds, read
#: and written where they add, written where they copy (before 2026-11-29 the whole target
#: counted as read and written: the causal FFT path's `y.index_add_` of each segment's rows
#: into the whole output, 6.2 TB of a 1M-token call's 45 counted)
SCATTERS = {"index_add_": 2, "scatter_add_": 2, "index_copy_": 1, "scatter_": 1}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [a for a in torch.utils._pytree.tree_leaves(tree) if isinstance(a, torch.Tensor)]


def _same_view(a, b) -> bool:
    """Whether two tensors view the same entries of one storage the same way: `copy_` between
    them returns at once (ATen's `copy_impl` checks this), no kernel, no traffic. It is what
    Python's `y[s] += x` ends with (its setitem copies the slice onto itself)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def op_bytes(func, args: tuple, kwargs: dict, out) -> int | None:
    """The bytes one aten op reads and writes (None: no traffic and no launch)."""
    if func.is_view or func in NO_TRAFFIC or func.namespace != "aten":
        return None  # (under FakeTensorMode, its `prim` queries of a tensor's device)
    name = func._schema.name.split("::")[-1]
    if name == "copy_" and len(args) > 1 and _same_view(args[0], args[1]):
        return None  # (counted before 2026-11-29's third CPU session: 16-68 GiB of the FFT path's calls)
    if name in SCATTERS:
        target = args[0]
        rest = _tensors((args[1:], kwargs))
        src = max((t for t in rest if t.dtype == target.dtype), key=_nbytes, default=None)
        return sum(_nbytes(t) for t in rest) + SCATTERS[name] * (0 if src is None else _nbytes(src))
    written = {id(t): t for t in _tensors(out)}
    for t in _tensors(kwargs.get("out")):  # an `out=` target: written, not read
        written[id(t)] = t
    reads = {}
    if name not in WRITE_ONLY:
        for i, t in enumerate(_tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))):
            if name == "copy_" and i == 0:  # copy_'s target: written only
                continue
            reads[id(t)] = t
    n_out = sum(_nbytes(t) for t in written.values())
    if name in GATHERS and args:
        src = args[0]
        reads.pop(id(src), None)
        n_in = sum(_nbytes(t) for t in reads.values()) + min(_nbytes(src), n_out)
    else:
        n_in = sum(_nbytes(t) for t in reads.values())
    return n_in + n_out


class ByteCounter(TorchDispatchMode):
    """`with ByteCounter() as c: ...` then `c.bytes`, `c.launches` and `c.by_op`
    (`{op name: [bytes, launches]}`)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.launches = 0, 0
        self.by_op: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        n = op_bytes(func, args, kwargs, out)
        if n is not None:
            self.bytes += n
            self.launches += 1
            entry = self.by_op.setdefault(str(func), [0, 0])
            entry[0] += n
            entry[1] += 1
        return out

    def top(self, k: int = 20) -> list[tuple[str, int, int]]:
        """The k ops that moved the most bytes: `(op, bytes, launches)`."""
        c = Counter({op: b for op, (b, _) in self.by_op.items()})
        return [(op, b, self.by_op[op][1]) for op, b in c.most_common(k)]
