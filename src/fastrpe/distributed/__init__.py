"""Context parallelism: attention over a sequence split across the ranks of a process group.

    import fastrpe.distributed as frd
    # every rank holds its contiguous slice of the sequence, rank order = sequence order
    out = frd.attention(q, k, v, kernel="nprf", position=fr.positions.KerpleLog(H), causal=True)

Built on `torch.distributed` (NCCL on GPU, gloo on CPU). The arguments and their meaning are
`fastrpe.attention`'s; the call picks a distributed path from the same information as the
single-process dispatcher (see `docs/DISTRIBUTED.md`):

* `ring`: exact softmax with any 1D positional term, key/value blocks passed around the
  ring, merged by log-sum-exp; kernelized attention with any 1D Toeplitz term by
  block-Toeplitz FFT products on the same ring (`fastrpe.distributed.ring`);
* `linear` (kernelized with an exact state-passing form: no term or a geometric decay
  (chunked), a finite-support term (band), none non-causal (bidirectional); or the forced
  backend "soe"): `O(F·Dv)` states passed between ranks (`fastrpe.distributed.linear`);
* `gather` (everything else 1D: additive terms, SIKF, trainable feature maps, a forced
  backend): the key side gathered from every rank, exact (`fastrpe.distributed.gather`).

2D grid terms have no distributed form and are refused.

Gradients: q, k and v get exactly the gradients of the single-process call (for their
slice). The parameters of the kernel and positional terms get this rank's share: summed over
the group (as data parallelism's all-reduce does) they equal the single-process gradient.
Every rank must call `attention` (and backward) in the same order: they are collectives.
"""
from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import FastRPEError

__all__ = ["attention", "explain", "choose_path", "path_reasons", "gather_bytes", "PATHS"]

#: the distributed paths, in the order `auto` prefers them when several fit
PATHS = ("ring", "linear", "gather")

#: numbers each rank contributes to the agreement check (see `_agree`): 0 L_r, 1 error flag,
#: 2 B, 3 H, 4 D, 5 Dv, 6 dtype, 7 causal, 8 has mask, 9 scale, 10 signature of kernel, terms,
#: backend and path, 11 q_offset, 12 memory limit, 13 requires grad, 14-15 parameter fingerprint
_META = 16

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _fingerprint(modules, device) -> Tensor:
    """`[2]` float64 on `device`: two numbers that differ when ranks hold different
    parameters/buffers (say, random features drawn from different seeds), which would give
    silently wrong sums. No host sync (the agreement's one all-gather reads it)."""
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for m in modules:
            if not isinstance(m, torch.nn.Module):
                continue
            for t in list(m.parameters()) + list(m.buffers()):
                if t.is_floating_point() and t.numel():
                    t64 = t.detach().to(device=device, dtype=torch.float64)
                    acc += torch.stack([t64.sum(), (t64 * t64).sum()])
    return acc


def _structure(obj) -> str:
    if obj is None or isinstance(obj, str):
        return repr(obj)
    extra = obj.extra_repr() if hasattr(obj, "extra_repr") else ""
    return f"{type(obj).__qualname__}({extra})"


@dataclasses.dataclass
class _Call:
    """What every rank agreed on: slice lengths and the global problem."""

    rank: int
    world: int
    lengths: list[int]
    problem: object  # dispatch.Problem for the whole sequence
    has_mask: bool
    memory_limit: int  # the smallest rank's (every rank must choose the same path)

    @property
    def offset(self) -> int:
        return sum(self.lengths[: self.rank])


def _agree(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale, backend, path, group) -> _Call:
    """Check this rank's arguments, then check with one all-gather that every rank passed the
    same call. Every rank raises together (a rank that raised alone would leave the others
    waiting in the next collective)."""
    from ..api import _problem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local_error = None
    p = None
    try:
        p, _ = _problem(q, k, v, kernel, position, causal, None, key_padding_mask, scale)
        if q.shape[2] != k.shape[2]:
            raise FastRPEError(f"k: each rank passes its slice of one sequence (self-attention), so q and k "
                               f"have one length; got Lq={q.shape[2]}, Lk={k.shape[2]}")
        if not isinstance(backend, str):
            raise FastRPEError(f"backend must be a string, got {backend!r}")
        if path not in ("auto", *PATHS):
            raise FastRPEError(f"path: unknown path {path!r}; known: auto, {', '.join(PATHS)}")
    except FastRPEError as e:
        local_error = e
    dev = q.device if isinstance(q, Tensor) else torch.device("cpu")
    if p is not None:
        mods = [p.kernel, p.position, *p.additive]
        sig = zlib.crc32("|".join([_structure(m) for m in mods] + [backend, path]).encode())
        meta = [q.shape[2], 0, *q.shape[:2], q.shape[3], v.shape[3], _DTYPES.index(q.dtype) if q.dtype in _DTYPES
                else 99, float(causal), float(key_padding_mask is not None), -1.0 if scale is None else float(scale),
                float(sig), -1.0 if q_offset is None else float(q_offset), float(_memory_limit(dev)),
                float(p.requires_grad)]
        fp = _fingerprint(mods, dev)
    else:
        meta = [0, 1] + [0.0] * (_META - 4)
        fp = torch.zeros(2, dtype=torch.float64, device=dev)
    t = torch.cat([torch.tensor(meta, dtype=torch.float64, device=dev), fp])  # fingerprint: the last two
    assert t.numel() == _META
    allm = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(allm, t, group=group)
    allm = torch.stack(allm).cpu()  # (P, _META)
    if local_error is not None:
        raise local_error
    bad = [int(r) for r in range(world) if allm[r, 1] != 0]
    if bad:
        raise FastRPEError(f"rank {bad[0]} rejected its arguments (its own error says why); nothing was computed")
    lengths = [int(x) for x in allm[:, 0].tolist()]
    names = {2: "B", 3: "H", 4: "D", 5: "Dv", 6: "dtype", 7: "causal", 9: "scale",
             10: "kernel, position, backend or path", 14: "kernel/position parameters",
             15: "kernel/position parameters"}
    for col, what in names.items():
        if not bool((allm[:, col] == allm[0, col]).all()):
            vals = allm[:, col].tolist()
            raise FastRPEError(f"group: every rank must pass the same {what}; ranks differ ({vals})")
    off = sum(lengths[:rank])
    if q_offset is not None and q_offset != off:
        raise FastRPEError(f"q_offset: the distributed call places rank {rank}'s queries at its global offset "
                           f"{off} (the sum of the earlier ranks' lengths); got q_offset={q_offset}")
    has_mask = bool(allm[:, 8].any())
    L = sum(lengths)
    # what decides the path must be the same on every rank (or they would wait on each other)
    gp = dataclasses.replace(p, Lq=L, Lk=L, q_offset=0, has_padding_mask=has_mask,
                             requires_grad=bool(allm[:, 13].any()))
    return _Call(rank, world, lengths, gp, has_mask, int(allm[:, 12].min()))


def _memory_limit(device) -> int:
    from ..dispatch import memory_limit

    return memory_limit(device)


def gather_bytes(p, lengths) -> int:
    """Peak extra bytes of the gather path on the rank with the longest slice: the gathered
    `k, v` (twice: the padded stack and its concatenation) and the single-process FFT op over
    `[L_r, L]` (its own estimate)."""
    from ..ops.linear.fft.plan import estimate_fft_cost

    L, n = sum(lengths), max(lengths)
    el = 8 if p.dtype == torch.float64 else 4 if p.dtype == torch.float32 else 2
    kv = 2 * p.B * p.H * L * (p.D + p.Dv) * el
    return kv + estimate_fft_cost(p.B, p.H, n, L, p.F, p.Dv, p.dtype)[1]


def _grid_reason(p) -> str | None:
    from ..positions.grid import GridTerm

    grids = [type(t).__name__ for t in (p.position, *p.additive) if isinstance(t, GridTerm)]
    if grids:
        return (f"{grids[0]} is a 2D grid term: an image's patches have no distributed form here "
                "(run it on one rank)")
    return None


def linear_kind(p, backend: str) -> str | None:
    """The state-passing kind (`fastrpe.distributed.linear.KINDS`) for problem `p`: the forced
    backend's own kind, or with "auto" the exact kind for its term (chunked for none or a
    geometric decay, band for finite support, bidirectional for none non-causal); None if none."""
    from . import linear

    if backend != "auto":
        return linear.KIND_OF_BACKEND.get(backend)
    kind = linear.choose_kind(p.position, p.causal)
    return None if kind == "soe" else kind  # approximate: only when asked for (backend="soe")


def path_reasons(path: str, p, backend: str = "auto") -> list[str]:
    """Why distributed path `path` cannot run the whole-sequence problem `p` with `backend`
    ("auto" or the forced single-process backend) (empty: it can)."""
    why = _grid_reason(p)
    if why:
        return [why]
    if path == "gather":
        return []
    if path == "ring":
        from .ring import ring_reasons

        r = ring_reasons(p)
        if not p.softmax and backend not in ("auto", "fft"):
            r.append(f"backend={backend!r} is forced (the kernelized ring runs the FFT op on each block)")
        return r
    if path == "linear":
        from . import linear

        if p.softmax:
            return ["the state-passing paths are kernelized (softmax runs on the ring)"]
        kind = linear_kind(p, backend)
        if kind is None:
            what = (f"backend={backend!r} has no state-passing form" if backend != "auto" else
                    f"{type(p.position).__name__} has no exact state-passing form "
                    f"({'causal' if p.causal else 'non-causal'})")
            return [what]
        r = linear.refusal(kind, p)
        return [r] if r else []
    raise FastRPEError(f"path: unknown path {path!r}; known: auto, {', '.join(PATHS)}")


def choose_path(p, backend: str = "auto", path: str = "auto", *, lengths=None, memory_limit: int | None = None) -> str:
    """The distributed path for the whole-sequence problem `p` and `backend`: the forced one
    if it fits, else the first that fits of ring, gather (softmax) or linear (a state-passing
    form: O(F·Dv) sent per rank instead of the keys), then gather if its gathered keys and
    FFT op fit `memory_limit` (it is the faster: one FFT over `[L_r, L]`), else the ring (one
    key block in memory) (kernelized). Without `lengths` and `memory_limit` the kernelized
    choice assumes gather does not fit. Raises `FastRPEError` with the reasons."""
    if path != "auto":
        r = path_reasons(path, p, backend)
        if r:
            raise FastRPEError(f"path={path!r} cannot run this call: " + "; ".join(r))
        return path
    order = ("ring", "gather")
    if not p.softmax:
        fits = lengths is not None and memory_limit is not None and gather_bytes(p, lengths) <= memory_limit
        order = ("linear", "gather", "ring") if fits else ("linear", "ring", "gather")
    refused = {}
    for name in order:
        r = path_reasons(name, p, backend)
        if not r:
            return name
        refused[name] = r
    raise FastRPEError("no distributed path runs this call: "
                       + "; ".join(f"{k}: {', '.join(v)}" for k, v in refused.items()))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel="softmax",
    position=None,
    *,
    causal: bool = False,
    q_offset: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    path: str = "auto",
    group=None,
) -> Tensor:
    """`fastrpe.attention` over a sequence split across the ranks of `group`.

    Args:
        q: `[B, H, L_r, D]`, this rank's contiguous slice of the queries; rank order is
            sequence order and slices may differ in length (every `L_r >= 1`).
        k: `[B, H, L_r, D]` and v: `[B, H, L_r, Dv]`, this rank's slice of keys and values
            (the same positions as q: self-attention).
        kernel, position, causal, scale: as `fastrpe.attention`, over the whole sequence.
        q_offset: None, or this rank's global offset (the sum of the earlier ranks' `L_r`);
            anything else is refused.
        key_padding_mask: `[B, L_r]` bool, True marks padding keys of this slice; ranks
            without one count as no padding.
        backend: as `fastrpe.attention`: "auto" or a single-process backend (refused where the
            single-process call would refuse it); a forced backend with a state-passing form
            ("chunked", "band", "bidirectional", "soe", ...) runs it across ranks, "fft" may
            run block by block on the ring, any other runs on the gathered keys.
        path: "auto" (softmax: ring; kernelized: linear where an exact state-passing form
            exists, else gather when the gathered keys fit the memory limit, else the ring),
            or "ring", "linear", "gather".
        group: the process group (None: the default group). With no process group
            initialized (and group None) or a group of one rank, this is `fastrpe.attention`.

    Returns:
        `[B, H, L_r, Dv]`, this rank's slice of the output, in q's dtype.
    """
    from ..api import attention as _attention

    if not _initialized():
        _check_single(q, k, q_offset, path, group)
        return _attention(q, k, v, kernel, position, causal=causal, key_padding_mask=key_padding_mask,
                          scale=scale, backend=backend)
    call = _agree(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale, backend, path, group)
    if call.world == 1:
        return _attention(q, k, v, kernel, position, causal=causal, key_padding_mask=key_padding_mask,
                          scale=scale, backend=backend)
    single, chosen, _ = _plan(call, backend, path)
    p = call.problem
    mask = key_padding_mask
    if call.has_mask and mask is None:  # another rank has padding: every rank sends a mask
        mask = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    if chosen == "ring":
        from .ring import kernel_ring_attention, ring_attention

        if p.softmax:
            return ring_attention(q, k, v, p, key_padding_mask=mask, has_mask=call.has_mask, lengths=call.lengths,
                                  group=group)
        return kernel_ring_attention(q, k, v, p, key_padding_mask=mask, has_mask=call.has_mask, lengths=call.lengths,
                                     group=group, backend=backend)
    if chosen == "linear":
        from . import linear

        return linear.attention(q, k, v, p.kernel, p.position, causal=causal, group=group, key_padding_mask=mask,
                                kind=linear_kind(p, backend), lengths=call.lengths)
    from .gather import gathered_attention

    return gathered_attention(q, k, v, p.kernel, position, causal=causal, key_padding_mask=mask, scale=scale,
                              backend=backend, lengths=call.lengths, group=group)


def _check_single(q, k, q_offset, path, group) -> None:
    if group is not None:
        raise FastRPEError("group: a process group was given but torch.distributed is not initialized")
    if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4 and k.dim() == 4 and q.shape[2] != k.shape[2]:
        raise FastRPEError(f"k: each rank passes its slice of one sequence (self-attention), so q and k "
                           f"have one length; got Lq={q.shape[2]}, Lk={k.shape[2]}")
    if q_offset not in (None, 0):
        raise FastRPEError(f"q_offset: a single process's slice starts at 0; got q_offset={q_offset}")
    if path not in ("auto", *PATHS):
        raise FastRPEError(f"path: unknown path {path!r}; known: auto, {', '.join(PATHS)}")


def _plan(call: _Call, backend: str, path: str) -> tuple[str, str, dict[str, list[str]]]:
    """`(single-process backend, distributed path, every path's refusal reasons)` for the
    agreed call; raises `FastRPEError` where nothing runs it."""
    from ..dispatch import select_backend

    p = call.problem
    why = _grid_reason(p)
    if why:
        raise FastRPEError(f"position: {why}")
    single = select_backend(p, backend).name  # the single-process semantics (and refusals) of `backend`
    reasons = {name: path_reasons(name, p, backend) for name in PATHS}
    return single, choose_path(p, backend, path, lengths=call.lengths, memory_limit=call.memory_limit), reasons


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel="softmax",
    position=None,
    *,
    causal: bool = False,
    q_offset: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    path: str = "auto",
    group=None,
) -> str:
    """Which distributed path `attention` takes for these arguments (collective: every rank
    calls it), the single-process backend it reproduces, and why the other paths are refused.
    Arguments as `attention`."""
    from ..api import explain as _explain

    if not _initialized():
        _check_single(q, k, q_offset, path, group)
        return "one process: fastrpe.attention\n" + str(_explain(q, k, v, kernel, position, causal=causal,
                                                                  key_padding_mask=key_padding_mask, scale=scale))
    call = _agree(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale, backend, path, group)
    if call.world == 1:
        return "one rank: fastrpe.attention"
    single, chosen, reasons = _plan(call, backend, path)
    lines = [f"distributed attention over {call.world} ranks, slices {call.lengths} (L={sum(call.lengths)}): "
             f"path {chosen!r} (the single-process call would run {single!r}; exact paths give its numbers)"]
    if not call.problem.softmax:
        lines.append(f"  gather would need ~{gather_bytes(call.problem, call.lengths) / 2**20:.3g} MiB on the "
                     f"longest slice; memory limit {call.memory_limit / 2**20:.3g} MiB (the ring holds one block)")
    for name in PATHS:
        mark = "*" if name == chosen else " "
        lines.append(f"{mark} {name:7s} " + ("refused: " + "; ".join(reasons[name]) if reasons[name] else "fits"))
    return "\n".join(lines)
