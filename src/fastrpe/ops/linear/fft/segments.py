"""Sums of parts over row ranges, each part computed from its own rows of the inputs, with a
backward that adds each part's input gradients in place at those rows.

The causal recursion's segments (`causal.py`) and the non-causal near band's blocks of rows
(`band.py`) are both such sums: part `(qa, qb, ka, kb)` reads queries `qa..qb-1`, keys
`ka..kb-1` and the log-coefficients of their offsets, and adds to output rows `qa..qb-1`.

Autograd left to itself makes every part's slices of `phi_q`, `phi_k`, `vv`, `lc` a full-size
gradient (`slice_backward`: zeros and a copy) and sums one per part into each input:
O(parts · L). At 262,144 tokens (B·H = 8, an H200's budget: 16 chunks, 240 segments) that was
1.0 of the 5.4 TB the causal call moved, at 1,048,576 (the recursion's 1,023 segments) 16.9 of
38.8 TB, more than its FFTs (`benchmarks/fft_at_scale.py`). Here each part's graph is kept as
autograd would keep it, through the gradient edge of its output (not the output itself: its
storage is freed), and the backward runs it alone (`torch.autograd.grad`) and adds what it
returns in place. A part that must not keep its temporaries until the backward (a leaf's or a
band block's weights) checkpoints itself, and its graph then holds only its input slices.

Inputs, in this order: `phi_q [B, H, Lq, F]`, `phi_k [B, H, Lk, F]`, `vv [B, H, Lk, C]`,
`lc [H, Lq+Lk-1]` (offset d at `Lq-1+q_offset-d`), `scale [H, Lq]`.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def segment_slice(seg: tuple, i: int, t: Tensor, Lq: int) -> Tensor:
    """Input i's rows for a part `seg = (kind, qa, qb, ka, kb, ...)`: queries `qa..qb-1`
    against keys `ka..kb-1`."""
    qa, qb, ka, kb = seg[1:5]
    if i == 0:  # phi_q: the queries' rows
        return t[:, :, qa:qb]
    if i == 4:  # scale: the queries' rows
        return t[:, qa:qb]
    if i in (1, 2):  # phi_k, vv: the keys' rows
        return t[:, :, ka:kb]
    s = ka - qb + Lq  # lc: the part's offsets, in its own origin `(qb-qa)-1 + (q_offset+qa-ka)`
    return t[:, s: s + (qb - qa) + (kb - ka) - 1]


def segment_slices(seg: tuple, ins: tuple[Tensor, ...]) -> list[Tensor]:
    """A part's `(phi_q, phi_k, vv, lcs, scale)`: its queries' and keys' rows, and the
    log-coefficients of its offsets."""
    Lq = ins[0].shape[2]
    return [segment_slice(seg, i, t, Lq) for i, t in enumerate(ins)]


#: `part(seg, args) -> (out [B, H, qb-qa, C], err or None)` from the part's slices
Part = Callable[[tuple, list], tuple]


def recomputed(fn: Callable, *args):
    """`fn(*args)`, recomputed in backward (checkpoint) where a tensor argument wants a gradient:
    a part whose temporaries (a leaf's or a band block's weights) autograd would otherwise keep
    until the backward, for every part at once."""
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def segment_sums(part: Part, segments: list, y: Tensor, err: Tensor | None, ins: tuple[Tensor, ...]):
    """`(y + Σ parts, err + Σ part errors)`, each part added at its query rows, in place into
    `y` and `err` (which the caller gives up). With a gradient wanted (and not under
    `torch.compile`, whose joint graph is the compiler's) the backward adds each part's
    input gradients in place (`SegmentSums`); otherwise a plain loop."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in ins) and not torch.compiler.is_compiling():
        return SegmentSums.apply(part, segments, y, err, *ins)
    for seg in segments:
        qa, qb = seg[1], seg[2]
        out, out_err = part(seg, segment_slices(seg, ins))
        rows = torch.arange(qa, qb, device=y.device)
        if out_err is not None:
            err.index_add_(2, rows, out_err)
        y.index_add_(2, rows, out)  # its backward passes the gradient through and gathers the part's rows
    return y, err


class SegmentSums(torch.autograd.Function):
    """`(y + Σ parts, err + Σ part errors)` in place over the parts, with the backward of the
    module docstring. A second backward through a retained graph makes each part again (the
    first freed their graphs)."""

    @staticmethod
    def forward(ctx, part, segments, y, err, *ins):
        from torch.autograd.graph import get_gradient_edge

        needs = ctx.needs_input_grad[4:]
        kept = []
        sums = y.detach(), (None if err is None else err.detach())  # the adds recorded by no graph
        with torch.enable_grad():
            for seg in segments:
                qa, qb = seg[1], seg[2]
                args = _leaves(seg, ins, needs)
                out, out_err = part(seg, args)
                sums[0][:, :, qa:qb] += out.detach()
                if out_err is not None:
                    sums[1][:, :, qa:qb] += out_err.detach()
                if out.requires_grad:
                    kept.append((seg, args, get_gradient_edge(out)))
                del out, out_err
        ctx.save_for_backward(*ins)
        ctx.part, ctx.segments, ctx.kept = part, segments, kept
        ctx.mark_dirty(*(t for t in (y, err) if t is not None))
        if err is not None:
            ctx.mark_non_differentiable(err)
        return y, err

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, _gerr):
        ins, needs = ctx.saved_tensors, ctx.needs_input_grad[4:]
        kept, ctx.kept = ctx.kept, None
        if kept is None:  # a retained graph's second backward: each part made again
            kept = _remade(ctx.part, ctx.segments, ins, needs)
        # one part (a band in one block): its gradients are the inputs', no zeros to add them to
        alone = len(ctx.segments) == 1
        grads = [torch.zeros_like(t) if n and not alone else None for t, n in zip(ins, needs)]
        Lq = gy.shape[2]
        for seg, args, out in kept:
            qa, qb = seg[1], seg[2]
            want = [i for i, a in enumerate(args) if a.requires_grad]
            got = torch.autograd.grad([out], [args[i] for i in want], grad_outputs=[gy[:, :, qa:qb]],
                                      allow_unused=True)
            for i, g in zip(want, got):
                if g is None:
                    continue
                if alone and g.shape == ins[i].shape:
                    grads[i] = g
                    continue
                if grads[i] is None:
                    grads[i] = torch.zeros_like(ins[i])
                segment_slice(seg, i, grads[i], Lq).add_(g)
        return (None, None, gy, None, *grads)


def _leaves(seg: tuple, ins: tuple[Tensor, ...], needs) -> list[Tensor]:
    """The part's slices of the inputs as leaves of a graph of its own."""
    return [t.detach().requires_grad_(n) for t, n in zip(segment_slices(seg, ins), needs)]


def _remade(part: Part, segments: list, ins: tuple[Tensor, ...], needs):
    """`(segment, leaves, out)` for each part, its graph made again, one at a time."""
    for seg in segments:
        with torch.enable_grad():
            args = _leaves(seg, ins, needs)
            out, _ = part(seg, args)
        if out.requires_grad:
            yield seg, args, out
