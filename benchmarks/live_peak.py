"""The bytes a PyTorch call holds at its peak, tracked op by op: what `torch.cuda.
max_memory_allocated` would report on a GPU, minus the caching allocator's rounding.

`LivePeak` is a `TorchDispatchMode`. Every storage an op returns that none of its inputs
holds is an allocation: its bytes are live from then until the last tensor that refers to it
(the op's output, or a later alias of it) is freed, which a weak reference reports. Views
share their base's storage and add nothing; an in-place op's or an `out=` op's target is an
input and adds nothing. Autograd's saved tensors keep their storage alive as on a GPU, and the
backward's ops pass through the mode as the forward's do.

Under `FakeTensorMode` (shapes and dtypes, no data) it runs a call at lengths no CPU could
compute, as `benchmarks/fft_at_scale.py` does; with real tensors it is the same count.
"""
from __future__ import annotations

import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_count import _tensors  # noqa: E402


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LivePeak(TorchDispatchMode):
    """`with LivePeak() as m: ...` then `m.peak` (bytes), `m.live` (bytes still held), and
    `m.at_peak`: the largest storages live at the peak, `(bytes, op that allocated it)`."""

    def __init__(self, keep: int = 12):
        super().__init__()
        self.live, self.peak, self.keep = 0, 0, keep
        self.at_peak: list[tuple[int, str]] = []
        self._held: dict[int, list] = {}  # storage -> [bytes, op, {id(ref): ref}]

    def _drop(self, key: int, ref) -> None:
        e = self._held.get(key)
        if e is None:
            return
        e[2].pop(id(ref), None)
        if not e[2]:
            self.live -= e[0]
            del self._held[key]

    def _refer(self, t: torch.Tensor, key: int) -> None:
        r = weakref.ref(t, lambda r, key=key: self._drop(key, r))
        self._held[key][2][id(r)] = r

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        grew = False
        for t in _tensors(out):
            key = _key(t)
            if key in self._held:  # an alias of a held storage keeps it alive too
                self._refer(t, key)
            elif key not in inputs:
                n = t.untyped_storage().nbytes()
                self._held[key] = [n, str(func), {}]
                self.live += n
                self._refer(t, key)
                grew = True
        if grew and self.live > self.peak:
            self.peak = self.live
            top = sorted(((e[0], e[1]) for e in self._held.values()), reverse=True)
            self.at_peak = top[:self.keep]
        return out
