"""Context parallelism for the linear-time kernelized paths: states passed between ranks.

Each rank holds a contiguous slice of the sequence (rank order is sequence order; slices may
differ in length) with its queries and keys at the same positions (self-attention). Luo
et al. 2021 Eq. 10 for this rank's queries,

    out_i = Σ_j φ(q_i)·φ(k_j)·c(j-i)·v_j / Σ_j φ(q_i)·φ(k_j)·c(j-i),

splits into the pairs inside the slice (the single-process op on the slice alone, its
positions shifted: every term here is Toeplitz) and the pairs with keys of other ranks,
which reach this rank only through small summaries, all sent in ONE differentiable
all-gather per call (so one backward all-reduce; `comm.tie` makes it run on every rank):

* ``"chunked"`` (geometric decay `c(r) = γ^|r|`, or none, γ = 1; Sun et al. 2023 RetNet /
  ALiBi): each rank's state after its last key `S_s = Σ_j γ^(e_s-1-j) φ(k_j) ⊗ [v_j, 1]`;
  rank r reads `Σ_{s<r} γ^(o_r - e_s) S_s` decayed by `γ^(i+1)` to its query i.
  Non-causal adds the mirror sweep: `R_s = Σ_j γ^(j-o_s) φ(k_j) ⊗ [v_j, 1]` from later ranks,
  and inside the slice a reversed causal pass without the diagonal.
* ``"soe"`` (any decaying term, causal, `SoEPlan` from `ops/linear/soe.py`): the K decayed
  states of the sum of exponentials, plus the exact band correction `corr(d)`, `d < W`,
  against the previous ranks' last `W-1` keys (a halo that may span several ranks).
* ``"band"`` (finite support: `b(r) = b(±W)` beyond `|r| >= W`, T5 / clipped tables): the
  previous ranks' last `W-1` keys (exact band) and the undecayed sum of their other keys
  (constant tail `exp(b(-W))`); non-causal mirrors both with the next ranks' first `W-1` keys.
* ``"bidirectional"`` (non-causal, no positional term): one all-reduce of `Σ_j φ(k_j) ⊗ [v_j, 1]`.

What one call sends from each rank (elements, forward; the backward all-reduce of the
gathered stack sends about twice `P` times that; `comm.counting()` measures it), with
`C = Dv + 1`, `P` ranks, plus one integer per rank for the slice lengths unless `lengths`
is given:

    chunked causal       (P-1)·B·H·F·C            non-causal: 2·(P-1)·B·H·F·C
    soe                  (P-1)·B·H·(K·F·C + (W-1)·(F+C))
    band causal          (P-1)·B·H·(F·C + (W-1)·(F+C))   non-causal: twice that
    bidirectional        2·(P-1)/P·B·H·F·C  (all-reduce)

independent of the sequence length (softmax's ring sends every key: `(P-1)·B·H·L/P·(D+Dv)`).

Entry points:
* `num_den(phi_q, phi_k, v, *, kind, causal, group, ...)`: this rank's `(num, den)` from
  features (for a dispatcher that builds the features and the positional data itself);
* `refusal(kind, ...)`: why a path cannot run a call (None if it can);
* `attention(q, k, v, kernel, position, *, causal, group, ...)`: the whole kernelized
  computation (features, shared key shifts all-reduced across ranks, path choice from the
  positional term, division), for `fastrpe.distributed.attention` to call.

Gradients: q, k, v get exactly their slice of the single-process gradient. A positional
term's parameters, replicated on every rank, get on each rank the part of the gradient
this rank computed: sum them over the group (as `fastrpe.train` does) for the full gradient.

Notation: B batch, H heads, L this rank's slice length, F features, Dv value width,
C = Dv + 1, K exponentials, W band width, h = W - 1 halo keys, P ranks, r this rank,
o_s / e_s the first position / one past the last position of rank s's slice, N = e_{P-1}.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as Fn
from torch import Tensor

from .._validate import FastRPEError, check_key_padding_mask, check_qkv
from ..kernels import Exp, FeatureMap, get_kernel
from ..ops.common import safe_divide
from ..ops.linear.band import kernelized_num_den_band
from ..ops.linear.chunked import kernelized_num_den_chunked
from ..ops.linear.soe import SoEPlan, kernelized_num_den_soe, soe_plan_for
from ..positions.base import Position
from . import comm

__all__ = ["KINDS", "KIND_OF_BACKEND", "num_den", "refusal", "attention", "choose_kind"]

#: the linear-time paths this module runs across ranks
KINDS = ("chunked", "soe", "band", "bidirectional")


# ---------------------------------------------------------------------------------------------
# Refusals and the path for a positional term


def refusal(kind: str, problem=None, *, causal: bool | None = None, kernel=None, position=None,
            window: int | None = None, plan: SoEPlan | None = None) -> str | None:
    """Why the distributed linear path `kind` cannot run this call (one line), or None.

    Args:
        kind: one of `KINDS`.
        problem: the whole sequence's `fastrpe.dispatch.Problem` (what `fastrpe.distributed`
            passes); or give its parts: causal, kernel (a feature map or its name), position
            (a `fastrpe.positions.Position` or None).
        window / plan: the band width / SoE fit a caller of `num_den` will pass.
    """
    if problem is not None:
        causal, kernel, position = problem.causal, problem.kernel, problem.position
        if problem.additive:
            names = ", ".join(type(t).__name__ for t in problem.additive)
            return f"additive terms ({names}) have no distributed linear form yet (gather runs them)"
    if causal is None:
        raise TypeError("refusal: give problem or causal")
    if kind not in KINDS:
        return f"kind must be one of {KINDS}, got {kind!r}"
    if kernel is not None:
        if isinstance(kernel, str):
            try:
                kernel = get_kernel(kernel, head_dim=1) if kernel != "softmax" else kernel
            except ValueError as e:
                return str(e)
        if not isinstance(kernel, FeatureMap):
            return "the linear-time paths are kernelized: softmax runs on the ring"
        if causal and kernel.per_key_shift_when_causal:
            return (f"causal {kernel.name!r} needs a running maximum over keys, which no linear-time path has; "
                    "use its normalized form (e.g. 'nexp')")
        if type(kernel).key_features is not FeatureMap.key_features and not isinstance(kernel, Exp):
            return f"{type(kernel).__name__} shifts keys by a data-dependent amount this module cannot share across ranks"
    if kind == "bidirectional":
        if causal:
            return "bidirectional is non-causal only (chunked is the causal form)"
        if position is not None:
            return f"bidirectional runs without a positional term, got {type(position).__name__}"
    elif kind == "chunked":
        if position is not None and position.geometric_decay() is None:
            return f"{type(position).__name__} is not a geometric decay γ^|r| (chunked needs one)"
    elif kind == "soe":
        if not causal:
            return "soe is causal only (non-causal decaying terms: gather the keys, fft)"
        if position is None and plan is None:
            return "soe needs a positional term (chunked runs none)"
    elif kind == "band":
        W = window if window is not None else (position.finite_support() if position is not None else None)
        if W is None:
            return ("band needs a finite-support term (constant beyond a distance W)" if position is None else
                    f"{type(position).__name__} is not constant beyond a finite distance")
        if int(W) < 1:
            return f"window must be >= 1, got {W}"
    return None


def choose_kind(position, causal: bool) -> str | None:
    """The exact linear path for `position` (None: no positional term), or "soe" (approximate)
    for another causal decaying term, or None where no linear path runs it."""
    if position is None:
        return "chunked" if causal else "bidirectional"
    if position.geometric_decay() is not None:
        return "chunked"
    if position.finite_support() is not None:
        return "band"
    return "soe" if causal else None


# ---------------------------------------------------------------------------------------------
# Helpers


def _with_ones(v: Tensor, dt) -> Tensor:
    """`[B, H, L, C]`: `[v, 1]`, the denominator as the last channel."""
    return torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)


def _gather_parts(parts: Sequence[Tensor], group) -> tuple[Tensor, list[list[Tensor]]]:
    """One differentiable all-gather of several tensors (same shapes on every rank):
    `(stack [P, n], pieces[s][k])` with piece k of rank s in its own shape."""
    flat = torch.cat([p.reshape(-1) for p in parts])  # (n,)
    st = comm.all_gather(flat, group)  # (P, n)
    out = []
    for s in range(st.shape[0]):
        i, ps = 0, []
        for p in parts:
            ps.append(st[s, i: i + p.numel()].view(p.shape))
            i += p.numel()
        out.append(ps)
    return st, out


def _last(x: Tensor, h: int) -> Tensor:
    """`[B, H, h, ...]`: the last h positions of `x: [B, H, L, ...]`, zero-padded in front."""
    t = x[:, :, max(0, x.shape[2] - h):]
    return Fn.pad(t, (0, 0, h - t.shape[2], 0))


def _first(x: Tensor, h: int) -> Tensor:
    """`[B, H, h, ...]`: the first h positions of `x`, zero-padded behind."""
    t = x[:, :, :h]
    return Fn.pad(t, (0, 0, 0, h - t.shape[2]))


def _outer_sum(phi_k: Tensor, vv: Tensor) -> Tensor:
    """`[B, H, F, C]`: `Σ_j φ(k_j) ⊗ vv_j`."""
    return torch.einsum("bhjf,bhjc->bhfc", phi_k, vv)


def _halo_left(pieces, lengths, offsets, rank: int, h: int, slot: int, F: int):
    """The last-h keys of the ranks before `rank`: `(keys [B, H, n, F], vv [B, H, n, C], pos [n])`."""
    ks, vs, ps = [], [], []
    for s in range(rank):
        n = min(lengths[s], h)
        blk = pieces[s][slot][:, :, h - n:]  # (B, H, n, F+C): the real keys of rank s's tail
        ks.append(blk[..., :F])
        vs.append(blk[..., F:])
        ps.append(torch.arange(offsets[s] + lengths[s] - n, offsets[s] + lengths[s]))
    return ks, vs, ps


def _halo_right(pieces, lengths, offsets, rank: int, h: int, slot: int, F: int):
    """The first-h keys of the ranks after `rank`."""
    ks, vs, ps = [], [], []
    for s in range(rank + 1, len(lengths)):
        n = min(lengths[s], h)
        blk = pieces[s][slot][:, :, :n]
        ks.append(blk[..., :F])
        vs.append(blk[..., F:])
        ps.append(torch.arange(offsets[s], offsets[s] + n))
    return ks, vs, ps


def _cat(xs: list[Tensor], like: Tensor, width: int) -> Tensor:
    if not xs:
        return like.new_zeros(like.shape[0], like.shape[1], 0, width)
    return torch.cat(xs, 2)


# ---------------------------------------------------------------------------------------------
# The paths


def _chunked(phi_q, phi_k, v, gamma, causal, group, lengths, offsets, rank):
    B, H, L, F = phi_q.shape
    dt, dev = phi_q.dtype, phi_q.device
    num, den, _, S = kernelized_num_den_chunked(phi_q, phi_k, v, gamma=gamma, return_state=True)
    y = torch.cat([num, den[..., None]], -1)  # (B, H, L, C)
    log_g = torch.zeros(H, dtype=dt, device=dev) if gamma is None else torch.log(gamma.to(dt))  # (H,)
    i = torch.arange(L, device=dev, dtype=dt)
    parts = [S]
    if not causal:
        # inside the slice, keys after the query: the reversed causal pass with one zero key in
        # front, so key j' sits at j'+1 and only j' < i' is seen, one step too little decayed
        pad = (0, 0, 1, 0)
        n2, d2, _, R = kernelized_num_den_chunked(phi_q.flip(2), Fn.pad(phi_k.flip(2), pad), Fn.pad(v.flip(2), pad),
                                                  gamma=gamma, return_state=True)
        g = torch.exp(log_g)[None, :, None, None]
        y = y + g * torch.cat([n2, d2[..., None]], -1).flip(2)
        parts.append(R)  # Σ_j γ^j φ(k_j) ⊗ vv_j: the slice's keys seen from its first position
    st, pieces = _gather_parts(parts, group)
    o, e = offsets[rank], offsets[rank] + L
    S_in = torch.zeros_like(S)
    for s in range(rank):  # the state after key o-1
        S_in = S_in + torch.exp(log_g * (o - offsets[s] - lengths[s]))[None, :, None, None] * pieces[s][0]
    qd = phi_q * torch.exp(log_g[:, None] * (i + 1))[None, :, :, None]  # γ^(i+1) φ(q_i)
    y = y + qd @ S_in
    if not causal:
        R_in = torch.zeros_like(S)
        for s in range(rank + 1, len(lengths)):  # the keys after e-1, seen from position e
            R_in = R_in + torch.exp(log_g * (offsets[s] - e))[None, :, None, None] * pieces[s][1]
        y = y + (phi_q * torch.exp(log_g[:, None] * (L - i))[None, :, :, None]) @ R_in
    return comm.tie(y, st), None


def _soe(phi_q, phi_k, v, plan: SoEPlan, group, lengths, offsets, rank):
    B, H, L, F = phi_q.shape
    dt, dev = phi_q.dtype, phi_q.device
    W, h = plan.window, plan.window - 1
    num, den, _, S = kernelized_num_den_soe(phi_q, phi_k, v, plan=plan, return_state=True)  # S: (B, H, K, F, C)
    y = torch.cat([num, den[..., None]], -1)
    vv = _with_ones(v, dt)
    st, pieces = _gather_parts([S, _last(torch.cat([phi_k, vv], -1), h)], group)
    o = offsets[rank]
    gam = plan.gamma  # (K,) float64
    S_in = torch.zeros_like(S)
    for s in range(rank):  # every term's state after key o-1
        S_in = S_in + (gam ** float(o - offsets[s] - lengths[s])).to(dt)[None, None, :, None, None] * pieces[s][0]
    if rank:  # far field: query i reads the states with a_k·γ_k^(i+1)
        i = torch.arange(L, device=dev, dtype=torch.float64)
        qfar = (plan.a[:, :, None] * gam[None, :, None] ** (i + 1)).to(dt)  # (H, K, L)
        u = torch.einsum("bhif,bhkfc->bhkic", phi_q, S_in)  # (B, H, K, L, C)
        y = y + torch.einsum("hki,bhkic->bhic", qfar, u)
    # exact band: corr(d) for the previous ranks' keys at distance d < W (only the first h queries)
    ks, vs, ps = _halo_left(pieces, lengths, offsets, rank, h, 1, F)
    qa = min(L, h)
    if ks and qa:
        kh, vh, ph = _cat(ks, phi_k, F), _cat(vs, vv, vv.shape[-1]), torch.cat(ps).to(dev)
        d = (o + torch.arange(qa, device=dev))[:, None] - ph[None, :]  # (qa, n) >= 1
        cw = plan.corr.to(dt)[:, d.clamp(0, W - 1)].masked_fill((d >= W)[None], 0.0)  # (H, qa, n)
        yb = (torch.einsum("bhif,bhjf->bhij", phi_q[:, :, :qa], kh) * cw[None]) @ vh  # (B, H, qa, C)
        y = torch.cat([y[:, :, :qa] + yb, y[:, :, qa:]], 2)
    return comm.tie(y, st), None


def _row_max(table: Tensor, lo: Tensor, hi: Tensor, W: int) -> Tensor:
    """`[H, L]`: max of `table[:, r + W]` over `lo_i <= r <= hi_i` (clipped to `[-W, W]`: the
    term is constant beyond), detached; 0 where every entry is `-inf`."""
    g = table.detach()  # (H, X), X = 2W+1
    idx = torch.arange(g.shape[1], device=g.device)
    # M[h, a, b] = max g[h, a..b]: a running maximum from every start a (X² entries, not L·X)
    ab = g[:, None, :].masked_fill((idx[None, :] < idx[:, None])[None], float("-inf")).cummax(-1).values
    m = ab[:, lo.clamp(-W, W) + W, hi.clamp(-W, W) + W]  # (H, L)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _band(phi_q, phi_k, v, table: Tensor, W: int, causal: bool, group, lengths, offsets, rank):
    B, H, L, F = phi_q.shape
    dt, dev = phi_q.dtype, phi_q.device
    h = W - 1
    N = sum(lengths)
    o = offsets[rank]
    table = table.to(dt)  # (H, 2W+1): b(r), r = -W..W
    r_loc = torch.arange(-(L - 1), L, device=dev)
    num, den, mrow = kernelized_num_den_band(phi_q, phi_k, v, table[:, r_loc.clamp(-W, W) + W], window=W, causal=causal)
    p = o + torch.arange(L, device=dev)  # global query positions
    M = _row_max(table, -p, torch.zeros_like(p) if causal else N - 1 - p, W).to(dt)  # (H, L): the row's scale
    y = torch.cat([num, den[..., None]], -1) * torch.exp((mrow - M).clamp_max(0.0))[None, ..., None]
    vv = _with_ones(v, dt)
    kv = torch.cat([phi_k, vv], -1)  # (B, H, L, F+C)
    C = vv.shape[-1]
    parts = [_last(kv, h), _outer_sum(phi_k[:, :, :max(0, L - h)], vv[:, :, :max(0, L - h)])]
    if not causal:
        parts += [_first(kv, h), _outer_sum(phi_k[:, :, h:], vv[:, :, h:])]
    st, pieces = _gather_parts(parts, group)

    qa = min(L, h)
    for side in ("left",) if causal else ("left", "right"):
        if side == "left":  # earlier ranks: their last h keys, and the sum of the others
            ks, vs, ps = _halo_left(pieces, lengths, offsets, rank, h, 0, F)
            far = sum((pieces[s][1] for s in range(rank)), torch.zeros_like(parts[1]))
            rows = slice(0, qa)  # only the first h queries have a previous rank's key in their band
            rest = slice(qa, L)
            tail_b, has_tail = table[:, 0], p >= W  # a key at distance >= W exists before
        else:  # later ranks: their first h keys, and the sum of the others
            ks, vs, ps = _halo_right(pieces, lengths, offsets, rank, h, 2, F)
            far = sum((pieces[s][3] for s in range(rank + 1, len(lengths))), torch.zeros_like(parts[1]))
            rows, rest = slice(L - qa, L), slice(0, L - qa)
            tail_b, has_tail = table[:, -1], p + W <= N - 1
        kh, vh = _cat(ks, phi_k, F), _cat(vs, vv, C)
        ph = torch.cat(ps).to(dev) if ps else torch.zeros(0, dtype=torch.long, device=dev)
        ct = torch.exp((tail_b[:, None] - M).masked_fill(~has_tail[None], float("-inf")))  # (H, L)
        qt = phi_q * ct[None, ..., None]  # (B, H, L, F): rows weighted by the tail coefficient
        # every row: the far keys, all in its tail; rows out of reach of the halo: the halo too
        y_far = qt @ far
        y_rest = qt[:, :, rest] @ _outer_sum(kh, vh)
        # rows within reach of the halo: each pair's own coefficient (b is constant beyond ±W)
        rr = ph[None, :] - p[rows][:, None]  # (qa, n) offsets j - i
        cw = torch.exp(table[:, rr.clamp(-W, W) + W] - M[:, rows][..., None])  # (H, qa, n)
        y_rows = (torch.einsum("bhif,bhjf->bhij", phi_q[:, :, rows], kh) * cw[None]) @ vh  # (B, H, qa, C)
        y_halo = torch.cat([y_rows, y_rest] if side == "left" else [y_rest, y_rows], 2)
        y = y + y_far + y_halo
    return comm.tie(y, st), M


# ---------------------------------------------------------------------------------------------
# Entry points


def _slices(L: int, group, device, lengths: Sequence[int] | None):
    rank, size = comm.world(group)
    if lengths is None:
        lengths = comm.slice_lengths(L, group, device=device)
    lengths = [int(n) for n in lengths]
    if len(lengths) != size or lengths[rank] != L:
        raise FastRPEError(f"lengths must hold every rank's slice length ({size} ranks, this one {L}), got {lengths}")
    if min(lengths) < 1:  # every rank sees the same lengths, so every rank raises
        raise FastRPEError(f"every rank needs a slice of at least one token, got lengths {lengths}")
    offsets = [sum(lengths[:s]) for s in range(size)]
    return rank, lengths, offsets


def num_den(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, kind: str, causal: bool, group=None,
            gamma: Tensor | None = None, plan: SoEPlan | None = None, table: Tensor | None = None,
            window: int | None = None, key_padding_mask: Tensor | None = None,
            lengths: Sequence[int] | None = None, return_log_scale: bool = False):
    """This rank's sums `Σ_j φ(q_i)·φ(k_j)·c(j-i)·[v_j, 1]` over the keys of every rank.

    Collective: every rank of `group` must call it with the same `kind`, `causal` and shapes
    (but its own slice length), and run its backward.

    Args:
        phi_q: `[B, H, L, F]` this rank's query features; phi_k: `[B, H, L, F]` its key features
            (one shift shared by all keys of all ranks: see `attention`); v: `[B, H, L, Dv]`.
            The queries sit at the keys' positions (global offset from the ranks' lengths).
        kind: "chunked" (`gamma: [H]` decays in (0, 1], or None for no term), "soe" (causal;
            `plan`: the `SoEPlan` fitted for the whole sequence's length, as the single-process
            backend does with `soe_plan_for(position, N)`), "band" (`table: [H, 2W+1]`, `b(r)`
            for `r = -W..W`, i.e. `position.log_coefficients(W+1, W+1)`, and `window` W) or
            "bidirectional" (non-causal, no term).
        causal: keys after the query are not seen.
        group: the process group (None: the default one; no initialized group: one rank).
        key_padding_mask: `[B, L]` bool, True marks this rank's padding keys.
        lengths: every rank's slice length, if known (saves one all-gather).
        return_log_scale: also return `log_scale` (`[H, L]`; the true sums are `num·exp(log_scale)`:
            band takes each row's largest log-coefficient out; zeros for the others).

    Returns:
        `(num [B, H, L, Dv], den [B, H, L])`, in phi_q's dtype (+ `log_scale`).
    """
    why = refusal(kind, causal=causal, window=window, plan=plan)
    if why:
        raise FastRPEError(f"kind: {why}")
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape[:3] + phi_k.shape[3:] or phi_k.shape[3] != phi_q.shape[3]:
        raise FastRPEError(f"phi_q and phi_k must both be [B, H, L, F] with the same L (this rank's slice), "
                           f"got {tuple(phi_q.shape)} and {tuple(phi_k.shape)}")
    if v.shape[:3] != phi_k.shape[:3]:
        raise FastRPEError(f"v must be [B, H, L, Dv] like phi_k, got {tuple(v.shape)}")
    B, H, L, F = phi_q.shape
    dt = phi_q.dtype
    rank, lengths, offsets = _slices(L, group, phi_q.device, lengths)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    v = v.to(dt)
    log_scale = None
    if kind == "chunked":
        y, _ = _chunked(phi_q, phi_k, v, gamma, causal, group, lengths, offsets, rank)
    elif kind == "soe":
        y, _ = _soe(phi_q, phi_k, v, plan, group, lengths, offsets, rank)
        log_scale = plan.log_scale(L, dt)  # the fit's per-head shift (Shaw's sums need the units)
    elif kind == "band":
        if table is None or table.shape != (H, 2 * int(window) + 1):
            raise FastRPEError(f"table must be [H, 2W+1] = [{H}, {2 * int(window) + 1}] (b(r) for r = -W..W), "
                               f"got {None if table is None else tuple(table.shape)}")
        y, log_scale = _band(phi_q, phi_k, v, table, int(window), causal, group, lengths, offsets, rank)
    else:  # bidirectional: one key summary over all ranks
        kv = comm.all_reduce_sum(_outer_sum(phi_k, _with_ones(v, dt)), group)  # (B, H, F, C)
        y = phi_q @ kv
    num, den = y[..., :-1], y[..., -1]
    if not return_log_scale:
        return num, den
    return num, den, phi_q.new_zeros(H, L) if log_scale is None else log_scale


def _key_features(kern: FeatureMap, k: Tensor, kpm: Tensor | None, group) -> Tensor:
    """Key features with one shift shared by the keys of every rank (true features up to that
    one constant, which cancels): SIKF's maximum over all keys is all-reduced."""
    if isinstance(kern, Exp) and not kern.normalize:
        x = kern._prepare(k)  # (B, H, L, D)
        own = x.detach().amax(-1)  # (B, H, L): each key's largest entry
        real = own if kpm is None else own.masked_fill(kpm[:, None, :], float("-inf"))
        s = comm.all_reduce_max(real.amax(-1, keepdim=True), group)  # (B, H, 1) over every rank's keys
        s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
        shift = s.expand_as(own) if kpm is None else torch.where(kpm[:, None, :], own, s.expand_as(own))
        return torch.exp(x - shift[..., None])
    phi_k, _ = kern.key_features(k, causal=False, key_padding_mask=kpm)  # a data-independent shift: cancels
    return phi_k


#: the single-process backend whose numbers each path reproduces
KIND_OF_BACKEND = {"chunked": "chunked", "triton_chunked": "chunked", "prefix": "chunked",
                   "bidirectional": "bidirectional", "band": "band", "soe": "soe", "triton_soe": "soe"}


def attention(q: Tensor, k: Tensor, v: Tensor, kernel, position: Position | None = None, *, causal: bool,
              group=None, key_padding_mask: Tensor | None = None, kind: str | None = None,
              backend: str | None = None, lengths: Sequence[int] | None = None) -> Tensor:
    """Kernelized attention (Luo et al. 2021 Eq. 10) over a sequence split across the ranks of
    `group`, with a linear-time path; equals `fastrpe.attention(...)` on the whole sequence
    (same kernel and term; `backend="soe"` for the approximate sum of exponentials).

    Collective: every rank calls it with its own contiguous slice (rank order is sequence
    order) and runs its backward.

    Args:
        q: `[B, H, L, D]` this rank's queries; k: `[B, H, L, D]`; v: `[B, H, L, Dv]` (the same
            positions: self-attention).
        kernel: a feature map or its name (`fastrpe.kernels`); not softmax.
        position: a `fastrpe.positions.Position` (a geometric decay, a finite-support term, or
            any decaying term causally by "soe") or None. Additive terms are not run here.
        causal: keys after the query are not seen.
        group: the process group (None: the default one).
        key_padding_mask: `[B, L]` bool, True marks this rank's padding keys.
        kind: force a path (`KINDS`); default from `backend`, else from the term (`choose_kind`).
        backend: the single-process backend whose numbers to reproduce (`KIND_OF_BACKEND`).
        lengths: every rank's slice length, if known.

    Returns:
        `[B, H, L, Dv]` this rank's slice of the output, in q's dtype.
    """
    check_qkv(q, k, v)
    B, H, L, D = q.shape
    if k.shape[2] != L:
        raise FastRPEError(f"k must cover the same positions as q on every rank (L={L}), got Lk={k.shape[2]}")
    if isinstance(position, (list, tuple)):
        if any(not isinstance(t, Position) for t in position) or len(position) > 1:
            raise FastRPEError("position: the distributed linear paths run one Position term and no additive "
                               f"terms, got {[type(t).__name__ for t in position]}")
        position = position[0] if position else None
    if position is not None and not isinstance(position, Position):
        raise FastRPEError(f"position must be a fastrpe.positions Position or None here, got {type(position).__name__}")
    if kind is None and backend is not None:
        kind = KIND_OF_BACKEND.get(backend)
        if kind is None:
            raise FastRPEError(f"backend: {backend!r} has no distributed linear form ({', '.join(KIND_OF_BACKEND)})")
    try:
        kern = get_kernel(kernel, head_dim=D)
    except ValueError as e:
        raise FastRPEError(str(e)) from None
    kind = choose_kind(position, causal) if kind is None else kind
    if kind is None:
        raise FastRPEError(f"position: {type(position).__name__} has no non-causal linear-time form across ranks")
    why = refusal(kind, causal=causal, kernel=kern, position=position)
    if why:
        raise FastRPEError(f"kind: {why}")
    kern = kern.to(q.device)
    kpm = check_key_padding_mask(key_padding_mask, B, L, q.device)
    rank, lengths, _ = _slices(L, group, q.device, lengths)
    N = sum(lengths)
    with torch.autocast(q.device.type, enabled=False):
        phi_q = kern(q, is_query=True)  # (B, H, L, F), float32/64
        dt = phi_q.dtype
        phi_k = _key_features(kern, k, kpm, group)
        extra = {}
        if kind == "chunked" and position is not None:
            extra["gamma"] = position.geometric_decay()
        elif kind == "soe":
            extra["plan"] = soe_plan_for(position, N)  # the single-process backend's fit for N tokens
        elif kind == "band":
            W = position.finite_support()
            extra["window"] = W
            extra["table"] = position.log_coefficients(W + 1, W + 1, 0).to(dt)  # b(r), r = -W..W
        num, den = num_den(phi_q, phi_k, v.to(dt), kind=kind, causal=causal, group=group, key_padding_mask=kpm,
                           lengths=lengths, **extra)
        return safe_divide(num, den).to(q.dtype)
