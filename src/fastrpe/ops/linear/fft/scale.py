"""Per-row rescaling: each query row is reported in units of the largest coefficient it sees.

FFT round-off is relative to the largest value in a product, so every product is computed
on `exp(b - m)` with its own maximum `m` and brought to the rows' own units `exp(s_i)`
afterwards; the rows' maxima `s_i` come from a sliding-window maximum over the
log-coefficients, on the device, with no host synchronization.
"""
from __future__ import annotations

import torch
from torch import Tensor


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


def row_max(lc: Tensor, Lq: int, Lk: int) -> Tensor:
    """`[H, Lq]`: the largest log-coefficient row i sees (`-inf` for rows that see none).
    Row i's offsets are `lc[:, Lq-1-i : Lq-1-i+Lk]`: a sliding-window max, reversed."""
    with torch.no_grad():
        return sliding_max(lc.detach(), Lk).flip(-1)


def row_scale(lc: Tensor, Lq: int, Lk: int, fill: float = 0.0) -> Tensor:
    """`[H, Lq]`: `row_max` with `fill` for rows that see no coefficient."""
    m = row_max(lc, Lq, Lk)
    return torch.where(torch.isfinite(m), m, torch.full_like(m, fill))


#: a product is brought to a row's units by `exp(m - s_i)`, clamped here so that it cannot
#: overflow; rows beyond the clamp are sent to the exact recomputation (`certify.py`)
MAX_RESCALE_NATS = {torch.float32: 40.0, torch.float64: 300.0}


def to_row_units(y: Tensor, m: Tensor, scale: Tensor) -> Tensor:
    """`y: [B, H, n, C]` in units of `exp(m)` (`m: [H, 1]`) -> the rows' own units `exp(scale)`
    (`scale: [H, n]`)."""
    nats = (m - scale).clamp_max(MAX_RESCALE_NATS[y.dtype])
    return y * torch.exp(nats)[None, :, :, None]
