"""Kernelized attention with a Toeplitz RPE by FFT, in blocks of feature channels.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding" (NeurIPS 2021), Eq. 10-13:
`num_i = Σ_m φ(q_i)_m Σ_j c(j-i) φ(k_j)_m [v_j, 1]` — for each feature m, a Toeplitz
product of the `Dv + 1` channels `φ(k)_m·[v, 1]`.

Memory: the channels of all features at once would be `[B, H, L, F·(Dv+1)]` (16 GiB at
L = 64k, F = 64, fp32). Features are processed `block` at a time, the block chosen from a
memory budget, and a custom autograd function recomputes each block in backward instead
of saving it, so forward and backward need O(L·(Dv+1)·block) extra memory.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, C = Dv + 1
channels per feature, N FFT length >= Lq + Lk - 1.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ...positions.base import toeplitz_index
from ..common import causal_offset_mask, finite_max
from ..toeplitz.fft import coeff_spectrum, fft_dtype_for, fft_length

DEFAULT_BUDGET = 512 << 20


def _bytes_per_feature(B: int, H: int, Lq: int, Lk: int, Dv: int, el: int) -> int:
    """Extra bytes one feature's channels need during a block (fwd or bwd, the larger)."""
    N = fft_length(Lq + Lk - 1)
    C = Dv + 1
    # x, its spectrum (complex: 2 el), the product, the inverse (N real), the kept rows; x2 in backward
    return B * H * C * el * (Lk + 2 * (N // 2 + 1) * 2 + N + Lq) * 2


def fft_block_size(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, dtype=torch.float32,
                   memory_budget_bytes: int | None = None) -> int:
    """Features per block so that one block's temporaries fit the budget (at least 1)."""
    el = 8 if dtype == torch.float64 else 4
    budget = DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes
    return int(max(1, min(F, budget // max(1, _bytes_per_feature(B, H, Lq, Lk, Dv, el)))))


def estimate_fft_cost(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, dtype=torch.float32,
                      memory_budget_bytes: int | None = None) -> tuple[float, int]:
    """(flops, peak extra bytes) of one forward call."""
    el = 8 if dtype == torch.float64 else 4
    N = fft_length(Lq + Lk - 1)
    C = Dv + 1
    fft_flops = 2 * 2.5 * N * math.log2(N) * B * H * F * C  # one rfft + one irfft per channel
    flops = fft_flops + 4 * B * H * (Lq + Lk) * F * C
    block = fft_block_size(B, H, Lq, Lk, F, Dv, dtype, memory_budget_bytes)
    # one block's temporaries, plus features, values and outputs kept for backward
    peak = block * _bytes_per_feature(B, H, Lq, Lk, Dv, el) + 3 * B * H * (Lq * (F + C) + Lk * (F + C)) * el
    return flops, int(peak)


def _channels(phi: Tensor, vv: Tensor) -> Tensor:
    """`φ(k)_m·[v, 1]` for a block: `[B, H, Lk, f], [B, H, Lk, C] -> [B, H, Lk, f·C]`."""
    return (phi[..., :, None] * vv[..., None, :]).flatten(-2)


def _toeplitz(cf: Tensor, x: Tensor, Lout: int, N: int) -> Tensor:
    """`[B, H, Lin, K] -> [B, H, Lout, K]` with the spectrum of the flipped coefficients `cf: [H, N//2+1]`."""
    Lin = x.shape[2]
    y = torch.fft.irfft(torch.fft.rfft(x, n=N, dim=2) * cf[..., None], n=N, dim=2)
    return y[:, :, Lin - 1: Lin - 1 + Lout]


class _FFTNumDen(torch.autograd.Function):
    """`(phi_q, phi_k, vv, c) -> y: [B, H, Lq, C]` with `y_i = Σ_m φq_im Σ_j c(j-i) φk_jm vv_j`."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, vv: Tensor, c: Tensor, block: int):
        B, H, Lq, F = phi_q.shape
        Lk, C = vv.shape[2], vv.shape[3]
        N = fft_length(Lq + Lk - 1)
        cf = coeff_spectrum(c, N)[None]  # (1, H, N//2+1)
        y = phi_q.new_zeros(B, H, Lq, C)
        for s in range(0, F, block):
            e = min(F, s + block)
            t = _toeplitz(cf, _channels(phi_k[..., s:e], vv), Lq, N)  # (B, H, Lq, f·C)
            y += torch.einsum("bhif,bhifc->bhic", phi_q[..., s:e], t.unflatten(-1, (e - s, C)))
        ctx.save_for_backward(phi_q, phi_k, vv, c)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        phi_q, phi_k, vv, c = ctx.saved_tensors
        block = ctx.block
        B, H, Lq, F = phi_q.shape
        Lk, C = vv.shape[2], vv.shape[3]
        N = fft_length(Lq + Lk - 1)
        cf = coeff_spectrum(c, N)[None]  # forward operator T
        cf_t = coeff_spectrum(c.flip(-1), N)[None]  # transposed operator Tᵀ
        need_c = ctx.needs_input_grad[3]
        g_q = torch.zeros_like(phi_q) if ctx.needs_input_grad[0] else None
        g_k = torch.zeros_like(phi_k) if ctx.needs_input_grad[1] else None
        g_v = torch.zeros_like(vv) if ctx.needs_input_grad[2] else None
        g_cf = None
        for s in range(0, F, block):
            e, f = min(F, s + block), min(F, s + block) - s
            x = _channels(phi_k[..., s:e], vv)  # (B, H, Lk, f·C)
            xf = torch.fft.rfft(x, n=N, dim=2)
            if g_q is not None:
                t = torch.fft.irfft(xf * cf[..., None], n=N, dim=2)[:, :, Lk - 1: Lk - 1 + Lq]
                g_q[..., s:e] = torch.einsum("bhic,bhifc->bhif", gy, t.unflatten(-1, (f, C)))
            z = _channels(phi_q[..., s:e], gy)  # (B, H, Lq, f·C): dL/dT-product per channel
            zf = torch.fft.rfft(z, n=N, dim=2)
            if g_k is not None or g_v is not None:
                g = torch.fft.irfft(zf * cf_t[..., None], n=N, dim=2)[:, :, Lq - 1: Lq - 1 + Lk]
                g = g.unflatten(-1, (f, C))  # (B, H, Lk, f, C)
                if g_k is not None:
                    g_k[..., s:e] = torch.einsum("bhjfc,bhjc->bhjf", g, vv)
                if g_v is not None:
                    g_v += torch.einsum("bhjfc,bhjf->bhjc", g, phi_k[..., s:e])
            if need_c:
                # dL/dc[r] = Σ_i Σ_ch z_i x_{i + r - (Lq-1)}: a cross-correlation, summed in the spectrum
                part = (zf.conj() * xf).sum(dim=(0, 3))  # (H, N//2+1)
                g_cf = part if g_cf is None else g_cf + part
        g_c = None
        if need_c:
            corr = torch.fft.irfft(g_cf, n=N, dim=-1)  # corr[t], t = j - i (mod N)
            R = Lq + Lk - 1
            t = torch.arange(-(Lq - 1), Lk, device=c.device) % N
            g_c = corr[:, t][:, :R]
        return g_q, g_k, g_v, g_c, None


def kernelized_num_den_fft(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    memory_budget_bytes: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same signature and results as `kernelized_num_den_naive`, by FFT in feature blocks.

    Args:
        phi_q: `[B, H, Lq, F]`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        log_coeff: `[H, Lq+Lk-1]` log-coefficients (offsets `-(Lq-1+q_offset) .. Lk-1-q_offset`) or None.
        causal, q_offset, key_padding_mask: as in the naive op.
        memory_budget_bytes: bound on one block's temporaries (default 512 MiB).

    Returns:
        `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` and `log_scale: [H, Lq]` (true values are
        `num·exp(log_scale)`): each row is scaled by the largest coefficient it sees. The
        FFTs run in float32 (float64 for float64 inputs); results are cast back to phi_q's dtype.
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    out_dt = phi_q.dtype
    dt = fft_dtype_for(out_dt)
    phi_q, phi_k = phi_q.to(dt), phi_k.to(dt)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], dim=-1)  # (B, H, Lk, C)
    if log_coeff is None and not causal:
        # no positional term: plain linear attention, no FFT needed
        kv = torch.einsum("bhjf,bhjc->bhfc", phi_k, vv)  # (B, H, F, C)
        y = torch.einsum("bhif,bhfc->bhic", phi_q, kv).to(out_dt)
        return y[..., :Dv], y[..., Dv], y.new_zeros(H, Lq)
    lc = torch.zeros(H, Lq + Lk - 1, dtype=dt, device=phi_q.device) if log_coeff is None else log_coeff.to(dt)
    if causal:
        lc = lc.masked_fill(~causal_offset_mask(Lq, Lk, q_offset, device=lc.device), float("-inf"))
    block = fft_block_size(B, H, Lq, Lk, F, Dv, dt, memory_budget_bytes)
    scale = row_scale(lc, Lq, Lk)  # (H, Lq)
    if not causal:
        y = _rescaled_product(phi_q, phi_k, vv, lc, scale, block)
    else:
        leaf = causal_leaf(B, H, dt, memory_budget_bytes)
        y = _causal_product(phi_q, phi_k, vv, lc, scale, q_offset, block, leaf)
    y = _certify_rows(y, phi_q, phi_k, vv, lc, scale, q_offset if causal else None).to(out_dt)
    return y[..., :Dv], y[..., Dv], scale.to(out_dt)


#: a row is trusted when the estimated round-off of its FFT products is below this fraction
#: of its denominator; other rows are recomputed exactly (see `_certify_rows`)
CERT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def _certify_rows(y: Tensor, phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor,
                  causal_offset: int | None) -> Tensor:
    """Recompute, exactly and densely, the rows whose FFT result cannot be trusted.

    FFT round-off in an output entry stays below `eps·‖c‖₂·‖x‖₂` for coefficients c and a
    channel x (measured at L = 4,096: the actual error is 0.02–0.8 of it). A row's estimate,
    in its own units, is `2·eps·e^(G_h - s_i)·‖exp(b_h - G_h)‖₂·Σ_m |φ(q_i)_m|·‖φ(k)_m·‖[v, 1]‖∞‖₂`
    (`G_h` the head's largest log-coefficient, `s_i` the row's). Rescaling by coefficients
    cannot see feature products: when a row's nearest keys have `φ(q_i)·φ(k_j) = 0` (relu
    features, say) its true weight sits far below that estimate and the FFT value would be
    noise. Such rows — none for self-attention with a decaying term, a few for queries far
    outside the keys — are recomputed from their own materialized coefficients. Tables
    whose rows see very different maxima flag more rows and cost more. Causal calls
    (`causal_offset` = q_offset) measure only the keys each row may see, so the decision
    itself cannot depend on the future.
    """
    Lq, Lk = phi_q.shape[2], phi_k.shape[2]
    dt = phi_q.dtype
    with torch.no_grad():
        eps = torch.finfo(dt).eps
        x = (phi_k * vv.abs().amax(-1, keepdim=True)) ** 2  # (B, H, Lk, F)
        if causal_offset is None:
            x2 = x.sum(2, keepdim=True).sqrt().expand(-1, -1, Lq, -1)  # ‖φ(k)_m·‖vv‖∞‖₂ over all keys
        else:  # over the keys each row may see: j <= q_offset + i
            last = (torch.arange(Lq, device=x.device) + causal_offset).clamp_max(Lk - 1)
            x2 = x.cumsum(2)[:, :, last].sqrt()  # (B, H, Lq, F)
        G = finite_max(lc)  # (H, 1)
        c2 = torch.exp(lc - G).norm(dim=-1, keepdim=True) * torch.exp((G - scale).clamp_max(80.0))  # (H, Lq)
        bound = 2 * eps * c2[None] * (phi_q.abs() * x2).sum(-1)  # (B, H, Lq)
        bad = (y[..., -1].abs() * CERT_RTOL[dt] < bound) & (bound > 0)  # (B, H, Lq)
        rows = bad.any(0).any(0).nonzero().flatten()
    if rows.numel() == 0:
        return y
    fixed = []
    for i in rows.tolist():  # one row at a time: its value must not depend on which other rows are flagged
        c = torch.exp(lc[:, Lq - 1 - i: Lq - 1 - i + Lk] - scale[:, i, None])  # (H, Lk), row i's own units
        a = (phi_q[:, :, i, None, :] @ phi_k.transpose(-1, -2)) * c[None, :, None, :]  # (B, H, 1, Lk)
        fixed.append(a @ vv)  # (B, H, 1, C)
    return y.index_copy(2, rows, torch.cat(fixed, dim=2))


#: FFT round-off is relative to the largest coefficient in a product; a row whose own
#: largest coefficient is more than this many nats below it loses digits, so such rows go
#: to a product of their own (measured: errors grow faster than eps·e^τ once φ and v vary,
#: so τ is kept small).
RESCALE_NATS = {torch.float32: 3.0, torch.float64: 6.0}

#: a product whose every weight is this many nats below the largest weight its rows see
#: elsewhere changes no digit of the result (e^-60 ≈ 1e-26 against float32's 6e-8, e^-120
#: ≈ 8e-53 against float64's 1e-16, with room for large ratios of feature magnitudes); it is
#: skipped. The causal recursion relies on this for sharp decays, where far blocks would
#: otherwise split into one row per FFT.
NEGLIGIBLE_NATS = {torch.float32: 60.0, torch.float64: 120.0}


def sliding_max(x: Tensor, w: int) -> Tensor:
    """`[H, R] -> [H, R-w+1]`: max over every window of w entries, in O(R) memory and time
    (van Herk / Gil-Werman: per-block prefix and suffix maxima). `max_pool1d` with a
    kernel as long as the sequence unfolds it and needs O(R·w) memory."""
    H, R = x.shape
    nb = -(-R // w)
    pad = torch.full((H, nb * w - R), float("-inf"), dtype=x.dtype, device=x.device)
    blocks = torch.cat([x, pad], -1).view(H, nb, w)
    pre = blocks.cummax(-1).values.view(H, -1)  # max from each block's start
    suf = blocks.flip(-1).cummax(-1).values.flip(-1).view(H, -1)  # max to each block's end
    n = R - w + 1
    return torch.maximum(suf[:, :n], pre[:, w - 1: w - 1 + n])


def row_scale(lc: Tensor, Lq: int, Lk: int, fill: float = 0.0) -> Tensor:
    """`[H, Lq]`: the largest log-coefficient row i sees (`fill` for rows that see none)."""
    with torch.no_grad():
        # row i's offsets are lc[:, Lq-1-i : Lq-1-i+Lk]: a sliding-window max, reversed
        m = sliding_max(lc.detach(), Lk).flip(-1)
        return torch.where(torch.isfinite(m), m, torch.full_like(m, fill))


def row_blocks(lc: Tensor, Lq: int, Lk: int, tau: float) -> list[tuple[int, int]]:
    """Contiguous blocks of query rows whose per-row largest log-coefficient (over the
    row's own offsets) spans at most `tau` nats in every head.

    Self-attention with a decaying term is one block (every row sees offset 0); queries
    far outside the keys, or tables with large swings, get split so that each block's
    FFT is rescaled by a maximum its rows actually see.
    """
    with torch.no_grad():
        m = sliding_max(lc.detach(), Lk).flip(-1)  # (H, Lq)
        m = torch.where(torch.isfinite(m), m, torch.full_like(m, -1e30))
        if float((m.amax(-1) - m.amin(-1)).max()) <= tau:
            return [(0, Lq)]
        m = m.cpu()
    blocks, a = [], 0
    lo, hi = m[:, 0].clone(), m[:, 0].clone()
    for i in range(1, Lq):
        lo, hi = torch.minimum(lo, m[:, i]), torch.maximum(hi, m[:, i])
        if float((hi - lo).max()) > tau:
            blocks.append((a, i))
            a, lo, hi = i, m[:, i].clone(), m[:, i].clone()
    blocks.append((a, Lq))
    return blocks


def _rescaled_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, block: int) -> Tensor:
    """Full (non-causal) product `[B, H, Lq, C]` for `lc: [H, Lq+Lk-1]`, in units of
    `exp(scale)` per row (`scale: [H, Lq]`), computed in row blocks that are each rescaled
    by the largest coefficient their rows see (see `row_blocks`).

    Heads whose coefficients would split the rows differently (ALiBi's slopes span 2^-1 ..
    2^-8) are done one at a time, so that a steep head does not split a flat one into many
    products; and each row block reads only the keys that can change a digit of it."""
    H, Lq, Lk = phi_q.shape[1], phi_q.shape[2], phi_k.shape[2]
    tau = RESCALE_NATS[phi_q.dtype]
    if H > 1:
        per_head = [row_blocks(lc[h:h + 1], Lq, Lk, tau) for h in range(H)]
        if any(b != per_head[0] for b in per_head[1:]):
            return torch.cat([_rescaled_heads(phi_q[:, h:h + 1], phi_k[:, h:h + 1], vv[:, h:h + 1], lc[h:h + 1],
                                              scale[h:h + 1], block, per_head[h]) for h in range(H)], dim=1)
        return _rescaled_heads(phi_q, phi_k, vv, lc, scale, block, per_head[0])
    return _rescaled_heads(phi_q, phi_k, vv, lc, scale, block, row_blocks(lc, Lq, Lk, tau))


def _key_window(lcs: Tensor, floor: Tensor, n: int, Lk: int) -> tuple[int, int]:
    """Keys `[k0, k1)` that a block of n rows needs: key j meets the rows through the offsets
    `lcs[:, j : j+n]`; it is dropped when every one of them is below the rows' `floor`
    (`[H, 1]`). Returns (0, 0) when no key is needed."""
    alive = (lcs >= floor).any(0).to(torch.int32)  # (n+Lk-1,) offsets some head may use
    cs = torch.cat([alive.new_zeros(1), alive.cumsum(0)])
    need = (cs[n:n + Lk] - cs[:Lk]) > 0  # (Lk,) key j sees an alive offset
    idx = need.nonzero().flatten()
    if idx.numel() == 0:
        return 0, 0
    return int(idx[0]), int(idx[-1]) + 1


def _rescaled_heads(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, block: int,
                    blocks: list[tuple[int, int]]) -> Tensor:
    """`_rescaled_product` for heads that share their row `blocks`."""
    Lq, Lk = phi_q.shape[2], phi_k.shape[2]
    neg = NEGLIGIBLE_NATS[phi_q.dtype]
    # how far below its own scale each row's largest coefficient in this product is
    below = (scale - row_scale(lc, Lq, Lk, fill=float("-inf"))).amin(0)  # (Lq,), over heads: the least negligible
    parts = []
    for a, b in blocks:
        lcs = lc[:, Lq - b: Lq - a + Lk - 1]  # offsets of rows a..b-1
        # no admissible coefficient, or every weight is e^-NEGLIGIBLE below what the row already has
        skip = not bool(torch.isfinite(lcs).any()) or float(below[a:b].min()) > neg
        if not skip:
            # keys whose every weight is e^-NEGLIGIBLE below every row's own scale change no digit
            k0, k1 = _key_window(lcs.detach(), scale[:, a:b].detach().amin(-1, keepdim=True) - neg, b - a, Lk)
            skip = k1 <= k0
        if skip:
            parts.append(phi_q.new_zeros(*phi_q.shape[:2], b - a, vv.shape[-1]))
            continue
        lcs = lcs[:, k0: k1 + (b - a) - 1]
        m = finite_max(lcs)  # (H, 1)
        y = _FFTNumDen.apply(phi_q[:, :, a:b], phi_k[:, :, k0:k1], vv[:, :, k0:k1], torch.exp(lcs - m), block)
        parts.append(y * torch.exp(m - scale[:, a:b])[None, :, :, None])  # units of exp(m) -> the rows' own
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


#: blocks of at most this many positions are done densely by the causal recursion (the
#: smallest leaf; `causal_leaf` picks a larger one when the memory budget allows)
CAUSAL_LEAF = 128
#: the largest leaf: measured on CPU (KERPLE-log, H = 2, F = 32, fwd + bwd) each doubling
#: from 128 to 2048 saves time — 16.9 s -> 9.0 s at L = 16k — since a dense leaf costs
#: O(leaf) per position and every FFT level a full-length product of F·(Dv+1) channels
CAUSAL_LEAF_MAX = 2048


def causal_leaf(B: int, H: int, dtype=torch.float32, memory_budget_bytes: int | None = None) -> int:
    """Diagonal leaf size of the causal recursion: the largest power of two from CAUSAL_LEAF
    to CAUSAL_LEAF_MAX whose dense `[B, H, leaf, leaf]` weights (about 4 copies with the
    backward pass) fit the memory budget."""
    el = 8 if dtype == torch.float64 else 4
    budget = DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes
    leaf = CAUSAL_LEAF
    while leaf < CAUSAL_LEAF_MAX and 4 * B * H * (2 * leaf) ** 2 * el <= budget:
        leaf *= 2
    return leaf


def causal_segments(Lq: int, Lk: int, q_offset: int, leaf: int = CAUSAL_LEAF):
    """Divide and conquer over positions for a causal product: yields
    `(kind, qa, qb, ka, kb)` — query indices `qa..qb-1` against key indices `ka..kb-1` —
    with kind "leaf" (a diagonal block: mask `j > i` inside) or "cross" (every key
    strictly earlier than every query: a full product). Together they cover each causal
    pair exactly once, and no segment pairs a query with a later key. O(log L) levels.
    """

    def solve(lo: int, hi: int):
        qa, qb = max(0, lo - q_offset), min(Lq, hi - q_offset)  # queries with positions in [lo, hi)
        ka, kb = max(0, lo), min(Lk, hi)
        if qa >= qb or ka >= kb:
            return
        if hi - lo <= leaf:
            yield "leaf", qa, qb, ka, kb
            return
        mid = (lo + hi) // 2
        yield from solve(lo, mid)
        yield from solve(mid, hi)
        qa2, qb2 = max(0, mid - q_offset), min(Lq, hi - q_offset)
        ka2, kb2 = max(0, lo), min(Lk, mid)
        if qa2 < qb2 and ka2 < kb2:
            yield "cross", qa2, qb2, ka2, kb2

    end = q_offset + Lq  # keys after the last query are never needed
    yield from solve(0, max(1, 1 << max(0, (end - 1).bit_length())))


def _leaf_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lcs: Tensor, scale: Tensor) -> Tensor:
    """A diagonal leaf of the causal recursion, dense: `[B, H, n, C]` in the rows' own units
    (`lcs` is masked: `-inf` for keys after a query)."""
    m = finite_max(lcs)
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k)  # (B, H, n, k)
    a = a * torch.exp(lcs - m)[:, toeplitz_index(phi_q.shape[2], phi_k.shape[2], device=lcs.device)]
    return (a @ vv) * torch.exp(m - scale)[None, :, :, None]


def _causal_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int,
                    block: int, leaf: int = CAUSAL_LEAF) -> Tensor:
    """Causal product over `causal_segments`: diagonal leaves dense, the rest FFT products.

    No computation for query i ever reads a key after i, so the future cannot leak into
    the past even through round-off; every product is rescaled by its own largest
    coefficient. O(L log² L) time. `lc` is already masked (`-inf` for `r > 0`).
    """
    B, H, Lq, _ = phi_q.shape
    Lk, C = phi_k.shape[2], vv.shape[-1]
    rows, parts = [], []
    for kind, qa, qb, ka, kb in causal_segments(Lq, Lk, q_offset, leaf):
        s = ka - qb + Lq  # offsets of queries qa..qb-1 against keys ka..kb-1
        lcs = lc[:, s: s + (qb - qa) + (kb - ka) - 1]
        if kind == "leaf":
            args = (phi_q[:, :, qa:qb], phi_k[:, :, ka:kb], vv[:, :, ka:kb], lcs, scale[:, qa:qb])
            if torch.is_grad_enabled() and any(t.requires_grad for t in args):
                # recomputed in backward: autograd would otherwise keep every leaf's [leaf, leaf]
                # weights until then (O(L·leaf) bytes: 3.3 GiB at 64k with 2048-position leaves)
                part = checkpoint(_leaf_product, *args, use_reentrant=False)
            else:
                part = _leaf_product(*args)
        else:
            part = _rescaled_product(phi_q[:, :, qa:qb], phi_k[:, :, ka:kb], vv[:, :, ka:kb], lcs,
                                     scale[:, qa:qb], block)
        rows.append(torch.arange(qa, qb, device=phi_q.device))
        parts.append(part)
    # one scatter at the end: adding each part into a fresh full-size copy (out-of-place,
    # as autograd needs) allocated O(L) per segment, O(L²/leaf) bytes in all
    return phi_q.new_zeros(B, H, Lq, C).index_add(2, torch.cat(rows), torch.cat(parts, dim=2))
