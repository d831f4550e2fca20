"""Kernelized attention with relative positions, composed from its parts: one pure op.

The formula this module computes, for query i (position `q_offset + i`) and keys j:

    out_i = ( Σ_j [φ(q_i)·φ(k_j)·c(j-i) + S_ij]·v_j ) / ( Σ_j [φ(q_i)·φ(k_j)·c(j-i) + S_ij] )
            + Σ_j W_ij·v_j

* `φ(q)·φ(k)·c(j-i)`, `c = exp(b)`: Luo et al., "Stable, Fast and Accurate: Kernelized
  Attention with Relative Positional Encoding" (NeurIPS 2021), Eq. 10. The inner sums are
  computed by an *inner-product algorithm* (dense, FFT, chunked, prefix, SoE, 2D FFT); every
  algorithm has the one signature of `NumDen` below. Backends only choose that algorithm.
* `S_ij = φ(q_i)·RP[clip(i-j, -k, k)]`: Shaw's relative vectors in the kernelized form of
  Scaleformer (Favier & Dal'Maz Silva, 2021), Eq. 10, added to numerator and denominator.
* `W_ij = w(j-i)` (or `w_row(Δrow) + w_col(Δcol)` on a grid): FastRPB ("FastRPB: a Scalable
  Relative Positional Encoding for Long Sequence Tasks", ICLR 2022 submission), added to
  the output, not normalized. Also used by the softmax backends (`add_fastrpb`).

Stabilizers, and why they are exact. Features are computed in float32/64 with shifts taken
out before `exp`:
* a query's features may carry any positive factor of its own (its row's numerator and
  denominator, Shaw's `φ(q_i)·RP` included, all carry it: it cancels);
* the keys' features carry `exp(-s)` with `s` one shift shared by every key a row sees
  (`FeatureMap.key_features`): a data-independent bound (PRF, nexp), one shift per (batch,
  head) (SIKF `exp`, non-causal), or a running maximum over keys (SIKF, causal: row i is
  rescaled by the maximum up to its own last key, as in online softmax, so no row depends
  on a later key);
* the inner-product algorithms take each row's largest log-coefficient out (`log_scale`).
The content part is therefore `num·exp(log_scale + s)` in true units. Without Shaw that
factor cancels in `num/den`. Shaw's sums are in true units, so before they are added both
parts are brought to the units `exp(u)`, `u = max(log_scale + s, 0)`: the stabilizer
cancels in every term of numerator and denominator (Scaleformer Eq. 10), and neither part
can overflow.

Notation: B batch, H heads, Lq/Lk lengths, D head width, F features, Dv value width,
R = Lq + Lk - 1 offsets, C = Dv + 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor

from .._validate import warn_underflowed_rows
from .common import safe_divide
from .fastrpb.fft import fastrpb_fft
from .fastrpb.grid import fastrpb2d_fft
from .fastrpb.naive import fastrpb2d_naive
from .fastrpb.naive import fastrpb_naive
from .linear.band import kernelized_num_den_band
from .linear.chunked import kernelized_num_den_chunked
from .linear.fft import kernelized_num_den_fft
from .linear.grid import kernelized_num_den_grid_fft
from .linear.naive import kernelized_num_den_grid_naive
from .linear.naive import kernelized_num_den_naive
from .linear.bidirectional import kernelized_num_den_bidirectional
from .linear.prefix import kernelized_num_den_prefix
from .linear.soe import SoEPlan, kernelized_num_den_soe
from .shaw.linear import shaw_num_den_linear
from .shaw.naive import shaw_logits, shaw_num_den_naive

__all__ = ["NumDen", "GridCoefficients", "BandCoefficients", "num_den_band", "FastRPB1DTerm", "FastRPB2DTerm", "kernelized_attention",
           "add_fastrpb", "shaw_logit_bias", "num_den_dense", "num_den_fft", "num_den_chunked",
           "num_den_prefix", "num_den_bidirectional", "num_den_soe", "num_den_grid_dense", "num_den_grid_fft"]


# ---------------------------------------------------------------------------------------------
# The inner-product algorithms, one signature


class NumDen(Protocol):
    """An inner-product algorithm: `Σ_j φ(q_i)·φ(k_j)·c(j-i)·[v_j, 1]`.

    `op(phi_q, phi_k, v, coeffs, *, causal, q_offset, key_padding_mask, key_log_scale=None)
    -> (num, den, log_scale)` with `phi_q: [B, H, Lq, F]`, `phi_k: [B, H, Lk, F]`,
    `v: [B, H, Lk, Dv]`, `num: [B, H, Lq, Dv]`, `den: [B, H, Lq]` and `log_scale: [H, Lq]`
    or `[B, H, Lq]` (true sums are `num·exp(log_scale)`).

    `coeffs` is what the algorithm needs to know about the positional term:
    `[H, R]` log-coefficients `b_h(r)` or None (dense, fft), `[H]` decays γ or None
    (chunked), None (prefix), an `SoEPlan` (soe), `BandCoefficients` (band),
    `GridCoefficients` (2D grids).
    `v` comes in the features' dtype, except for an algorithm with the attribute
    `keeps_value_dtype = True`, which gets the caller's v as it is (bf16/fp16 included).
    `key_log_scale: [B, H, Lk]` is a per-key log-factor of the key features (true features
    `phi_k·exp(key_log_scale)`, the running maximum of causal SIKF); only `num_den_dense`
    accepts it, the others raise.
    An algorithm with the attribute `divides = True` also takes `divide=dtype` and then
    returns the quotient `num/den` (rows without weight 0, as `safe_divide`) in that dtype in
    place of num: the composition asks for it when nothing is added to the sums (no Shaw),
    so that no float32 num is kept for backward and no float32 gradient of it is made.
    An algorithm with the attribute `with_feature_maps` (a function of `(q, k, v, kernel,
    coeffs, *, causal, q_offset, key_padding_mask)`) may take a call with no Shaw or FastRPB
    term whole, feature maps included, and return its output, or None to leave it to the
    composition (`triton_chunked_prf`, `triton_soe_prf`: the maps' backward inside their gradient
    kernels).
    """

    def __call__(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, coeffs, *, causal: bool, q_offset: int,
                 key_padding_mask: Tensor | None, key_log_scale: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]: ...  # pragma: no cover - protocol


@dataclass(frozen=True)
class GridCoefficients:
    """What the 2D inner-product algorithms need: `table: [H, 2Hg-1, 2Wg-1]` log-coefficients
    `b_h(Δrow, Δcol)`, `grid = (Hg, Wg)`, `cls: [H, 3]` class-token log-coefficients or None."""

    table: Tensor
    grid: tuple[int, int]
    cls: Tensor | None = None


def _no_key_scale(name: str, key_log_scale: Tensor | None) -> None:
    if key_log_scale is not None:
        raise ValueError(f"{name}: keys stabilized per key (a running maximum) need the dense algorithm; "
                         "this one needs one shift shared by all keys")


def _causal_only(name: str, causal: bool) -> None:
    if not causal:
        raise ValueError(f"{name}: causal only (got causal=False)")


def num_den_dense(phi_q, phi_k, v, coeffs: Tensor | None, *, causal, q_offset, key_padding_mask,
                  key_log_scale=None):
    """Materialized weights (`kernelized_num_den_naive`); coeffs: `[H, R]` or None."""
    return kernelized_num_den_naive(phi_q, phi_k, v, coeffs, causal=causal, q_offset=q_offset,
                                    key_padding_mask=key_padding_mask, key_log_scale=key_log_scale)


def num_den_fft(phi_q, phi_k, v, coeffs: Tensor | None, *, causal, q_offset, key_padding_mask,
                key_log_scale=None):
    """Toeplitz product by FFT in feature blocks (Luo et al. 2021); coeffs: `[H, R]` or None."""
    _no_key_scale("fft", key_log_scale)
    return kernelized_num_den_fft(phi_q, phi_k, v, coeffs, causal=causal, q_offset=q_offset,
                                  key_padding_mask=key_padding_mask)


def num_den_chunked(phi_q, phi_k, v, coeffs: Tensor | None, *, causal, q_offset, key_padding_mask,
                    key_log_scale=None):
    """Causal, chunks and a running state; coeffs: `[H]` geometric decays γ or None (γ = 1)."""
    _causal_only("chunked", causal)
    _no_key_scale("chunked", key_log_scale)
    return kernelized_num_den_chunked(phi_q, phi_k, v, gamma=coeffs, q_offset=q_offset,
                                      key_padding_mask=key_padding_mask)


def num_den_prefix(phi_q, phi_k, v, coeffs: None, *, causal, q_offset, key_padding_mask, key_log_scale=None):
    """Causal prefix sums (Scaleformer Algorithm 1); no positional term (coeffs must be None)."""
    _causal_only("prefix", causal)
    _no_key_scale("prefix", key_log_scale)
    if coeffs is not None:
        raise ValueError("prefix: runs without a positional term (coeffs must be None)")
    return kernelized_num_den_prefix(phi_q, phi_k, v, q_offset=q_offset, key_padding_mask=key_padding_mask)


def num_den_bidirectional(phi_q, phi_k, v, coeffs: None, *, causal, q_offset, key_padding_mask, key_log_scale=None):
    """Non-causal, no positional term: one `[F, Dv]` key summary (Katharopoulos et al. 2020)."""
    if causal:
        raise ValueError("bidirectional: non-causal only (prefix and chunked are the causal forms)")
    _no_key_scale("bidirectional", key_log_scale)
    if coeffs is not None:
        raise ValueError("bidirectional: runs without a positional term (coeffs must be None)")
    return kernelized_num_den_bidirectional(phi_q, phi_k, v, key_padding_mask=key_padding_mask)


def num_den_soe(phi_q, phi_k, v, coeffs: SoEPlan, *, causal, q_offset, key_padding_mask, key_log_scale=None):
    """Causal, exact band plus a sum-of-exponentials far field; coeffs: the `SoEPlan` fit."""
    _causal_only("soe", causal)
    _no_key_scale("soe", key_log_scale)
    return kernelized_num_den_soe(phi_q, phi_k, v, q_offset=q_offset, key_padding_mask=key_padding_mask,
                                  plan=coeffs)


@dataclass(frozen=True)
class BandCoefficients:
    """What the band algorithm needs: `log_coeff: [H, R]` and `window` W, the distance from
    which the term is constant (`Position.finite_support()`)."""

    log_coeff: Tensor
    window: int


def num_den_band(phi_q, phi_k, v, coeffs: BandCoefficients, *, causal, q_offset, key_padding_mask,
                 key_log_scale=None):
    """Finite-support terms: exact band `|r| < W` plus constant tails; coeffs: `BandCoefficients`."""
    _no_key_scale("band", key_log_scale)
    return kernelized_num_den_band(phi_q, phi_k, v, coeffs.log_coeff, window=coeffs.window, causal=causal,
                                   q_offset=q_offset, key_padding_mask=key_padding_mask)


def _grid_call(name: str, causal: bool, q_offset: int, key_log_scale) -> None:
    if causal or q_offset:
        raise ValueError(f"{name}: a 2D grid term is bidirectional (got causal={causal}, q_offset={q_offset})")
    _no_key_scale(name, key_log_scale)


def num_den_grid_dense(phi_q, phi_k, v, coeffs: GridCoefficients, *, causal, q_offset, key_padding_mask,
                       key_log_scale=None):
    """2D table by materialized weights; coeffs: `GridCoefficients`."""
    _grid_call("grid dense", causal, q_offset, key_log_scale)
    cls = None if coeffs.cls is None else coeffs.cls.to(phi_q.dtype)
    return kernelized_num_den_grid_naive(phi_q, phi_k, v, coeffs.table.to(phi_q.dtype), coeffs.grid, cls,
                                         key_padding_mask=key_padding_mask)


def num_den_grid_fft(phi_q, phi_k, v, coeffs: GridCoefficients, *, causal, q_offset, key_padding_mask,
                     key_log_scale=None):
    """2D table by 2D FFT (Toeplitz-block-Toeplitz), class token exact; coeffs: `GridCoefficients`."""
    _grid_call("grid_fft", causal, q_offset, key_log_scale)
    cls = None if coeffs.cls is None else coeffs.cls.to(phi_q.dtype)
    return kernelized_num_den_grid_fft(phi_q, phi_k, v, coeffs.table.to(phi_q.dtype), coeffs.grid, cls,
                                       key_padding_mask=key_padding_mask)


# ---------------------------------------------------------------------------------------------
# Additive terms: their parameters for one call


@dataclass(frozen=True)
class FastRPB1DTerm:
    """FastRPB 1D for one call: `w: [H, R]`, `w_h(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset`."""

    w: Tensor


@dataclass(frozen=True)
class FastRPB2DTerm:
    """FastRPB 2D (separable): `w_row: [H, 2Hg-1]`, `w_col: [H, 2Wg-1]`, `w_cls: [H, 3]` or None."""

    w_row: Tensor
    w_col: Tensor
    w_cls: Tensor | None
    grid: tuple[int, int]


def add_fastrpb(out: Tensor, v: Tensor, terms: Sequence[FastRPB1DTerm | FastRPB2DTerm], *, causal: bool = False,
                q_offset: int = 0, key_padding_mask: Tensor | None = None, naive: bool = False) -> Tensor:
    """`out + Σ_terms W·v` (FastRPB: `Y = Attention(Q, K, V) + W·V`); padding keys add nothing.

    Args:
        out: `[B, H, Lq, Dv]` attention output; v: `[B, H, Lk, Dv]`.
        terms: the FastRPB terms' parameters for this call.
        naive: materialize W (the reference) instead of the FFT forms.

    Returns:
        `[B, H, Lq, Dv]` in out's dtype.
    """
    if not terms:
        return out
    vm = v.to(out.dtype)
    if key_padding_mask is not None:
        vm = vm.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    Lq = out.shape[2]
    for t in terms:
        if isinstance(t, FastRPB2DTerm):
            if causal or q_offset:
                raise ValueError("FastRPB2D is bidirectional (no causal mask, no q_offset)")
            fn = fastrpb2d_naive if naive else fastrpb2d_fft
            w_cls = None if t.w_cls is None else t.w_cls.to(out.dtype)
            y = fn(t.w_row.to(out.dtype), t.w_col.to(out.dtype), vm, t.grid, w_cls)
        elif isinstance(t, FastRPB1DTerm):
            fn = fastrpb_naive if naive else fastrpb_fft
            # fft: the coefficients keep their dtype (the FFT runs in float32/64 and casts them)
            y = fn(t.w.to(out.dtype) if naive else t.w, vm, Lq, causal=causal, q_offset=q_offset)
        else:
            raise TypeError(f"add_fastrpb: unknown term {type(t).__name__}")
        out = out + y.to(out.dtype)
    return out


def shaw_logit_bias(q: Tensor, shaw: Sequence[Tensor], Lk: int, q_offset: int, scale: float,
                    bias: Tensor | None = None) -> Tensor | None:
    """`bias` (`[H, Lq, Lk]` or None) plus Shaw's softmax logit term `scale·q_i·RP[clip(i-j, -k, k)]`
    for every table (Shaw et al., "Self-Attention with Relative Position Representations",
    NAACL 2018, Eq. 5): `[B, H, Lq, Lk]`, or `bias` without tables. `shaw`: tables `[H, 2k+1, D]`."""
    for rp in shaw:
        s = shaw_logits(q, rp, Lk, q_offset) * scale
        bias = s if bias is None else bias + s
    return bias


# ---------------------------------------------------------------------------------------------
# The composition


def kernelized_attention(q: Tensor, k: Tensor, v: Tensor, kernel, num_den: NumDen, coeffs=None, *,
                         shaw: Sequence[Tensor] = (), fastrpb: Sequence[FastRPB1DTerm | FastRPB2DTerm] = (),
                         causal: bool = False, q_offset: int = 0, key_padding_mask: Tensor | None = None,
                         naive: bool = False) -> Tensor:
    """Kernelized attention with a multiplicative Toeplitz (or 2D) term, Shaw vectors and
    FastRPB terms: Luo Eq. 10 + Scaleformer Eq. 10 + FastRPB (see the module docstring).

    Runs with autocast off: features, sums and FFTs are float32 (float64 for float64 inputs)
    whatever the caller's autocast says (under fp16 autocast a feature product of two keys
    with norm 1e3 overflows fp16); the output comes back in q's dtype.

    Args:
        q: `[B, H, Lq, D]`, queries at positions `q_offset + 0..Lq-1`; k: `[B, H, Lk, D]`;
            v: `[B, H, Lk, Dv]`.
        kernel: a `fastrpe.kernels.FeatureMap` (`kernel(q, is_query=True)` and
            `kernel.key_features(k, causal=, key_padding_mask=)` are used).
        num_den: the inner-product algorithm (`NumDen`); coeffs: what it needs.
        shaw: Shaw tables `RP: [H, 2k+1, F]`, row `t + k` holds `RP[t]`, `t = clip(i-j, -k, k)`.
        fastrpb: FastRPB terms' parameters for this call.
        causal: only keys `j <= q_offset + i`.
        q_offset: position of the first query.
        key_padding_mask: `[B, Lk]` bool, True marks padding keys (they contribute nothing).
        naive: Shaw and FastRPB by their materializing references (the dense backend).

    Returns:
        `[B, H, Lq, Dv]` in q's dtype; a row with no weight is 0.
    """
    with torch.autocast(q.device.type, enabled=False):
        # an algorithm that runs the feature maps itself (their backward in its own kernels:
        # `triton_chunked_prf`, `triton_soe_prf`) takes the call whole where it can, else says None
        whole = getattr(num_den, "with_feature_maps", None)
        if whole is not None and not shaw and not fastrpb:
            out = whole(q, k, v, kernel, coeffs, causal=causal, q_offset=q_offset, key_padding_mask=key_padding_mask)
            if out is not None:
                return out.to(q.dtype)
        phi_q = kernel(q, is_query=True)  # (B, H, Lq, F), float32/64
        phi_k, s = kernel.key_features(k, causal=causal, key_padding_mask=key_padding_mask)  # (B, H, Lk, F)
        warn_underflowed_rows(kernel, phi_q, phi_k)  # exp/prf at huge norms: zero rows, said once
        # values in the features' dtype, unless the algorithm reads bf16/fp16 values itself
        # (`keeps_value_dtype`, the Triton kernels): then no float32 copy is made and saved
        vv = v if getattr(num_den, "keeps_value_dtype", False) else v.to(phi_q.dtype)
        s = torch.as_tensor(s, dtype=phi_q.dtype, device=phi_q.device).detach()
        per_key = s.dim() == 3 and s.shape[-1] > 1  # causal running maximum: [B, H, Lk]
        # the algorithm divides itself when the quotient is all that is asked (FastRPB's term
        # is added to it in the features' dtype: it then gets the quotient in that dtype)
        divide = getattr(num_den, "divides", False) and not shaw and not per_key
        kw = dict(divide=phi_q.dtype if fastrpb else q.dtype) if divide else {}
        num, den, log_scale = num_den(phi_q, phi_k, vv, coeffs, causal=causal, q_offset=q_offset,
                                      key_padding_mask=key_padding_mask, key_log_scale=s if per_key else None, **kw)
        if shaw or fastrpb:
            vv = vv.to(phi_q.dtype)
        if shaw:
            # content sums are in units of exp(log_scale + s) per row, Shaw's in units of 1
            total = log_scale if per_key else log_scale + s  # s: (), (H, 1) or (B, H, 1)
            total = torch.broadcast_to(total, den.shape)  # (B, H, Lq)
            u = total.clamp_min(0.0)
            a, b = torch.exp(total - u), torch.exp(-u)  # (B, H, Lq), both <= 1
            num, den = num * a[..., None], den * a
            shaw_fn = shaw_num_den_naive if naive else shaw_num_den_linear
            for rp in shaw:
                n2, d2 = shaw_fn(phi_q, vv, rp.to(phi_q.dtype), Lk=k.shape[2], causal=causal, q_offset=q_offset,
                                 key_padding_mask=key_padding_mask)
                num, den = num + n2 * b[..., None], den + d2 * b
        out = num if divide else safe_divide(num, den)
        out = add_fastrpb(out, vv, fastrpb, causal=causal, q_offset=q_offset, key_padding_mask=key_padding_mask,
                          naive=naive)
        return out.to(q.dtype)
