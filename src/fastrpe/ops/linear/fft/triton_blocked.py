"""Triton kernels for the blocked product's sums over chunks (`blocked.py`), on the spectra as
`torch.fft.rfft` writes them.

`blocked._BlockedNumDen` sums, per head and frequency p of the length-2T real FFT, over the
pairs of chunks (query chunk b, key chunk a < b) with `K = ks[h, lag[b, a]]`, `W = W[h, b, a]`:

  1. `_mix_kernel`, forward:  `out[b, c, p] = Σ_a W·K(p)·x[a, c, p]`, with the round-off
     energies `e2[h, b, (B, c)] = Σ_p |out|² + Σ_a Σ_p |W·K|²·|x_a|²` (`blocked._pair_energy`);
  2. `_mix_kernel`, adjoint:  `back[a, c, p] = Σ_b conj(W·K(p))·z[b, c, p]`;
  3. `_corr_kernel`: `corr[h, l, p] += Σ_{(b, a): lag l} W·Σ_{B, c} z[b, c, p]·conj(x[a, c, p])`,
     the lags' kernels' gradient in the spectrum.

The torch path moves every block's spectra (`[B, H·n, f·c, P]`, frequency innermost: cuFFT
writes no other order) to frequency-major order and back, and builds the lag matrices
`[H, P, nb, na]`, to make each frequency's sum a batched complex matmul. These kernels read
the spectra (float32 real and imaginary parts interleaved) and the lag kernels `ks: [H, lags, P]`
in place, with `W`, `lag` and `valid` (`[H, nb, na]`, `[nb, na]`): a program holds the sums of
a tile of output chunks, channels and frequencies and loops over the chunks it sums
(only those some row of its tile pairs with); the correlations' program holds a tile of
chunk pairs and loops over the batch and channels, then adds each lag's pairs into `corr`
(atomic adds: the kernel refuses under `torch.use_deterministic_algorithms`).

Traffic per block of fc channels, in bytes, with `S_n = 8·B·H·n·fc·P` a block's spectra over n
chunks (complex64): each kernel reads its spectra and writes its result once at the least,
`S_na + S_nb` (forward, adjoint; plus `ks`, `W`, and the energies `4·H·nb·B·fc` per tile of
frequencies), `S_na + S_nb` (correlations; plus `corr`); at most, with no reuse in the cache,
the forward reads `x` once per tile of BR query chunks: `ceil(nb/BR)·S_na`, the adjoint
`ceil(na/BR)·S_nb`, the correlations `ceil(na/BA)·S_nb + ceil(nb/BI)·S_na`. The torch path's
transposes alone read and write every spectrum once more (`_to_freq_major` of the inputs,
`_from_freq_major` of the results), and every block reads its lag matrices
(`plan.MATRIX_PASSES_KEPT`).
`traffic()` gives both counts for a call, and `count_traffic` adds them up where a launch
happens (or, for `FakeTensorMode`, would: `benchmarks/fft_blocked_traffic.py --at-scale`),
since `benchmarks/byte_count.ByteCounter` sees aten ops only.

Notation: B batch, H heads, nb query chunks, na key chunks, fc channels of a block, P = T + 1
frequencies, lags the lag kernels; a kernel writes NR chunks ("rows", r) from NS ("sums", s);
BR, BC, BP (rows, channels, frequencies) and BI, BA (query, key chunks) power-of-two tiles.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ...common import MAX_GRID_YZ
from ..triton_chunked import HAS_TRITON, _tuned, compile_opaque, triton_unavailable_reason

if HAS_TRITON:
    import triton
    import triton.language as tl

    # the sizes are not specialized (Triton would compile again for each pattern of which of them
    # are 1 or multiples of 16): one compilation a variant and config serves every length, the
    # GPU test's 8,192 tokens and the bench's 65,536 and 262,144 alike (the spectra's odd P
    # leaves no aligned vector loads to gain)
    @triton.jit(do_not_specialize=["H", "NB", "NA", "FC", "P", "LAGS", "NCT"])
    def _mix_kernel(x_ptr, k_ptr, w_ptr, lag_ptr, lo_ptr, hi_ptr, out_ptr, e2_ptr, H, NB, NA, FC, P, LAGS, NCT,
                    ADJOINT: tl.constexpr, ENERGY: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                    BP: tl.constexpr):
        """Rows `r` of one tile: `out[r] = Σ_s W·K·x[s]` (conj(W·K) with ADJOINT, where the rows
        are key chunks and the sums query chunks), for s in the rows' spans `lo[r]..hi[r]-1`."""
        pid = tl.program_id(0)
        ct, pt = pid % NCT, pid // NCT
        bh = tl.program_id(2).to(tl.int64)
        b, h = bh // H, bh % H
        if ADJOINT:
            NR, NS = NA, NB
        else:
            NR, NS = NB, NA
        r = tl.program_id(1) * BR + tl.arange(0, BR)
        c = ct * BC + tl.arange(0, BC)
        p = pt * BP + tl.arange(0, BP)
        mr, mc, mp = r < NR, c < FC, p < P
        m_cp = mc[:, None] & mp[None, :]
        m_rp = mr[:, None] & mp[None, :]
        s_lo = tl.min(tl.load(lo_ptr + r, mask=mr, other=NS))
        s_hi = tl.max(tl.load(hi_ptr + r, mask=mr, other=0))
        x_cp = c[:, None] * (P * 2) + p[None, :] * 2  # (BC, BP): a channel's spectrum, re/im interleaved
        acc_r = tl.zeros((BR, BC, BP), dtype=tl.float32)
        acc_i = tl.zeros((BR, BC, BP), dtype=tl.float32)
        pair = tl.zeros((BR, BC, BP), dtype=tl.float32)  # summed over frequencies once, after the loop
        for s in range(s_lo, s_hi):
            if ADJOINT:
                wl = (h * NB + s) * NA + r
                lg = tl.load(lag_ptr + s * NA + r, mask=mr, other=0)
            else:
                wl = (h * NB + r) * NA + s
                lg = tl.load(lag_ptr + r * NA + s, mask=mr, other=0)
            w = tl.load(w_ptr + wl, mask=mr, other=0.0)  # 0 off the pairs
            kp = k_ptr + ((h * LAGS + lg)[:, None] * P + p[None, :]) * 2  # (BR, BP)
            kr = tl.load(kp, mask=m_rp, other=0.0) * w[:, None]
            ki = tl.load(kp + 1, mask=m_rp, other=0.0) * w[:, None]
            xp = x_ptr + ((b * H + h) * NS + s) * FC * P * 2 + x_cp
            xr = tl.load(xp, mask=m_cp, other=0.0)
            xi = tl.load(xp + 1, mask=m_cp, other=0.0)
            if ADJOINT:
                ki = -ki
            acc_r += kr[:, None, :] * xr[None, :, :] - ki[:, None, :] * xi[None, :, :]
            acc_i += kr[:, None, :] * xi[None, :, :] + ki[:, None, :] * xr[None, :, :]
            if ENERGY:  # each pair's ‖W·K·x_s‖² over this tile's frequencies
                pair += (kr * kr + ki * ki)[:, None, :] * (xr * xr + xi * xi)[None, :, :]
        o = out_ptr + (((b * H + h) * NR + r) * FC * P * 2)[:, None, None] + x_cp[None, :, :]
        m = mr[:, None, None] & m_cp[None, :, :]
        tl.store(o, acc_r, mask=m)
        tl.store(o + 1, acc_i, mask=m)
        if ENERGY:  # (tiles of frequencies, H, nb, B·fc): summed over the tiles by the caller
            e2 = tl.sum(acc_r * acc_r + acc_i * acc_i + pair, axis=2)
            bfc = tl.num_programs(2) // H * FC  # B·fc
            e = e2_ptr + ((pt * H + h) * NB + r)[:, None] * bfc + (b * FC + c)[None, :]
            tl.store(e, e2, mask=mr[:, None] & mc[None, :])

    @triton.jit(do_not_specialize=["B", "H", "NB", "NA", "FC", "P", "LAGS", "NIT", "NAT"])
    def _corr_kernel(z_ptr, x_ptr, w_ptr, lag_ptr, ok_ptr, corr_ptr, B, H, NB, NA, FC, P, LAGS, NIT, NAT,
                     BI: tl.constexpr, BA: tl.constexpr, BP: tl.constexpr):
        """A tile of pairs (query chunks i, key chunks a): `Σ_{B, c} z_i·conj(x_a)` per
        frequency, weighted by W and added into each pair's lag."""
        pid = tl.program_id(0)
        it, rest = pid % NIT, pid // NIT
        at, pt = rest % NAT, rest // NAT
        h = tl.program_id(1).to(tl.int64)
        i = it * BI + tl.arange(0, BI)
        a = at * BA + tl.arange(0, BA)
        p = pt * BP + tl.arange(0, BP)
        mi, ma, mp = i < NB, a < NA, p < P
        m_ia = mi[:, None] & ma[None, :]
        ia = i[:, None] * NA + a[None, :]
        ok = tl.load(ok_ptr + ia, mask=m_ia, other=0) != 0
        n = tl.where(tl.max(ok.to(tl.int32)) > 0, B * FC, 0)  # a tile with no pair reads nothing
        acc_r = tl.zeros((BI, BA, BP), dtype=tl.float32)
        acc_i = tl.zeros((BI, BA, BP), dtype=tl.float32)
        m_zp = mi[:, None] & mp[None, :]
        m_xp = ma[:, None] & mp[None, :]
        for q in range(0, n):
            bb, c = q // FC, q % FC
            zp = z_ptr + ((((bb * H + h) * NB + i) * FC + c) * P * 2)[:, None] + p[None, :] * 2
            xp = x_ptr + ((((bb * H + h) * NA + a) * FC + c) * P * 2)[:, None] + p[None, :] * 2
            zr = tl.load(zp, mask=m_zp, other=0.0)
            zi = tl.load(zp + 1, mask=m_zp, other=0.0)
            xr = tl.load(xp, mask=m_xp, other=0.0)
            xi = tl.load(xp + 1, mask=m_xp, other=0.0)
            acc_r += zr[:, None, :] * xr[None, :, :] + zi[:, None, :] * xi[None, :, :]
            acc_i += zi[:, None, :] * xr[None, :, :] - zr[:, None, :] * xi[None, :, :]
        w = tl.load(w_ptr + h * NB * NA + ia, mask=m_ia, other=0.0)
        w = tl.where(ok, w, 0.0)
        acc_r = acc_r * w[:, :, None]
        acc_i = acc_i * w[:, :, None]
        lg = tl.load(lag_ptr + ia, mask=m_ia, other=0)
        l_lo = tl.min(tl.where(ok, lg, LAGS))
        l_hi = tl.max(tl.where(ok, lg, -1)) + 1
        for lag in range(l_lo, l_hi):  # BI + BA - 1 lags at most in a tile (lag = b - a + const)
            sel = (ok & (lg == lag))[:, :, None]
            cr = tl.sum(tl.sum(tl.where(sel, acc_r, 0.0), axis=1), axis=0)
            ci = tl.sum(tl.sum(tl.where(sel, acc_i, 0.0), axis=1), axis=0)
            cp = corr_ptr + ((h * LAGS + lag) * P + p) * 2
            tl.atomic_add(cp, cr, mask=mp)
            tl.atomic_add(cp + 1, ci, mask=mp)

    _mix_kernel = _tuned(_mix_kernel, ["FC", "P", "NB", "NA", "ADJOINT", "ENERGY"])
    _corr_kernel = _tuned(_corr_kernel, ["FC", "P", "NB", "NA"], reset=["corr_ptr"])


def _pow2(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, int(n) - 1).bit_length())


def mix_tiles(nr: int, fc: int, P: int) -> tuple[int, int, int]:
    """`(BR, BC, BP)` of `_mix_kernel`: up to 16 rows by 4 channels by 32 frequencies (two tiles
    of 2,048 float32 sums a program, three with the energies: 32 to 48 registers a thread of 4
    warps). Not timed on a GPU yet."""
    return _pow2(nr, 16), _pow2(fc, 4), _pow2(P, 32)


def corr_tiles(nb: int, na: int, P: int) -> tuple[int, int, int]:
    """`(BI, BA, BP)` of `_corr_kernel`: 8 by 8 pairs by 32 frequencies."""
    return _pow2(nb, 8), _pow2(na, 8), _pow2(P, 32)


# ---- counting: a Triton launch is no aten op, so `ByteCounter` cannot see it ----------------------

class Traffic:
    """The kernels' bytes, from shapes: `lower` (each operand read and each result written
    once, `ByteCounter`'s convention) and `upper` (the spectra as often as the tiles read them,
    no reuse in the cache), with `launches`."""

    def __init__(self):
        self.lower = self.upper = self.launches = 0

    def add(self, lower: int, upper: int) -> None:
        self.lower += lower
        self.upper += upper
        self.launches += 1


_COUNTERS: list[Traffic] = []
#: with `count_traffic(simulate=True)`: no launch, outputs allocated only (for `FakeTensorMode`)
_SIMULATE = [False]


@contextlib.contextmanager
def counting(counters: list, simulating: list, simulate: bool):
    """A module's `count_traffic`: a `Traffic` in `counters` (each launch adds to it) and
    `simulating[0] = simulate` inside the block, both restored after it."""
    t = Traffic()
    counters.append(t)
    saved, simulating[0] = simulating[0], simulate
    try:
        yield t
    finally:
        counters.remove(t)
        simulating[0] = saved


def count_traffic(simulate: bool = False):
    """`with count_traffic() as t:` every launch here adds its `traffic()` to `t`. `simulate`:
    launch nothing, only allocate the outputs (shapes for `FakeTensorMode`: the device check
    of `unsupported` is skipped, as on the GPU being counted)."""
    return counting(_COUNTERS, _SIMULATE, simulate)


def traffic(kind: str, B: int, H: int, nb: int, na: int, fc: int, P: int, lags: int) -> tuple[int, int]:
    """`(lower, upper)` bytes of one launch: kind "forward" (with the energies), "out" (without),
    "adjoint" or "corr" (module docstring)."""
    c8 = 8  # complex64
    S_a, S_b = c8 * B * H * na * fc * P, c8 * B * H * nb * fc * P
    small = c8 * H * lags * P + 4 * H * nb * na + 4 * nb * na + 8 * max(nb, na)
    if kind in ("forward", "out"):
        BR, BC, BP = mix_tiles(nb, fc, P)
        e2 = 4 * -(-P // BP) * H * nb * B * fc if kind == "forward" else 0
        return S_a + S_b + small + e2, -(-nb // BR) * S_a + S_b + small + e2
    if kind == "adjoint":
        BR, BC, BP = mix_tiles(na, fc, P)
        return S_a + S_b + small, -(-na // BR) * S_b + S_a + small
    BI, BA, BP = corr_tiles(nb, na, P)
    corr = 2 * c8 * H * lags * P  # atomic adds: read and written
    return S_a + S_b + small + corr, -(-na // BA) * S_b + -(-nb // BI) * S_a + small + corr


def _count(kind: str, B: int, H: int, nb: int, na: int, fc: int, P: int, lags: int) -> None:
    if _COUNTERS:
        lo, hi = traffic(kind, B, H, nb, na, fc, P, lags)
        for t in _COUNTERS:
            t.add(lo, hi)


# ---- launches -------------------------------------------------------------------------------------

def _mix(xs: Tensor, ks: Tensor, wv: Tensor, lag: Tensor, lo: Tensor, hi: Tensor, adjoint: bool,
         energy: bool) -> tuple[Tensor, Tensor]:
    """`xs: [B, H·ns, fc, P]` (complex64) -> `(out [B, H·nr, fc, P], e2 [H, nb, B·fc] or None)`."""
    H, nb, na = wv.shape
    B, _, fc, P = xs.shape
    nr = na if adjoint else nb
    BR, BC, BP = mix_tiles(nr, fc, P)
    nct, npt = -(-fc // BC), -(-P // BP)
    out = torch.empty(B, H * nr, fc, P, dtype=xs.dtype, device=xs.device)
    e2p = torch.empty(npt, H, nb, B * fc, dtype=torch.float32, device=xs.device) if energy else None
    _count("adjoint" if adjoint else ("forward" if energy else "out"), B, H, nb, na, fc, P, ks.shape[1])
    if not _SIMULATE[0]:
        _mix_kernel[(nct * npt, -(-nr // BR), B * H)](
            torch.view_as_real(xs), torch.view_as_real(ks), wv, lag, lo, hi, torch.view_as_real(out),
            torch.view_as_real(out) if e2p is None else e2p, H, nb, na, fc, P, ks.shape[1], nct,
            ADJOINT=adjoint, ENERGY=energy, BR=BR, BC=BC, BP=BP)
    return out, (None if e2p is None else e2p.sum(0))


def _mix_fake(xs, ks, wv, lag, lo, hi, adjoint, energy):
    H, nb, na = wv.shape
    B, _, fc, P = xs.shape
    return (xs.new_empty(B, H * (na if adjoint else nb), fc, P),
            xs.new_empty(H, nb, B * fc, dtype=torch.float32) if energy else xs.new_empty(0))


def _corr(zs: Tensor, xs: Tensor, ks: Tensor, wv: Tensor, lag: Tensor, ok: Tensor) -> tuple[Tensor]:
    """`zs: [B, H·nb, fc, P]`, `xs: [B, H·na, fc, P]` -> `corr: [H, lags, P]` (complex64)."""
    H, nb, na = wv.shape
    B, _, fc, P = xs.shape
    lags = ks.shape[1]
    BI, BA, BP = corr_tiles(nb, na, P)
    nit, nat = -(-nb // BI), -(-na // BA)
    corr = torch.zeros(H, lags, P, dtype=ks.dtype, device=ks.device)
    _count("corr", B, H, nb, na, fc, P, lags)
    if not _SIMULATE[0]:
        _corr_kernel[(nit * nat * -(-P // BP), H)](
            torch.view_as_real(zs), torch.view_as_real(xs), wv, lag, ok, torch.view_as_real(corr),
            B, H, nb, na, fc, P, lags, nit, nat, BI=BI, BA=BA, BP=BP)
    return (corr,)


def _corr_fake(zs, xs, ks, wv, lag, ok):
    return (ks.new_empty(ks.shape),)


_mix_op = compile_opaque("fft_blocked_mix", _mix, _mix_fake)
_corr_op = compile_opaque("fft_blocked_corr", _corr, _corr_fake)


# ---- what the blocked product calls ---------------------------------------------------------------

def shape_reasons(device: torch.device, dtype: torch.dtype, B: int, H: int) -> list[str]:
    """Why the kernels cannot take a call of B·H heads whose spectra are of `dtype`'s real type
    on `device`, from these alone (empty: they can; what `plan.causal_chunk` weighs its chunk
    counts by, before any tensor exists)."""
    if not HAS_TRITON:
        return ["needs triton (pip install 'fastrpe[triton]')"]
    why = []
    if not _SIMULATE[0]:
        dev = triton_unavailable_reason(device)
        if dev is not None:
            why.append(dev)
    if dtype != torch.float32:
        why.append(f"float32 inputs only (complex64 spectra), got {dtype}")
    if B * H > MAX_GRID_YZ:
        why.append(f"B·H = {B * H} programs on a grid axis of at most {MAX_GRID_YZ}")
    return why


def unsupported(xs_like: Tensor, ks: Tensor, B: int, H: int, corr: bool = False) -> list[str]:
    """Why the kernels cannot take a call (empty: they can): `xs_like` a tensor of the spectra's
    real dtype and device (the chunked inputs), `ks` the lag kernels' spectra; `corr`: the
    correlations' kernel too."""
    why = shape_reasons(xs_like.device, xs_like.dtype, B, H)
    if not HAS_TRITON:
        return why
    if not _SIMULATE[0] and is_fake(xs_like) and not torch.compiler.is_compiling():  # (compiled: the ops' fakes)
        why.append("fake tensors (shapes only): nothing to launch on (count_traffic(simulate=True) counts)")
    if xs_like.dtype == torch.float32 and ks.dtype != torch.complex64:  # (else shape_reasons said so)
        why.append(f"complex64 spectra only, got {ks.dtype}")
    if corr and torch.are_deterministic_algorithms_enabled():
        why.append("the correlations' kernel adds into the lags atomically: not deterministic")
    return why


class LagSums:
    """One call's sums over chunks on the native spectra (`[B, H·n, fc, P]` complex64), from the
    lag kernels `ks: [H, lags, P]` and `W: [H, nb, na]`, `lag`, `valid: [nb, na]`; the small
    tables the kernels read (`W` zero off the pairs, each row's and column's span of pairs)
    made once."""

    def __init__(self, ks: Tensor, W: Tensor, lag: Tensor, valid: Tensor):
        nb, na = valid.shape
        self.ks = ks.contiguous()
        self.wv = torch.where(valid, W, torch.zeros_like(W)).to(torch.float32).contiguous()  # (H, nb, na)
        self.lag = lag.to(torch.int32).contiguous()
        self.ok = valid.to(torch.int8).contiguous()
        a = torch.arange(na, device=valid.device, dtype=torch.int32)
        b = torch.arange(nb, device=valid.device, dtype=torch.int32)[:, None]
        # forward: query chunk b sums key chunks lo..hi-1; adjoint: key chunk a sums query chunks
        self.row = (torch.where(valid, a, na).amin(1).to(torch.int32), torch.where(valid, a + 1, 0).amax(1).to(torch.int32))
        self.col = (torch.where(valid, b, nb).amin(0).to(torch.int32), torch.where(valid, b + 1, 0).amax(0).to(torch.int32))

    def forward(self, xs: Tensor, energy: bool = True) -> tuple[Tensor, Tensor | None]:
        """`(out [B, H·nb, fc, P], e2 [H, nb, B·fc] or None)`: `Σ_a W·K·x_a`, and with `energy`
        `Σ_p |out|² + Σ_a Σ_p |W·K|²·|x_a|²` (`blocked._pair_energy`)."""
        out, e2 = _mix_op(xs.contiguous(), self.ks, self.wv, self.lag, *self.row, False, energy)
        return out, (e2 if energy else None)

    def adjoint(self, zs: Tensor) -> Tensor:
        """`[B, H·na, fc, P]`: `Σ_b conj(W·K)·z_b`."""
        return _mix_op(zs.contiguous(), self.ks, self.wv, self.lag, *self.col, True, False)[0]

    def correlations(self, zs: Tensor, xs: Tensor) -> Tensor:
        """`[H, lags, P]`: `Σ_{pairs of each lag} W·Σ_{B, c} z_b·conj(x_a)`."""
        return _corr_op(zs.contiguous(), xs.contiguous(), self.ks, self.wv, self.lag, self.ok)[0]
