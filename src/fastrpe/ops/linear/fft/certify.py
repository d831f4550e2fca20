"""Row certificates and exact recomputation, without host synchronization.

FFT round-off is spread over a product's outputs: an entry's error is about
`eps·‖c‖₂·‖x‖₂` times a factor that shrinks with the FFT length N (measured in float32, for
flat, decaying, spiky and ±30 random coefficients at N = 2k..32k: the largest entry error
is 0.03–0.25 of `eps·‖c‖₂·‖x‖₂`, 2–7× the RMS, and the RMS stays below
`sqrt(log2 N / N)` of it). `fft_error_factor` takes 16·sqrt(log2 N / N) (at most 1):
twice the largest measured.

A row's estimate, in its own units `exp(s_i)`, per product over keys X and coefficients c:
`f(N)·eps·e^(G - s_i)·‖exp(b - G)‖₂·Σ_m |φ(q_i)_m|·‖φ(k)_m·w‖₂` over the keys of X, with
`w = 1` for the denominator and `w_j = ‖v_j‖₂` for the numerator (`G` the head's largest
log-coefficient). The numerator is judged against `‖num_i‖`, not against the denominator:
values that average out (`‖out_i‖ ≪ max ‖v_j‖`) lose relative digits first — a ±30 table
at L = 4,096 reached 1.08e-4 when only the denominator was judged. A row is trusted when
both estimates are below ROW_RTOL/2 of its own values, so `out = num/den` is within ROW_RTOL.

Rows that fail — queries whose nearest keys give `φ(q)·φ(k) = 0` (relu features), rows
whose own largest coefficient is far below the head's — are recomputed densely and exactly
from their own materialized coefficients. The number of such rows is not known before the
call; a fixed number per (batch, head), from shapes (`plan.recompute_capacity`), is
recomputed: the first failing rows in index order (so that, causally, whether a row is
recomputed depends only on earlier rows). Rows that fail beyond that capacity are set to
NaN: nothing silently wrong, and no host synchronization to decide it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .scale import MAX_RESCALE_NATS

#: the promise: each row's `num/den` within this relative error of the exact value
ROW_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def fft_error_factor(N: int) -> float:
    """Largest FFT round-off per output entry, as a fraction of `eps·‖c‖₂·‖x‖₂` (with margin)."""
    return min(1.0, 16.0 * math.sqrt(math.log2(max(N, 2)) / N))


def error_bounds(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor,
                 products: list[tuple[int, int | None]], q_offset: int) -> tuple[Tensor, Tensor]:
    """`(den_err, num_err)`, each `[B, H, Lq]`: estimated FFT round-off of each row in its own units.

    `products`: `[(h, N)]`; `h = None` is one product over every key and offset (non-causal);
    otherwise a causal level whose products pair query position p with keys `p-2h+1 .. p-1`
    through offsets `-(2h-1) .. -1` (see `causal.causal_levels`). Only earlier keys enter a
    causal row's estimate, so the decision cannot depend on the future.
    """
    Lq, Lk = phi_q.shape[2], phi_k.shape[2]
    dt = phi_q.dtype
    eps = torch.finfo(dt).eps
    with torch.no_grad():
        phi_q, phi_k, vv, lc = phi_q.detach(), phi_k.detach(), vv.detach(), lc.detach()
        G = lc.amax(-1, keepdim=True)
        G = torch.where(torch.isfinite(G), G, torch.zeros_like(G))  # (H, 1)
        cn = torch.exp(lc - G)  # (H, R)
        amp = torch.exp((G - scale).clamp_max(MAX_RESCALE_NATS[dt]))  # (H, Lq): e^(G - s_i)
        xd = phi_k.square()  # (B, H, Lk, F)
        xn = xd * vv[..., :-1].square().sum(-1, keepdim=True)  # φ(k)_jm²·‖v_j‖²
        aq = phi_q.abs()
        den_err = phi_q.new_zeros(phi_q.shape[:3])
        num_err = phi_q.new_zeros(phi_q.shape[:3])
        if products and products[0][0] is None:
            f = fft_error_factor(products[0][1]) * eps
            c2 = (f * cn.norm(dim=-1, keepdim=True) * amp)[None]  # (1, H, Lq)
            den_err = c2 * torch.einsum("bhif,bhf->bhi", aq, xd.sum(2).sqrt())
            num_err = c2 * torch.einsum("bhif,bhf->bhi", aq, xn.sum(2).sqrt())
            return den_err, num_err
        zero = xd.new_zeros(*xd.shape[:2], 1, xd.shape[3])
        cd, cnum = torch.cat([zero, xd.cumsum(2)], 2), torch.cat([zero, xn.cumsum(2)], 2)  # (B, H, Lk+1, F)
        pos = torch.arange(Lq, device=lc.device) + q_offset  # query positions
        origin = Lq - 1 + q_offset  # index of offset 0 in lc
        for h, N in products:
            t0, t1 = max(0, origin - (2 * h - 1)), max(0, origin)  # offsets -(2h-1) .. -1
            c2 = (fft_error_factor(N) * eps * cn[:, t0:t1].norm(dim=-1, keepdim=True) * amp)[None]
            hi, lo = pos.clamp(0, Lk), (pos - 2 * h + 1).clamp(0, Lk)  # keys lo .. hi-1
            wd = (cd[:, :, hi] - cd[:, :, lo]).clamp_min(0).sqrt()  # (B, H, Lq, F)
            wn = (cnum[:, :, hi] - cnum[:, :, lo]).clamp_min(0).sqrt()
            den_err = den_err + c2 * (aq * wd).sum(-1)
            num_err = num_err + c2 * (aq * wn).sum(-1)
        return den_err, num_err


def untrusted_rows(y: Tensor, den_err: Tensor, num_err: Tensor, lc: Tensor, scale: Tensor) -> Tensor:
    """`[B, H, Lq]` bool: rows whose FFT value cannot be certified within ROW_RTOL."""
    with torch.no_grad():
        y = y.detach()
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
    windows = lc.unfold(-1, Lk, 1)  # (H, Lq, Lk): window s holds the offsets of row Lq-1-s
    c = torch.exp(windows[heads, Lq - 1 - idx] - scale[heads, idx][..., None])  # (B, H, K, Lk)
    pq = phi_q.gather(2, idx[..., None].expand(-1, -1, -1, phi_q.shape[-1]))  # (B, H, K, F)
    a = (pq @ phi_k.transpose(-1, -2)) * c  # (B, H, K, Lk)
    return a @ vv


def certify_rows(y: Tensor, phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, lc_fft: Tensor, scale: Tensor,
                 empty: Tensor,
                 products: list[tuple[int, int | None]], q_offset: int, capacity: int, chunk: int) -> Tensor:
    """`y: [B, H, Lq, C]` with its untrusted rows recomputed exactly (`capacity` per batch and
    head, `chunk` at a time) and any beyond the capacity set to NaN; rows that see no
    coefficient at all (`empty: [H, Lq]`) are exactly 0. `lc`: the log-coefficients;
    `lc_fft`: the part of them the FFT products multiplied (whose round-off is estimated)."""
    B, H, Lq, C = y.shape
    den_err, num_err = error_bounds(phi_q, phi_k, vv, lc_fft, scale, products, q_offset)
    bad = untrusted_rows(y, den_err, num_err, lc_fft, scale) & ~empty  # (B, H, Lq)
    with torch.no_grad():
        # the first `capacity` untrusted rows of each (batch, head), in index order
        rank = torch.where(bad, Lq - torch.arange(Lq, device=y.device), 0)
        key, idx = rank.topk(capacity, dim=-1, sorted=True)  # (B, H, K)
        chosen = key > 0
        done = torch.zeros_like(bad).scatter(2, idx, chosen)
    parts = []
    for s in range(0, capacity, chunk):  # a static loop: sizes come from shapes
        args = (phi_q, phi_k, vv, lc, scale, idx[..., s:s + chunk])
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
            # recomputed in backward: the [B, H, chunk, Lk] weights are not kept
            parts.append(checkpoint(_exact_rows, *args, use_reentrant=False))
        else:
            parts.append(_exact_rows(*args))
    exact = torch.cat(parts, dim=2)  # (B, H, K, C)
    ie = idx[..., None].expand(-1, -1, -1, C)
    y = y.scatter(2, ie, torch.where(chosen[..., None], exact, y.gather(2, ie)))
    y = torch.where((bad & ~done)[..., None], torch.full_like(y, float("nan")), y)
    return torch.where(empty[None, :, :, None], torch.zeros_like(y), y)
