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
state, the far field from stored states (`triton_soe.FAR_FIELD = "states"`) and every term in
one launch group (`triton_soe.launch_group`): only then is a chunk's dφ whole within one
launch. T5's one term always is; KERPLE's 16 are at 65,536 tokens, B·H = 8, with a 16-bit
call's bf16 states (the bench's row; float32 states fit 15 there, bf16 ones 7 at 262,144). The
plan's own gradients (the far weights' from the dq kernel, the near table's from
`_soe_bwd_dcn_kernel`, which reads the features, not dφ) are made as on the unfused path.
`fused_reasons` says what declines a call, and the caller runs the unfused path.

Numerics: the same kernels and sums as the unfused path up to dφ (the tile helpers
`triton_soe._soe_dq_tile` and `_soe_dkv_tiles` are both paths' bodies), which stays in
registers in float32 (the unfused path stores it in float32: the same values), then the maps'
backward (`triton_prf.prf_grad_rows`), which computes φ again from x with the attention's
products (`precision`), where the maps' forward took theirs (`triton_prf.PRECISION`): φ may
differ in its last bits, far below dx's bf16 rounding.

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
    from .triton_chunked import _store_tile
    from .triton_soe import _KEY, _soe_dkv_tiles, _soe_dq_tile

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dq_map_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, dwq_ptr,
                               x_ptr, w_ptr, shift_ptr, dx_ptr,
                               H, Lq, Lk, F, Dv, N, K, NS, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale,
                               inv_sqrt_f,
                               BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                               NB: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                               SCALED: tl.constexpr, DWQ: tl.constexpr, NORMALIZE: tl.constexpr,
                               DX_BF16: tl.constexpr):
        """Grid (NS, B·H), query chunks n = g, g + NS, ...: `triton_soe._soe_bwd_dq_kernel`'s
        dφq of every term (one launch: near field and all K terms' far field), taken through
        the query map's backward: dq of the chunk's queries (`[B, H, Lq, D]` contiguous, q's
        dtype; DX_BF16: the int16 view of bf16) from q (x_ptr, strides sx*); and (DWQ) the
        program's sums of the far weights' gradient, as there."""
        gi = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BD)
        for n in range(gi, N, NS):
            dphi, qi, qm = _soe_dq_tile(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr,
                                        dwq_ptr, bh, gi, n, H, Lq, Lk, F, Dv, N, K, NS, q_offset, BT, BF, BDV, NB, True,
                                        DT, ACC, MODE, SCALED, DWQ)
            r = qi.to(tl.int64)
            dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, qm, H, D, F, sxb, sxh, sxl, swh,
                               s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, True, MODE)
            _store_tile(dx_ptr + (bh * Lq + r)[:, None] * D + d[None, :], dx, qm[:, None] & (d < D)[None, :],
                        DX_BF16)

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dkv_map_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr, dv_ptr,
                                x_ptr, w_ptr, shift_ptr, dx_ptr,
                                H, Lq, Lk, F, Dv, N, K, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale,
                                inv_sqrt_f,
                                BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                                NB: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                                SCALED: tl.constexpr, DV_BF16: tl.constexpr, NORMALIZE: tl.constexpr,
                                DX_BF16: tl.constexpr):
        """Grid (N, B·H): `triton_soe._soe_bwd_dkv_kernel`'s dv of key chunk n (one launch:
        no earlier sums to add), and its dφk taken through the key map's backward: dk of the
        chunk's keys (`[B, H, Lk, D]`, k's dtype) from k (x_ptr)."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dphi, pos, km = _soe_dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr,
                                       dv_ptr, dv_ptr, bh, n, H, Lq, Lk, F, Dv, N, K, q_offset, BT, BF, BDV, NB, True,
                                       False, DT, ACC, MODE, SCALED, DV_BF16, True)
        r = pos.to(tl.int64)
        dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, km, H, D, F, sxb, sxh, sxl, swh,
                           s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, False, MODE)
        d = tl.arange(0, BD)
        _store_tile(dx_ptr + (bh * Lk + r)[:, None] * D + d[None, :], dx, km[:, None] & (d < D)[None, :], DX_BF16)

    # autotuned as triton_soe's own gradient kernels (as they are under the interpreter): the
    # dq kernel in bf16x3 over pipelined configs only, as `triton_soe.SOE_DQ_BF16X3_NOTE` says
    # of the kernel whose body it runs; nothing to restore (one launch: no output is added to)
    _MAP_KEY = [x for x in _KEY if x != "NEAR"] + ["SCALED", "D", "NORMALIZE"]
    _soe_bwd_dq_map_kernel_bf16x3 = _tuned(_soe_bwd_dq_map_kernel, _MAP_KEY + ["DWQ"], reset=["dwq_ptr"],
                                           min_stages=2)
    _soe_bwd_dq_map_kernel = _tuned(_soe_bwd_dq_map_kernel, _MAP_KEY + ["DWQ"], reset=["dwq_ptr"])
    _soe_bwd_dkv_map_kernel = _tuned(_soe_bwd_dkv_map_kernel, _MAP_KEY + ["DV_BF16"])


def launch_dq(maps: MapGrads, grid, args: tuple, dims: tuple, lb: int, tiles: dict) -> Tensor:
    """dq (q's dtype and shape) by `_soe_bwd_dq_map_kernel`: `args` as
    `triton_soe._soe_bwd_dq_kernel` takes them less its dq (φq, φk, v, do, inv, dd, cn, wq, h,
    z, dwq), `dims` (H, Lq, Lk, F, Dv, N, K, NS, q_offset), `tiles` its constants."""
    kernel = _soe_bwd_dq_map_kernel_bf16x3 if tiles["MODE"] == dot_mode("bf16x3") else _soe_bwd_dq_map_kernel
    return launch_map_kernel(kernel, grid, args, maps.xq, maps, dims, lb, tiles)


def launch_dkv(maps: MapGrads, grid, args: tuple, dv: Tensor, dims: tuple, lb: int, dv_bf16: bool,
               tiles: dict) -> Tensor:
    """dk (k's dtype and shape) and dv (into `dv`) by `_soe_bwd_dkv_map_kernel`: `args` as
    `triton_soe._soe_bwd_dkv_kernel` takes them before its dk (φq, φk, v, do, inv, dd, cn, log γ,
    dh, dz), `dims` (H, Lq, Lk, F, Dv, N, K, q_offset)."""
    return launch_map_kernel(_soe_bwd_dkv_map_kernel, grid, (*args, dv.view(torch.int16) if dv_bf16 else dv),
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


def _terms_and_window(coeffs) -> tuple[int, int]:
    """`(K, W)` of an `SoEPlan` or a `BandCoefficients` (one term), without building a plan."""
    from ..kernelized import BandCoefficients

    if isinstance(coeffs, BandCoefficients):
        return 1, int(coeffs.window)
    return coeffs.num_terms, int(coeffs.window)


def fused_reasons(q: Tensor, k: Tensor, v: Tensor, kern, coeffs, key_padding_mask: Tensor | None, causal: bool,
                  features_dtype: torch.dtype | None, *, q_offset: int = 0, state_dtype: torch.dtype | None = None,
                  chunk_size: int | None = None, state_budget: int | None = None) -> list[str]:
    """Why the fused path does not take this call (empty: it does). `coeffs`: an `SoEPlan`
    (triton_soe) or `BandCoefficients` (triton_band); the rest as `prf_soe_attention` and the
    composition take them (`features_dtype`: the dtype the call rounds the features to, or None)."""
    from ...kernels import PRF
    from . import triton_soe as ts
    from .triton_chunked import DEFAULT_CHUNK

    r = map_reasons(q, k, kern, key_padding_mask, features_dtype)
    if not causal:
        r.append("causal only (the fused SoE kernels are)")
    if ts.FAR_FIELD != "states":
        r.append(f"the far field from stored states only (triton_soe.FAR_FIELD is {ts.FAR_FIELD!r}: the walk adds its "
                 f"far field's dφ after the near field's)")
    if isinstance(kern, PRF) and q.dim() == 4 and v.dim() == 4:
        # the launch groups as `kernelized_num_den_triton_soe` forms them (float32 features)
        K, W = _terms_and_window(coeffs)
        T, _ = ts.near_chunks(W, chunk_size or DEFAULT_CHUNK)
        B, H, Lq = q.shape[0], q.shape[1], q.shape[2]
        N = -(-max(v.shape[2], q_offset + Lq) // T)
        sdt = ts.state_storage(torch.float32, state_dtype)
        group = ts.launch_group(B * H, N, kern.num_features(q.shape[-1]), v.shape[3], sdt, K, state_budget,
                                ts.STATE_TERMS)
        if group < K:
            r.append(f"its {K} terms run in {-(-K // group)} launch groups (the states' budget, "
                     f"triton_soe.STATE_BUDGET): a chunk's dφ is whole only after the last")
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
    if group < plan.num_terms:
        raise FastRPEError(f"prf_soe_attention: the {plan.num_terms} terms need {-(-plan.num_terms // group)} launch "
                           f"groups; the fused maps take one (fused_reasons)")
    vv = v.to(value_dtype(v, dt)).contiguous()
    num, den = _SoEMaps.apply(q, k, vv, phi_q, phi_k, cn, wq, lgk, consts, int(q_offset), T, NB,
                              dot_mode(precision), sdt, group, q.dtype, terms)
    return with_quotient_grad(num, den)
