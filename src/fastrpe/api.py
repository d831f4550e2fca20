"""`fastrpe.attention` and `fastrpe.explain`: the functional entry points."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import backends as _backends  # noqa: F401  (registers the built-in backends)
from ._validate import FastRPEError, check_key_padding_mask, check_qkv, check_scale, resolve_q_offset
from .dispatch import Explanation, Problem, explain_problem, select_backend
from .kernels import FeatureMap, get_kernel
from .positions.base import AdditiveTerm, Position

PositionSpec = Position | AdditiveTerm | Sequence[Position | AdditiveTerm] | None


def _split_position(position: PositionSpec, H: int, device: torch.device):
    if position is None:
        items: list = []
    elif isinstance(position, (Position, AdditiveTerm)):
        items = [position]
    elif isinstance(position, (list, tuple)):
        items = list(position)
    else:
        raise FastRPEError(
            f"position must be a fastrpe.positions term, a list of them, or None; got {type(position).__name__}"
        )
    mult = [t for t in items if isinstance(t, Position)]
    add = [t for t in items if isinstance(t, AdditiveTerm)]
    bad = [t for t in items if not isinstance(t, (Position, AdditiveTerm))]
    if bad:
        raise FastRPEError(f"position: {type(bad[0]).__name__} is not a fastrpe positional term")
    if len(mult) > 1:
        raise FastRPEError("position: at most one log-coefficient term (Position) per call; "
                           f"got {[type(t).__name__ for t in mult]}")
    for t in items:
        if t.num_heads != H:
            raise FastRPEError(f"position: {type(t).__name__} has num_heads={t.num_heads} but q has H={H}")
        for prm in list(t.parameters()) + list(t.buffers()):
            if prm.device != device:
                raise FastRPEError(f"position: {type(t).__name__} is on {prm.device}, q/k/v on {device}")
    return (mult[0] if mult else None), tuple(add)


def _problem(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale) -> tuple[Problem, Tensor | None]:
    check_qkv(q, k, v)
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    try:
        kern = get_kernel(kernel, head_dim=D)
    except ValueError as e:
        raise FastRPEError(str(e)) from None
    if isinstance(kern, FeatureMap):
        kern = kern.to(q.device)
    pos, add = _split_position(position, H, q.device)
    if not isinstance(causal, bool):
        raise FastRPEError(f"causal must be a bool, got {causal!r}")
    off = resolve_q_offset(Lq, Lk, causal, q_offset)
    kpm = check_key_padding_mask(key_padding_mask, B, Lk, q.device)
    check_scale(scale)  # inf made every softmax row NaN
    needs_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or any(p.requires_grad for t in ([pos] if pos else []) + list(add) for p in t.parameters())
        or (isinstance(kern, FeatureMap) and any(p.requires_grad for p in kern.parameters()))
    )
    p = Problem(B, H, Lq, Lk, D, Dv, q.dtype, q.device, kern, pos, add, causal, off, kpm is not None,
                needs_grad, scale)
    return p, kpm


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel="softmax",
    position: PositionSpec = None,
    *,
    causal: bool = False,
    q_offset: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Attention with a relative positional term.

    Args:
        q: `[B, H, Lq, D]` queries, at positions `q_offset + 0..Lq-1`.
        k: `[B, H, Lk, D]` keys, at positions `0..Lk-1`.
        v: `[B, H, Lk, Dv]` values.
        kernel: "softmax", a feature-map name ("elu", "relu", "exp", "prf", "orf", "sphere_prf",
            "trf", "dpfp"; prefix "n" to l2-normalize q/k first, e.g. "nprf") or a `fastrpe.kernels` object.
        position: a `fastrpe.positions` term (log-coefficients `b_h(j-i)`: softmax adds it to the
            scores, kernelized attention weighs by `exp(b)`), an additive term (FastRPB, Shaw),
            a list with at most one of the former and any of the latter, or None.
        causal: keys `j > i` are never seen.
        q_offset: position of the first query; default 0, or `Lk - Lq` when causal with `Lq < Lk`.
        key_padding_mask: `[B, Lk]` bool, True marks padding keys (ignored).
        scale: softmax score scale, default `D**-0.5` (feature maps carry their own scaling).
        backend: "auto" (cheapest that supports the call, see `explain`) or a backend name.

    Returns:
        `[B, H, Lq, Dv]` in q's dtype. A row with no admissible key (all weights 0) is 0.
    """
    p, kpm = _problem(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale)
    b = select_backend(p, backend, (q, k, v, kpm))  # the "measure" policy times on these
    return b.run(q, k, v, p, kpm)


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel="softmax",
    position: PositionSpec = None,
    *,
    causal: bool = False,
    q_offset: int | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    allow_approximate: bool = False,
) -> Explanation:
    """Which backend `attention(..., backend="auto")` picks for these arguments, every
    candidate's estimated time and memory, and why the others are refused. `print()` it."""
    p, _ = _problem(q, k, v, kernel, position, causal, q_offset, key_padding_mask, scale)
    return explain_problem(p, allow_approximate=allow_approximate)
