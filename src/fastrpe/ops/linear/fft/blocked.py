"""Causal products across chunks: one FFT per chunk and, per frequency, a lower-triangular sum.

Luo et al. 2021 (Eq. 10-13) multiply by the Toeplitz matrix with one FFT of the whole length,
which lets every query read every key; causally, `causal.py` splits the positions in halves
down to dense leaves, one full-length FFT level per halving (`log2(L/leaf)` levels). Here the
positions are cut into chunks of T (a power of two) instead. Query chunk b sees an earlier key
chunk a < b through the offsets `d = (b-a)·T + s - t`, `s, t in [0, T)`: for each lag
`δ = b - a` a kernel of `2T - 1` coefficients, which a circular convolution of length 2T with
the key chunk zero-padded applies exactly. So:

- every key chunk's channels `φ(k)_m·[v, 1]` are transformed once (length 2T);
- for each frequency, query chunk b's spectrum is `Σ_{a<b} W[b,a]·K_{b-a}·X_a`: a
  lower-triangular `[nb, na]` matrix times the chunks' spectra, one batched complex matmul;
- every query chunk's sum is transformed back once and contracted with its `φ(q)`.

No query chunk's sum reads a later key chunk, so no future key reaches a past query, even
through round-off; a chunk's own pairs (a = b) are the caller's (`causal.py`: the recursion
inside each chunk). The work is one FFT level plus `nb·na` complex multiply-adds per frequency
and channel, where the recursion above the chunks took `log2(L/T)` levels.

Units: lag δ's kernel is `exp(lc - m_δ)` (`m_δ` its largest log-coefficient), and query
chunk b's sum is in units of `exp(M_b)`, `M_b = max m_δ` over the lags it sees, so
`W[b,a] = exp(m_{b-a} - M_b) <= 1`; the caller brings each row to its own units.

Round-off: each `(b, a)` product is a circular convolution of spectrum `P = W·K·X`, whose
entry error `product.ROUND_OFF` bounds by `eps·sqrt(log2 N)·‖P‖₂/N`. A chunk's sum has the
inverse transform's round-off, which follows `‖Σ_a P_ba‖₂` (all of the error where the pairs
are coherent: positive channels, a positive kernel's DC term), and each pair's forward
transform's, independent across pairs, `sqrt(Σ_a ‖P_ba‖₂²)`; the estimate takes both in
quadrature, the second summed over frequencies and pairs in one real matmul. The second
alone left positive values over 64 chunks less than the tests' 1.5x margin; a bound from each
band of frequencies' largest `|K|²` was far looser for a positive kernel, whose DC term dwarfs
the rest (most rows of signed values failed the certificate where the recursion's passed).

Notation: B batch, H heads, F features, C = Dv + 1 channels per feature, T chunk length,
P = T + 1 frequencies of the length-2T real FFT, nb query chunks, na key chunks.
"""
from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

from ...common import device_route, route_setting
from .product import ROUND_OFF, _blocks, _channels
from .scale import to_row_units
from .triton_rowsum import add_row_sum


def chunk_layout(Lq: int, Lk: int, q_offset: int, T: int) -> tuple[int, int, int]:
    """`(b0, nb, na)`: queries (positions `q_offset..q_offset+Lq-1`) lie in chunks
    `b0..b0+nb-1` of T positions, and the keys that some later query chunk sees in chunks
    `0..na-1` (na = 0: no pair across chunks)."""
    end = q_offset + Lq
    b0 = q_offset // T
    nb = -(-end // T) - b0
    na = max(0, min(-(-min(Lk, end) // T), (end - 1) // T))
    return b0, nb, na


def _lags(b0: int, nb: int, na: int, device) -> tuple[Tensor, Tensor, int]:
    """`(lag, valid, lo)`: `lag[i, a] = b0 + i - a - lo`, the index of the pair's lag among
    `lo..b0+nb-1`, and `valid[i, a]`: key chunk a is strictly before query chunk b0 + i."""
    lo = max(1, b0 - na + 1)
    i = torch.arange(nb, device=device)[:, None]
    a = torch.arange(na, device=device)[None, :]
    lag = b0 + i - a
    valid = lag >= 1
    return (lag - lo).clamp_min(0), valid, lo


def lag_kernels(lc: Tensor, Lq: int, q_offset: int, T: int, lo: int, hi: int) -> Tensor:
    """`[H, hi-lo+1, 2T-1]`: the log-coefficients of lags `lo..hi`, offsets
    `d = δ·T - (T-1) .. δ·T + (T-1)` (`-inf` outside the table). Row i's offsets are
    `lc[:, Lq-1-i : ...]`, so offset d (query position minus key position) is
    `lc[:, Lq-1+q_offset-d]`."""
    R = lc.shape[-1]
    d = torch.arange(lo, hi + 1, device=lc.device)[:, None] * T + torch.arange(-(T - 1), T, device=lc.device)
    idx = Lq - 1 + q_offset - d  # (lags, 2T-1)
    inside = (idx >= 0) & (idx < R)
    seg = lc[:, idx.clamp(0, R - 1)]
    return seg.masked_fill(~inside, float("-inf"))


def _circular(kern: Tensor, T: int) -> Tensor:
    """`[..., 2T-1]` taps `t = -(T-1)..T-1` -> `[..., 2T]` with tap t at `t mod 2T` (index T
    is no tap: it stays 0)."""
    return torch.cat([kern[..., T - 1:], kern.new_zeros(*kern.shape[:-1], 1), kern[..., :T - 1]], dim=-1)


def _to_freq_major(x: Tensor, H: int, n: int) -> Tensor:
    """`[B, H·n, fc, P]` spectra -> `[H, P, n, B·fc]` (each frequency a matrix over chunks)."""
    B, _, fc, P = x.shape
    return x.view(B, H, n, fc, P).permute(1, 4, 2, 0, 3).reshape(H, P, n, B * fc)


def _from_freq_major(y: Tensor, B: int) -> Tensor:
    """`[H, P, n, B·fc]` -> `[B, H·n, fc, P]`."""
    H, P, n, bfc = y.shape
    return y.view(H, P, n, B, bfc // B).permute(3, 0, 2, 4, 1).reshape(B, H * n, bfc // B, P)


#: the `[H, P, nb, na]` lag matrices are built once a call when they fit in this many bytes,
#: else one slice of frequencies at a time, again for every block of channels (the whole is
#: H·(T+1)·nb·na complex entries: 4.3 GB at a million tokens, H = 8, 64 chunks)
MATRIX_BYTES = 128 << 20


class _LagSlice:
    """One slice of frequencies of the lag matrices, `m: [H, p, nb, na]`, with what the
    products derive from it made once (`energy` for the round-off estimate, `adjoint` for the
    backward's transposed product), however many blocks of channels use it."""

    def __init__(self, m: Tensor):
        self.m = m
        self._energy = self._adjoint = None

    @property
    def energy(self) -> Tensor:
        """`[H, nb, p·na]`: `|m|²` laid out for `_pair_energy`'s matmul."""
        if self._energy is None:
            H, p, nb, na = self.m.shape
            self._energy = torch.view_as_real(self.m).square().sum(-1).permute(0, 2, 1, 3).reshape(H, nb, p * na)
        return self._energy

    @property
    def adjoint(self) -> Tensor:
        """`[H, p, na, nb]`: the conjugate transpose, contiguous."""
        if self._adjoint is None:
            self._adjoint = self.m.conj().transpose(-1, -2).resolve_conj().contiguous()
        return self._adjoint


class _LagMatrices:
    """`W[b, a]·K_{b-a}(f)` (0 off the pairs) as `_LagSlice`s of `[H, p, nb, na]`."""

    def __init__(self, ks: Tensor, lag: Tensor, valid: Tensor, W: Tensor):
        H, _, P = ks.shape
        nb, na = lag.shape
        per = max(1, H * nb * na * 2 * ks.real.element_size())
        p = int(max(1, min(P, MATRIX_BYTES // per)))
        self.slices = [(s, min(P, s + p)) for s in range(0, P, p)]
        self.ks, self.lag, self.w = ks, lag, torch.where(valid, W, torch.zeros_like(W))[..., None]
        self.kept = [self._build(f0, f1) for f0, f1 in self.slices] if len(self.slices) == 1 else None

    def _build(self, f0: int, f1: int) -> _LagSlice:
        # contiguous once: a permuted view was copied again by every matmul that read it, once
        # per block of channels (2 of the 6 matrix-sized reads and writes a block made forward)
        return _LagSlice((self.ks[:, :, f0:f1][:, self.lag] * self.w).permute(0, 3, 1, 2).contiguous())  # (H, p, nb, na)

    def __iter__(self):
        for n, (f0, f1) in enumerate(self.slices):
            yield f0, f1, (self.kept[n] if self.kept is not None else self._build(f0, f1))


class _Parts:
    """A matmul's result over the frequency slices: the one product itself when there is one
    slice (no copy), else written slice by slice into one tensor."""

    def __init__(self, mats: _LagMatrices, shape: tuple, like: Tensor):
        self.whole = None if len(mats.slices) == 1 else like.new_empty(shape)

    def put(self, f0: int, f1: int, part: Tensor) -> None:
        if self.whole is None:
            self.whole = part
        else:
            self.whole[:, f0:f1] = part


def _pair_energy(m: _LagSlice, xs: Tensor) -> Tensor:
    """`[H, nb, q]`: `Σ_a Σ_f |m(f)|²·|x_a(f)|²` for a slice of lag matrices and spectra
    `xs: [H, p, na, q]`: each pair's `‖P_ba‖²`, summed over the pairs (one matmul over
    frequencies and key chunks together; `|x|²` from the real view)."""
    H, p, na, _ = xs.shape
    x2 = torch.view_as_real(xs).square().sum(-1).reshape(H, p * na, -1)
    return torch.bmm(m.energy, x2)


def _add_pair_correlations(pairs: Tensor, zs: Tensor, xs: Tensor) -> None:
    """`pairs += zs·xsᴴ` per head and frequency, in place (`[H, P, nb, na]` from `zs: [H, P,
    nb, q]` and `xs: [H, P, na, q]`): each pair of chunks' correlation, summed over a block's
    channels by the product and over the blocks by the accumulation."""
    H, P, nb, na = pairs.shape
    pairs.view(H * P, nb, na).baddbmm_(zs.reshape(H * P, nb, -1), xs.reshape(H * P, na, -1).conj().transpose(-1, -2))


def _lag_correlations(corr: Tensor, pairs: Tensor, Wv: Tensor, lag: Tensor) -> None:
    """`corr[:, lag[b, a]] += W[b, a]·pairs[:, :, b, a]` (`corr: [H, lags, p]`, `pairs: [H, p,
    nb, na]`): each pair's cross-correlation of the output gradient with its key chunk, in the
    spectrum, weighted by W and summed into the pair's lag."""
    H, p, nb, na = pairs.shape
    q = (pairs * Wv[:, None]).permute(0, 2, 3, 1).reshape(H, nb * na, p)
    corr.index_add_(1, lag.flatten(), q)


#: where `_BlockedNumDen` takes its sums over chunks in Triton kernels that read each block's
#: spectra as the FFT writes them (`triton_blocked.py`: no frequency-major copies, no lag
#: matrices): "never" (the default until a GPU has timed them: the bench's rows
#: `fastrpe-fft+lag-kernels`), "cuda" or "always" (wherever the kernels run: the interpreter,
#: for the tests). A call the kernels refuse (`triton_blocked.unsupported`: float32 only; the
#: coefficients' gradient under deterministic algorithms) takes the torch path. Counted on
#: shapes at the GPU bench's problem (B = 1, H = 8, F = 32, Dv = 64, a frozen table, the H200's
#: budget, forward + backward), a call moved 594.8 GiB at 65,536 tokens with the torch path,
#: 443.9 to 467.8 with the kernels; 4,240 and 2,322 to 2,611 at 262,144, 22,416 and 13,839 to
#: 14,997 at 1,048,576, each with its own chunks (`plan.causal_chunk` with `kernels_take`: 64
#: chunks where the torch path takes 8 and the recursion). The range: the kernels' re-reads of
#: the spectra (benchmarks/fft_blocked_traffic.py --at-scale, results/fft_blocked_kernels_at_scale.json).
KERNEL = "never"


def _routed(device: torch.device, route: str | None = None) -> bool:
    """Whether `route` (default `KERNEL`) sends a call on `device` to the kernels (`device_route`,
    which says what a bad value is)."""
    return device_route(KERNEL if route is None else route, "fastrpe.ops.linear.fft.blocked.KERNEL", device)


def use_kernel(route: str):
    """`KERNEL = route` ("cuda", "always" or "never") inside the block, restored after it."""
    return route_setting(sys.modules[__name__], "KERNEL", route)


def kernels_take(device: torch.device, dtype: torch.dtype, B: int, H: int) -> bool:
    """Whether a call's sums over chunks run in the kernels (`KERNEL` routes `device`, and they
    take float32 spectra of B·H heads there): the chunk counts `plan.causal_chunk` weighs
    differ with them."""
    if not _routed(device):
        return False
    from . import triton_blocked

    return not triton_blocked.shape_reasons(device, dtype, B, H)


def _lag_sums(qc: Tensor, ks: Tensor, W: Tensor, lag: Tensor, valid: Tensor, corr: bool = False):
    """The kernels' `triton_blocked.LagSums` for this call (`KERNEL`), or None: the torch path."""
    if not _routed(qc.device):
        return None
    from . import triton_blocked

    if triton_blocked.unsupported(qc, ks, qc.shape[0], qc.shape[1], corr):
        return None
    return triton_blocked.LagSums(ks, W, lag, valid)


class _BlockedNumDen(torch.autograd.Function):
    """`(qc, kc, vc, circ, W, lag, valid, block) -> (y, err2)` over chunked, padded inputs:
    `qc: [B, H, nb, F, T]`, `kc: [B, H, na, F, T]`, `vc: [B, H, na, C, T]` (channel-major),
    `circ: [H, lags, 2T]` the lags' circular kernels, `W: [H, nb, na]` (no gradient).
    `y: [B, H, nb, T, C]` with `y_bs = Σ_m φq_bsm Σ_{a<b} (W[b,a]·circ_{b-a} ⊛ φk_am·vv_a)_s`;
    `err2: [B, H, nb, F, C]`: each feature's channel products' squared round-off per entry.
    The sums over chunks per frequency by `triton_blocked`'s kernels (`KERNEL`) or as batched
    matmuls over frequency-major copies and lag matrices."""

    @staticmethod
    def forward(ctx, qc, kc, vc, circ, W, lag, valid, block):
        B, H, nb, F, T = qc.shape
        na, C = kc.shape[2], vc.shape[3]
        ks = torch.fft.rfft(circ, dim=-1)  # (H, lags, P)
        P = ks.shape[-1]
        sums = _lag_sums(qc, ks, W, lag, valid)
        mats = _LagMatrices(ks, lag, valid, W) if sums is None else None
        y = qc.new_zeros(B, H, nb, C, T)
        err2 = qc.new_empty(B, H, nb, F, C)
        unit = ROUND_OFF * torch.finfo(qc.dtype).eps * math.sqrt(2 * math.log2(2 * T)) / (2 * T)
        kf = kc.flatten(1, 2)  # (B, H·na, F, T)
        vf = vc.flatten(1, 2)
        for s, e, cs, ce in _blocks(F, C, block):
            f, c = e - s, ce - cs
            xs = torch.fft.rfft(_channels(kf[:, :, s:e], vf[:, :, cs:ce], 2 * T), dim=-1)  # (B, H·na, f·c, P)
            if sums is not None:  # the spectra as they are; the same sums and energies
                out, e2 = sums.forward(xs)  # (B, H·nb, f·c, P), (H, nb, B·f·c)
                del xs
            else:
                xs = _to_freq_major(xs, H, na)
                parts = _Parts(mats, (H, P, nb, B * f * c), xs)
                e2 = qc.new_zeros(H, nb, B * f * c)
                for f0, f1, m in mats:
                    part = torch.matmul(m.m, xs[:, f0:f1])  # (H, p, nb, B·f·c)
                    parts.put(f0, f1, part)
                    # the sum's ‖Σ_a P_ba‖² (what the inverse transform's round-off follows; all of
                    # it where the pairs are coherent) and each pair's ‖P_ba‖² (where they are not);
                    # the frequency pairs f, -f: the factor 2 in `unit`
                    e2 += torch.linalg.vector_norm(torch.view_as_real(part), dim=(1, -1)).square()
                    e2 += _pair_energy(m, xs[:, f0:f1])
                del xs
                out = _from_freq_major(parts.whole, B)
                del parts
            t = torch.fft.irfft(out, n=2 * T, dim=-1)[..., :T]  # (B, H·nb, f·c, T)
            del out
            t = t.view(B, H, nb, f, c, T)
            add_row_sum(y[:, :, :, cs:ce], t, qc[:, :, :, s:e, None], 3)
            err2[:, :, :, s:e, cs:ce] = (unit ** 2 * e2).view(H, nb, B, f, c).permute(2, 0, 1, 3, 4)
        ctx.save_for_backward(qc, kc, vc, circ, W, lag, valid)
        ctx.block = block
        ctx.mark_non_differentiable(err2)
        return y.transpose(-1, -2), err2

    @staticmethod
    def backward(ctx, gy, _gerr):
        qc, kc, vc, circ, W, lag, valid = ctx.saved_tensors
        block = ctx.block
        B, H, nb, F, T = qc.shape
        na, C = kc.shape[2], vc.shape[3]
        ks = torch.fft.rfft(circ, dim=-1)
        P = ks.shape[-1]
        need_q, need_k, need_v, need_c = ctx.needs_input_grad[:4]
        sums = _lag_sums(qc, ks, W, lag, valid, corr=need_c)
        mats = _LagMatrices(ks, lag, valid, W) if sums is None else None
        g_q = torch.zeros_like(qc) if need_q else None
        g_k = torch.zeros_like(kc) if need_k else None
        g_v = torch.zeros_like(vc) if need_v else None
        corr = torch.zeros_like(ks) if need_c else None  # each lag's cross-correlations, in the spectrum
        # with the matrices kept whole, every block's pair correlations `zs·xsᴴ` ([H, P, nb, na])
        # add up in one tensor, weighted and summed into their lags once after the blocks; per
        # block that took five matrix-sized reads and writes more (`_lag_correlations`)
        pairs = ks.new_zeros(H, P, nb, lag.shape[1]) if need_c and mats is not None and len(mats.slices) == 1 else None
        gt = gy.transpose(-1, -2).contiguous()  # (B, H, nb, C, T)
        kf, vf, qf, gf = kc.flatten(1, 2), vc.flatten(1, 2), qc.flatten(1, 2), gt.flatten(1, 2)
        Wv = torch.where(valid, W, torch.zeros_like(W))
        for s, e, cs, ce in _blocks(F, C, block):
            f, c = e - s, ce - cs
            xs = torch.fft.rfft(_channels(kf[:, :, s:e], vf[:, :, cs:ce], 2 * T), dim=-1)  # (B, H·na, f·c, P)
            zs = torch.fft.rfft(_channels(qf[:, :, s:e], gf[:, :, cs:ce], 2 * T), dim=-1)  # (B, H·nb, f·c, P)
            out = back = None
            if sums is not None:
                if need_q:
                    out = sums.forward(xs, energy=False)[0]
                if need_k or need_v:  # the adjoint: each pair's kernel reversed, conj in the spectrum
                    back = sums.adjoint(zs)
                if need_c:
                    corr += sums.correlations(zs, xs)
                del xs, zs
            else:
                xs, zs = _to_freq_major(xs, H, na), _to_freq_major(zs, H, nb)
                outs = _Parts(mats, (H, P, nb, B * f * c), xs) if need_q else None
                backs = _Parts(mats, (H, P, na, B * f * c), xs) if (need_k or need_v) else None
                for f0, f1, m in mats:
                    if outs is not None:
                        outs.put(f0, f1, torch.matmul(m.m, xs[:, f0:f1]))
                    if backs is not None:  # the adjoint: each pair's kernel reversed, conj in the spectrum
                        backs.put(f0, f1, torch.matmul(m.adjoint, zs[:, f0:f1]))
                    if need_c and pairs is None:  # sliced: each slice's correlations into the lags at once
                        _lag_correlations(corr[:, :, f0:f1],
                                          torch.matmul(zs[:, f0:f1], xs[:, f0:f1].conj().transpose(-1, -2)), Wv, lag)
                if pairs is not None:
                    _add_pair_correlations(pairs, zs, xs)
                del xs, zs
                out = None if outs is None else _from_freq_major(outs.whole, B)
                back = None if backs is None else _from_freq_major(backs.whole, B)
                del outs, backs
            if out is not None:
                t = torch.fft.irfft(out, n=2 * T, dim=-1)[..., :T].view(B, H, nb, f, c, T)
                del out
                add_row_sum(g_q[:, :, :, s:e], t, gt[:, :, :, None, cs:ce], 4)
                del t
            if back is not None:
                g = torch.fft.irfft(back, n=2 * T, dim=-1)[..., :T].view(B, H, na, f, c, T)
                del back
                if need_k:
                    add_row_sum(g_k[:, :, :, s:e], g, vc[:, :, :, None, cs:ce], 4)
                if need_v:
                    add_row_sum(g_v[:, :, :, cs:ce], g, kc[:, :, :, s:e, None], 3)
        if pairs is not None:
            _lag_correlations(corr, pairs, Wv, lag)
        # d loss / d circ_δ[p] = Σ_pairs W·Σ_s ȳ_b[s]·x_a[s-p], a circular cross-correlation whose
        # spectrum is Ȳ·conj(X) (pairs off the triangle added zeros: their W is 0)
        g_circ = torch.fft.irfft(corr, n=2 * T, dim=-1) if need_c else None
        return g_q, g_k, g_v, g_circ, None, None, None, None


def _chunks(x: Tensor, start: int, n: int, T: int, pos0: int) -> Tensor:
    """`x: [B, H, L, k]` whose rows sit at positions `pos0..pos0+L-1` -> channel-major chunks
    `[B, H, n, k, T]` of positions `start·T .. (start+n)·T - 1` (zeros where x has no row)."""
    B, H, L, k = x.shape
    lo, hi = start * T, (start + n) * T
    a, b = max(lo, pos0), min(hi, pos0 + L)
    x = x[:, :, a - pos0: b - pos0]
    x = torch.nn.functional.pad(x, (0, 0, a - lo, hi - b))
    return x.view(B, H, n, T, k).transpose(-1, -2)


def blocked_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int, T: int,
                    block: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
    """`(y, err)`, each `[B, H, Lq, C]` in the rows' units `exp(scale)`: the causal pairs
    across chunks of T positions (key chunk strictly before the query's), for the masked
    log-coefficients `lc: [H, Lq+Lk-1]`. `err` bounds each entry's round-off."""
    B, H, Lq, F = phi_q.shape
    Lk = phi_k.shape[2]
    b0, nb, na = chunk_layout(Lq, Lk, q_offset, T)
    if na == 0:
        z = phi_q.new_zeros(B, H, Lq, vv.shape[-1])
        return z, z
    lag, valid, lo = _lags(b0, nb, na, phi_q.device)
    seg = lag_kernels(lc, Lq, q_offset, T, lo, b0 + nb - 1)  # (H, lags, 2T-1)
    with torch.no_grad():
        top = seg.detach().amax(-1)  # (H, lags)
        seen = torch.isfinite(top)
        m = torch.where(seen, top, torch.zeros_like(top))
        # a chunk's units from the lags it sees with some coefficient (an empty lag's kernel is 0)
        pair = torch.where(valid & seen[:, lag], top[:, lag], torch.full_like(top[:, lag], float("-inf")))  # (H, nb, na)
        M = pair.amax(-1, keepdim=True)
        M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))  # (H, nb, 1)
        W = torch.exp(pair - M)
    circ = _circular(torch.exp(seg - m[..., None]), T).to(phi_q.dtype)
    qc = _chunks(phi_q, b0, nb, T, q_offset)
    kc, vc = _chunks(phi_k, 0, na, T, 0), _chunks(vv, 0, na, T, 0)
    y, err2 = _BlockedNumDen.apply(qc, kc, vc, circ, W, lag, valid, block)
    with torch.no_grad():
        err = torch.einsum("bhnft,bhnfc->bhntc", qc.detach().abs(), err2.sqrt())
    first = q_offset - b0 * T  # the first query's place in the padded chunks
    y = y.flatten(2, 3)[:, :, first: first + Lq]
    err = err.flatten(2, 3)[:, :, first: first + Lq]
    units = M.expand(H, nb, T).reshape(H, nb * T)[:, first: first + Lq]  # (H, Lq)
    return to_row_units(y, units, scale), to_row_units(err, units, scale)
