"""The near band of a non-causal product, dense: offsets `|r| <= w` around each row's diagonal.

FFT round-off is spread over all outputs of a product, so a row whose weight sits in a few
nearby keys (a sharp decay) with `φ(q_i)·φ(k_j) = 0` there (relu features) has a true
value far below the product's noise. Taking the offsets `-w .. w` out of the FFT and
computing them densely leaves the FFT only the far coefficients, whose noise is then
relative to them: for sharp decays it vanishes, and such rows are certified instead of
recomputed. (The causal recursion has this already: its diagonal leaves are dense.)

Rows are taken `w` at a time; a block of rows at positions `a .. a+w-1` meets the keys
`a+q_offset-w .. a+q_offset+2w-1`, so the band is one batched `[w, 3w]` product per block:
O(Lq·w·(F + C)) time and memory, with static shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor

from .plan import budget_or_default, element_size
from .segments import recomputed, segment_sums

#: half width of the dense near band of non-causal products
NEAR_BAND = 32


def far_coefficients(lc: Tensor, Lq: int, q_offset: int, w: int) -> Tensor:
    """`lc: [H, R]` with the band offsets `-w .. w` set to `-inf` (what the FFT multiplies)."""
    origin = Lq - 1 + q_offset  # index of offset 0
    idx = torch.arange(lc.shape[-1], device=lc.device)
    return lc.masked_fill((idx - origin).abs() <= w, float("-inf"))


def band_covers_all(Lq: int, Lk: int, q_offset: int, w: int) -> bool:
    """Whether every offset lies in the band (then no FFT is needed)."""
    return -(Lq - 1 + q_offset) >= -w and Lk - 1 - q_offset <= w


def _band(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int, w: int) -> Tensor:
    B, H, Lq, F = phi_q.shape
    Lk, C, R = phi_k.shape[2], vv.shape[-1], lc.shape[-1]
    nb = -(-Lq // w)
    dev = phi_q.device
    pq = nnf.pad(phi_q, (0, 0, 0, nb * w - Lq)).view(B, H, nb, w, F)
    kidx = (torch.arange(nb, device=dev)[:, None] * w + q_offset - w + torch.arange(3 * w, device=dev))  # (nb, 3w)
    kvalid = (kidx >= 0) & (kidx < Lk)
    kflat = kidx.clamp(0, Lk - 1).flatten()
    pk = phi_k.index_select(2, kflat).view(B, H, nb, 3 * w, F)
    v = vv.index_select(2, kflat).view(B, H, nb, 3 * w, C)
    t = torch.arange(w, device=dev)[:, None]
    u = torch.arange(3 * w, device=dev)[None, :]
    r = u - w - t  # (w, 3w): offset of (row a+t, key a+q_offset-w+u)
    lci = (r + Lq - 1 + q_offset).clamp(0, R - 1)
    rvalid = (torch.arange(nb * w, device=dev) < Lq).view(nb, w)
    keep = (r.abs() <= w)[None] & kvalid[:, None, :] & rvalid[:, :, None]  # (nb, w, 3w)
    s = nnf.pad(scale, (0, nb * w - Lq)).view(H, nb, w)
    x = lc[:, lci][:, None] - s[..., None]  # (H, nb, w, 3w), <= 0 inside the band
    wgt = torch.exp(torch.where(keep[None], x, torch.full_like(x, float("-inf"))))  # masked before exp: no inf·0
    a = torch.einsum("bhntf,bhnuf->bhntu", pq, pk) * wgt  # (B, H, nb, w, 3w)
    y = (a @ v).view(B, H, nb * w, C)
    return y[:, :, :Lq]


def band_rows(B: int, H: int, F: int, Dv: int, dtype=torch.float32, memory_budget_bytes: int | None = None,
              w: int = NEAR_BAND) -> int:
    """Rows of the band computed at once (a multiple of w) so that their temporaries fit the
    budget: per row the gathered keys' features and channels (`3·(F + C)`: each block of w rows
    gathers 3w keys), the `[w, 3w]` block's products, weights and mask (about `3·3w`) and its
    output (C), twice: the backward holds each of them and its gradient. Unbounded, the band
    held about 24 GiB at once at 1,048,576 tokens (B·H = 8, F = 32, Dv = 64), 27 of the 35 GiB
    the whole non-causal call held at its peak; sized for the forward alone, its backward set
    the peak at 262,144 tokens (`benchmarks/fft_at_scale.py`)."""
    C = Dv + 1
    per_row = 2 * B * H * element_size(dtype) * (3 * (F + C) + 9 * w + C)
    return max(w, budget_or_default(memory_budget_bytes) // max(1, per_row) // w * w)


def band_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int,
                 w: int = NEAR_BAND, rows: int | None = None, into: Tensor | None = None) -> Tensor:
    """`[B, H, Lq, C]` in the rows' units `exp(scale)`: the terms with offsets `|r| <= w`, dense,
    `rows` rows at a time (`band_rows`; None: all at once), added in place to `into` (which
    the caller gives up) or to zeros. Each block of rows reads only the keys and offsets its
    band meets and is recomputed in backward (checkpoint), so autograd keeps no `[Lq, 3w]`
    weights, the backward holds one block's temporaries at a time as the forward does, and
    each block's gradients are added in place at its rows (`segments.segment_sums`: summed by
    autograd, every block made full-size key gradients, 2% of the bytes of a non-causal call
    at 1,048,576 tokens)."""
    B, H, Lq, _ = phi_q.shape
    Lk = phi_k.shape[2]
    step = Lq if rows is None else max(w, rows // w * w)
    blocks = []
    for a in range(0, Lq, step):  # a static loop: sizes come from shapes
        b = min(Lq, a + step)
        # rows a..b-1 are queries at q_offset + a..; the keys within w of them
        ka, kb = max(0, q_offset + a - w), min(Lk, q_offset + b + w)
        if ka < kb:
            blocks.append(("band", a, b, ka, kb, w, q_offset + a - ka))
    y = phi_q.new_zeros(B, H, Lq, vv.shape[-1]) if into is None else into
    return segment_sums(_band_block, blocks, y, None, (phi_q, phi_k, vv, lc, scale))[0]


def _band_block(seg: tuple, args: list[Tensor]) -> tuple[Tensor, None]:
    """One block's band from its slices (`segments.segment_slices`), recomputed in backward."""
    return recomputed(_band, *args, seg[6], seg[5]), None  # (q_offset, w)
