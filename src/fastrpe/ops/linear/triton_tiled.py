"""Kernelized attention with any Toeplitz term, exactly, in tiles: the quadratic sibling of the
FFT path for an arbitrary table over all offsets (a learned bias, anything with no linear-time
form), written as flash attention is, with nothing `[Lq, Lk]` materialized. The dense
reference is `naive.py` (`kernelized_num_den_naive`), whose contract this op keeps:

    num_i = Σ_j exp(b(r_ij) - m_i) (φq_i·φk_j) v_j,   den_i = Σ_j exp(b(r_ij) - m_i) (φq_i·φk_j)

with `r_ij = j - (q_offset + i)`, `b` the `[H, Lq+Lk-1]` log-coefficients (Luo et al. 2021,
Eq. 10 with `c = exp(b)`), causal keeping `r <= 0`, and `m_i` the row's own largest `b` over
the keys it sees (its `log_scale`: no row underflows because of another's scale).

Each program holds a tile of BM queries and walks the key tiles, as flash attention does with
its scores: `m_i` is the running maximum of `b` over the tiles seen so far, and the sums are
rescaled by `exp(m_old - m_new)` when it grows (here the maximum is of the position term
alone, so it is the same for every batch row). Per pair it costs `φq·φk` (F products) and
`exp(b - m)`, against FlexAttention's `q·k` (D products) and its softmax `exp`; the table is
read through the tile of offsets `j - i + Lq - 1`, which is the same few KB for every tile.
Keys stabilized one by one (causal SIKF's running maximum, `key_log_scale`) add their log-scale
to `b`: the running maximum then does what flash attention's does with its scores, so causal
`exp` features run here in linear memory, where only `dense` (quadratic) ran them before.

Backward, as flash attention's: `_tiled_bwd_dq` (a program per query tile) and
`_tiled_bwd_dkv` (a program per key tile) recompute `A = φq·φkᵀ` and `w = exp(b - m)` from
the saved `m`; with `G_ij = inv_i (do_i·v_j) + dd_i` (do the quotient's or num's gradient,
`_numerator_grads`), `dφq = (G∘w) φk`, `dφk = (G∘w)ᵀ φq`, `dv = (A∘w∘inv)ᵀ do`, and the table's
gradient `db(r) = Σ_{r_ij = r} A_ij w_ij G_ij` by atomic adds (only when b takes one).

Without an exponential per pair: `w_ij = exp(b_d - m_i) = exp(b_d - top)·exp(top - m_i)` with
`top` the head's largest `b`. One launch per call makes the table `e = exp(b - top)`
(`exp_table`: 2L entries per head), and the pairs read their weights from it as they read b.
Each row's factor `exp(top - m_i)` is one exponential per row (`_row_factor`): dq multiplies
each weight by it, dk/dv folds it into the query rows' inv and dd. The forward keeps the
running maximum of the weights (`m_i = top + log` of it at the end). This holds where every
weight and factor is a normal float with room to spare: the head's finite `b` span at most
`EXP_TABLE_SPAN` (20 nats in float32). A head that spans more takes `exp(b - m)` per pair, in
the same launch: each program reads its head's flag, so no host synchronization decides it.
At 64x64 tile pairs the table takes 13-30% off an interior iteration's SASS with bf16
features (sm_90, benchmarks/tile_bodies.py).

Memory: O(L) (the inputs, den and m); time: O(Lq·Lk·(F + Dv)), half of it when causal.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, R = Lq + Lk - 1
offsets; BM/BN query/key tile rows, BF/BDV power-of-two tile widths (>= 16 for `tl.dot`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._validate import FastRPEError
from .triton_chunked import (_TL_DTYPE, HAS_TRITON, _numerator_grads, _pow2, _tuned, acc_dtype, compile_opaque,
                             dot_mode, dv_in_bf16, length_bucket, quotient_flags, triton_unavailable_reason, value_dtype,
                             with_quotient_grad)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_chunked import _divide_rows, _dot, _load_rows, _row_inv, _store_tile

    #: the running maximum's start: below any log-coefficient that matters, and finite, so
    #: `exp(m_old - m_new)` is never `exp(-inf + inf)`
    _NEG = tl.constexpr(-1e30)

    @triton.jit
    def _log_weights(lc_ptr, ks_ptr, hh, bh, i, j, iok, jok, Lq, Lk, R, q_offset, CAUSAL: tl.constexpr,
                     KEY_SCALE: tl.constexpr, ACC: tl.constexpr, KEY_MAJOR: tl.constexpr = False,
                     EDGE: tl.constexpr = True, fill=float("-inf")):
        """`[len(i), len(j)]` log-weights `b(j - q_offset - i)` of head hh (KEY_SCALE: plus each
        key's log-scale `s[bh, j]`), `-inf` outside the call (and, CAUSAL, for keys after the
        query). KEY_MAJOR: `[len(j), len(i)]`, the same entries transposed, read as such, not a
        `tl.trans` of the query-major tile (see `_tiled_bwd_dkv_kernel`). EDGE=False: an interior
        tile pair (`_interior`), every query and key in the call and every key visible, read
        without a mask. lc_ptr may be the call's weight table `exp(b - top)` (`exp_table`; never
        with KEY_SCALE), read as such, with `fill` (0) outside."""
        if KEY_MAJOR:
            i, j, iok, jok = i[None, :], j[:, None], iok[None, :], jok[:, None]
        else:
            i, j, iok, jok = i[:, None], j[None, :], iok[:, None], jok[None, :]
        if EDGE:
            ok = iok & jok
            if CAUSAL:
                ok = ok & (j <= q_offset + i)
            b = tl.load(lc_ptr + hh * R + (j - i + Lq - 1), mask=ok, other=fill).to(ACC)
            if KEY_SCALE:
                b = b + tl.load(ks_ptr + bh * Lk + j, mask=jok, other=float("-inf")).to(ACC)
        else:
            b = tl.load(lc_ptr + hh * R + (j - i + Lq - 1)).to(ACC)
            if KEY_SCALE:
                b = b + tl.load(ks_ptr + bh * Lk + j).to(ACC)
        return b

    @triton.jit
    def _interior(lo, hi, first, n, BT: tl.constexpr, full):
        """`(a, b)`: the tiles `[a, b)` of the walk `[lo, hi)` (steps of BT) whose pairs with this
        program's tile are interior: the walk's tiles from `first` on (the first whose pairs see
        every key), short of the last partial one (`n` rows in all); none unless this program's
        own tile is `full`. Each loop takes an interior pair without masks (EDGE=False), the
        others with: at 64k tokens and causal, 1,023 in 1,024 of a tile's pairs are interior.
        Per iteration on sm_90 (triton 3.6.0, the H100 image's; benchmarks/tile_bodies.py) that
        is 6-8% fewer SASS instructions with tf32x3, 12-20% with bf16 features (under triton
        3.9.0 only in the dk/dv kernel). One loop with a branch, not three loops: with three, the
        dk/dv kernel spilled 3,728 B with tf32x3; with the branch 992, before 876."""
        b = tl.minimum(hi, n // BT * BT)
        a = tl.minimum(tl.maximum(lo, tl.cdiv(tl.maximum(first, 0), BT) * BT), b)
        if not full:
            a = b
        return a, b

    @triton.jit
    def _query_tile(Lq, BM: tl.constexpr, CAUSAL: tl.constexpr):
        """This program's query tile: causal, the last first. A causal tile's work grows with
        its index (it walks the key tiles up to its own), and programs start in index order,
        so the heaviest start first and the light ones fill in behind them, rather than the
        heaviest starting last and running alone (at 4,096 tokens 8 heads make 512 programs,
        about two waves on an H100)."""
        if CAUSAL:
            return tl.cdiv(Lq, BM) - 1 - tl.program_id(0)
        return tl.program_id(0)

    @triton.jit
    def _key_walk(i0, Lq, Lk, q_offset, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr):
        """`(hi, a, b)` of the query tile from row i0 (forward and dq): its key tiles are
        `[0, hi)`, the interior ones `[a, b)` (`_interior`: a prefix, up to the last tile that
        every row of a full query tile sees whole)."""
        hi = Lk
        seen = Lk
        if CAUSAL:
            hi = tl.minimum(Lk, q_offset + i0 + BM)
            seen = tl.minimum(Lk, q_offset + i0 + 1)  # what the tile's first row sees
        a, b = _interior(0, hi, 0, seen, BN, i0 + BM <= Lq)
        return hi, a, b

    @triton.jit
    def _key_tile(k_ptr, v_ptr, lc_ptr, ks_ptr, hh, bh, i, iok, j0, f, c, Lq, Lk, F, Dv, R, q_offset,
                  BN: tl.constexpr, CAUSAL: tl.constexpr, ACC: tl.constexpr, KEY_SCALE: tl.constexpr,
                  EDGE: tl.constexpr, fill):
        """`(φk, v, b)` of the key tile from j0 for the query rows i (forward and dq): its features
        in ACC, its values as stored, and the log-weights of the pairs (`_log_weights`; from the
        weight table, their weights)."""
        j = j0 + tl.arange(0, BN)
        jok = j < Lk
        k = _load_rows(k_ptr + bh * Lk * F, j, jok, f, F, F).to(ACC)
        v = _load_rows(v_ptr + bh * Lk * Dv, j, jok, c, Dv, Dv)
        b = _log_weights(lc_ptr, ks_ptr, hh, bh, i, j, iok, jok, Lq, Lk, R, q_offset, CAUSAL, KEY_SCALE, ACC,
                         False, EDGE, fill)
        return k, v, b

    @triton.jit
    def _fwd_step(q, k_ptr, v_ptr, lc_ptr, ks_ptr, hh, bh, i, iok, j0, f, c, acc, den, m, Lq, Lk, F, Dv, R, q_offset,
                  BN: tl.constexpr, CAUSAL: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                  KEY_SCALE: tl.constexpr, EDGE: tl.constexpr, fast, fill):
        """The forward's sums after the key tile from j0 (`(acc, den, m)`, m the running maximum
        of b; `fast` (lc_ptr the weight table): of the weights `exp(b - top)`, which divide by
        it, with no exponential per pair)."""
        k, v, b = _key_tile(k_ptr, v_ptr, lc_ptr, ks_ptr, hh, bh, i, iok, j0, f, c, Lq, Lk, F, Dv, R, q_offset, BN,
                            CAUSAL, ACC, KEY_SCALE, EDGE, fill)
        m_new = tl.maximum(m, tl.max(b, 1))
        if fast:  # weights so far 0: m = 0 (nothing to rescale, nothing to weigh)
            seen = m_new > 0
            alpha = tl.where(seen, m / tl.where(seen, m_new, 1.0), 1.0)
            w = b * tl.where(seen, 1.0 / tl.where(seen, m_new, 1.0), 0.0)[:, None]
        else:
            alpha = tl.exp(m - m_new)
            w = tl.exp(b - m_new[:, None])
        P = _dot(q, tl.trans(k), DT, ACC, MODE) * w
        acc = acc * alpha[:, None] + _dot(P, v, DT, ACC, MODE)
        den = den * alpha + tl.sum(P, 1)
        return acc, den, m_new

    @triton.jit
    def _dq_step(k_ptr, v_ptr, lc_ptr, ks_ptr, hh, bh, i, iok, j0, f, c, do, inv, dd, m, Lq, Lk, F, Dv, R, q_offset,
                 BN: tl.constexpr, CAUSAL: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                 KEY_SCALE: tl.constexpr, EDGE: tl.constexpr, fast, fill, s):
        """The key tile from j0's share of dφq (`fast`: weights from the table times each row's
        factor s, `_row_factor`)."""
        k, v, w = _key_tile(k_ptr, v_ptr, lc_ptr, ks_ptr, hh, bh, i, iok, j0, f, c, Lq, Lk, F, Dv, R, q_offset, BN,
                            CAUSAL, ACC, KEY_SCALE, EDGE, fill)
        if fast:
            w = w * s[:, None]
        else:
            w = tl.exp(w - m[:, None])
        G = inv[:, None] * _dot(do, tl.trans(v), DT, ACC, MODE) + dd[:, None]
        return _dot(G * w, k, DT, ACC, MODE)

    @triton.jit
    def _dkv_step(q_ptr, lc_ptr, ks_ptr, do_ptr, inv_ptr, dd_ptr, m_ptr, db_ptr, hh, bh, j, jok, i0, f, c, k, v, dk, dv,
                  Lq, Lk, F, Dv, R, q_offset, BM: tl.constexpr, CAUSAL: tl.constexpr, DT: tl.constexpr,
                  ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr, DB: tl.constexpr,
                  KEY_SCALE: tl.constexpr, EDGE: tl.constexpr, fast, fill, top, span):
        """`(dk, dv)` after the query tile from i0, in key-major `[BN, BM]` tiles, each product
        formed as such, never a `tl.trans` of a product (`HOPPER_TRANS_NOTE` in triton_chunked.py;
        with tf32x3, sm_90 ptxas spilled no more than for the transposed products: 956 B against
        968 at 4 warps, 804 against 972 at 8, compiled without a launch's alignment; as launched,
        benchmarks/results/tile_bodies.json). `fast`: the weights from the table, each query row's
        factor in its inv and dd (`_row_factor`)."""
        i = i0 + tl.arange(0, BM)
        iok = i < Lq
        q = _load_rows(q_ptr + bh * Lq * F, i, iok, f, F, F).to(ACC)
        do = _load_rows(do_ptr + bh * Lq * Dv, i, iok, c, Dv, Dv)
        inv = _row_inv(inv_ptr + bh * Lq, i, iok, ACC, SCALED)
        dd = tl.load(dd_ptr + bh * Lq + i, mask=iok, other=0.0).to(ACC)
        m = tl.load(m_ptr + bh * Lq + i, mask=iok, other=0.0)
        wT = _log_weights(lc_ptr, ks_ptr, hh, bh, i, j, iok, jok, Lq, Lk, R, q_offset, CAUSAL, KEY_SCALE, ACC, True,
                          EDGE, fill)
        if fast:  # the factor in the query rows' inv and dd (`_row_factor` says when that overflows)
            s = _row_factor(m, top, span)
            inv, dd = inv * s, dd * s
        else:
            wT = tl.exp(wT - m[None, :])
        AT = _dot(k, tl.trans(q), DT, ACC, MODE)
        dAT = (inv[None, :] * _dot(v, tl.trans(do), DT, ACC, MODE) + dd[None, :]) * wT
        dk += _dot(dAT, q, DT, ACC, MODE)
        dv += _dot(AT * wT * inv[None, :], do, DT, ACC, MODE)
        if DB:
            if EDGE:
                ok = jok[:, None] & iok[None, :]
                tl.atomic_add(db_ptr + hh * R + (j[:, None] - i[None, :] + Lq - 1), AT * dAT, mask=ok)
            else:
                tl.atomic_add(db_ptr + hh * R + (j[:, None] - i[None, :] + Lq - 1), AT * dAT)
        return dk, dv

    @triton.jit
    def _head_weights(lc_ptr, et_ptr, top_ptr, fast_ptr, hh, ACC: tl.constexpr, ETAB: tl.constexpr):
        """`(tab, fill, fast, top)` of head hh: ETAB (the call made `exp_table`) and the head's
        span within it, its weight table, 0 outside, and top; else its log-coefficients, -inf
        outside (fast False, top 0)."""
        tab, fill, fast, top = lc_ptr, float("-inf"), False, 0.0
        if ETAB:
            fast = tl.load(fast_ptr + hh) != 0
            top = tl.load(top_ptr + hh).to(ACC)
            fill = tl.where(fast, 0.0, float("-inf"))
            if fast:
                tab = et_ptr
        return tab, fill, fast, top

    @triton.jit
    def _row_factor(m, top, span):
        """Each query row's `exp(top - m)`, which turns the table's weights `exp(b - top)` into
        the row's `exp(b - m)`: one exponential per row, a product per pair. Capped at
        `exp(span)`: a row that sees nothing has m = 0 and only zero weights; every other row's m
        is within span of top (`exp_table`). dq applies it to the weights, whose products with it
        are at most 1. dk/dv folds it into the query rows' inv and dd, where a product per pair
        (the factor broadcast into its key-major tiles) cost more than the exponentials saved
        (benchmarks/tile_bodies.py: 805 SASS instructions per bf16 iteration against 738 with
        exponentials, 642 folded). Folded, `inv·exp(top - m)` overflows float32 for a row whose
        den is under about 1.4e-30 at the largest factor, e^20 (`EXP_TABLE_SPAN`): its dk and dv
        contributions turn inf or NaN where the exponentials gave finite ones."""
        return tl.exp(tl.minimum(top - m, span))

    @triton.jit
    def _exp_table_kernel(lc_ptr, e_ptr, top_ptr, fast_ptr, R, RU, span, BR: tl.constexpr, ACC: tl.constexpr):
        """Grid (H,): head hh's weight table over the offsets a call reads (`[0, RU)` of R):
        `top`, its largest finite log-coefficient (0 if none), `e = exp(b - top)` (0 from RU on),
        and `fast`: whether its finite entries span at most `span`, so that every weight and every
        row's factor `exp(top - m)` is a normal float (`exp_table`)."""
        hh = tl.program_id(0).to(tl.int64)
        hi = tl.full([BR], float("-inf"), ACC)
        lo = tl.full([BR], float("inf"), ACC)
        for r0 in range(0, RU, BR):
            r = r0 + tl.arange(0, BR)
            x = tl.load(lc_ptr + hh * R + r, mask=r < RU, other=float("-inf")).to(ACC)
            hi = tl.maximum(hi, x)
            lo = tl.minimum(lo, tl.where(x > float("-inf"), x, float("inf")))
        top = tl.max(hi, 0)
        top = tl.where(top > float("-inf"), top, 0.0)
        fast = (top - tl.min(lo, 0)) <= span  # nothing finite: -inf
        for r0 in range(0, R, BR):
            r = r0 + tl.arange(0, BR)
            x = tl.load(lc_ptr + hh * R + r, mask=r < RU, other=float("-inf")).to(ACC)
            tl.store(e_ptr + hh * R + r, tl.exp(x - top), mask=r < R)
        tl.store(top_ptr + hh, top)
        tl.store(fast_ptr + hh, fast.to(tl.int32))

    @triton.jit(do_not_specialize=["LB"])
    def _tiled_fwd_kernel(q_ptr, k_ptr, v_ptr, lc_ptr, ks_ptr, et_ptr, top_ptr, fast_ptr, num_ptr, den_ptr, m_ptr,
                          H, Lq, Lk, F, Dv, R, q_offset, LB,
                          BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                          CAUSAL: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                          DIVIDE: tl.constexpr = False, THR: tl.constexpr = 0.0, OUT_BF16: tl.constexpr = False,
                          KEY_SCALE: tl.constexpr = False, ETAB: tl.constexpr = False):
        """Grid (cdiv(Lq, BM), B·H): num (or, DIVIDE, the quotient; OUT_BF16: into the int16 view
        of a bf16 output), den and the rows' log-scale m of one query tile. ETAB: a head whose
        `fast` is set reads its weights from the table et `exp(b - top)` (`exp_table`), its
        running maximum that of the weights, and m = top + log of it."""
        im = _query_tile(Lq, BM, CAUSAL)
        bh = tl.program_id(1).to(tl.int64)
        hh = bh % H
        i = im * BM + tl.arange(0, BM)
        iok = i < Lq
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        cm = c[None, :] < Dv
        q = _load_rows(q_ptr + bh * Lq * F, i, iok, f, F, F).to(ACC)
        acc = tl.zeros([BM, BDV], dtype=ACC)
        den = tl.zeros([BM], dtype=ACC)
        m = tl.full([BM], _NEG, dtype=ACC)
        tab, fill, fast, top = _head_weights(lc_ptr, et_ptr, top_ptr, fast_ptr, hh, ACC, ETAB)
        if fast:  # the running maximum of the weights, from 0
            m = tl.zeros([BM], dtype=ACC)
        hi, a, b = _key_walk(im * BM, Lq, Lk, q_offset, BM, BN, CAUSAL)
        for j0 in range(0, hi, BN):
            if (j0 >= a) & (j0 < b):
                acc, den, m = _fwd_step(q, k_ptr, v_ptr, tab, ks_ptr, hh, bh, i, iok, j0, f, c, acc, den, m, Lq, Lk,
                                        F, Dv, R, q_offset, BN, CAUSAL, DT, ACC, MODE, KEY_SCALE, False, fast, fill)
            else:
                acc, den, m = _fwd_step(q, k_ptr, v_ptr, tab, ks_ptr, hh, bh, i, iok, j0, f, c, acc, den, m, Lq, Lk,
                                        F, Dv, R, q_offset, BN, CAUSAL, DT, ACC, MODE, KEY_SCALE, True, fast, fill)
        if fast:  # back to the largest b; _NEG where the row sees nothing
            m = tl.where(m > 0, top + tl.log(tl.where(m > 0, m, 1.0)), _NEG)
        if DIVIDE:
            acc = _divide_rows(acc, den, THR)
        _store_tile(num_ptr + bh * Lq * Dv + i[:, None] * Dv + c[None, :], acc, iok[:, None] & cm, OUT_BF16)
        tl.store(den_ptr + bh * Lq + i, den.to(den_ptr.dtype.element_ty), mask=iok)
        # a row that sees nothing: 0. Not `m == _NEG`: triton 3.6 types the constant float32, and
        # float32(-1e30) differs from a float64 m's -1e30 (float64 calls stored -1e30 there)
        tl.store(m_ptr + bh * Lq + i, tl.where(m > 0.5 * _NEG, m, 0.0), mask=iok)

    @triton.jit(do_not_specialize=["LB"])
    def _tiled_bwd_dq_kernel(k_ptr, v_ptr, lc_ptr, ks_ptr, et_ptr, top_ptr, fast_ptr, do_ptr, inv_ptr, dd_ptr, m_ptr,
                             dq_ptr, H, Lq, Lk, F, Dv, R, q_offset, span, LB,
                             BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                             CAUSAL: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                             SCALED: tl.constexpr, KEY_SCALE: tl.constexpr = False, ETAB: tl.constexpr = False):
        """Grid (cdiv(Lq, BM), B·H): dφq of one query tile. SCALED: do is the quotient's
        gradient, its rows scaled by inv (`_row_inv`). ETAB: as the forward's, the weights of a
        `fast` head from the table, times each row's factor (`_row_factor`)."""
        im = _query_tile(Lq, BM, CAUSAL)
        bh = tl.program_id(1).to(tl.int64)
        hh = bh % H
        i = im * BM + tl.arange(0, BM)
        iok = i < Lq
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        do = _load_rows(do_ptr + bh * Lq * Dv, i, iok, c, Dv, Dv)
        inv = _row_inv(inv_ptr + bh * Lq, i, iok, ACC, SCALED)
        dd = tl.load(dd_ptr + bh * Lq + i, mask=iok, other=0.0).to(ACC)
        m = tl.load(m_ptr + bh * Lq + i, mask=iok, other=0.0)
        tab, fill, fast, top = _head_weights(lc_ptr, et_ptr, top_ptr, fast_ptr, hh, ACC, ETAB)
        s = _row_factor(m, top, span)
        dq = tl.zeros([BM, BF], dtype=ACC)
        hi, a, b = _key_walk(im * BM, Lq, Lk, q_offset, BM, BN, CAUSAL)
        for j0 in range(0, hi, BN):
            if (j0 >= a) & (j0 < b):
                dq += _dq_step(k_ptr, v_ptr, tab, ks_ptr, hh, bh, i, iok, j0, f, c, do, inv, dd, m, Lq, Lk, F, Dv, R,
                               q_offset, BN, CAUSAL, DT, ACC, MODE, KEY_SCALE, False, fast, fill, s)
            else:
                dq += _dq_step(k_ptr, v_ptr, tab, ks_ptr, hh, bh, i, iok, j0, f, c, do, inv, dd, m, Lq, Lk, F, Dv, R,
                               q_offset, BN, CAUSAL, DT, ACC, MODE, KEY_SCALE, True, fast, fill, s)
        tl.store(dq_ptr + bh * Lq * F + i[:, None] * F + f[None, :], dq, mask=iok[:, None] & (f[None, :] < F))

    @triton.jit(do_not_specialize=["LB"])
    def _tiled_bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, lc_ptr, ks_ptr, et_ptr, top_ptr, fast_ptr, do_ptr, inv_ptr, dd_ptr,
                              m_ptr, dk_ptr, dv_ptr, db_ptr, H, Lq, Lk, F, Dv, R, q_offset, span, LB,
                              BM: tl.constexpr, BN: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                              CAUSAL: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                              SCALED: tl.constexpr, DV_BF16: tl.constexpr = False, DB: tl.constexpr = False,
                              KEY_SCALE: tl.constexpr = False, ETAB: tl.constexpr = False):
        """Grid (cdiv(Lk, BN), B·H): dφk and dv of one key tile (DV_BF16: dv_ptr is the int16
        view of a bf16 dv); DB: the table's gradient added to db_ptr `[H, R]` (atomics in ACC).
        ETAB: as the forward's (`_row_factor` per query tile)."""
        jn = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        hh = bh % H
        j = jn * BN + tl.arange(0, BN)
        jok = j < Lk
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        fm, cm = f[None, :] < F, c[None, :] < Dv
        k = _load_rows(k_ptr + bh * Lk * F, j, jok, f, F, F).to(ACC)
        v = _load_rows(v_ptr + bh * Lk * Dv, j, jok, c, Dv, Dv)
        dk = tl.zeros([BN, BF], dtype=ACC)
        dv = tl.zeros([BN, BDV], dtype=ACC)
        lo = 0
        first = 0
        if CAUSAL:  # the first query tile with a query at or after the tile's first key; the
            lo = tl.maximum(jn * BN - q_offset, 0) // BM * BM  # first whose queries see all its keys
            first = jn * BN + BN - 1 - q_offset
        a, b = _interior(lo, Lq, first, Lq, BM, jn * BN + BN <= Lk)
        tab, fill, fast, top = _head_weights(lc_ptr, et_ptr, top_ptr, fast_ptr, hh, ACC, ETAB)
        for i0 in range(lo, Lq, BM):
            if (i0 >= a) & (i0 < b):
                dk, dv = _dkv_step(q_ptr, tab, ks_ptr, do_ptr, inv_ptr, dd_ptr, m_ptr, db_ptr, hh, bh, j, jok, i0, f,
                                   c, k, v, dk, dv, Lq, Lk, F, Dv, R, q_offset, BM, CAUSAL, DT, ACC, MODE, SCALED, DB,
                                   KEY_SCALE, False, fast, fill, top, span)
            else:
                dk, dv = _dkv_step(q_ptr, tab, ks_ptr, do_ptr, inv_ptr, dd_ptr, m_ptr, db_ptr, hh, bh, j, jok, i0, f,
                                   c, k, v, dk, dv, Lq, Lk, F, Dv, R, q_offset, BM, CAUSAL, DT, ACC, MODE, SCALED, DB,
                                   KEY_SCALE, True, fast, fill, top, span)
        tl.store(dk_ptr + bh * Lk * F + j[:, None] * F + f[None, :], dk, mask=jok[:, None] & fm)
        _store_tile(dv_ptr + bh * Lk * Dv + j[:, None] * Dv + c[None, :], dv, jok[:, None] & cm, DV_BF16)

    # LB: the length's bucket (`triton_chunked.length_bucket` of the tiles)
    # (MODE in every key: as triton_chunked's)
    _tiled_fwd_kernel = _tuned(_tiled_fwd_kernel, ["F", "Dv", "LB", "CAUSAL", "DIVIDE", "OUT_BF16", "KEY_SCALE",
                                                   "MODE"])
    _tiled_bwd_dq_kernel = _tuned(_tiled_bwd_dq_kernel, ["F", "Dv", "LB", "CAUSAL", "SCALED", "KEY_SCALE", "MODE"])
    _tiled_bwd_dkv_kernel = _tuned(_tiled_bwd_dkv_kernel, ["F", "Dv", "LB", "CAUSAL", "SCALED", "DV_BF16", "DB", "MODE",
                                                           "KEY_SCALE"],
                                   reset=["db_ptr"])

#: query and key tile rows
TILE = 64


def _tiles_bucket(Lq: int, Lk: int) -> int:
    """The autotuners' length key: `length_bucket` of the longer side's tiles."""
    return length_bucket(triton.cdiv(max(Lq, Lk), TILE))


#: Whether the kernels may read a call's weights from a table `exp(b - top)` made once per head
#: and call (`exp_table`), in place of an exponential per tile pair: at 64x64 pairs, each thread's
#: exponentials and running maximum were about a quarter to a third of an interior iteration's
#: SASS (bf16 features, sm_90; benchmarks/tile_bodies.py). Each row's factor `exp(top - m)` is
#: one exponential per row (`_row_factor`), and the forward keeps the running maximum of the
#: weights instead of their logarithms. Never with keys' own log-scales (causal SIKF).
EXP_TABLE = True
#: A head takes the table only if its finite log-coefficients (over the offsets the call reads)
#: span at most this many nats in the accumulation dtype: every weight `exp(b - top)` and every
#: row's factor `exp(top - m)` is then a normal float. The dk/dv kernel folds the factor into the
#: query rows' `inv = 1/den` (`_row_factor`), which overflows float32 where den is under
#: `exp(span)/3.4e38`: at 77 nats and features of 1e-3 its gradients came out NaN. At 20 that
#: takes a den under 1.4e-30. Each weight is also the exponential of a rounded number as large
#: as the span (`exp(b - m)`'s is as large as the row's own spread): up to 60 nats the float32
#: errors stayed within 2x the dense float32 path's (benchmarks/table_span.py). 700 in float64.
#: The bench's N(0, 1) tables span about 9. A head that spans more (steep tables: ALiBi-like
#: slopes over long ranges) takes the exponentials, in the same launch (the kernels read each
#: head's `fast` flag: no host synchronization). Read once per call (`table_span`).
EXP_TABLE_SPAN = {torch.float32: 20.0, torch.float64: 700.0}


def table_span(dtype: torch.dtype, ks: Tensor | None) -> float:
    """A call's span for the weight table (`EXP_TABLE_SPAN` of its accumulation dtype), or -1
    for none (`EXP_TABLE` off, or keys with their own log-scales). Read once per call, in the
    forward: its backward caps the row factors with the same number whatever the module
    constants say by then."""
    return EXP_TABLE_SPAN[acc_dtype(dtype)] if EXP_TABLE and ks is None else -1.0


def exp_table(lc: Tensor, causal: bool, Lq: int, q_offset: int, span: float | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """`(e [H, R], top [H], fast [H] int32)` of the log-coefficients `lc [H, R]` (in the
    accumulation dtype) by one launch of `_exp_table_kernel`, over the offsets the call reads
    (causal: `r <= 0`, the first `Lq + q_offset` entries): each head's largest finite `b` (0 if
    none), `exp(b - top)`, and whether its finite entries span at most `span` (default
    `EXP_TABLE_SPAN`)."""
    span = EXP_TABLE_SPAN[lc.dtype] if span is None else span
    H, R = lc.shape
    e = torch.empty_like(lc)
    top = torch.empty(H, dtype=lc.dtype, device=lc.device)
    fast = torch.empty(H, dtype=torch.int32, device=lc.device)
    _exp_table_kernel[(H,)](lc, e, top, fast, R, min(R, Lq + q_offset) if causal else R, span,
                            BR=min(1024, _pow2(R)), ACC=_TL_DTYPE[lc.dtype])
    return e, top, fast


def _tiled_meta(phi_q: Tensor, v: Tensor, causal: bool, mode: int, key_scale: bool, etab: bool = False) -> dict:
    """The tiles and flags every tiled kernel takes."""
    dt = phi_q.dtype
    return dict(BM=TILE, BN=TILE, BF=_pow2(phi_q.shape[3]), BDV=_pow2(v.shape[3]), CAUSAL=causal, DT=_TL_DTYPE[dt],
                ACC=_TL_DTYPE[acc_dtype(dt)], MODE=mode, KEY_SCALE=key_scale, ETAB=etab)


def _tiled_forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, lc: Tensor, ks: Tensor | None, q_offset: int,
                   causal: bool, out_dtype: torch.dtype, mode: int, divide: torch.dtype | None, span: float
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`(num or the quotient, den, m, e, top, fast)` of `_Tiled` (the last three `exp_table`'s
    at `span`, which the backward reads again; None for a span below 0 (`table_span`), an empty
    tensor from the custom op: `compile_opaque`)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, acc = phi_q.device, acc_dtype(phi_q.dtype)
    num = torch.empty(B, H, Lq, Dv, dtype=out_dtype if divide is None else divide, device=dev)
    den = torch.empty(B, H, Lq, dtype=out_dtype if divide is None else acc, device=dev)
    m = torch.empty(B, H, Lq, dtype=acc, device=dev)
    out_bf16, quot = quotient_flags(divide, acc)
    e, top, fast = exp_table(lc, causal, Lq, q_offset, span) if span >= 0 else (None, None, None)
    _tiled_fwd_kernel[(triton.cdiv(Lq, TILE), B * H)](phi_q, phi_k, v, lc, lc if ks is None else ks,
                                                      *_table_args(lc, e, top, fast),
                                                      num.view(torch.int16) if out_bf16 else num, den, m,
                                                      H, Lq, Lk, F, Dv, Lq + Lk - 1, q_offset,
                                                      _tiles_bucket(Lq, Lk), **quot,
                                                      **_tiled_meta(phi_q, v, causal, mode, ks is not None,
                                                                    e is not None))
    return num, den, m, e, top, fast


def _table_args(lc: Tensor, e: Tensor | None, top: Tensor | None, fast: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' `(et_ptr, top_ptr, fast_ptr)`: `exp_table`'s, or lc three times (never read
    without ETAB)."""
    return (lc, lc, lc) if e is None or e.numel() == 0 else (e, top, fast)


def _tiled_forward_fake(phi_q, phi_k, v, lc, ks, q_offset, causal, out_dtype, mode, divide, span):
    B, H, Lq, _ = phi_q.shape
    acc = acc_dtype(phi_q.dtype)
    table = ((lc.new_empty(lc.shape), lc.new_empty(H), lc.new_empty(H, dtype=torch.int32)) if span >= 0
             else (phi_q.new_empty(0),) * 3)
    return (phi_q.new_empty(B, H, Lq, v.shape[3], dtype=out_dtype if divide is None else divide),
            phi_q.new_empty(B, H, Lq, dtype=out_dtype if divide is None else acc),
            phi_q.new_empty(B, H, Lq, dtype=acc), *table)


def _tiled_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, lc: Tensor, ks: Tensor | None, m: Tensor,
                    den: Tensor | None, e: Tensor, top: Tensor, fast: Tensor, dnum: Tensor | None,
                    dden: Tensor | None, q_offset: int, causal: bool, mode: int, want_db: bool, span: float
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(dφq, dφk, dv, db)` of `_Tiled` (db, the table's gradient, None unless `want_db`; e, top,
    fast: the forward's `exp_table`, or empty; span: the forward's, the row factors' cap)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt, R = phi_q.device, phi_q.dtype, lc.shape[1]
    acc = acc_dtype(dt)
    meta = dict(_tiled_meta(phi_q, v, causal, mode, ks is not None, e.numel() > 0), SCALED=den is not None)
    table = _table_args(lc, e, top, fast)
    span = max(span, 0.0)
    ks = lc if ks is None else ks
    dnum, inv, dd = _numerator_grads(dnum, dden, den, (B, H, Lq, Dv), dt, dev)
    dq = torch.empty(B, H, Lq, F, dtype=acc, device=dev)
    _tiled_bwd_dq_kernel[(triton.cdiv(Lq, TILE), B * H)](phi_k, v, lc, ks, *table, dnum, inv, dd, m, dq,
                                                         H, Lq, Lk, F, Dv, R, q_offset, span, _tiles_bucket(Lq, Lk),
                                                         **meta)
    dk = torch.empty(B, H, Lk, F, dtype=acc, device=dev)
    dv_bf16 = dv_in_bf16(v, dt)
    dv = torch.empty(B, H, Lk, Dv, dtype=torch.bfloat16 if dv_bf16 else acc, device=dev)
    # (without it, a placeholder that is never touched: the autotuner zeroes db_ptr's tensor)
    db = torch.zeros(H, R, dtype=acc, device=dev) if want_db else torch.zeros(1, dtype=acc, device=dev)
    _tiled_bwd_dkv_kernel[(triton.cdiv(Lk, TILE), B * H)](phi_q, phi_k, v, lc, ks, *table, dnum, inv, dd, m, dk,
                                                          dv.view(torch.int16) if dv_bf16 else dv, db,
                                                          H, Lq, Lk, F, Dv, R, q_offset, span, _tiles_bucket(Lq, Lk),
                                                          DV_BF16=dv_bf16,
                                                          DB=want_db, **meta)
    return dq.to(dt), dk.to(dt), dv.to(v.dtype), db.to(lc.dtype) if want_db else None


def _tiled_backward_fake(phi_q, phi_k, v, lc, ks, m, den, e, top, fast, dnum, dden, q_offset, causal, mode, want_db,
                         span):
    return (torch.empty_like(phi_q), phi_k.new_empty(phi_k.shape, dtype=phi_q.dtype), torch.empty_like(v),
            lc.new_empty(lc.shape) if want_db else phi_q.new_empty(0))


_tiled_forward_op = compile_opaque("triton_tiled_forward", _tiled_forward, _tiled_forward_fake)
_tiled_backward_op = compile_opaque("triton_tiled_backward", _tiled_backward, _tiled_backward_fake)


class _Tiled(torch.autograd.Function):
    """`(num or the quotient, den, m)` of `kernelized_num_den_triton_tiled`; custom ops under
    `torch.compile` (`compile_opaque`)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, lc, ks, q_offset: int, causal: bool, out_dtype, mode: int, divide=None):
        span = table_span(phi_q.dtype, ks)
        num, den, m, e, top, fast = _tiled_forward_op(phi_q, phi_k, v, lc, ks, q_offset, causal, out_dtype, mode,
                                                      divide, span)
        ctx.save_for_backward(phi_q, phi_k, v, lc, ks, m, den if divide is not None else None, e, top, fast)
        ctx.cfg = (q_offset, causal, mode, span)
        ctx.mark_non_differentiable(m)
        return num, den, m

    @staticmethod
    def backward(ctx, dnum, dden, dm):
        phi_q, phi_k, v, lc, ks, m, den, e, top, fast = ctx.saved_tensors
        q_offset, causal, mode, span = ctx.cfg
        want_db = ctx.needs_input_grad[3]
        if e is None:  # eagerly the forward's None (no table); under compile an empty tensor
            e = top = fast = phi_q.new_empty(0)
        dq, dk, dv, db = _tiled_backward_op(phi_q, phi_k, v, lc, ks, m, den, e, top, fast, dnum, dden, q_offset,
                                            causal, mode, want_db, span)
        return dq, dk, dv, db if want_db else None, None, None, None, None, None, None


def kernelized_num_den_triton_tiled(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    log_coeff: Tensor | None = None,
    *,
    causal: bool = False,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    key_log_scale: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    precision: str = "ieee",
    divide: torch.dtype | None = None,
):
    """`kernelized_num_den_naive`'s results by the tiled Triton kernels, forward and backward,
    without materializing any `[Lq, Lk]` tensor.

    Args:
        phi_q: `[B, H, Lq, F]`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]` (read as it
            comes if bf16/fp16, else in phi_q's dtype).
        log_coeff: `[H, Lq+Lk-1]` `b(r)` for `r = -(Lq-1+q_offset) .. Lk-1-q_offset` (`-inf`
            allowed; differentiable), or None for no term.
        causal, q_offset, key_padding_mask: as the naive op's.
        key_log_scale: `[B, H, Lk]` or None: the true key features are `phi_k·exp(key_log_scale)`
            (causal SIKF's running maximum, `kernels.SIKF.key_features`); a row's log-scale then
            includes them, as the naive op's does (not differentiated: the caller detaches it).
        out_dtype: dtype of num and den (default phi_q's).
        precision: how float32 features are multiplied on the GPU (`triton_chunked.PRECISIONS`).
        divide: a dtype: the quotient `num/den` in it in place of num (rows without weight 0, as
            `safe_divide`), den in the accumulation dtype; backward reads the quotient's
            gradient as it comes (`_QuotientGrad`).

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])` (`[B, H, Lq]` with
        `key_log_scale`): the true sums are `num·exp(log_scale)`, log_scale each row's largest
        `b` (plus the key's log-scale) over the keys it sees.
    """
    if not HAS_TRITON:
        raise FastRPEError("the triton kernels need triton: pip install 'fastrpe[triton]'")
    why = triton_unavailable_reason(phi_q.device)
    if why is not None:
        raise FastRPEError(f"phi_q: the triton kernels cannot run on {phi_q.device}: {why}")
    B, H, Lq, F = phi_q.shape
    Lk = phi_k.shape[2]
    dt = phi_q.dtype
    if dt not in _TL_DTYPE:
        raise FastRPEError(f"phi_q: dtype {dt} is not supported (float16, bfloat16, float32, float64)")
    if Lk < 1:
        raise FastRPEError("phi_k: needs at least one key")
    acc = acc_dtype(dt)
    if log_coeff is None:
        lc = torch.zeros(H, Lq + Lk - 1, dtype=acc, device=phi_q.device)
    else:
        if log_coeff.shape != (H, Lq + Lk - 1):
            raise FastRPEError(f"log_coeff: expected shape {(H, Lq + Lk - 1)}, got {tuple(log_coeff.shape)}")
        lc = log_coeff.to(acc).contiguous()
    ks = None
    if key_log_scale is not None:
        if key_log_scale.shape != (B, H, Lk):
            raise FastRPEError(f"key_log_scale: expected shape {(B, H, Lk)}, got {tuple(key_log_scale.shape)}")
        ks = key_log_scale.detach().to(acc)
        if key_padding_mask is not None:  # a padding key's scale does not enter a row's maximum
            ks = ks.masked_fill(key_padding_mask[:, None, :], float("-inf"))
        ks = ks.contiguous()
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    q, k = phi_q.contiguous(), phi_k.to(dt).contiguous()
    vv = v.to(value_dtype(v, dt)).contiguous()
    num, den, m = _Tiled.apply(q, k, vv, lc, ks, int(q_offset), bool(causal), out_dtype or dt, dot_mode(precision),
                               divide)
    if divide is not None:
        num = with_quotient_grad(num, den)
    return num, den, (m if ks is not None else m[0]).detach()
