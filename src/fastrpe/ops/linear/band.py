"""Kernelized attention with a finite-support positional term, exactly, in linear time.

A term whose log-coefficients are constant beyond a distance `W` (T5 buckets beyond their
last bucket, a clipped learned table) is an exact band plus constant tails:

    c(r) = exp(b(r))          for |r| < W (dense, per chunk pair)
    c(r) = exp(b(-W))         for r <= -W (one running sum: a geometric state with γ = 1)
    c(r) = exp(b(+W))         for r >= +W (bidirectional only: the suffix sum)

No approximation: the naive sibling is `kernelized_num_den_naive`. Chunks of length
`T >= W` put every band pair of a query chunk `c` in key chunks `c-1, c` (and `c+1`
without the causal mask); keys further away are all in a tail.

Notation: B batch, H heads, F features, C = Dv + 1 channels, T chunk length,
n key chunks, m query chunks, X window width (2T causal, 3T bidirectional).
"""
from __future__ import annotations

import torch
import torch.nn.functional as Fn
from torch import Tensor

DEFAULT_CHUNK = 64


def _row_max(g: Tensor, lo: Tensor, hi: Tensor, W: int) -> Tensor:
    """`[H, Lq]`: the largest of `g[:, r + W]` over `lo_i <= r <= hi_i` (detached, finite:
    0 where every entry is -inf). `g: [H, 2W+1]` holds `b(r)` for `r = -W..W`, constant
    beyond, so clipping a row's offset range to `[-W, W]` keeps its maximum."""
    g = g.detach()
    X = g.shape[1]
    idx = torch.arange(X, device=g.device)
    # M[h, a, b] = max g[h, a..b]: a running maximum from every start a
    M = g[:, None, :].masked_fill((idx[None, :] < idx[:, None])[None], float("-inf")).cummax(-1).values  # (H, X, X)
    m = M[:, lo.clamp(-W, W) + W, hi.clamp(-W, W) + W]  # (H, Lq)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def kernelized_num_den_band(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor,
    *,
    window: int,
    causal: bool = True,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: Tensor | None = None,
):
    """`(num, den, log_scale)` exactly as `kernelized_num_den_naive`, for a term with
    `b(r) = b(-W)` for all `r <= -W` and `b(r) = b(W)` for all `r >= W` (`W = window`).

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        log_coeff: `[H, Lq+Lk-1]` `b(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset` (differentiable;
            `-inf` allowed). Values beyond `±W` are taken from `b(±W)`, so the vector must hold
            a term with that finite support.
        window: W >= 1.
        causal: keep only `r <= 0`.
        key_padding_mask: `[B, Lk]` bool, True = padding.
        chunk_size: T (raised to W when smaller).
        initial_state: `[B, H, F, Dv+1]` `Σ φ(k_j) ⊗ [v_j, 1]` of keys before position 0, each at
            distance >= W from every query (causal decoding keeps the last W keys as keys).

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]`, `log_scale: [H, Lq]` (each row's largest
        log-coefficient, taken out before `exp`; the true numerator is `num·exp(log_scale)`).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt, dev = phi_q.dtype, phi_q.device
    W = int(window)
    if W < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)  # (B, H, Lk, C)
    C = Dv + 1
    T = max(int(chunk_size), W)
    n = -(-max(Lk, q_offset + Lq) // T)  # chunks covering every key and query position
    c0, c1 = q_offset // T, (q_offset + Lq - 1) // T  # the query chunks
    m = c1 - c0 + 1

    if initial_state is not None and q_offset < W:
        raise ValueError(f"initial_state needs q_offset >= window ({W}), got {q_offset}")

    # b(r) on r = -W..W from the call's vector (an offset outside it occurs in no real pair)
    rmin = -(Lq - 1 + q_offset)
    rg = torch.arange(-W, W + 1, device=dev)
    g = log_coeff.to(dt)[:, rg.clamp(rmin, Lk - 1 - q_offset) - rmin]  # (H, 2W+1)
    # each row's own maximum over the offsets it sees, so no row underflows for another's scale
    pos = torch.arange(Lq, device=dev) + q_offset
    hi = (Lk - 1 - pos).clamp_max(0) if causal else Lk - 1 - pos
    lo = -pos if initial_state is None else -pos - W  # keys of the initial state are in the tail
    mrow = _row_max(g, lo, hi, W).to(dt)  # (H, Lq)

    # keys and queries on the position grid, zero-padded
    pad_q = (q_offset - c0 * T, (c1 + 1) * T - q_offset - Lq)
    k_pos = Fn.pad(phi_k, (0, 0, 0, n * T - Lk)).view(B, H, n, T, F)
    v_pos = Fn.pad(vv, (0, 0, 0, n * T - Lk)).view(B, H, n, T, C)
    q_pos = Fn.pad(phi_q, (0, 0, *pad_q)).view(B, H, m, T, F)
    mgrid = Fn.pad(mrow, pad_q).view(H, m, T)
    pgrid = (torch.arange(m * T, device=dev) + c0 * T).view(m, T)  # query positions
    qreal = (pgrid >= q_offset) & (pgrid < q_offset + Lq)  # (m, T)

    # near field: key chunks c-1, c (, c+1) of query chunk c, one zero chunk padded on each side
    nwin = 2 if causal else 3
    kp = Fn.pad(k_pos, (0, 0, 0, 0, 1, 1))  # (B, H, n+2, T, F): chunk c sits at c+1
    vp = Fn.pad(v_pos, (0, 0, 0, 0, 1, 1))
    kwin = torch.cat([kp[:, :, c0 + o: c0 + o + m] for o in range(nwin)], 3)  # (B, H, m, X, F)
    vwin = torch.cat([vp[:, :, c0 + o: c0 + o + m] for o in range(nwin)], 3)  # (B, H, m, X, C)
    jwin = (torch.arange(m, device=dev)[:, None] + c0 - 1) * T + torch.arange(nwin * T, device=dev)  # (m, X)
    r = jwin[:, None, :] - pgrid[:, :, None]  # (m, T, X) offsets
    # only real pairs get a coefficient: elsewhere b - m could overflow exp against zero features
    real = qreal[:, :, None] & (jwin[:, None, :] >= 0) & (jwin[:, None, :] < Lk)
    if causal:
        real = real & (r <= 0)
    logw = g[:, r.clamp(-W, W) + W] - mgrid[..., None]  # (H, m, T, X)
    coef = torch.exp(logw.masked_fill(~real[None], float("-inf")))
    a = torch.einsum("bhmsf,bhmxf->bhmsx", q_pos, kwin) * coef[None]
    y = torch.einsum("bhmsx,bhmxc->bhmsc", a, vwin)  # (B, H, m, T, C)

    # far field: the tails, keys >= T+1 >= W away, as prefix (and suffix) sums of chunk summaries
    kc = torch.einsum("bhntf,bhntc->bhnfc", k_pos, v_pos)  # (B, H, n, F, C)
    zero = kc.new_zeros(B, H, 1, F, C)
    pre = torch.cat([zero, zero, kc.cumsum(2)], 2)  # index c: keys in chunks < c - 1
    left = pre[:, :, c0: c1 + 1]  # (B, H, m, F, C)
    has_left = qreal & (pgrid >= W)
    if initial_state is not None:
        left = left + initial_state.to(dt)[:, :, None]
        has_left = qreal
    cl = torch.exp((g[:, :1, None] - mgrid).masked_fill(~has_left[None], float("-inf")))  # (H, m, T)
    y = y + torch.einsum("bhmsf,bhmfc->bhmsc", q_pos * cl[None, ..., None], left)
    if not causal:
        suf = torch.cat([kc.flip(2).cumsum(2).flip(2), zero, zero], 2)  # index c: keys in chunks >= c
        right = suf[:, :, c0 + 2: c1 + 3]
        has_right = qreal & (pgrid + W <= Lk - 1)
        cr = torch.exp((g[:, -1:, None] - mgrid).masked_fill(~has_right[None], float("-inf")))
        y = y + torch.einsum("bhmsf,bhmfc->bhmsc", q_pos * cr[None, ..., None], right)
    y = y.reshape(B, H, m * T, C)[:, :, q_offset - c0 * T: q_offset - c0 * T + Lq]
    return y[..., :Dv], y[..., Dv], mrow
