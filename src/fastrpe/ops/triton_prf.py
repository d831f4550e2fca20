"""PRF/NPRF feature maps in one Triton launch each way: the fast sibling of
`kernels.PRF.features` (forward) and `kernels._prf_input_grad` (backward), which stay the
reference and the fallback.

    x̂ = x / max(‖x‖, 1e-12)   (normalize; else x̂ = x)      xs = s·x̂
    e₀ = [w·xs, −w·xs] − ‖xs‖²/2   (two-sided; else w·xs − ‖xs‖²/2)
    φ  = exp(e₀ − c)/√F,   c = max_f e₀ (a query) or the map's key shift (a key)

Why: PyTorch runs q's and k's maps, forward and backward, as 70 launches, most of them
elementwise over float32 `[B, H, L, D]` tensors. For the GPU bench's maps (NPRF, bf16,
B·H = 8, D = 64, 32 features) at 65,536 tokens they move 11.0 GiB: at least 3.5 ms at an
H100's peak bandwidth, more than fla's whole geometric-decay step (3.3 ms, issue 12's table).
These kernels move 0.63 GiB in 4 launches, at least 0.20 ms
(`benchmarks/prf_traffic.py`, counted on CPU; `benchmarks/results/prf_traffic.json`; 0.75 GiB
until their backward computed φ again from x instead of reading the forward's, 2026-11-28).

Backward: `de = dφ·φ`, φ computed again from x as the forward did; a query's subtracted
maximum sends `−Σde` to its maximal entries, split evenly among ties (the entries are found
again from e₀ computed as the forward did); `dxs = de·W − xs·Σde` with W the projection
stacked per feature (`[w; −w]` two-sided: `de·W = de₊·w − de₋·w`); through `xs = s·x̂` and the
normalization `dx = (dx̂ − x̂(x̂·dx̂))/‖x‖` (`dx̂/1e-12` below the clamp: no radial part).
`prf_grad_rows` is that backward on a tile of rows whose dφ is in registers: the standalone
backward kernel's, and the attention kernels' that make dφ themselves (`triton_chunked_prf`).

Notation: B batch, H heads, L positions, D head width, M projections, F features (M, or 2M
two-sided), BR rows per program, BD/BM tile widths.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from .._validate import FastRPEError
from .linear.triton_chunked import (
    HAS_TRITON,
    INTERPRETED,
    _pow2,
    dot_mode,
    on_device_of,
    triton_unavailable_reason,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .linear.triton_chunked import _dot, _store_tile

    @triton.jit
    def _prf_rows(x_ptr, w_ptr, bh, r, ok, H, D, M, sxb, sxh, sxl, swh, scale,
                  BD: tl.constexpr, BM: tl.constexpr, NORMALIZE: tl.constexpr, MODE: tl.constexpr):
        """The rows r (int64: r·sxl overflows int32 on a head-split view, sxl = H·D, once
        L·H·D >= 2^31; `ok` those < L) of head bh: `(‖x‖ clamped [BR], w [BM, BD], w·xs [BR, BM],
        ‖xs‖²/2 [BR])`, in float32. The projection multiplies x as it is stored (a bf16 x is an
        exact tensor-core operand: two bf16 or tf32 products against w's halves, where x̂ in
        float32 took three and its own split) and scales each row after, `w·xs = (w·x)·s/‖x‖`;
        per row, not per entry: the normalization's reciprocal and ‖xs‖² from ‖x‖² (one
        reduction over D)."""
        b, h = bh // H, bh % H
        d, m = tl.arange(0, BD), tl.arange(0, BM)
        x = tl.load(x_ptr + b * sxb + h * sxh + r[:, None] * sxl + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                    other=0.0)
        xf = x.to(tl.float32)
        sq = tl.sum(xf * xf, 1)
        nrm = tl.maximum(tl.sqrt(sq), 1e-12)
        w = tl.load(w_ptr + h * swh + m[:, None] * D + d[None, :], mask=(m < M)[:, None] & (d < D)[None, :],
                    other=0.0).to(tl.float32)
        wx = _dot(x, tl.trans(w), tl.float32, tl.float32, MODE)  # (BR, BM)
        if NORMALIZE:
            inv = 1.0 / nrm
            wx = wx * (scale * inv)[:, None]
            sq = sq * (inv * inv)
        else:
            wx = wx * scale
        half = sq * (scale * scale / 2)
        return nrm, w, wx, half

    @triton.jit
    def _prf_fwd_kernel(x_ptr, w_ptr, shift_ptr, phi_ptr, H, L, D, M, F, sxb, sxh, sxl, swh, s_shift, scale,
                        inv_sqrt_f,
                        BR: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, NORMALIZE: tl.constexpr,
                        QUERY: tl.constexpr, TWO_SIDED: tl.constexpr, MODE: tl.constexpr, TILES: tl.constexpr = 1):
        """Grid (L/(BR·TILES), B·H): φ of TILES tiles of BR positions of one head, `[B, H, L, F]`
        float32, one tile after the other (TILES > 1: the loop's loads are pipelined)."""
        bh = tl.program_id(1).to(tl.int64)
        for t in tl.range(0, TILES):
            _prf_fwd_tile(x_ptr, w_ptr, shift_ptr, phi_ptr, bh, (tl.program_id(0) * TILES + t) * BR, H, L, D, M, F,
                          sxb, sxh, sxl, swh, s_shift, scale, inv_sqrt_f, BR, BD, BM, NORMALIZE, QUERY, TWO_SIDED,
                          MODE)

    @triton.jit
    def _prf_fwd_tile(x_ptr, w_ptr, shift_ptr, phi_ptr, bh, r0, H, L, D, M, F, sxb, sxh, sxl, swh, s_shift, scale,
                      inv_sqrt_f, BR: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, NORMALIZE: tl.constexpr,
                      QUERY: tl.constexpr, TWO_SIDED: tl.constexpr, MODE: tl.constexpr):
        """`_prf_fwd_kernel`'s tile of BR positions from r0."""
        r = (r0 + tl.arange(0, BR)).to(tl.int64)
        ok = r < L
        nrm, w, wx, half = _prf_rows(x_ptr, w_ptr, bh, r, ok, H, D, M, sxb, sxh, sxl, swh, scale, BD, BM,
                                     NORMALIZE, MODE)
        m = tl.arange(0, BM)
        live = (m < M)[None, :]
        e1 = wx - half[:, None]
        e2 = -wx - half[:, None]
        if QUERY:  # its own largest exponent, over both halves
            c = tl.max(tl.where(live, e1, float("-inf")), 1)
            if TWO_SIDED:
                c = tl.maximum(c, tl.max(tl.where(live, e2, float("-inf")), 1))
            c = c[:, None]
        else:
            c = tl.load(shift_ptr + (bh % H) * s_shift)  # one shift per head, or one for all (stride 0)
        out = phi_ptr + (bh * L + r)[:, None] * F + m[None, :]
        keep = ok[:, None] & live
        tl.store(out, tl.exp(e1 - c) * inv_sqrt_f, mask=keep)
        if TWO_SIDED:
            tl.store(out + M, tl.exp(e2 - c) * inv_sqrt_f, mask=keep)

    @triton.jit
    def _prf_bwd_kernel(x_ptr, w_ptr, shift_ptr, dphi_ptr, dx_ptr, H, L, D, F, sxb, sxh, sxl, swh, s_shift, scale,
                        inv_sqrt_f,
                        BR: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, NORMALIZE: tl.constexpr,
                        QUERY: tl.constexpr, MODE: tl.constexpr, DX_BF16: tl.constexpr, TILES: tl.constexpr = 1):
        """Grid (L/(BR·TILES), B·H): dx of TILES tiles of BR positions of one head (`[B, H, L, D]`
        contiguous, x's dtype; DX_BF16: dx_ptr is the int16 view of a bf16 dx, rounded to nearest
        as the GPU rounds), as `_prf_fwd_kernel` walks them. w_ptr: the stacked projection
        (`stacked_projection`), F rows."""
        bh = tl.program_id(1).to(tl.int64)
        for t in tl.range(0, TILES):
            r = ((tl.program_id(0) * TILES + t) * BR + tl.arange(0, BR)).to(tl.int64)
            ok = r < L
            f, d = tl.arange(0, BF), tl.arange(0, BD)
            dphi = tl.load(dphi_ptr + (bh * L + r)[:, None] * F + f[None, :], mask=ok[:, None] & (f < F)[None, :],
                           other=0.0)
            dx = prf_grad_rows(dphi, x_ptr, w_ptr, shift_ptr, bh, r, ok, H, D, F, sxb, sxh, sxl, swh, s_shift, scale,
                               inv_sqrt_f, BR, BD, BF, NORMALIZE, QUERY, MODE)
            _store_tile(dx_ptr + (bh * L + r)[:, None] * D + d[None, :], dx, ok[:, None] & (d < D)[None, :], DX_BF16)

    @triton.jit
    def prf_grad_rows(dphi, x_ptr, w_ptr, shift_ptr, bh, r, ok, H, D, F, sxb, sxh, sxl, swh, s_shift, scale,
                      inv_sqrt_f, BR: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, NORMALIZE: tl.constexpr,
                      QUERY: tl.constexpr, MODE: tl.constexpr):
        """dx `[BR, BD]` (float32) of the rows r (int64, `ok` those < L) of head bh from their dφ
        `[BR, BF]` (float32 in registers; its columns past F are not read): the map's backward for
        `_prf_bwd_kernel` and for attention kernels that make dφ themselves
        (`triton_chunked_prf`). w_ptr: the stacked projection `[F, D]` (or `[H, F, D]`, head
        stride swh): `[w; −w]` two-sided, so that `e₀ = s·x̂·W_fᵀ − ‖xs‖²/2` for every feature f.

        φ is computed again from x, as the forward computed it, not read: the forward's float32 φ
        would be half of a standalone launch's bytes besides dφ. dx = s·(de·W) − s²·x̂·Σde, less
        its radial part x̂(x̂·dx) where normalized: with x̂·(de·W) = Σ_f de·wx / s,
        x̂·dx = Σ_f de·wx − s²·Σde·‖x̂‖² (‖x̂‖² = 2·half/s²), so each row's coefficient of x̂ comes
        from [BR, BF] tiles, and x̂, read again at the end, is not held across the products.
        With these and the raw-x projection (`_prf_rows`), the standalone kernel (64 rows, 4
        warps, sm_90) holds 183 registers a thread in tf32x3 where it held 235, 167 in bf16x3
        where 214 (3 programs an SM instead of 2), and 16 KiB of shared memory where 48 and 24
        (`benchmarks/prf_ptxas.py`, results/prf_ptxas-sm90.json, before and after 2026-11-28)."""
        b, h = bh // H, bh % H
        f, d = tl.arange(0, BF), tl.arange(0, BD)
        nrm, w, wx, half = _prf_rows(x_ptr, w_ptr, bh, r, ok, H, D, F, sxb, sxh, sxl, swh, scale, BD, BF,
                                     NORMALIZE, MODE)
        live = (f < F)[None, :]
        e = wx - half[:, None]
        if QUERY:  # its own largest exponent, as the forward found it
            c = tl.max(tl.where(live, e, float("-inf")), 1)[:, None]
        else:
            c = tl.load(shift_ptr + h * s_shift)
        de = tl.where(live, dphi * (tl.exp(e - c) * inv_sqrt_f), 0.0)  # (dφ past F: 0 wherever it came from)
        if QUERY:  # the maximum's share, at the entries the forward's maximum found
            top = (live & (e == c)).to(tl.float32)
            de = de - top * (tl.sum(de, 1) / tl.sum(top, 1))[:, None]
        coef = (scale * scale) * tl.sum(de, 1)
        if NORMALIZE:  # the radial part goes, unless ‖x‖ was clamped
            coef = coef + tl.where(nrm > 1e-12, tl.sum(de * wx, 1) - coef * (2.0 * half / (scale * scale)), 0.0)
        dx = _dot(de, w, tl.float32, tl.float32, MODE) * scale
        xt = tl.load(x_ptr + b * sxb + h * sxh + r[:, None] * sxl + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                     other=0.0).to(tl.float32)
        if NORMALIZE:
            return (dx - xt * (1.0 / nrm)[:, None] * coef[:, None]) * (1.0 / nrm)[:, None]
        return dx - xt * coef[:, None]


#: positions per program (a power of two >= 16, `tl.dot`'s least), warps per program and the
#: projection's product precision (`triton_chunked.PRECISIONS`): the launch choices
#: benchmarks/prf_sweep.py times against each other (its first config is this one).
#: `$FASTRPE_PRF_LAUNCH` ("BR:num_warps:precision[:tiles]", read when this module is imported;
#: "FWD/BWD": the backward's own after "/", `BWD_LAUNCH`)
#: sets them (and `TILES`): the GPU bench's script sets it to the sweep's fastest choice for the rows it
#: times after the sweep, so that one GPU session can both find a better launch and measure it.
#: "tf32x3" since the sweep on the H100 of 2026-11-27 (second session,
#: benchmarks/results/gpu/h100-2026-11-27b-profile.json, `prf_sweep`): at 65,536 tokens x 8
#: heads the four launches (q and k maps, forward and backward) took 0.75 ms against "ieee"'s
#: 1.71, within 5.6e-9 (forward) and 9.8e-4 (backward: one bf16 rounding of dx) of "ieee"'s
#: results, and the sweep adopted it (of the two tf32x3 shapes tried, 64 rows and 4 warps was
#: the faster: 128 rows and 8 warps took 0.81 ms).
BLOCK_ROWS = 64
NUM_WARPS = 4
PRECISION = "tf32x3"
#: row tiles a program walks in turn (1: one; more: fewer programs, whose loop's loads Triton
#: pipelines; at most as many as leave `MIN_PROGRAMS` programs, so that short calls keep the
#: SMs busy): a launch choice the sweep times since 2026-11-28; on the H100 that day (seventh
#: session, h100-2026-11-28-profile.json) 4 and 8 tiles took 0.983 and 0.988 ms for the four
#: launches against one tile's 0.925, so it stays 1. At one tile a
#: program the maps moved a third of the H100's bandwidth (a forward launch 0.12 ms for its
#: 128 MiB, tf32x3; h100-2026-11-27b-profile.json): each program loads its tile and waits, and
#: its 48 KiB of shared memory (sm_90, 4 warps, tf32x3; 92 registers) left 4 programs an SM
#: (6 since the raw-x projection of 2026-11-28: 16 KiB, 80 registers).
#: With 4 or 8 tiles the loop's loads are asynchronous copies, 3 stages deep (80 KiB, 128
#: registers: 2 programs an SM; the backward 112 KiB, 255 registers; benchmarks/prf_ptxas.py,
#: results/prf_ptxas-sm90.json)
TILES = 1
MIN_PROGRAMS = 1024
#: the backward's own launch choices (a `Launch`), or None: the forward's. The backward holds
#: more per row than the forward (dφ, e₀, dx: ptxas, sm_90, 64 rows, 4 warps, bf16x3: 48
#: registers a thread forward, 167 backward; benchmarks/prf_ptxas.py), so its best shape
#: need not be the forward's: the sweep times each pass's choices and may pick two
#: (`$FASTRPE_PRF_LAUNCH` "FWD/BWD"). It computes φ again under its own choices, which may
#: differ from the forward's φ in the last bits (another tiling or precision of the projection):
#: the gradient's error is then that of φ's own round-off, far below dx's bf16 rounding
BWD_LAUNCH = None


class Launch(NamedTuple):
    """The PRF kernels' launch choices (`parse_launch`, "BR:num_warps:precision[:tiles]")."""

    block_rows: int
    num_warps: int
    precision: str
    tiles: int = 1

    def spec(self) -> str:
        """"BR:num_warps:precision", ":tiles" after it where not 1 (`parse_launch`'s input)."""
        return f"{self.block_rows}:{self.num_warps}:{self.precision}" + (f":{self.tiles}" if self.tiles != 1 else "")


def parse_launch(spec: str, what: str = "FASTRPE_PRF_LAUNCH") -> Launch:
    """The `Launch` of "BR:num_warps:precision" or "BR:num_warps:precision:tiles" (prf_sweep's
    configs), with a one-line error naming `what` for anything else."""
    from .linear.triton_chunked import PRECISIONS

    parts = spec.split(":")

    def pow2(x: str) -> bool:
        return x.isdecimal() and x.isascii() and int(x) > 0 and int(x) & (int(x) - 1) == 0

    if (len(parts) not in (3, 4) or not pow2(parts[0]) or int(parts[0]) < 16 or not pow2(parts[1])
            or int(parts[1]) > 32 or parts[2] not in PRECISIONS or (len(parts) == 4 and not pow2(parts[3]))):
        raise FastRPEError(f"{what}: expected BR:num_warps:precision[:tiles] (BR a power of two >= 16, num_warps a "
                           f"power of two <= 32, precision one of {', '.join(PRECISIONS)}, tiles a power of two), "
                           f"optionally a second one after '/' for the backward, got {spec!r}")
    return Launch(int(parts[0]), int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else 1)


def parse_launches(spec: str, what: str = "FASTRPE_PRF_LAUNCH") -> tuple[Launch, Launch | None]:
    """`(forward, backward or None)` of "FWD" or "FWD/BWD", each as `parse_launch` reads it."""
    fwd, sep, bwd = spec.partition("/")
    return parse_launch(fwd, what), (parse_launch(bwd, what) if sep else None)


if os.environ.get("FASTRPE_PRF_LAUNCH"):
    (BLOCK_ROWS, NUM_WARPS, PRECISION, TILES), BWD_LAUNCH = parse_launches(os.environ["FASTRPE_PRF_LAUNCH"])


def forward_launch() -> Launch:
    """The forward's launch choices in force (`BLOCK_ROWS`, `NUM_WARPS`, `PRECISION`, `TILES`)."""
    return Launch(BLOCK_ROWS, NUM_WARPS, PRECISION, TILES)


def backward_launch() -> Launch:
    """The backward's: `BWD_LAUNCH`, or the forward's where it is None."""
    return BWD_LAUNCH or forward_launch()


def launch_choice() -> str:
    """The launch choices in force, as "BR:num_warps:precision" (":tiles" after it where TILES
    is not 1; "/" and the backward's where it has its own; the GPU bench records it)."""
    fwd, bwd = forward_launch(), backward_launch()
    return fwd.spec() + ("" if bwd == fwd else "/" + bwd.spec())


def _launch_args(x: Tensor, w: Tensor, block_rows: int | None, num_warps: int | None, precision: str | None,
                 tiles: int | None):
    """`(grid, dims, strides, meta)` of a launch over x's positions: `BLOCK_ROWS`, `NUM_WARPS`,
    `PRECISION` and `TILES` where the choices are None (16 rows for L <= 16; tiles only as
    many as leave `MIN_PROGRAMS` programs)."""
    B, H, L, D = x.shape
    M = w.shape[-2]
    BR = block_rows or (BLOCK_ROWS if L > 16 else 16)
    T = min(tiles or TILES, max(1, triton.cdiv(L, BR) * B * H // MIN_PROGRAMS))
    return (triton.cdiv(L, BR * T), B * H), (H, L, D, M), (x.stride(0), x.stride(1), x.stride(2),
                                                             M * D if w.dim() == 3 else 0), \
        {"BR": BR, "BD": _pow2(D), "BM": _pow2(M), "MODE": dot_mode(precision or PRECISION), "TILES": T,
         **({} if INTERPRETED else {"num_warps": num_warps or NUM_WARPS})}


def prf_forward_launch(x: Tensor, w: Tensor, shift: Tensor, phi: Tensor, kern, is_query: bool, *,
                       block_rows: int | None = None, num_warps: int | None = None,
                       precision: str | None = None, tiles: int | None = None) -> None:
    """`φ` of x (`[B, H, L, D]`) into `phi` (`[B, H, L, F]` float32) by one `_prf_fwd_kernel`
    launch; the launch choices default to `BLOCK_ROWS`, `NUM_WARPS`, `PRECISION`, `TILES`
    (benchmarks/prf_sweep.py times others)."""
    grid, dims, strides, meta = _launch_args(x, w, block_rows, num_warps, precision, tiles)
    F = phi.shape[-1]
    _prf_fwd_kernel[grid](x, w, shift, phi, *dims, F, *strides, int(shift.numel() > 1), float(kern.input_scale),
                          F ** -0.5, NORMALIZE=kern.normalize, QUERY=bool(is_query), TWO_SIDED=kern.two_sided,
                          **meta)


def stacked_projection(w: Tensor, two_sided: bool) -> Tensor:
    """The projection the backward reads, one row per feature: `w` (`[M, D]` or `[H, M, D]`,
    float32), `[w; −w]` along M where the map is two-sided (φ₋'s exponent is −w·xs − ‖xs‖²/2)."""
    return torch.cat([w, -w], dim=-2).contiguous() if two_sided else w


def prf_backward_launch(x: Tensor, w: Tensor, shift: Tensor, dphi: Tensor, dx: Tensor, kern, is_query: bool, *,
                        block_rows: int | None = None, num_warps: int | None = None,
                        precision: str | None = None, tiles: int | None = None) -> None:
    """dx (`[B, H, L, D]` contiguous, x's dtype) from `dphi` by one `_prf_bwd_kernel` launch,
    φ computed again from x (w the map's projection, as the forward takes it; shift the
    forward's); the launch choices as `prf_forward_launch`'s."""
    wf = stacked_projection(w, kern.two_sided)
    grid, dims, strides, meta = _launch_args(x, wf, block_rows, num_warps, precision, tiles)
    meta["BF"] = meta.pop("BM")
    bf16 = dx.dtype == torch.bfloat16
    F = dphi.shape[-1]
    _prf_bwd_kernel[grid](x, wf, shift, dphi.to(torch.float32).contiguous(), dx.view(torch.int16) if bf16 else dx,
                          *dims, *strides, int(shift.numel() > 1), float(kern.input_scale), F ** -0.5,
                          NORMALIZE=kern.normalize, QUERY=bool(is_query), DX_BF16=bf16, **meta)


class _PRFTriton(torch.autograd.Function):
    """`φ` by `_prf_fwd_kernel`, saving x and φ (as `kernels._PRFFeatures`); dx by
    `_prf_bwd_kernel` under the backward's launch choices in force at the forward (the
    forward's unless `BWD_LAUNCH`), or by the differentiable PyTorch backward under create_graph."""

    @staticmethod
    @on_device_of(1)
    def forward(ctx, x: Tensor, kern, is_query: bool, w: Tensor, shift: Tensor) -> Tensor:
        B, H, L, D = x.shape
        phi = torch.empty(B, H, L, kern.num_features(D), dtype=torch.float32, device=x.device)
        prf_forward_launch(x, w, shift, phi, kern, is_query, **forward_launch()._asdict())
        ctx.kern, ctx.is_query, ctx.launch = kern, is_query, backward_launch()
        ctx.save_for_backward(x, phi, w, shift)
        return phi

    @staticmethod
    @on_device_of(1)
    def backward(ctx, dphi: Tensor):
        x, phi, w, shift = ctx.saved_tensors
        kern = ctx.kern
        if torch.is_grad_enabled():  # create_graph: the PyTorch backward is made of differentiable ops
            from ..kernels import _prf_input_grad

            return _prf_input_grad(kern, x, phi, dphi, ctx.is_query, inplace=False), None, None, None, None
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        prf_backward_launch(x, w, shift, dphi, dx, kern, ctx.is_query, **ctx.launch._asdict())
        return dx, None, None, None, None


def prf_features_triton(x: Tensor, kern, is_query: bool) -> Tensor:
    """`kern.features(kern._prepare(x), is_query)` for a `kernels.PRF` map, in one Triton
    launch (and one in backward), differentiable in x.

    Args:
        x: `[B, H, L, D]`, float32, bfloat16 or float16, unit stride in D (the head split's
            views are read as they are). kern: the `PRF` map (its `w`, shift and flags).
        is_query: a query subtracts its own largest exponent, a key the map's `key_log_shift`.

    Returns:
        `[B, H, L, F]` float32 (the maps' compute dtype for these inputs).
    """
    why = triton_unavailable_reason(x.device)
    if why is not None:
        raise FastRPEError(f"x: the triton kernels cannot run on {x.device}: {why}")
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise FastRPEError(f"x: expected [B, H, L, D] in float32, bfloat16 or float16, got {x.dtype} "
                           f"{list(x.shape)}")
    if x.shape[-1] != kern.head_dim:
        raise FastRPEError(f"x: {type(kern).__name__} was built for head_dim={kern.head_dim}, got {x.shape[-1]}")
    H = x.shape[1]
    if kern.num_heads is not None and kern.num_heads != H:
        raise FastRPEError(f"x: the map draws per head for num_heads={kern.num_heads}, got {H} heads")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = kern.w.to(torch.float32).contiguous()  # (M, D) or (H, M, D)
    shift = kern.key_log_shift().to(device=x.device, dtype=torch.float32).reshape(-1)  # (1,) or (H,)
    return _PRFTriton.apply(x, kern, bool(is_query), w, shift)
