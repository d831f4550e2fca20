"""The fused sum-of-exponentials kernels (`triton_soe`: KERPLE log/power by backend
`triton_soe`, T5 and clipped tables exactly by `triton_band`) with the PRF feature maps'
backward in their gradient kernels: the dq and dk/dv kernels take dφq and dφk through the maps
and write the inputs' gradients, where the unfused path writes dφ in float32 and the maps' own
backward launches (`triton_prf._prf_bwd_kernel`) read it again with x. `triton_chunked_prf`
does the same for the geometric decay; this module reuses its `MapGrads`.

Why: the maps' two backward launches took 0.62 ms of ALiBi's call at 65,536 tokens on the H100
(B·H = 8, NPRF, 32 features, bf16; 2026-11-28, `triton_chunked_prf`), each writing or reading
a float32 dφ of 64 MiB a map, at a third of the peak bandwidth. The maps are the same whatever
the positional term, so KERPLE's and T5's calls pay the same: fused, no dφ is written or read
back, and the maps' rows are worked where the gradient kernels hold them. Opt-in with the
chunked one (`backends_triton.FUSED_MAPS`) until a GPU has timed it.

What it covers: causal calls of a `kernels.PRF` map (one- or two-sided, normalized or not,
shared or per-head projection) whose features take the Triton route, float32 features (no
`bf16-features` rounding), float32/bf16/fp16 inputs, no key padding, no initial or returned
state, the far field from stored states (`triton_soe.FAR_FIELD = "states"`), and its terms in
any number of launch groups (`triton_soe.launch_group`, sized by the states' budget: at B·H = 8
with a 16-bit call's bf16 states, KERPLE's 16 terms are one group at 65,536 tokens, 7 a group
at 262,144 and one at 1M). A chunk's dφ is whole only after the last group: the earlier groups
run the unfused path's dq and dk/dv kernels (`triton_soe._soe_bwd_dq_kernel`,
`_soe_bwd_dkv_kernel`: dφ summed in float32 `[B, H, L, F]`, dv in bf16 pairs, flags NEAR and
ACCUM), and the last group's kernels here read that sum, add their own terms' and take it
through the maps (ACCUM). So a call of several groups is spared the last group's float32 dφ
store and the maps' backward launches that read it again with x, not the sums between groups.
The plan's own gradients (the far weights' from the dq kernels, the near table's from
`_soe_bwd_dcn_kernel`, which reads the features, not dφ) are made as on the unfused path.
`fused_reasons` says what declines a call, and the caller runs the unfused path.

Numerics: the same kernels and sums as the unfused path up to dφ (the tile helpers
`triton_soe._soe_dq_tile` and `_soe_dkv_tiles` are both paths' bodies; the earlier groups'
float32 sum is added last, as there), which stays in registers in float32 (the unfused path
stores it in float32: the same values), then the maps' backward (`triton_prf.prf_grad_rows`),
which computes φ again from x with the attention's products (`precision`), where the maps'
forward took theirs (`triton_prf.PRECISION`): φ may differ in its last bits, far below dx's
bf16 rounding.

Notation: B batch, H heads, Lq/Lk lengths, D head width, F features, Dv value width, K terms,
T chunk, NB near chunks, N chunks, NS chunk groups of the dq kernel.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_chunked import HAS_TRITON, _tuned, dot_mode
from .triton_chunked_prf import MapGrads, launch_map_kernel, map_inputs, map_reasons

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..triton_prf import prf_grad_rows
    from .triton_chunked import _load_rows, _store_tile
    from .triton_soe import _KEY, _soe_dkv_tiles, _soe_dq_tile

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dq_map_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, dwq_ptr,
                               early_ptr, x_ptr, w_ptr, shift_ptr, dx_ptr,
                               H, Lq, Lk, F, Dv, N, K, NS, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale,
                               inv_sqrt_f,
                               BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                               NB: tl.constexpr, NEAR: tl.constexpr, ACCUM: tl.constexpr, DT: tl.constexpr,
                               ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr, DWQ: tl.constexpr,
                               NORMALIZE: tl.constexpr, DX_BF16: tl.constexpr):
        """Grid (NS, B·H), query chunks n = g, g + NS, ...: `triton_soe._soe_bwd_dq_kernel`'s
        dφq of the last launch group's terms (NEAR: the only group, near field included; ACCUM:
        plus the earlier groups' dφq, float32 `[B, H, Lq, F]` at early_ptr, as that kernel adds
        them), taken through the query map's backward: dq of the chunk's queries (`[B, H, Lq, D]`
        contiguous, q's dtype; DX_BF16: the int16 view of bf16) from q (x_ptr, strides sx*); and
        (DWQ) the program's sums of the group's far weights' gradient, as there."""
        gi = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BD)
        for n in range(gi, N, NS):
            dphi, qi, qm = _soe_dq_tile(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr,
                                        dwq_ptr, bh, gi, n, H, Lq, Lk, F, Dv, N, K, NS, q_offset, BT, BF, BDV, NB, NEAR,
                                        DT, ACC, MODE, SCALED, DWQ)
            if ACCUM:
                dphi += _load_rows(early_ptr + bh * Lq * F, qi, qm, tl.arange(0, BF), F, F)
            r = qi.to(tl.int64)
            dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, qm, H, D, F, sxb, sxh, sxl, swh,
                               s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, True, MODE)
            _store_tile(dx_ptr + (bh * Lq + r)[:, None] * D + d[None, :], dx, qm[:, None] & (d < D)[None, :],
                        DX_BF16)

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dkv_map_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr, dv_ptr,
                                dvlo_ptr, early_ptr, x_ptr, w_ptr, shift_ptr, dx_ptr,
                                H, Lq, Lk, F, Dv, N, K, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale,
                                inv_sqrt_f,
                                BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                                NB: tl.constexpr, NEAR: tl.constexpr, ACCUM: tl.constexpr, DT: tl.constexpr,
                                ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr, DV_BF16: tl.constexpr,
                                NORMALIZE: tl.constexpr, DX_BF16: tl.constexpr):
        """Grid (N, B·H): `triton_soe._soe_bwd_dkv_kernel`'s dv of key chunk n in the last launch
        group (ACCUM: added to the earlier groups' dv, and dvlo_ptr's part of it, as there), and
        its dφk (NEAR, ACCUM as `_soe_bwd_dq_map_kernel`'s: the earlier groups' float32
        `[B, H, Lk, F]` at early_ptr) taken through the key map's backward: dk of the chunk's keys
        (`[B, H, Lk, D]`, k's dtype) from k (x_ptr)."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dphi, pos, km = _soe_dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr,
                                       dv_ptr, dvlo_ptr, bh, n, H, Lq, Lk, F, Dv, N, K, q_offset, BT, BF, BDV, NB,
                                       NEAR, ACCUM, DT, ACC, MODE, SCALED, DV_BF16, True)
        if ACCUM:
            dphi += _load_rows(early_ptr + bh * Lk * F, pos, km, tl.arange(0, BF), F, F)
        r = pos.to(tl.int64)
        dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, km, H, D, F, sxb, sxh, sxl, swh,
                           s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, False, MODE)
        d = tl.arange(0, BD)
        _store_tile(dx_ptr + (bh * Lk + r)[:, None] * D + d[None, :], dx, km[:, None] & (d < D)[None, :], DX_BF16)

    # autotuned as triton_soe's own gradient kernels (as they are under the interpreter): the
    # dq kernel in bf16x3 over pipelined configs only, as `triton_soe.SOE_DQ_BF16X3_NOTE` says
    # of the kernel whose body it runs; dv restored, which a last group of several adds to (dq
    # and dk are written, the earlier groups' dφ only read)
    _MAP_KEY = _KEY + ["ACCUM", "SCALED", "D", "NORMALIZE"]
    _soe_bwd_dq_map_kernel_bf16x3 = _tuned(_soe_bwd_dq_map_kernel, _MAP_KEY + ["DWQ"], reset=["dwq_ptr"],
                                           min_stages=2)
    _soe_bwd_dq_map_kernel = _tuned(_soe_bwd_dq_map_kernel, _MAP_KEY + ["DWQ"], reset=["dwq_ptr"])
    _soe_bwd_dkv_map_kernel = _tuned(_soe_bwd_dkv_map_kernel, _MAP_KEY + ["DV_BF16"], restore=["dv_ptr", "dvlo_ptr"])


def launch_dq(maps: MapGrads, grid, args: tuple, early: Tensor | None, dims: tuple, lb: int, tiles: dict) -> Tensor:
    """dq (q's dtype and shape) by `_soe_bwd_dq_map_kernel`: `args` as
    `triton_soe._soe_bwd_dq_kernel` takes them less its dq (φq, φk, v, do, inv, dd, cn, wq, h,
    z, dwq), `early` the earlier launch groups' dφq (float32, `[B, H, Lq, F]`; None: one group),
    `dims` (H, Lq, Lk, F, Dv, N, K, NS, q_offset), `tiles` its constants (NEAR, ACCUM among
    them)."""
    kernel = _soe_bwd_dq_map_kernel_bf16x3 if tiles["MODE"] == dot_mode("bf16x3") else _soe_bwd_dq_map_kernel
    # (one group: φq in early's place, which the kernel does not read without ACCUM)
    return launch_map_kernel(kernel, grid, (*args, args[0] if early is None else early), maps.xq, maps, dims, lb,
                             tiles)


def launch_dkv(maps: MapGrads, grid, args: tuple, dv: Tensor, dvlo: Tensor, early: Tensor | None, dims: tuple,
               lb: int, dv_bf16: bool, tiles: dict) -> Tensor:
    """dk (k's dtype and shape) and dv (into `dv`, added to the earlier groups' there and in
    `dvlo` as `triton_soe._soe_bwd_dkv_kernel` adds them) by `_soe_bwd_dkv_map_kernel`: `args` as
    that kernel takes them before its dk (φq, φk, v, do, inv, dd, cn, log γ, dh, dz), `early` the
    earlier groups' dφk (float32, `[B, H, Lk, F]`; None: one group), `dims` (H, Lq, Lk, F, Dv, N,
    K, q_offset)."""
    dvs = (dv.view(torch.int16), dvlo.view(torch.int16)) if dv_bf16 else (dv, dvlo)
    return launch_map_kernel(_soe_bwd_dkv_map_kernel, grid, (*args, *dvs, args[0] if early is None else early),
                             maps.xk, maps, dims, lb, tiles, DV_BF16=dv_bf16)


class _SoEMaps(torch.autograd.Function):
    """`(num/den, den)` of the fused SoE kernels from the maps' inputs q and k: the features
    φq, φk come in computed (no graph behind them), the tables cn, wq with theirs (to the
    plan's `a` and `corr`); the backward returns q's and k's gradients from the fused kernels
    (`triton_soe.soe_backward` with `maps`), v's, and the tables' where they need them."""

    @staticmethod
    def forward(ctx, xq, xk, v, phi_q, phi_k, cn, wq, lgk, consts, q_offset: int, T: int, NB: int, mode: int,
                state_dtype, group: int, divide, state_terms: int):
        from . import triton_chunked as tc, triton_soe as ts

        keep_bytes = ts.SAVE_STATES_BYTES if any(ctx.needs_input_grad[:7]) else -1  # (inference keeps none)
        num, den, h, z = ts._soe_forward_op(phi_q, phi_k, v, cn, wq, lgk, q_offset, T, NB, divide, mode, state_dtype,
                                            group, divide, tc.STATE_SCAN, keep_bytes, "states", state_terms)
        ctx.save_for_backward(xq, xk, v, phi_q, phi_k, cn, wq, lgk, den, h, z)
        # (the backward keeps the forward's settings, which a context manager may have set)
        ctx.cfg = (consts, q_offset, T, NB, mode, state_dtype, group, tc.STATE_SCAN, state_terms)
        return num, den

    @staticmethod
    def backward(ctx, dnum, dden):
        from . import triton_chunked as tc, triton_soe as ts

        xq, xk, v, phi_q, phi_k, cn, wq, lgk, den, h, z = ctx.saved_tensors
        (wf, shift, scale, normalize), q_offset, T, NB, mode, sdt, group, scan, terms = ctx.cfg
        want_dcn, want_dwq = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
        maps = MapGrads(xq, xk, wf, shift, scale, normalize)
        dq, dk, dv, dcn, dwq = tc.on_device_of(0)(ts.soe_backward)(
            phi_q, phi_k, v, cn, wq, lgk, den, dnum, dden, q_offset, T, NB, mode, sdt, group, scan, want_dcn, want_dwq,
            h, z, "states", terms, maps)
        return (dq, dk, dv, None, None, dcn if want_dcn else None, dwq if want_dwq else None,
                None, None, None, None, None, None, None, None, None, None)


def _plan_of(coeffs, Lq: int, q_offset: int):
    """The call's `SoEPlan`: `coeffs` itself (triton_soe), or the exact plan of a
    `BandCoefficients` (triton_band, `triton_band.band_plan_of`)."""
    from ..kernelized import BandCoefficients

    if isinstance(coeffs, BandCoefficients):
        from .triton_band import band_plan_of

        return band_plan_of(coeffs.log_coeff, coeffs.window, Lq, q_offset)
    return coeffs


def fused_reasons(q: Tensor, k: Tensor, kern, key_padding_mask: Tensor | None, causal: bool,
                  features_dtype: torch.dtype | None) -> list[str]:
    """Why the fused path does not take this call (empty: it does), as the composition takes it
    (`features_dtype`: the dtype the call rounds the features to, or None). Its terms, shapes,
    state dtype and states' budget decline nothing: any number of launch groups is taken (the
    module docstring)."""
    from . import triton_soe as ts

    r = map_reasons(q, k, kern, key_padding_mask, features_dtype)
    if not causal:
        r.append("causal only (the fused SoE kernels are)")
    if ts.FAR_FIELD != "states":
        r.append(f"the far field from stored states only (triton_soe.FAR_FIELD is {ts.FAR_FIELD!r}: the walk adds its "
                 f"far field's dφ after the near field's)")
    return r


def prf_soe_attention(q: Tensor, k: Tensor, v: Tensor, kern, coeffs, *, q_offset: int = 0,
                      chunk_size: int | None = None, precision: str = "ieee", state_dtype: torch.dtype | None = None,
                      state_budget: int | None = None) -> Tensor:
    """Causal kernelized attention `Σ_j c(p_i−j) φ(q_i)·φ(k_j) v_j / Σ_j c(p_i−j) φ(q_i)·φ(k_j)`
    with a PRF map `kern` (`kernels.PRF`) and the coefficients of an `SoEPlan` (exact below its
    window, its sum of exponentials beyond) or of a finite-support `BandCoefficients` (exact),
    `[B, H, Lq, Dv]` in q's dtype: the maps' forward launches, the fused SoE kernels, and a
    backward whose dq and dk/dv kernels take dφ through the maps (see the module docstring;
    `fused_reasons` must be empty). Gradients reach the plan's `a` and `corr` (the table's
    entries, for a band) as on the unfused path.

    Args:
        q: `[B, H, Lq, D]` at positions `q_offset + 0..Lq-1`; k: `[B, H, Lk, D]`; v:
            `[B, H, Lk, Dv]`. coeffs: `soe.SoEPlan` or `kernelized.BandCoefficients` (its
            `log_coeff` `[H, Lq+Lk-1]`). chunk_size, precision, state_dtype, state_budget: as
            `triton_soe.kernelized_num_den_triton_soe`'s.
    """
    from ..._validate import FastRPEError
    from . import triton_soe as ts
    from .triton_chunked import DEFAULT_CHUNK, acc_dtype, value_dtype, with_quotient_grad

    chunk = chunk_size or DEFAULT_CHUNK
    if chunk < 16 or chunk & (chunk - 1):
        raise FastRPEError(f"chunk_size: must be a power of two >= 16 (tl.dot), got {chunk}")
    B, H, Lq, D = q.shape
    plan = _plan_of(coeffs, Lq, q_offset)
    if plan.a.shape[0] != H:
        raise FastRPEError(f"coeffs: fitted for {plan.a.shape[0]} heads, q has {H}")
    if v.shape[2] < 1:
        raise FastRPEError("v: needs at least one key")
    T, NB = ts.near_chunks(plan.window, chunk)
    q, k, phi_q, phi_k, consts = map_inputs(q, k, kern)
    dt = phi_q.dtype  # float32
    acc = acc_dtype(dt)
    cn, wq, lgk = ts.kernel_tables(plan, T, NB, acc)
    N = -(-max(v.shape[2], q_offset + Lq) // T)
    sdt = ts.state_storage(dt, state_dtype)
    terms = ts.STATE_TERMS  # (read once: the group, the forward's passes and the backward's)
    group = ts.launch_group(B * H, N, phi_q.shape[-1], v.shape[3], sdt, plan.num_terms, state_budget, terms)
    vv = v.to(value_dtype(v, dt)).contiguous()
    num, den = _SoEMaps.apply(q, k, vv, phi_q, phi_k, cn, wq, lgk, consts, int(q_offset), T, NB,
                              dot_mode(precision), sdt, group, q.dtype, terms)
    return with_quotient_grad(num, den)
