"""Kernelized attention with a 2D RPE on an image grid by 2D FFT (the naive reference is
`naive.kernelized_num_den_grid_naive`).

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding" (NeurIPS 2021), Eq. 10 with a 2D table:
`out_i = Σ_j φ(q_i)·φ(k_j)·c(i, j)·v_j / Σ_j φ(q_i)·φ(k_j)·c(i, j)`, `c = exp(b)`, where
`b(i, j) = table[Δrow, Δcol]` between patches and a class-token coefficient when i or j
is the class token. Self-attention only (`Lq = Lk = N`), non-causal.

The patch–patch part is, for each feature m, a Toeplitz-block-Toeplitz product of the
`Dv + 1` channels `φ(k)_m·[v, 1]` (2D FFT, `ops/toeplitz/fft2d.py`), done `block`
features at a time with a custom backward that recomputes each block, so forward and
backward need O(N·(Dv+1)·block) extra memory. The class token's row and column are
rank-one corrections added exactly.

Notation: B batch, H heads, grid `(Hg, Wg)`, `P = Hg·Wg` patches, `N = cls + P` tokens,
F features, Dv value width, `C = Dv + 1` channels per feature, `(N1, N2)` FFT size.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..common import CLS_TO_CLS, CLS_TO_PATCH, PATCH_TO_CLS, check_grid
from ..toeplitz.fft import fft_dtype_for
from ..toeplitz.fft2d import apply_spectrum2d, fft2d_size, table_spectrum
from .naive import check_grid_num_den_inputs, grid_head_max

DEFAULT_BUDGET = 512 << 20


def _bytes_per_feature(B: int, H: int, grid, Dv: int, el: int) -> int:
    """Extra bytes one feature's channels need during a block (backward, the larger)."""
    N1, N2 = fft2d_size(grid)
    P = grid[0] * grid[1]
    # x, its spectrum (complex), the product, the inverse (N1·N2 real), the kept rows; x2 in backward
    return B * H * (Dv + 1) * el * (P + 2 * 2 * N1 * (N2 // 2 + 1) + N1 * N2 + P) * 2


def grid_fft_block_size(B: int, H: int, grid, F: int, Dv: int, dtype=torch.float32,
                        memory_budget_bytes: int | None = None) -> int:
    """Features per block so that one block's temporaries fit the budget (at least 1)."""
    el = 8 if dtype == torch.float64 else 4
    budget = DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes
    return int(max(1, min(F, budget // max(1, _bytes_per_feature(B, H, check_grid(grid), Dv, el)))))


def estimate_grid_fft_cost(B: int, H: int, grid, F: int, Dv: int, dtype=torch.float32,
                           memory_budget_bytes: int | None = None) -> tuple[float, int]:
    """(flops, peak extra bytes) of one forward call of `kernelized_num_den_grid_fft`."""
    el = 8 if dtype == torch.float64 else 4
    N1, N2 = fft2d_size(grid)
    P, C = grid[0] * grid[1], Dv + 1
    fft_flops = 2 * 2.5 * N1 * N2 * math.log2(max(2, N1 * N2)) * B * H * F * C  # rfft2 + irfft2 per channel
    flops = fft_flops + 4 * B * H * 2 * P * F * C
    block = grid_fft_block_size(B, H, grid, F, Dv, dtype, memory_budget_bytes)
    peak = block * _bytes_per_feature(B, H, check_grid(grid), Dv, el) + 3 * B * H * 2 * P * (F + C) * el
    return flops, int(peak)


def _channels(phi: Tensor, vv: Tensor, grid) -> Tensor:
    """`φ_m·vv` for a block, channels first: `[B, H, P, f], [B, H, P, C] -> [B, H, f·C, Hg, Wg]`."""
    x = phi.transpose(-1, -2)[..., :, None, :] * vv.transpose(-1, -2)[..., None, :, :]  # (B, H, f, C, P)
    return x.flatten(2, 3).unflatten(-1, grid)


class _FFT2DNumDen(torch.autograd.Function):
    """`(phi_q, phi_k, vv, c) -> y: [B, H, P, C]` with
    `y_i = Σ_m φq_im Σ_j c(Δrow, Δcol) φk_jm vv_j` over patches, `c: [H, 2Hg-1, 2Wg-1]`."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, vv: Tensor, c: Tensor, grid: tuple[int, int], block: int):
        B, H, P, F = phi_q.shape
        C = vv.shape[-1]
        size = fft2d_size(grid)
        cf = table_spectrum(c, size)  # (H, N1, N2//2+1)
        y = phi_q.new_zeros(B, H, P, C)
        for s in range(0, F, block):
            e = min(F, s + block)
            t = apply_spectrum2d(cf, _channels(phi_k[..., s:e], vv, grid), grid, size)  # (B, H, f·C, Hg, Wg)
            y += torch.einsum("bhif,bhfci->bhic", phi_q[..., s:e], t.reshape(B, H, e - s, C, P))
        ctx.save_for_backward(phi_q, phi_k, vv, c)
        ctx.grid, ctx.block = grid, block
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        phi_q, phi_k, vv, c = ctx.saved_tensors
        grid, block = ctx.grid, ctx.block
        Hg, Wg = grid
        B, H, P, F = phi_q.shape
        C = vv.shape[-1]
        size = fft2d_size(grid)
        cf = table_spectrum(c, size)  # forward operator T
        cf_t = table_spectrum(c.flip(-2, -1), size)  # transposed operator: c(-Δrow, -Δcol)
        need_c = ctx.needs_input_grad[3]
        g_q = torch.zeros_like(phi_q) if ctx.needs_input_grad[0] else None
        g_k = torch.zeros_like(phi_k) if ctx.needs_input_grad[1] else None
        g_v = torch.zeros_like(vv) if ctx.needs_input_grad[2] else None
        g_cf = None
        for s in range(0, F, block):
            e = min(F, s + block)
            f = e - s
            xf = torch.fft.rfft2(_channels(phi_k[..., s:e], vv, grid), s=size)  # (B, H, f·C, N1, N2//2+1)
            if g_q is not None:
                t = torch.fft.irfft2(xf * cf.unsqueeze(-3), s=size)[..., Hg - 1: 2 * Hg - 1, Wg - 1: 2 * Wg - 1]
                g_q[..., s:e] = torch.einsum("bhic,bhfci->bhif", gy, t.reshape(B, H, f, C, P))
            zf = torch.fft.rfft2(_channels(phi_q[..., s:e], gy, grid), s=size)  # dL/d(T-product) per channel
            if g_k is not None or g_v is not None:
                g = torch.fft.irfft2(zf * cf_t.unsqueeze(-3), s=size)[..., Hg - 1: 2 * Hg - 1, Wg - 1: 2 * Wg - 1]
                g = g.reshape(B, H, f, C, P)
                if g_k is not None:
                    g_k[..., s:e] = torch.einsum("bhfcj,bhjc->bhjf", g, vv)
                if g_v is not None:
                    g_v += torch.einsum("bhfcj,bhjf->bhjc", g, phi_k[..., s:e])
            if need_c:
                # dL/dc[Δ] = Σ_i Σ_ch z_i x_(i+Δ): a 2D cross-correlation, summed in the spectrum
                part = (zf.conj() * xf).sum(dim=(0, 2))  # (H, N1, N2//2+1)
                g_cf = part if g_cf is None else g_cf + part
        g_c = None
        if need_c:
            corr = torch.fft.irfft2(g_cf, s=size)  # corr[t1, t2], t = Δ (mod N)
            tr = torch.arange(-(Hg - 1), Hg, device=c.device) % size[0]
            tc = torch.arange(-(Wg - 1), Wg, device=c.device) % size[1]
            g_c = corr[:, tr][:, :, tc]
        return g_q, g_k, g_v, g_c, None, None


def kernelized_num_den_grid_fft(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    table: Tensor,
    grid,
    cls_coeff: Tensor | None = None,
    *,
    key_padding_mask: Tensor | None = None,
    memory_budget_bytes: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same signature and results as `kernelized_num_den_grid_naive`, by 2D FFT in feature blocks.

    Args:
        phi_q, phi_k: `[B, H, N, F]`; v: `[B, H, N, Dv]`; table: `[H, 2Hg-1, 2Wg-1]`;
        grid: `(Hg, Wg)`; cls_coeff: `[H, 3]` or None; key_padding_mask: `[B, N]`: as in the naive op.
        memory_budget_bytes: bound on one block's temporaries (default 512 MiB).

    Returns:
        `num: [B, H, N, Dv]`, `den: [B, H, N]` and `log_scale: [H, N]` (true values are
        `num·exp(log_scale)`), in float32 (float64 for float64 inputs).
    """
    Hg, Wg, N = check_grid_num_den_inputs(phi_q, phi_k, v, table, grid, cls_coeff)
    B, H, _, F = phi_q.shape
    Dv = v.shape[-1]
    dt = fft_dtype_for(phi_q.dtype)
    phi_q, phi_k = phi_q.to(dt), phi_k.to(dt)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], dim=-1)  # (B, H, N, C)
    tb = table.to(dt)
    cc = None if cls_coeff is None else cls_coeff.to(dt)
    m = grid_head_max(tb, cc)  # (H, 1): any per-head constant cancels in num / den
    block = grid_fft_block_size(B, H, (Hg, Wg), F, Dv, dt, memory_budget_bytes)
    ncls = int(cc is not None)
    pq, pk, pv = phi_q[:, :, ncls:], phi_k[:, :, ncls:], vv[:, :, ncls:]  # patches only
    y = _FFT2DNumDen.apply(pq, pk, pv, torch.exp(tb - m[..., None]), (Hg, Wg), block)  # (B, H, P, C)
    if cc is not None:
        # the class token's row and column of the weights: rank-one corrections
        c = torch.exp(cc - m)[None, :, :, None, None]  # (1, H, 3, 1, 1)
        c_cp, c_pc, c_cc = c[:, :, CLS_TO_PATCH], c[:, :, PATCH_TO_CLS], c[:, :, CLS_TO_CLS]  # (1, H, 1, 1)
        q0, k0, v0 = phi_q[:, :, :1], phi_k[:, :, :1], vv[:, :, :1]  # (B, H, 1, .)
        kv = torch.einsum("bhjf,bhjc->bhfc", pk, pv)  # (B, H, F, C): Σ over patch keys
        y_cls = (c_cp * torch.einsum("bhif,bhfc->bhic", q0, kv)
                 + c_cc * (q0 * k0).sum(-1, keepdim=True) * v0)  # (B, H, 1, C)
        y_pc = c_pc * torch.einsum("bhif,bhjf->bhij", pq, k0) * v0  # (B, H, P, C)
        y = torch.cat([y_cls, y + y_pc], dim=2)  # (B, H, N, C)
    return y[..., :Dv], y[..., Dv], m.expand(H, N)
