"""The chunked geometric-decay kernels (`triton_chunked`) with the PRF feature maps' backward
in their gradient kernels: dq and dk/dv take dφq and dφk through the maps there and write the
inputs' gradients, where the unfused path writes dφ in float32 and the maps' own backward
launches (`triton_prf._prf_bwd_kernel`) read it again with x.

Why: at 65,536 tokens (B·H = 8, NPRF, 32 features, bf16) ALiBi's `triton_chunked` call took
3.15 ms on the H100 against fla's `chunk_simple_gla` 2.72 (2026-11-28, docs/RESULTS.md,
seventh session), and the maps' four launches 0.93 of it, their two backward launches 0.62,
each at about 1 TB/s, a third of the peak (`benchmarks/prf_sweep.py`). Fused, the backward
writes no dφ (64 MiB a map, float32) and reads none back, and the maps' rows are worked where
the gradient kernels hold them. Opt-in (`backends_triton.FUSED_MAPS`) until a GPU has timed it.

What it covers: causal calls of a `kernels.PRF` map (one- or two-sided, normalized or not,
shared or per-head projection) whose features take the Triton route, float32 features (no
`bf16-features` rounding), no key padding, no initial or returned state, a decay that needs no
gradient (ALiBi's is fixed); `fused_reasons` says what else declines it, and the caller runs
the unfused path.

Numerics: the same kernels and sums as the unfused path up to dφ, which stays in registers in
float32 (the unfused path stores it in float32: the same values), then the maps' backward
(`triton_prf.prf_grad_rows`), which computes φ again from x with the attention's products
(`precision`), where the maps' forward took theirs (`triton_prf.PRECISION`): φ may differ in
its last bits, far below dx's bf16 rounding (`triton_prf.BWD_LAUNCH` says the same of the
standalone backward).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .triton_chunked import HAS_TRITON, _pow2, _tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ..triton_prf import prf_grad_rows
    from .triton_chunked import _dkv_tiles, _dq_tile, _store_tile

    @triton.jit(do_not_specialize=["LB"])
    def _bwd_dq_map_kernel(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, h_ptr, z_ptr,
                           x_ptr, w_ptr, shift_ptr, dx_ptr,
                           H, Lq, Lk, F, Dv, N, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale, inv_sqrt_f,
                           BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                           STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                           SCALED: tl.constexpr, NORMALIZE: tl.constexpr, DX_BF16: tl.constexpr):
        """Grid (N, B·H): `triton_chunked._bwd_dq_kernel`'s dφq of chunk n, taken through the
        query map's backward: dq of its queries (`[B, H, Lq, D]` contiguous, q's dtype; DX_BF16:
        the int16 view of bf16) from q (x_ptr, strides sx*)."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dphi, qi, qm = _dq_tile(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, h_ptr, z_ptr, bh, n, H, Lq, Lk, F,
                                Dv, N, q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED)
        r = qi.to(tl.int64)
        dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, qm, H, D, F, sxb, sxh, sxl, swh,
                           s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, True, MODE)
        d = tl.arange(0, BD)
        _store_tile(dx_ptr + (bh * Lq + r)[:, None] * D + d[None, :], dx, qm[:, None] & (d < D)[None, :], DX_BF16)

    @triton.jit(do_not_specialize=["LB"])
    def _bwd_dkv_map_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, dv_ptr,
                            x_ptr, w_ptr, shift_ptr, dx_ptr,
                            H, Lq, Lk, F, Dv, N, q_offset, LB, D, sxb, sxh, sxl, swh, s_shift, scale, inv_sqrt_f,
                            BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, BD: tl.constexpr,
                            STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                            SCALED: tl.constexpr, DV_BF16: tl.constexpr, NORMALIZE: tl.constexpr,
                            DX_BF16: tl.constexpr):
        """Grid (N, B·H): `triton_chunked._bwd_dkv_kernel`'s dv, and its dφk taken through the
        key map's backward: dk of chunk n's keys (`[B, H, Lk, D]`, k's dtype) from k (x_ptr)."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dphi, pos, km = _dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, dv_ptr,
                                   bh, n, H, Lq, Lk, F, Dv, N, q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED,
                                   DV_BF16)
        r = pos.to(tl.int64)
        dx = prf_grad_rows(dphi.to(tl.float32), x_ptr, w_ptr, shift_ptr, bh, r, km, H, D, F, sxb, sxh, sxl, swh,
                           s_shift, scale, inv_sqrt_f, BT, BD, BF, NORMALIZE, False, MODE)
        d = tl.arange(0, BD)
        _store_tile(dx_ptr + (bh * Lk + r)[:, None] * D + d[None, :], dx, km[:, None] & (d < D)[None, :], DX_BF16)

    # autotuned as triton_chunked's own gradient kernels (as they are under the interpreter)
    _bwd_dq_map_kernel = _tuned(_bwd_dq_map_kernel, ["F", "Dv", "D", "LB", "STRICT", "SCALED", "MODE", "NORMALIZE"])
    _bwd_dkv_map_kernel = _tuned(_bwd_dkv_map_kernel, ["F", "Dv", "D", "LB", "STRICT", "SCALED", "DV_BF16", "MODE",
                                                       "NORMALIZE"])


class MapGrads(NamedTuple):
    """What the fused gradient kernels read of the maps: the raw q and k (`[B, H, L, D]`, unit
    stride in D), the stacked projection (`triton_prf.stacked_projection`, float32), the key
    shift (`[1]` or `[H]`), the input scale and whether inputs are normalized."""

    xq: Tensor
    xk: Tensor
    wf: Tensor
    shift: Tensor
    scale: float
    normalize: bool


def _x_args(x: Tensor, wf: Tensor, shift: Tensor, scale: float, F: int) -> tuple:
    """`(D, sxb, sxh, sxl, swh, s_shift, scale, inv_sqrt_f)` of one map's launch."""
    return (x.shape[-1], x.stride(0), x.stride(1), x.stride(2), wf.shape[-2] * wf.shape[-1] if wf.dim() == 3 else 0,
            int(shift.numel() > 1), float(scale), F ** -0.5)


def launch_map_kernel(kernel, grid, args: tuple, x: Tensor, maps: MapGrads, dims: tuple, lb: int, tiles: dict,
                      **flags) -> Tensor:
    """x's gradient (x's dtype and shape) by a fused gradient kernel of this module or of
    `triton_soe_prf`: `args` the kernel's arguments before the map's (x, the projection, the
    shift, dx), `dims` those after them (F fourth), `tiles` and `flags` its constants."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    bf16 = dx.dtype == torch.bfloat16
    kernel[grid](*args, x, maps.wf, maps.shift, dx.view(torch.int16) if bf16 else dx, *dims, lb,
                 *_x_args(x, maps.wf, maps.shift, maps.scale, dims[3]), BD=_pow2(x.shape[-1]),
                 NORMALIZE=maps.normalize, DX_BF16=bf16, **flags, **tiles)
    return dx


def launch_dkv(maps: MapGrads, grid, args: tuple, dv: Tensor, dims: tuple, lb: int, dv_bf16: bool,
               tiles: dict) -> Tensor:
    """dk (k's dtype and shape) and dv (into `dv`) by `_bwd_dkv_map_kernel`: `args` as
    `triton_chunked._bwd_dkv_kernel` takes them before its dk (q, k, v, do, inv, dd, log γ, dh,
    dz), `dims` (H, Lq, Lk, F, Dv, N, q_offset)."""
    return launch_map_kernel(_bwd_dkv_map_kernel, grid, (*args, dv.view(torch.int16) if dv_bf16 else dv), maps.xk,
                             maps, dims, lb, tiles, DV_BF16=dv_bf16)


def launch_dq(maps: MapGrads, grid, args: tuple, dims: tuple, lb: int, tiles: dict) -> Tensor:
    """dq (q's dtype and shape) by `_bwd_dq_map_kernel`: `args` as
    `triton_chunked._bwd_dq_kernel` takes them before its dq (k, v, do, inv, dd, log γ, h, z)."""
    return launch_map_kernel(_bwd_dq_map_kernel, grid, args, maps.xq, maps, dims, lb, tiles)


class _ChunkedDecayMaps(torch.autograd.Function):
    """`(num/den, den)` of the causal decay recurrence from the maps' inputs q and k: the
    features φq, φk come in computed (no graph behind them), and the backward returns q's and
    k's gradients from the fused kernels (`triton_chunked.chunked_backward` with `maps`)."""

    @staticmethod
    def forward(ctx, xq, xk, v, phi_q, phi_k, log_g, consts, q_offset: int, chunk: int, out_dtype, mode: int,
                divide, state_dtype):
        from . import triton_chunked as tc

        num, den, _, h, z = tc._chunked_forward_op(phi_q, phi_k, v, log_g, None, q_offset, chunk, False, out_dtype,
                                                   mode, divide, state_dtype, False, tc.STATE_SCAN)
        ctx.save_for_backward(xq, xk, v, phi_q, phi_k, log_g, h, z, den)
        ctx.cfg = (consts, q_offset, chunk, mode, tc.STATE_SCAN)
        return num, den

    @staticmethod
    def backward(ctx, dnum, dden):
        from . import triton_chunked as tc

        xq, xk, v, phi_q, phi_k, log_g, h, z, den = ctx.saved_tensors
        (wf, shift, scale, normalize), q_offset, chunk, mode, scan = ctx.cfg
        maps = MapGrads(xq, xk, wf, shift, scale, normalize)
        dq, dk, dv, _, _ = tc.on_device_of(0)(tc.chunked_backward)(
            phi_q, phi_k, v, log_g, h, z, None, None, den, dnum, dden, None, q_offset, chunk, False, mode, scan, False,
            maps)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def map_reasons(q: Tensor, k: Tensor, kern, key_padding_mask: Tensor | None,
                features_dtype: torch.dtype | None) -> list[str]:
    """Why no kernel can take the PRF maps' backward for this call, whatever its term (both
    fused paths' first reasons: this module's and `triton_soe_prf`'s)."""
    from ...kernels import PRF

    r = []
    if not HAS_TRITON:
        r.append("needs triton")
    if not isinstance(kern, PRF):
        r.append(f"the maps' backward is PRF's ({type(kern).__name__} given)")
    elif not (kern._triton_features(q) and kern._triton_features(k)):
        r.append("the map's features do not take the Triton route here (kernels.TRITON_FEATURES, dtype, shape)")
    if key_padding_mask is not None:
        r.append("no key padding (masked keys' features are zeroed after the map)")
    if features_dtype is not None:
        r.append(f"float32 features only (the call rounds them to {features_dtype})")
    if torch.compiler.is_compiling():
        r.append("not under torch.compile (no custom op for the fused backward yet)")
    if q.dtype == torch.float64:
        r.append("float64 runs the unfused path (the maps' kernels are float32)")
    return r


def fused_reasons(q: Tensor, k: Tensor, kern, gamma: Tensor | None, key_padding_mask: Tensor | None,
                  causal: bool, features_dtype: torch.dtype | None) -> list[str]:
    """Why the fused path does not take this call (empty: it does)."""
    r = map_reasons(q, k, kern, key_padding_mask, features_dtype)
    if not causal:
        r.append("causal only (the bidirectional decay runs two passes of its own)")
    if gamma is not None and gamma.requires_grad and torch.is_grad_enabled():
        r.append("the decay's gradient needs dφ, which the fused kernels do not make")
    return r


def map_inputs(q: Tensor, k: Tensor, kern) -> tuple:
    """`(q, k, φq, φk, consts)` of a fused call (this module's or `triton_soe_prf`'s): q and k
    with unit stride in D, their features by the maps' forward launches (no graph behind them),
    and what the fused gradient kernels read of the map (`(projection, key shift, input scale,
    normalize)`, `MapGrads` less q and k)."""
    from ..._validate import warn_underflowed_rows
    from ..triton_prf import prf_features_triton, stacked_projection

    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    with torch.no_grad():
        phi_q = prf_features_triton(q, kern, True)
        phi_k = prf_features_triton(k, kern, False)
    warn_underflowed_rows(kern, phi_q, phi_k)  # as the unfused composition says it
    w = kern.w.to(torch.float32).contiguous()
    consts = (stacked_projection(w, kern.two_sided),
              kern.key_log_shift().to(device=q.device, dtype=torch.float32).reshape(-1),
              float(kern.input_scale), bool(kern.normalize))
    return q, k, phi_q, phi_k, consts


def prf_chunked_attention(q: Tensor, k: Tensor, v: Tensor, kern, *, gamma: Tensor | None = None,
                          q_offset: int = 0, chunk_size: int | None = None, precision: str = "ieee",
                          state_dtype: torch.dtype | None = None) -> Tensor:
    """Causal kernelized attention `Σ_j γ^(p_i−j) φ(q_i)·φ(k_j) v_j / Σ_j γ^(p_i−j) φ(q_i)·φ(k_j)`
    with a PRF map `kern` (`kernels.PRF`), `[B, H, Lq, Dv]` in q's dtype: the maps' forward
    launches, the chunked kernels, and a backward whose gradient kernels take dφ through the
    maps (see the module docstring; `fused_reasons` must be empty).

    Args:
        q: `[B, H, Lq, D]` at positions `q_offset + 0..Lq-1`; k: `[B, H, Lk, D]`; v:
            `[B, H, Lk, Dv]`. gamma: `[H]` decays in (0, 1], or None (γ = 1). precision: the
            kernels' float32 products (`triton_chunked.PRECISIONS`). state_dtype: as
            `kernelized_num_den_triton_chunked`'s.
    """
    from . import triton_chunked as tc

    chunk = chunk_size or tc.DEFAULT_CHUNK
    q, k, phi_q, phi_k, consts = map_inputs(q, k, kern)
    pq, pk, vv, log_g = tc._prepare(phi_q, phi_k, v, gamma, None, chunk)
    num, den = _ChunkedDecayMaps.apply(q, k, vv, pq, pk, log_g, consts, int(q_offset), chunk, phi_q.dtype,
                                       tc.dot_mode(precision), q.dtype, state_dtype)
    return tc.with_quotient_grad(num, den)
