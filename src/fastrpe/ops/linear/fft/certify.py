"""Row certificates and exact recomputation, without host synchronization.

Each FFT product reports the round-off of each of its output entries (`product.ROUND_OFF`:
from the product's own spectrum, measured with a margin of 2.2), brought to each row's
units. A row is trusted when the estimated error of its numerator is below ROW_RTOL/2 of
`‖num_i‖` and that of its denominator below ROW_RTOL/2 of `|den_i|`, so that
`out_i = num_i/den_i` is within ROW_RTOL. The numerator is judged against its own norm, not
against the denominator: values that average out (`‖out_i‖ ≪ max ‖v_j‖`) lose relative
digits first — a ±30 table at L = 4,096 reached 1.08e-4 when only the denominator was judged.

Rows that fail — queries whose nearest keys give `φ(q)·φ(k) = 0` (relu features), rows
whose own largest coefficient is far below the product's — are recomputed densely and
exactly from their own materialized coefficients. How many fail is not known before the
call; a fixed number per (batch, head), from shapes (`plan.recompute_capacity`), is
recomputed: the first failing rows in index order (so that, causally, whether a row is
recomputed depends only on earlier rows).

Rows that fail beyond that capacity (tables whose values swing by tens of nats across
offsets: a ±30 random walk at L = 4,096 fails most rows) are, in eager mode on the CPU,
recomputed exactly as well, at the price of one read of a count (free there). On a GPU that
read would drain the stream on every call, so there the schedule stays fixed and sync-free by
default, as it does under `torch.compile`, during CUDA-graph capture and inside
`static_schedule()`: such rows are set to NaN (loud, never silently wrong), and the next call
warns, having read the flag back asynchronously. `sync_recompute()` lets a GPU call pay the one
sync and recompute them.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ...common import LaterReads, capturing
from .scale import MAX_RESCALE_NATS

#: the promise: each row's `num/den` within this relative error of the exact value
ROW_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}

_STATIC = [False]
_SYNC_ON_CUDA = [False]
#: the NaN-row flags of GPU calls, read once they have landed (`_warn_pending`)
_PENDING = LaterReads()


@contextmanager
def static_schedule():
    """Within this block the FFT path makes no host synchronization at all: rows it cannot
    certify beyond the fixed recompute capacity come back NaN instead of being recomputed
    (what `torch.compile` and CUDA graphs always get)."""
    prev, _STATIC[0] = _STATIC[0], True
    try:
        yield
    finally:
        _STATIC[0] = prev


@contextmanager
def sync_recompute():
    """Within this block the FFT path on a GPU, in eager mode, makes one host synchronization
    per call to recompute exactly every row beyond the fixed capacity (the CPU always does)."""
    prev, _SYNC_ON_CUDA[0] = _SYNC_ON_CUDA[0], True
    try:
        yield
    finally:
        _SYNC_ON_CUDA[0] = prev


def _may_sync(y: Tensor) -> bool:
    """Eager mode outside `static_schedule()`, on the CPU or inside `sync_recompute()`: one host
    sync to recompute every failing row."""
    if _STATIC[0] or torch.compiler.is_compiling():
        return False
    if y.is_cuda:
        return _SYNC_ON_CUDA[0] and not capturing()
    return True


def _warn_pending() -> None:
    """Warn for earlier GPU calls that returned NaN rows, once their flag has arrived (an event
    query, never a wait). Not while a CUDA graph is captured: an event query there invalidates
    the capture (the flags wait for the next call outside it)."""
    import warnings

    for flag, _ in _PENDING.landed():
        if bool(flag):  # pinned host memory the copy has finished writing: no device sync
            warnings.warn("fastrpe fft: some rows could not be certified and were beyond the fixed recompute "
                          "capacity, so they came back NaN (a table that swings by tens of nats); run the call "
                          "inside fastrpe.ops.linear.fft.sync_recompute() to recompute them exactly (one host "
                          "sync per call)", RuntimeWarning, stacklevel=4)
            _PENDING.clear()


def _flag_later(over: Tensor) -> None:
    """Copy `over.any()` to pinned host memory without waiting; `_warn_pending` reads it later."""
    if not torch.compiler.is_compiling() and _PENDING.accepting():
        _PENDING.add(over.any())


def untrusted_rows(y: Tensor, err: Tensor, lc: Tensor, scale: Tensor) -> Tensor:
    """`[B, H, Lq]` bool: rows whose value `y: [B, H, Lq, C]` cannot be certified within
    ROW_RTOL given the estimated round-off `err: [B, H, Lq, C]` of each entry."""
    with torch.no_grad():
        y = y.detach()
        den_err, num_err = err[..., -1], err[..., :-1].norm(dim=-1)
        rtol = ROW_RTOL[y.dtype] / 2
        den, num = y[..., -1].abs(), y[..., :-1].norm(dim=-1)
        ok = (den_err <= rtol * den) & (num_err <= rtol * num)
        ok = ok | ((den_err == 0) & (num_err == 0))  # no round-off at all (e.g. every product is 0)
        ok = ok & torch.isfinite(y).all(-1)
        # the product's rescaling was clamped for rows this far below the head's maximum
        G = lc.detach().amax(-1, keepdim=True)
        ok = ok & (G - scale <= MAX_RESCALE_NATS[y.dtype])[None]
        return ~ok


def _exact_rows(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, idx: Tensor) -> Tensor:
    """Rows `idx: [B, H, K]` (per batch and head) computed densely: `[B, H, K, C]` in their own units."""
    H, Lq, Lk = lc.shape[0], phi_q.shape[2], phi_k.shape[2]
    heads = torch.arange(H, device=idx.device)[None, :, None]
    # row i's offsets are lc[:, Lq-1-i : Lq-1-i+Lk]; gathered by index, so that backward
    # scatters into [H, R] (an unfolded [H, Lq, Lk] view would need an O(Lq·Lk) gradient)
    offs = (Lq - 1 - idx)[..., None] + torch.arange(Lk, device=idx.device)  # (B, H, K, Lk)
    c = torch.exp(lc[heads[..., None], offs] - scale[heads, idx][..., None])  # (B, H, K, Lk)
    pq = phi_q.gather(2, idx[..., None].expand(-1, -1, -1, phi_q.shape[-1]))  # (B, H, K, F)
    a = (pq @ phi_k.transpose(-1, -2)) * c  # (B, H, K, Lk)
    return a @ vv


def certify_rows(y: Tensor, err: Tensor, phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, lc_fft: Tensor,
                 scale: Tensor, empty: Tensor, capacity: int, chunk: int) -> Tensor:
    """`y: [B, H, Lq, C]` with its untrusted rows recomputed exactly (`capacity` per batch and
    head, `chunk` at a time) and any beyond the capacity set to NaN; rows that see no
    coefficient at all (`empty: [H, Lq]`) are exactly 0. `lc`: the log-coefficients;
    `lc_fft`: the part of them the FFT products multiplied; `err`: their estimated round-off."""
    B, H, Lq, C = y.shape
    bad = untrusted_rows(y, err, lc_fft, scale) & ~empty  # (B, H, Lq)
    with torch.no_grad():
        # the first `capacity` untrusted rows of each (batch, head), in index order
        rank = torch.where(bad, Lq - torch.arange(Lq, device=y.device), 0)
        key, idx = rank.topk(capacity, dim=-1, sorted=True)  # (B, H, K)
        chosen = key > 0
        done = torch.zeros_like(bad).scatter(2, idx, chosen)
    y = _recompute(y, idx, chosen, phi_q, phi_k, vv, lc, scale, chunk)
    over = bad & ~done
    if y.is_cuda and not torch.compiler.is_compiling():
        _warn_pending()
    if _may_sync(y):
        n = int(over.sum(-1).amax())  # the one host sync: how many rows the capacity missed
        if n:
            with torch.no_grad():
                key2, idx2 = torch.where(over, Lq - torch.arange(Lq, device=y.device), 0).topk(n, dim=-1)
            y = _recompute(y, idx2, key2 > 0, phi_q, phi_k, vv, lc, scale, chunk)
            over = torch.zeros_like(over)
    elif y.is_cuda and not _STATIC[0]:
        _flag_later(over)
    y = torch.where(over[..., None], torch.full_like(y, float("nan")), y)
    return torch.where(empty[None, :, :, None], torch.zeros_like(y), y)


def _recompute(y: Tensor, idx: Tensor, chosen: Tensor, phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor,
               scale: Tensor, chunk: int) -> Tensor:
    """`y` with rows `idx: [B, H, K]` (where `chosen`) replaced by their exact values."""
    C = y.shape[-1]
    parts = []
    for s in range(0, idx.shape[-1], chunk):  # a static loop: sizes come from shapes
        args = (phi_q, phi_k, vv, lc, scale, idx[..., s:s + chunk])
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
            # recomputed in backward: the [B, H, chunk, Lk] weights are not kept
            parts.append(checkpoint(_exact_rows, *args, use_reentrant=False))
        else:
            parts.append(_exact_rows(*args))
    exact = torch.cat(parts, dim=2)  # (B, H, K, C)
    ie = idx[..., None].expand(-1, -1, -1, C)
    return y.scatter(2, ie, torch.where(chosen[..., None], exact, y.gather(2, ie)))
