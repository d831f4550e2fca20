"""The FFT product itself: a custom autograd function over blocks of feature channels.

Luo et al., "Stable, Fast and Accurate: Kernelized Attention with Relative Positional
Encoding" (NeurIPS 2021), Eq. 10-13:
`num_i = Σ_m φ(q_i)_m Σ_j c(j-i) φ(k_j)_m [v_j, 1]` — for each feature m, a Toeplitz
product of the `Dv + 1` channels `φ(k)_m·[v, 1]`.

Memory: the channels of all features at once would be `[B, H, L, F·(Dv+1)]` (16 GiB at
L = 64k, F = 64, fp32). Features are processed `block` at a time (a static loop: the block
comes from shapes and the memory budget), and backward recomputes each block instead of
saving it, so forward and backward need O(L·(Dv+1)·block) extra memory. Where even one
feature's `Dv + 1` channels do not fit (1M tokens), its channels go through in parts.

Layout: a block's channels are channel-major, `[B, H, f·c, N]`, zero-padded to the FFT's
length, so that every transform runs along the last, contiguous axis (`_channels`): along the
middle axis of `[B, H, L, f·c]` the FFT first copied the block twice, to pad it and to move the
axis last (CPU, L = 8,192, H = 8, forward + backward: 1.53x faster in blocks of 8 features,
1.89x in one block of 32, the same results to the bit; benchmarks/fft_product_ab.py,
results/fft_product_ab.json; repeated runs on that 2-core machine varied by up to 25%).

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, C = Dv + 1
channels per feature, N FFT length >= Lq + Lk - 1.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ...common import finite_max
from ...toeplitz.fft import coeff_spectrum, fft_length, times_spectrum
from .scale import to_row_units
from .triton_rowsum import add_row_sum


def _channels(a: Tensor, b: Tensor, N: int) -> Tensor:
    """`φ(k)_m·[v, 1]` for a block, channel-major and zero-padded to the FFT's length N, from
    the two factors channel-major already (`_major`): `[B, H, f, L], [B, H, c, L] -> [B, H,
    f·c, N]`.

    The transform's axis is last and contiguous, so the FFT takes the block as it is: along
    the middle axis of the natural `[B, H, L, f·c]` layout, torch's FFTs (cuFFT and pocketfft
    alike) first pad the block to N in a copy and then copy it again with that axis moved
    last, and the spectrum comes back strided. Here the products are written straight into
    the padded buffer, eagerly and without autograd. A graph being recorded (as a double
    backward would) takes the padding copy, and so does `torch.compile`, which cannot trace a
    strided `out=` and fuses the padding into the products itself."""
    B, H, f, L = a.shape
    c = b.shape[-2]
    a, b = a[..., :, None, :], b[..., None, :, :]  # (B, H, f, 1, L), (B, H, 1, c, L)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return torch.nn.functional.pad(a * b, (0, N - L)).flatten(2, 3)
    x = a.new_empty(B, H, f, c, N)
    torch.mul(a, b, out=x[..., :L])
    x[..., L:].zero_()
    return x.flatten(2, 3)


def _major(x: Tensor) -> Tensor:
    """`[B, H, L, n] -> [B, H, n, L]`, contiguous: a factor of `_channels`, transposed once per
    call (a block's slice of it reads along L in step with the products it makes)."""
    return x.transpose(-1, -2).contiguous()


def _blocks(F: int, C: int, block) -> list[tuple[int, int, int, int]]:
    """`(s, e, cs, ce)`: features `s..e-1` with channels `cs..ce-1`. `block`: features per
    block, or `(features, channels)` where channels < C splits one feature's channels."""
    fb, cb = (block, C) if isinstance(block, int) else block
    if cb < C and fb != 1:
        raise ValueError(f"block: a feature's channels are split only one feature at a time, got {block}")
    return [(s, min(F, s + fb), cs, min(C, cs + cb)) for s in range(0, F, fb) for cs in range(0, C, cb)]


#: FFT round-off per output entry of a circular convolution with spectrum P (length N):
#: at most ROUND_OFF·eps·sqrt(log2 N)·‖P‖₂/N. Measured in float32 against float64 for N =
#: 1k..64k, coefficients flat, decaying, sharp (-2|r|), a single spike, ±3 and ±30 noise,
#: channels positive, offset-positive and signed: the largest entry error is 1.1–5.4 times
#: `eps·sqrt(log2 N)·‖P‖₂/N` (no trend with N); 12 leaves a margin of 2.2. Unlike
#: `eps·‖c‖₂·‖x‖₂` it follows where a product's energy is: coherent (positive channels, a
#: flat table) or spread (signed values), so neither kind is over- or under-estimated.
ROUND_OFF = 12.0


class _FFTNumDen(torch.autograd.Function):
    """`(phi_q, phi_k, vv, c) -> (y, err)`: `y: [B, H, Lq, C]` with
    `y_i = Σ_m φq_im Σ_j c(j-i) φk_jm vv_j`, and `err: [B, H, F, C]` the estimated round-off
    of each feature's channel products per entry (not differentiable)."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, vv: Tensor, c: Tensor, block: int | tuple[int, int]):
        B, H, Lq, F = phi_q.shape
        Lk, C = vv.shape[2], vv.shape[3]
        N = fft_length(Lq + Lk - 1)
        cf = coeff_spectrum(c, N)[None]  # (1, H, N//2+1)
        y = phi_q.new_zeros(B, H, Lq, C)
        err = phi_q.new_empty(B, H, F, C)
        # sqrt(2)·‖half spectrum‖₂ >= ‖full spectrum‖₂ (Parseval over the rfft's half)
        unit = ROUND_OFF * torch.finfo(phi_q.dtype).eps * math.sqrt(2 * math.log2(max(N, 2))) / N
        cf = cf[:, :, None, :]  # (1, H, 1, N//2+1): one spectrum per head, for every channel
        kt, vt = _major(phi_k), _major(vv)  # (B, H, F, Lk), (B, H, C, Lk)
        for s, e, cs, ce in _blocks(F, C, block):
            fc = (e - s, ce - cs)
            p = times_spectrum(torch.fft.rfft(_channels(kt[:, :, s:e], vt[:, :, cs:ce], N), dim=-1), cf)  # (B, H, f·c, N//2+1)
            # ‖P‖₂ per channel, one reduction over the real view (vector_norm on the complex
            # spectrum took 3.6x as long on the CPU; the einsum of Σ|P|² it replaces, a batched
            # dot product, ran as cuBLAS gemv on the H100: 24 of 555 ms at 65,536 tokens)
            norm = torch.linalg.vector_norm(torch.view_as_real(p).flatten(-2), dim=-1)  # (B, H, f·c)
            err[:, :, s:e, cs:ce] = (unit * norm).unflatten(-1, fc)
            t = torch.fft.irfft(p, n=N, dim=-1)[..., Lk - 1: Lk - 1 + Lq]  # (B, H, f·c, Lq)
            del p
            # Σ_f t[f, c, i]·φq[i, f]: (B, H, f, c, Lq) by (B, H, f, 1, Lq), summed over f (φq's
            # block read through a transposed view: a channel-major copy of all of φq would add
            # B·H·F·Lq floats to the forward's peak, 1 GiB at a million tokens)
            qb = phi_q[..., s:e].transpose(-1, -2)[:, :, :, None]
            add_row_sum(y[..., cs:ce].transpose(-1, -2), t.unflatten(2, fc), qb, 2)
        ctx.save_for_backward(phi_q, phi_k, vv, c)
        ctx.block = block
        ctx.mark_non_differentiable(err)
        return y, err

    @staticmethod
    def backward(ctx, gy: Tensor, _gerr: Tensor):
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
        cf, cf_t = cf[:, :, None, :], cf_t[:, :, None, :]  # (1, H, 1, N//2+1)
        kt, vt, qt, gt = _major(phi_k), _major(vv), _major(phi_q), _major(gy)  # (B, H, F or C, L)
        for s, e, cs, ce in _blocks(F, C, block):
            fc = (e - s, ce - cs)
            xf = torch.fft.rfft(_channels(kt[:, :, s:e], vt[:, :, cs:ce], N), dim=-1)  # (B, H, f·c, N//2+1)
            if g_q is not None:
                # (the spectrum multiplied in place when the coefficients' gradient does not need it)
                t = torch.fft.irfft(xf * cf if need_c else times_spectrum(xf, cf), n=N, dim=-1)[..., Lk - 1: Lk - 1 + Lq]
                # Σ_c gy[i, c]·t[f, c, i]: (B, H, f, c, Lq) by (B, H, 1, c, Lq), summed over c
                add_row_sum(g_q[..., s:e].transpose(-1, -2), t.unflatten(2, fc), gt[:, :, None, cs:ce], 3)
                del t
            # dL/d(T-product) per channel
            zf = torch.fft.rfft(_channels(qt[:, :, s:e], gt[:, :, cs:ce], N), dim=-1)  # (B, H, f·c, N//2+1)
            if need_c:
                # dL/dc[r] = Σ_i Σ_ch z_i x_{i + r - (Lq-1)}: a cross-correlation, summed in the spectrum
                # (xf is still the rfft of x here: with need_c nothing multiplied it in place)
                part = (zf.conj() * xf).sum(dim=(0, 2))  # (H, N//2+1)
                g_cf = part if g_cf is None else g_cf + part
            del xf
            if g_k is not None or g_v is not None:
                g = torch.fft.irfft(times_spectrum(zf, cf_t), n=N, dim=-1)[..., Lq - 1: Lq - 1 + Lk].unflatten(2, fc)
                # (B, H, f, c, Lk)
                if g_k is not None:
                    add_row_sum(g_k[..., s:e].transpose(-1, -2), g, vt[:, :, None, cs:ce], 3)
                if g_v is not None:
                    add_row_sum(g_v[..., cs:ce].transpose(-1, -2), g, kt[:, :, s:e, None], 2)
        g_c = None
        if need_c:
            corr = torch.fft.irfft(g_cf, n=N, dim=-1)  # corr[t], t = j - i (mod N)
            R = Lq + Lk - 1
            t = torch.arange(-(Lq - 1), Lk, device=c.device) % N
            g_c = corr[:, t][:, :R]
        return g_q, g_k, g_v, g_c, None


def scaled_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor,
                   block: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
    """`(y, err)`, each `[B, H, Lq, C]` in the rows' units `exp(scale)` (`scale: [H, Lq]`), for
    the log-coefficients `lc: [H, Lq+Lk-1]`: one FFT product on `exp(lc - m)`, `m` the
    per-head largest entry (computed on the device), then each row brought to its own
    units. `err` bounds each entry's round-off (`Σ_m |φ(q_i)_m|·err_m`): rows whose own
    maximum is far below `m`, or whose value is far below the product's, show it there."""
    m = finite_max(lc)  # (H, 1)
    y, err = _FFTNumDen.apply(phi_q, phi_k, vv, torch.exp(lc - m), block)
    with torch.no_grad():
        err = torch.einsum("bhif,bhfc->bhic", phi_q.detach().abs(), err)  # (B, H, Lq, C)
    return to_row_units(y, m, scale), to_row_units(err, m, scale)
