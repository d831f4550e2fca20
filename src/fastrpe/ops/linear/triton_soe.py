"""Triton kernels for causal kernelized attention with any decaying term in one fused pass,
from a sum-of-exponentials fit (`soe.SoEPlan`): the fast sibling of `soe.py` (the dense
reference is `naive.py` with the plan's coefficients). `triton_band.py` runs finite-support
terms (T5) exactly through the same kernels.

The plan gives `c(d) = Σ_k a_k γ_k^d` beyond the band and `c(d) = Σ_k a_k γ_k^d + corr(d)`
exactly for `d < W`. With chunks of T positions and NB near chunks, `W <= (NB-1)·T + 1`
(`near_chunks`: NB = 2 for the SoE band of 64 at T = 64, 3 for T5's 113 distances), a query
in chunk n sees

  * near field, key chunks n-NB+1 .. n (`d < NB·T`): each chunk pair's `φ(q)·φ(k)` formed
    once and weighted by the coefficient table `cn[h, d]`, `d = 0..NB·T-1` (exact below W);
  * far field, key chunks <= n-NB (`d > (NB-1)·T`, beyond the band): K decayed states
    `S_k(m) = Σ_{j < mT} γ_k^(mT-1-j) φk_j ⊗ [v_j, 1]`, `m = n-NB+1`, read with the weights
    `wq[h, k, s] = a_hk γ_k^((NB-1)T+s+1)` (query s of the chunk is that far past their
    reference).

Chunks stay small (T = 64) whatever the band: a T = 128 chunk (what T5's band needed when
the near field was two chunks) needed 295 KB of shared memory in `_soe_bwd_dkv` with float32
features on sm_90 (ptxas; the H100 has 227 KiB) and spilled kilobytes of registers.

Kernels: `_soe_state` (K states, sequential over chunks, parallel over terms),
`_soe_out` (parallel over chunks: NB `[T, T]` products, then K `[T, F]x[F, Dv]` reads),
`_soe_bwd_state` (the states' gradients, reverse), `_soe_bwd_dq` (dφq and the gradient of
the far weights `wq`), `_soe_bwd_dkv` (dφk, dv) and `_soe_bwd_dcn` (the gradient of the
near table `cn`, only when it needs one). The tables carry autograd back to the plan's `a`
and `corr`, so a learnable positional term trains through this path. The gradient kernels
are apart because together they spilled registers (sm_90, ptxas). The bodies of the dq and
dk/dv kernels are tile helpers (`_soe_dq_tile`, `_soe_dkv_tiles`), which `triton_soe_prf`'s
kernels run too, with the PRF maps' backward after them (`backends_triton.FUSED_MAPS`).

Memory: the K·N chunk states are the largest buffer (K times the geometric path's), so the
terms run in groups sized to `STATE_BUDGET` (`terms_per_group`): each group builds its
states, reads them and frees them; the first launch of each kernel also does the near field,
the later ones add their far field to its sums (the flags NEAR and ACCUM). Backward
recomputes the states the same way instead of keeping them.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, K terms, W band,
T (BT) chunk, NB near chunks, N chunks, NS chunk groups of the gradient kernels.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..._memo import ByIdentity, kept
from ..._validate import FastRPEError
from .soe import MAX_NEAR, STATE_BUDGET, SoEPlan, near_chunks, terms_per_group  # noqa: F401  (re-exported)
from ..common import quotient
from . import triton_chunked as _tc, triton_soe_stacked as _stacked, triton_soe_walk as _walk
from .triton_chunked import (_TL_DTYPE, DEFAULT_CHUNK, HAS_TRITON, _numerator_grads, _pow2, _state_pass, _tuned,
                             acc_dtype, compile_opaque, dot_mode, dv_in_bf16, length_bucket, quotient_flags,
                             triton_unavailable_reason, value_dtype, with_quotient_grad)

#: Why bf16x3's dq kernel tunes over pipelined configs only (`_soe_bwd_dq_kernel_bf16x3`): on
#: the H100 (2026-11-27, Triton 3.6.0, tests/test_gpu.py::test_sixteen_bit_products_match_
#: float64_at_4096, each config pinned by FASTRPE_TRITON_CONFIG with CUDA_LAUNCH_BLOCKING=1) the
#: soe and band backwards in bf16x3 failed in `_soe_bwd_dq_kernel` with num_stages=1 alone: an
#: illegal memory access at 8 warps, dq off by 4e4 (KERPLE-log; 1.9e6 with T5's band) at 4
#: warps, while its 2- and 3-stage configs at 4 and 8 warps passed, as did the default tf32x3 at
#: 4 warps and 1 stage and bf16 features at 4 and 8 warps and 1 stage. Its sm_90 TTGIR has none
#: of `HOPPER_TRANS_NOTE`'s pattern; the cause in Triton is not known.
SOE_DQ_BF16X3_NOTE = "num_stages=1 wrong on the H100 in bf16x3 (2026-11-27, Triton 3.6.0)"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_chunked import (_bf16_bits, _bf16_value, _block_total, _divide_rows, _dot, _load_rows, _row_inv,
                                 _store_tile)

    @triton.jit
    def _soe_state_kernel(k_ptr, v_ptr, lgk_ptr, h_ptr, z_ptr, c_ptr, cz_ptr, Lk, F, Dv, N, K, GB, NBK,
                          BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                          DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, K·NBK): h[bh, k, n] = S_k(n), the keys of chunks < n decayed to
        nT - 1, for the chunks blk·GB .. blk·GB+GB-1 of program blk (PHASE 0: NBK = 1, GB = N,
        from zero). PHASE 1 (from zero) writes only the block's final state, into c_ptr/cz_ptr
        `[B·H, K, NBK, ...]`; PHASE 2 starts from them (`triton_chunked.STATE_SCAN`)."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1)
        kk = tl.program_id(2) // NBK
        blk = tl.program_id(2) % NBK
        lg = tl.load(lgk_ptr + kk).to(ACC)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        kdec = tl.exp(lg * (BT - 1 - t).to(ACC))  # (BT,)
        g = tl.exp(lg * BT)
        cb = (bh * K + kk) * NBK + blk
        S, z = _block_start(c_ptr, cz_ptr, cb, f, c, BF, BV, BDV, ACC, PHASE)
        h_base = h_ptr + (bh * K + kk) * N * BF * BDV
        z_base = z_ptr + (bh * K + kk) * N * BF
        for n in range(blk * GB, tl.minimum(blk * GB + GB, N)):
            if PHASE != 1:
                tl.store(h_base + n * BF * BDV + f[:, None] * BDV + c[None, :], S.to(h_ptr.dtype.element_ty))
                tl.store(z_base + n * BF + f, z, mask=(f + iv * BF) < BF)  # only the first value block
            pos = n * BT + t
            km = pos < Lk
            k = tl.load(k_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], mask=km[:, None] & (f[None, :] < F),
                        other=0.0).to(ACC)
            v = tl.load(v_ptr + bh * Lk * Dv + pos[:, None] * Dv + c[None, :], mask=km[:, None] & (c[None, :] < Dv),
                        other=0.0)
            kt = k * kdec[:, None]
            S = S * g + _dot(tl.trans(kt), v, DT, ACC, MODE)
            z = z * g + tl.sum(kt, 0)
        if PHASE == 1:
            _block_total(c_ptr, cz_ptr, cb, S, z, f, c, iv, BF, BDV)

    @triton.jit
    def _block_start(c_ptr, cz_ptr, cb, f, c, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                     ACC: tl.constexpr, PHASE: tl.constexpr):
        """A state pass's start: block cb's carry (PHASE 2), else zero."""
        if PHASE == 2:
            S = tl.load(c_ptr + cb * BF * BDV + f[:, None] * BDV + c[None, :]).to(ACC)
            z = tl.load(cz_ptr + cb * BF + f).to(ACC)
        else:
            S = tl.zeros([BF, BV], dtype=ACC)
            z = tl.zeros([BF], dtype=ACC)
        return S, z

    @triton.jit
    def _near_table(cn_ptr, hh, d0, j: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr):
        """`[BT, BT]` coefficients of the pair (query chunk n, key chunk n - j): distance
        `s - u + j·T` (`d0 = s - u`); the future (j = 0, s < u) is 0."""
        if j == 0:
            return tl.load(cn_ptr + hh * NB * BT + tl.maximum(d0, 0), mask=d0 >= 0, other=0.0)
        else:
            return tl.load(cn_ptr + hh * NB * BT + d0 + j * BT)

    @triton.jit(do_not_specialize=["LB"])
    def _soe_out_kernel(q_ptr, k_ptr, v_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, num_ptr, den_ptr,
                        H, Lq, Lk, F, Dv, N, K, q_offset, LB,
                        BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                        NB: tl.constexpr, NEAR: tl.constexpr, ACCUM: tl.constexpr,
                        DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                        DIVIDE: tl.constexpr = False, THR: tl.constexpr = 0.0, OUT_BF16: tl.constexpr = False):
        """Grid (N, B·H, BDV/BV): outputs of query chunk n. K: the terms of this launch (a group,
        `terms_per_group`); NEAR: also the near field (the first group); ACCUM: add to num/den.
        DIVIDE, THR, OUT_BF16 (one launch for every term, never with ACCUM): the quotient in
        place of num, as `triton_chunked._fwd_out_kernel`'s."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2)
        hh = bh % H
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        q = _load_rows(q_ptr + bh * Lq * F, qi, qm, f, F, F).to(ACC)
        o = tl.zeros([BT, BV], dtype=ACC)
        den = tl.zeros([BT], dtype=ACC)
        if NEAR:
            d0 = t[:, None] - t[None, :]
            for j in tl.static_range(NB):  # key chunk n - j
                kp = pos - j * BT
                km = (kp >= 0) & (kp < Lk)
                kj = _load_rows(k_ptr + bh * Lk * F, kp, km, f, F, F).to(ACC)
                vj = _load_rows(v_ptr + bh * Lk * Dv, kp, km, c, Dv, Dv)
                A = _dot(q, tl.trans(kj), DT, ACC, MODE) * _near_table(cn_ptr, hh, d0, j, BT, NB).to(ACC)
                o += _dot(A, vj, DT, ACC, MODE)
                den += tl.sum(A, 1)
        if n >= NB - 1:  # far field: S_k(n - NB + 1)
            for kk in range(K):
                w = tl.load(wq_ptr + (hh * K + kk) * BT + t).to(ACC)
                off = ((bh * K + kk) * N + n - NB + 1) * BF
                S = tl.load(h_ptr + off * BDV + f[:, None] * BDV + c[None, :])
                zs = tl.load(z_ptr + off + f)
                qw = q * w[:, None]
                o += _dot(qw, S, DT, ACC, MODE)
                den += tl.sum(qw * zs[None, :], 1)
        om = qm[:, None] & (c[None, :] < Dv)
        dm = qm & ((t + iv * BT) < BT)  # the first value block writes den
        if ACCUM:  # a later group of terms: this program owns its tile, no race
            o += tl.load(num_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], mask=om, other=0.0).to(ACC)
            den += tl.load(den_ptr + bh * Lq + qi, mask=dm, other=0.0).to(ACC)
        if DIVIDE:  # every value block has the whole den (one launch)
            o = _divide_rows(o, den, THR)
        _store_tile(num_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], o, om, OUT_BF16)
        tl.store(den_ptr + bh * Lq + qi, den.to(den_ptr.dtype.element_ty), mask=dm)

    @triton.jit
    def _soe_bwd_state_kernel(q_ptr, do_ptr, inv_ptr, dd_ptr, wq_ptr, lgk_ptr, dh_ptr, dz_ptr, c_ptr, cz_ptr,
                              H, Lq, F, Dv, N, K, GB, NBK,
                              q_offset, BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                              NB: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                              SCALED: tl.constexpr, PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, K·NBK): dh[bh, k, n] = gradient of S_k(n) (read by query chunk
        n + NB - 1, and through S_k(n+1) = γ^T S_k(n) + ... by every later one), for the
        chunks blk·GB+GB-1 down to blk·GB of program blk (PHASE 0: NBK = 1, GB = N, from
        zero); dh[bh, k, N] stays 0. PHASE 1 and 2 as `_soe_state_kernel`'s."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1)
        kk = tl.program_id(2) // NBK
        blk = tl.program_id(2) % NBK
        hh = bh % H
        lg = tl.load(lgk_ptr + kk).to(ACC)
        g = tl.exp(lg * BT)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        w = tl.load(wq_ptr + (hh * K + kk) * BT + t).to(ACC)
        cb = (bh * K + kk) * NBK + blk
        D, dz = _block_start(c_ptr, cz_ptr, cb, f, c, BF, BV, BDV, ACC, PHASE)
        dh_base = dh_ptr + (bh * K + kk) * (N + 1) * BF * BDV
        dz_base = dz_ptr + (bh * K + kk) * (N + 1) * BF
        n_hi = tl.minimum(blk * GB + GB, N)
        for i in range(n_hi - blk * GB):
            n = n_hi - 1 - i
            pos = (n + NB - 1) * BT + t  # the query chunk that reads S_k(n)
            qi = pos - q_offset
            qm = (qi >= 0) & (qi < Lq)
            qw = _load_rows(q_ptr + bh * Lq * F, qi, qm, f, F, F).to(ACC) * w[:, None]
            do = _load_rows(do_ptr + bh * Lq * Dv, qi, qm, c, Dv, Dv)
            dd = tl.load(dd_ptr + bh * Lq + qi, mask=qm, other=0.0).to(ACC)
            qs = qw * _row_inv(inv_ptr + bh * Lq, qi, qm, ACC, SCALED)[:, None]
            D = D * g + _dot(tl.trans(qs), do, DT, ACC, MODE)
            dz = dz * g + tl.sum(qw * dd[:, None], 0)
            if PHASE != 1:
                tl.store(dh_base + n * BF * BDV + f[:, None] * BDV + c[None, :], D.to(dh_ptr.dtype.element_ty))
                tl.store(dz_base + n * BF + f, dz, mask=(f + iv * BF) < BF)
        if PHASE == 1:
            _block_total(c_ptr, cz_ptr, cb, D, dz, f, c, iv, BF, BDV)

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, dq_ptr, dwq_ptr,
                           H, Lq, Lk, F, Dv, N, K, NS, q_offset, LB,
                           BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                           NB: tl.constexpr, NEAR: tl.constexpr, ACCUM: tl.constexpr,
                           DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                           DWQ: tl.constexpr = True):
        """Grid (NS, B·H), query chunks n = g, g + NS, ...: dφq, and (DWQ) this program's sums
        for the far weights' gradient dwq `[K, BT]`. K, NEAR, ACCUM as `_soe_out_kernel`'s.
        Without DWQ (the weights take no gradient: a frozen term) none of it is formed."""
        gi = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        f = tl.arange(0, BF)
        for n in range(gi, N, NS):
            dq, qi, qm = _soe_dq_tile(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, dwq_ptr,
                                      bh, gi, n, H, Lq, Lk, F, Dv, N, K, NS, q_offset, BT, BF, BDV, NB, NEAR, DT, ACC,
                                      MODE, SCALED, DWQ)
            dqm = qm[:, None] & (f[None, :] < F)
            if ACCUM:
                dq += tl.load(dq_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], mask=dqm, other=0.0)
            tl.store(dq_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], dq, mask=dqm)

    @triton.jit
    def _soe_dq_tile(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, wq_ptr, h_ptr, z_ptr, dwq_ptr, bh, gi, n,
                     H, Lq, Lk, F, Dv, N, K, NS, q_offset,
                     BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr, NEAR: tl.constexpr,
                     DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                     DWQ: tl.constexpr):
        """`_soe_bwd_dq_kernel`'s query chunk n of head bh (program gi): adds its far weights'
        gradient to the program's dwq sums (DWQ), returns `(dφq [BT, BF] in ACC of this launch's
        terms, query rows [BT], their mask)` for the caller to store (or to take through the
        query map's backward, `triton_soe_prf`)."""
        hh = bh % H
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        qb, kb, vb = q_ptr + bh * Lq * F, k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        dob, ivb, ddb = do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        dwq_base = dwq_ptr + (bh * NS + gi) * K * BT
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        qn = _load_rows(qb, qi, qm, f, F, F).to(ACC)
        don = _load_rows(dob, qi, qm, c, Dv, Dv)
        ddn = tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)
        inv = _row_inv(ivb, qi, qm, ACC, SCALED)
        dq = tl.zeros([BT, BF], dtype=ACC)
        if NEAR:
            d0 = t[:, None] - t[None, :]
            for j in tl.static_range(NB):  # key chunk n - j
                kp = pos - j * BT
                km = (kp >= 0) & (kp < Lk)
                kj = _load_rows(kb, kp, km, f, F, F).to(ACC)
                vj = _load_rows(vb, kp, km, c, Dv, Dv)
                G = inv[:, None] * _dot(don, tl.trans(vj), DT, ACC, MODE) + ddn[:, None]
                dq += _dot(G * _near_table(cn_ptr, hh, d0, j, BT, NB).to(ACC), kj, DT, ACC, MODE)
        if n >= NB - 1:  # far field: chunk n reads S_k(n - NB + 1)
            for kk in range(K):
                w = tl.load(wq_ptr + (hh * K + kk) * BT + t).to(ACC)
                off = ((bh * K + kk) * N + n - NB + 1) * BF
                S = tl.load(h_ptr + off * BDV + f[:, None] * BDV + c[None, :])
                zs = tl.load(z_ptr + off + f)
                Y = _dot(don, tl.trans(S), DT, ACC, MODE)  # (BT, BF): do·Sᵀ
                dq += w[:, None] * (inv[:, None] * Y + ddn[:, None] * zs[None, :])
                if DWQ:
                    # the weight's gradient q·S·doᵀ per row is Σ_f q ⊙ (do·Sᵀ): Y again, no [BT, BDV] q·S
                    dw = inv * tl.sum(qn * Y, 1) + tl.sum(qn * zs[None, :], 1) * ddn
                    tl.store(dwq_base + kk * BT + t, tl.load(dwq_base + kk * BT + t) + dw)
        return dq, qi, qm

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dcn_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, p_ptr, Lq, Lk, F, Dv, N, NS, q_offset, LB,
                            BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr,
                            DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr):
        """Grid (NS, B·H, NB), query chunks n = g, g + NS, ...: `P_j = Σ_n (φq_n·φk_(n-j)ᵀ) ⊙
        (do_n·v_(n-j)ᵀ + dd_n)`, `[BT, BT]`, summed diagonal by diagonal on the host into the
        gradient of cn (`_diagonal_sums`)."""
        gi = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        j = tl.program_id(2)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        qb, kb, vb = q_ptr + bh * Lq * F, k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        dob, ivb, ddb = do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        P = tl.zeros([BT, BT], dtype=ACC)
        for n in range(gi, N, NS):
            pos = n * BT + t
            qi = pos - q_offset
            qm = (qi >= 0) & (qi < Lq)
            kp = pos - j * BT
            km = (kp >= 0) & (kp < Lk)
            G = _dot(_load_rows(dob, qi, qm, c, Dv, Dv), tl.trans(_load_rows(vb, kp, km, c, Dv, Dv)), DT, ACC, MODE)
            G = G * _row_inv(ivb, qi, qm, ACC, SCALED)[:, None] + tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)[:, None]
            P += _dot(_load_rows(qb, qi, qm, f, F, F).to(ACC), tl.trans(_load_rows(kb, kp, km, f, F, F).to(ACC)),
                      DT, ACC, MODE) * G
        tl.store(p_ptr + ((bh * NS + gi) * NB + j) * BT * BT + t[:, None] * BT + t[None, :], P)

    @triton.jit(do_not_specialize=["LB"])
    def _soe_bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr, dk_ptr,
                            dv_ptr, dvlo_ptr, H, Lq, Lk, F, Dv, N, K, q_offset, LB,
                            BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                            NB: tl.constexpr, NEAR: tl.constexpr, ACCUM: tl.constexpr,
                            DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                            DV_BF16: tl.constexpr = False, LAST: tl.constexpr = True):
        """Grid (N, B·H): dφk and dv of key chunk n (near: query chunks n .. n+NB-1; far: the
        gradient of S_k(n+1), which chunk n's keys enter). K, NEAR, ACCUM as `_soe_out_kernel`'s.
        DV_BF16: dv_ptr is the int16 view of a bf16 dv. Between the launches of several groups
        (all but the LAST), dvlo_ptr (the same) holds the part of the float32 sum that bf16 dv
        lost, `sum - dv`: the pair carries about 16 bits where float32 carries 24, in 4 bytes
        per value where a float32 sum and its bf16 copy took 6."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        f = tl.arange(0, BF)
        dk, pos, km = _soe_dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr,
                                     dv_ptr, dvlo_ptr, bh, n, H, Lq, Lk, F, Dv, N, K, q_offset, BT, BF, BDV, NB, NEAR,
                                     ACCUM, DT, ACC, MODE, SCALED, DV_BF16, LAST)
        dkm = km[:, None] & (f[None, :] < F)
        if ACCUM:
            dk += tl.load(dk_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], mask=dkm, other=0.0)
        tl.store(dk_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], dk, mask=dkm)

    @triton.jit
    def _soe_dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, cn_ptr, lgk_ptr, dh_ptr, dz_ptr, dv_ptr, dvlo_ptr,
                       bh, n, H, Lq, Lk, F, Dv, N, K, q_offset,
                       BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr, NEAR: tl.constexpr,
                       ACCUM: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                       SCALED: tl.constexpr, DV_BF16: tl.constexpr, LAST: tl.constexpr):
        """`_soe_bwd_dkv_kernel`'s key chunk n of head bh: stores dv (added to the earlier
        launches' where ACCUM), returns `(dφk [BT, BF] in ACC of this launch's terms, key
        positions [BT], their mask)` for the caller to store (or to take through the key map's
        backward, `triton_soe_prf`)."""
        hh = bh % H
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        pos = n * BT + t
        km = pos < Lk
        kn = _load_rows(k_ptr + bh * Lk * F, pos, km, f, F, F).to(ACC)
        vn = _load_rows(v_ptr + bh * Lk * Dv, pos, km, c, Dv, Dv)
        dk = tl.zeros([BT, BF], dtype=ACC)
        dv = tl.zeros([BT, BDV], dtype=ACC)
        if NEAR:
            # 16-bit operands: key-major tiles [key u, query s], each product formed as such,
            # never a `tl.trans` of a product (`HOPPER_TRANS_NOTE`); else transposed products,
            # fewer spills (tf32x3, 4 warps, sm_90 ptxas: 708 B against 1,414 key-major at NB = 2)
            KEY_MAJOR: tl.constexpr = DT == tl.bfloat16 or DT == tl.float16 or MODE >= 3
            d0 = t[:, None] - t[None, :]  # s - u
            if KEY_MAJOR:
                d0 = t[None, :] - t[:, None]
            qb, dob, ivb, ddb = q_ptr + bh * Lq * F, do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
            for j in tl.static_range(NB):  # query chunk n + j
                qi = pos + j * BT - q_offset
                qm = (qi >= 0) & (qi < Lq)
                qj = _load_rows(qb, qi, qm, f, F, F).to(ACC)
                doj = _load_rows(dob, qi, qm, c, Dv, Dv)
                ddj = tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)
                invj = _row_inv(ivb, qi, qm, ACC, SCALED)
                M = _near_table(cn_ptr, hh, d0, j, BT, NB).to(ACC)  # [query s, key u], KEY_MAJOR [u, s]
                if KEY_MAJOR:
                    G = invj[None, :] * _dot(vn, tl.trans(doj), DT, ACC, MODE) + ddj[None, :]
                    dk += _dot(G * M, qj, DT, ACC, MODE)
                    dv += _dot(_dot(kn, tl.trans(qj), DT, ACC, MODE) * (M * invj[None, :]), doj, DT, ACC, MODE)
                else:
                    G = invj[:, None] * _dot(doj, tl.trans(vn), DT, ACC, MODE) + ddj[:, None]
                    dk += _dot(tl.trans(G * M), qj, DT, ACC, MODE)
                    dv += _dot(tl.trans(_dot(qj, tl.trans(kn), DT, ACC, MODE) * (M * invj[:, None])), doj, DT, ACC,
                               MODE)
        # far field
        for kk in range(K):
            lg = tl.load(lgk_ptr + kk).to(ACC)
            kdec = tl.exp(lg * (BT - 1 - t).to(ACC))
            off1 = ((bh * K + kk) * (N + 1) + n + 1) * BF
            dS = tl.load(dh_ptr + off1 * BDV + f[:, None] * BDV + c[None, :])
            dzs = tl.load(dz_ptr + off1 + f)
            dk += kdec[:, None] * (_dot(vn, tl.trans(dS), DT, ACC, MODE) + dzs[None, :])
            dv += _dot(kn * kdec[:, None], dS, DT, ACC, MODE)
        dvm = km[:, None] & (c[None, :] < Dv)
        dvo = bh * Lk * Dv + pos[:, None] * Dv + c[None, :]
        if ACCUM:
            if DV_BF16:
                dv += _bf16_value(tl.load(dv_ptr + dvo, mask=dvm, other=0))
                dv += _bf16_value(tl.load(dvlo_ptr + dvo, mask=dvm, other=0))
            else:
                dv += tl.load(dv_ptr + dvo, mask=dvm, other=0.0)
        if DV_BF16:
            hi = _bf16_bits(dv)
            tl.store(dv_ptr + dvo, hi, mask=dvm)
            if not LAST:
                tl.store(dvlo_ptr + dvo, _bf16_bits(dv - _bf16_value(hi)), mask=dvm)
        else:
            tl.store(dv_ptr + dvo, dv.to(dv_ptr.dtype.element_ty), mask=dvm)
        return dk, pos, km

    # NB and NEAR in the keys: a band call (three near chunks) and the near-field launch tune apart;
    # LB, the length's bucket (`triton_chunked.length_bucket`)
    _KEY = ["F", "Dv", "K", "BT", "NB", "NEAR", "LB", "MODE"]  # (MODE: as triton_chunked's keys)
    _soe_out_kernel = _tuned(_soe_out_kernel, _KEY + ["DIVIDE", "OUT_BF16"], restore=["num_ptr", "den_ptr"])
    # bf16x3 (MODE 3) tunes over pipelined configs only (`SOE_DQ_BF16X3_NOTE`); one JIT function,
    # so the two autotuners share its compiled variants
    _soe_bwd_dq_kernel_bf16x3 = _tuned(_soe_bwd_dq_kernel, _KEY + ["SCALED", "DWQ"], reset=["dwq_ptr"],
                                       restore=["dq_ptr"], min_stages=2)
    _soe_bwd_dq_kernel = _tuned(_soe_bwd_dq_kernel, _KEY + ["SCALED", "DWQ"], reset=["dwq_ptr"], restore=["dq_ptr"])
    _soe_bwd_dkv_kernel = _tuned(_soe_bwd_dkv_kernel, _KEY + ["SCALED", "DV_BF16", "LAST"],
                                 restore=["dk_ptr", "dv_ptr", "dvlo_ptr"])
    _soe_bwd_dcn_kernel = _tuned(_soe_bwd_dcn_kernel, ["F", "Dv", "BT", "NB", "LB", "SCALED", "MODE"])


def _diagonal_sums(P: Tensor, T: int) -> Tensor:
    """`[H, NB·T]`: `Σ P[:, j, s, u]` over `s - u + j·T = d` (`P: [H, NB, T, T]`; for j = 0 only
    `s >= u`), by index lists (a boolean mask's nonzero would synchronize with the host)."""
    H, NB = P.shape[0], P.shape[1]
    s, u = torch.tril_indices(T, T, device=P.device)  # s >= u
    t = torch.arange(T, device=P.device)
    out = P.new_zeros(H, NB * T)
    out.index_add_(1, s - u, P[:, 0, s, u])
    for j in range(1, NB):
        out.index_add_(1, (t[:, None] - t[None, :] + j * T).flatten(), P[:, j].flatten(1))
    return out


def _soe_sizes(phi_q: Tensor, v: Tensor, K: int, q_offset: int, T: int, group: int):
    """`(BF, BDV, BV, N, groups)`: the feature and value tiles, the output kernels' value
    block, the number of chunks and the term groups `[(k0, k1), ...]` of `group` terms."""
    Lq, F = phi_q.shape[2], phi_q.shape[3]
    Lk, Dv = v.shape[2], v.shape[3]
    BDV = _pow2(Dv)
    groups = [(k0, min(K, k0 + group)) for k0 in range(0, K, group)]
    return _pow2(F), BDV, min(BDV, 64), -(-max(Lk, q_offset + Lq) // T), groups


def state_storage(dt: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The chunk states' dtype for features of dtype `dt`: bf16/fp16 features enter tl.dot in
    their dtype anyway, so their states are stored so (half the bytes); float32 features of a
    bf16 call may ask for bf16 states too (`state_dtype`), else the accumulation dtype."""
    return dt if dt in (torch.float16, torch.bfloat16) else (state_dtype or acc_dtype(dt))


def launch_group(BH: int, N: int, F: int, Dv: int, sdt: torch.dtype, K: int, state_budget: int | None,
                 state_terms: int) -> int:
    """The terms one launch group takes: as many of the K as `state_budget` holds the states
    of (`terms_per_group`), in whole stacks of `state_terms` (`triton_soe_stacked.stacked_group`)."""
    group = terms_per_group(BH, N, _pow2(F), _pow2(Dv), sdt.itemsize, K, state_budget)
    return _stacked.stacked_group(group, K, state_terms)


def _soe_sum_dtypes(dt: torch.dtype, out_dtype: torch.dtype, divide: torch.dtype | None, n_groups: int):
    """`(fused, num dtype, den dtype)` of the output launches: `fused`, one launch writes the
    quotient (`divide`) itself; several groups add into num/den, or a quotient is formed from
    them after: sums in the accumulation dtype until the end."""
    acc = acc_dtype(dt)
    fused = divide is not None and n_groups == 1
    sum_dtype = divide if fused else (out_dtype if n_groups == 1 and divide is None else acc)
    return fused, sum_dtype, acc if divide is not None else sum_dtype


def _soe_states(phi_k, v, lgk, N, T, BF, BDV, BV, hdt, acc, meta, scan, state_terms: int = 1):
    """`h: [B·H, K, N, BF, BDV]`, `z: [B·H, K, N, BF]`: S_k(n) for every chunk n (K =
    lgk.numel()), over the chunks as `scan` says (`triton_chunked.STATE_SCAN`); up to
    `state_terms` terms a program (`STATE_TERMS`, `triton_soe_stacked`)."""
    KG = _stacked.stack_size(lgk.numel(), state_terms)
    if KG > 1:
        return _stacked.forward_states(phi_k, v, lgk, N, T, BF, BDV, BV, hdt, acc, meta, scan, KG)
    B, H, Lk, F = phi_k.shape
    Dv, K = v.shape[3], lgk.numel()
    h = torch.empty(B * H, K, N, BF, BDV, dtype=hdt, device=phi_k.device)
    z = torch.empty(B * H, K, N, BF, dtype=acc, device=phi_k.device)
    _state_pass(lambda nb, h, z, c, cz, G, NBK, phase: _soe_state_kernel[(B * H, BDV // BV, K * nb)](
        phi_k, v, lgk, h, z, c, cz, Lk, F, Dv, N, K, G, NBK, BT=T, BF=BF, BV=BV, BDV=BDV, PHASE=phase, **meta),
        h, z, lgk, N, T, N * T, reverse=False, mode=scan, programs=B * H * (BDV // BV) * K, from_zero=True)
    return h, z


def _soe_state_grads(phi_q, dnum, inv, dden, wq, lgk, dh, dz, N, T, NB, BF, BDV, BV, q_offset, meta, scaled: dict,
                     scan, state_terms: int = 1) -> None:
    """The gradients of `_soe_states`' states into `dh`, `dz` (zeros, `[B·H, K, N+1, ...]`: the
    state read by query chunk n + NB - 1 and every later one), in reverse over the chunks as
    `scan` says; up to `state_terms` terms a program, as `_soe_states`."""
    KG = _stacked.stack_size(lgk.numel(), state_terms)
    if KG > 1:
        return _stacked.backward_states(phi_q, dnum, inv, dden, wq, lgk, dh, dz, N, T, NB, BF, BDV, BV, q_offset,
                                        meta, scaled, scan, KG)
    B, H, Lq, F = phi_q.shape
    Dv, K = dnum.shape[3], lgk.numel()
    _state_pass(lambda nb, dh, dz, c, cz, G, NBK, phase: _soe_bwd_state_kernel[(B * H, BDV // BV, K * nb)](
        phi_q, dnum, inv, dden, wq, lgk, dh, dz, c, cz, H, Lq, F, Dv, N, K, G, NBK, q_offset, BT=T, BF=BF, BV=BV,
        BDV=BDV, NB=NB, PHASE=phase, **meta, **scaled), dh, dz, lgk, N, T, N * T, reverse=True, mode=scan,
        programs=B * H * (BDV // BV) * K, from_zero=True)


#: The chunk-state passes' terms a program (`triton_soe_stacked`): 1, the default, runs a
#: program per term (`_soe_state_kernel`, `_soe_bwd_state_kernel`), each reading the chunk's
#: keys and values (backward: queries, output gradients, row scales) again; n > 1 stacks up to n
#: (a power of two) terms' states in a program, which reads them once for all, in fewer programs
#: (so STATE_SCAN's "auto" blocks the pass where they fill few SMs). Opt-in until a GPU has timed
#: it (the bench's `+stacked-states` rows: 4); the bytes it spares: benchmarks/soe_traffic.py.
STATE_TERMS = 1


@contextlib.contextmanager
def use_state_terms(n: int):
    """`STATE_TERMS = n` inside the block."""
    global STATE_TERMS
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise FastRPEError(f"triton_soe.STATE_TERMS: expected a positive int, got {n!r}")
    before, STATE_TERMS = STATE_TERMS, n
    try:
        yield
    finally:
        STATE_TERMS = before


#: The forward keeps its states for the backward, instead of making them again there, when
#: the call's terms run in one group (`terms_per_group`) and either there is one term (T5's
#: band: the footprint of the geometric path's states, which triton_chunked always keeps) or
#: the states `h, z` take at most this many bytes (0, the default: only then). The backward's
#: state pass took 1.25 ms of triton_soe's 11.7 ms KERPLE-log call and 1.28 of triton_band's
#: 9.25 ms T5 call (65,536 tokens, B·H = 8, bf16) on the H100 (2026-11-27,
#: benchmarks/results/gpu/h100-2026-11-27-profile.json). KERPLE-log's 16 terms kept would be
#: 0.54 GB per call held from forward to backward, 64 bytes per token, head and term: 2.7 times
#: the layer's bf16 q, k and v. A training run with the memory opts in (`use_saved_states`).
SAVE_STATES_BYTES = 0


@contextlib.contextmanager
def use_saved_states(max_bytes: int):
    """`SAVE_STATES_BYTES = max_bytes` inside the block (the forward decides; its backward
    uses what it kept); -1 keeps none, not even one term's."""
    global SAVE_STATES_BYTES
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < -1:
        raise FastRPEError(f"use_saved_states: max_bytes must be an int >= 0 (-1: never keep), got {max_bytes!r}")
    before, SAVE_STATES_BYTES = SAVE_STATES_BYTES, max_bytes
    try:
        yield
    finally:
        SAVE_STATES_BYTES = before


#: How the far field runs: "states", every term's state at every chunk stored (K·N tiles, in
#: term groups of `STATE_BUDGET`) and read by the output and gradient kernels; "walk", blocks
#: of chunks walked with several terms' states in registers (`triton_soe_walk`), memory the
#: blocks' carries only, every term in one pass at any length. Same sums (float32 order aside).
#: "states" stays the default until the GPU has timed "walk" (the bench's `+walk` rows).
FAR_FIELD = "states"
FAR_FIELDS = ("states", "walk")


@contextlib.contextmanager
def use_far_field(mode: str):
    """`FAR_FIELD = mode` inside the block (a call's backward keeps its forward's)."""
    global FAR_FIELD
    if mode not in FAR_FIELDS:
        raise FastRPEError(f"use_far_field: expected one of {FAR_FIELDS}, got {mode!r}")
    before, FAR_FIELD = FAR_FIELD, mode
    try:
        yield
    finally:
        FAR_FIELD = before


def _keeps_states(phi_q: Tensor, v: Tensor, K: int, q_offset: int, T: int, group: int, state_dtype: torch.dtype,
                  max_bytes: int) -> bool:
    """Whether a forward keeps its states for the backward (`SAVE_STATES_BYTES`): one term
    group, and one term or `h` and `z` within `max_bytes` (`max_bytes` < 0: never, for the
    tests' recomputing twin). From shapes alone: the op's fake agrees."""
    if max_bytes < 0:
        return False
    BF, BDV, _, N, groups = _soe_sizes(phi_q, v, K, q_offset, T, group)
    if len(groups) != 1:
        return False
    rows = phi_q.shape[0] * phi_q.shape[1] * K * N * BF
    return K == 1 or rows * (BDV * state_dtype.itemsize + acc_dtype(phi_q.dtype).itemsize) <= max_bytes


def _soe_forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, cn: Tensor, wq: Tensor, lgk: Tensor, q_offset: int, T: int,
                 NB: int, out_dtype: torch.dtype, mode: int, state_dtype: torch.dtype, group: int,
                 divide: torch.dtype | None, scan: str, keep_bytes: int = -1, far: str = "states", state_terms: int = 1
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(num, den, h, z)` of `_SoE`: the near field once, the far field term group by term
    group (each group's K·N states built, read and freed before the next: memory bounded by
    `STATE_BUDGET`); `h, z` the one group's states where `_keeps_states(..., keep_bytes)`
    (for the backward), else None. `far` = "walk": `_soe_forward_walk` instead."""
    if far == "walk":
        return _soe_forward_walk(phi_q, phi_k, v, cn, wq, lgk, q_offset, T, NB, out_dtype, mode, divide,
                                 keep_bytes >= 0)
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt = phi_q.device, phi_q.dtype
    acc = acc_dtype(dt)
    BF, BDV, BV, N, groups = _soe_sizes(phi_q, v, lgk.numel(), q_offset, T, group)
    fused, num_dtype, den_dtype = _soe_sum_dtypes(dt, out_dtype, divide, len(groups))
    num = torch.empty(B, H, Lq, Dv, dtype=num_dtype, device=dev)
    den = torch.empty(B, H, Lq, dtype=den_dtype, device=dev)
    meta = dict(DT=_TL_DTYPE[dt], ACC=_TL_DTYPE[acc], MODE=mode)
    out_bf16, quot = quotient_flags(divide if fused else None, acc)
    keep = _keeps_states(phi_q, v, lgk.numel(), q_offset, T, group, state_dtype, keep_bytes)
    kept_h = kept_z = None
    for i, (k0, k1) in enumerate(groups):
        h, z = _soe_states(phi_k, v, lgk[k0:k1], N, T, BF, BDV, BV, state_dtype, acc, meta, scan, state_terms)
        _soe_out_kernel[(N, B * H, BDV // BV)](phi_q, phi_k, v, cn, wq[:, k0:k1].contiguous(), h, z,
                                               num.view(torch.int16) if out_bf16 else num, den,
                                               H, Lq, Lk, F, Dv, N, k1 - k0, q_offset, length_bucket(N),
                                               BT=T, BF=BF, BV=BV,
                                               BDV=BDV, NB=NB, NEAR=i == 0, ACCUM=i > 0, **quot, **meta)
        if keep:
            kept_h, kept_z = h, z
        del h, z
    # by default the states are not kept for backward (K times the geometric path's: 8.6 GB
    # at L = 1M, B·H = 8, bf16): backward recomputes them with the light sequential pass
    if divide is not None:  # `num/den` in place of num, den saved alone (`triton_chunked._ChunkedDecay`)
        return (num if fused else quotient(num, den, divide)), den, kept_h, kept_z
    return num.to(out_dtype), den.to(out_dtype), kept_h, kept_z


def _soe_forward_walk(phi_q: Tensor, phi_k: Tensor, v: Tensor, cn: Tensor, wq: Tensor, lgk: Tensor, q_offset: int,
                      T: int, NB: int, out_dtype: torch.dtype, mode: int, divide: torch.dtype | None, keep: bool
                      ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """`_soe_forward` with the far field walked (`FAR_FIELD = "walk"`): the near field by
    `_soe_out_kernel` with no terms into num/den in the accumulation dtype, every term's far
    field added by `triton_soe_walk.far_forward`; its blocks' carries in place of `h, z`
    where `keep` (a forward with a backward to come, `SAVE_STATES_BYTES` not -1): K·NBK
    states, 126 MB at L = 1M, B·H = 8, 15 terms, against the totals pass they spare it."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt = phi_q.dtype
    acc = acc_dtype(dt)
    BF, BDV, BV, N, _ = _soe_sizes(phi_q, v, 1, q_offset, T, 1)
    num = torch.empty(B, H, Lq, Dv, dtype=acc, device=phi_q.device)
    den = torch.empty(B, H, Lq, dtype=acc, device=phi_q.device)
    meta = dict(DT=_TL_DTYPE[dt], ACC=_TL_DTYPE[acc], MODE=mode)
    _soe_out_kernel[(N, B * H, BDV // BV)](phi_q, phi_k, v, cn, wq, wq, wq, num, den, H, Lq, Lk, F, Dv, N, 0,
                                           q_offset, length_bucket(N), BT=T, BF=BF, BV=BV, BDV=BDV, NB=NB,
                                           NEAR=True, ACCUM=False, **meta)
    carry, carryz = _walk.far_forward(phi_q, phi_k, v, wq, lgk, num, den, q_offset, T, NB, meta)
    if not keep:
        carry = carryz = None
    if divide is not None:
        return quotient(num, den, divide), den, carry, carryz
    return num.to(out_dtype), den.to(out_dtype), carry, carryz


def _soe_forward_fake(phi_q, phi_k, v, cn, wq, lgk, q_offset, T, NB, out_dtype, mode, state_dtype, group, divide,
                      scan, keep_bytes=-1, far="states", state_terms=1):
    B, H, Lq, _ = phi_q.shape
    Dv = v.shape[3]
    if divide is None:
        num_dtype = den_dtype = out_dtype
    else:
        num_dtype, den_dtype = divide, acc_dtype(phi_q.dtype)
    if far == "walk" and keep_bytes >= 0:  # the blocks' carries (`_soe_forward_walk`)
        hs, zs = _walk.carries_shapes(phi_q, v, lgk.numel(), q_offset, T)
        acc = acc_dtype(phi_q.dtype)
        h, z = phi_q.new_empty(hs, dtype=acc), phi_q.new_empty(zs, dtype=acc)
    elif far != "walk" and _keeps_states(phi_q, v, lgk.numel(), q_offset, T, group, state_dtype, keep_bytes):
        BF, BDV, _, N, _ = _soe_sizes(phi_q, v, lgk.numel(), q_offset, T, group)
        h = phi_q.new_empty(B * H, lgk.numel(), N, BF, BDV, dtype=state_dtype)
        z = phi_q.new_empty(B * H, lgk.numel(), N, BF, dtype=acc_dtype(phi_q.dtype))
    else:
        h = z = phi_q.new_empty(0)
    return phi_q.new_empty(B, H, Lq, Dv, dtype=num_dtype), phi_q.new_empty(B, H, Lq, dtype=den_dtype), h, z


def _soe_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, cn: Tensor, wq: Tensor, lgk: Tensor, den: Tensor | None,
                  dnum: Tensor | None, dden: Tensor | None, q_offset: int, T: int, NB: int, mode: int,
                  state_dtype: torch.dtype, group: int, scan: str, want_dcn: bool, want_dwq: bool,
                  kept_h: Tensor | None = None, kept_z: Tensor | None = None, far: str = "states",
                  state_terms: int = 1
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`(dφq, dφk, dv, dcn, dwq)` of `_SoE` (dcn, dwq None unless wanted); the states are
    made again, group by group, as the forward made them, unless the forward kept them
    (`kept_h`, `kept_z`, non-empty: one group, `SAVE_STATES_BYTES`). `far` = "walk": the far
    field's gradients by `triton_soe_walk.far_backward`."""
    return soe_backward(phi_q, phi_k, v, cn, wq, lgk, den, dnum, dden, q_offset, T, NB, mode, state_dtype, group, scan,
                        want_dcn, want_dwq, kept_h, kept_z, far, state_terms)


def soe_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, cn: Tensor, wq: Tensor, lgk: Tensor, den: Tensor | None,
                 dnum: Tensor | None, dden: Tensor | None, q_offset: int, T: int, NB: int, mode: int,
                 state_dtype: torch.dtype, group: int, scan: str, want_dcn: bool, want_dwq: bool,
                 kept_h: Tensor | None = None, kept_z: Tensor | None = None, far: str = "states",
                 state_terms: int = 1, maps=None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_soe_backward` (the custom op's body), and with `maps` (`triton_chunked_prf.MapGrads`;
    the stored states' far field) the PRF maps' backward in the last launch group's dq and dk/dv
    kernels (`triton_soe_prf`), the earlier groups' dφq, dφk summed in float32 as without it:
    `(dq, dk, ...)` of the maps' inputs, in their dtype, in place of dφq, dφk. The plan's
    gradients (dcn, dwq) are made as without `maps`."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt = phi_q.device, phi_q.dtype
    acc = acc_dtype(dt)
    BF, BDV, BV, N, groups = _soe_sizes(phi_q, v, lgk.numel(), q_offset, T, group)
    dnum, inv, dden = _numerator_grads(dnum, dden, den, (B, H, Lq, Dv), dt, dev)
    meta = dict(DT=_TL_DTYPE[dt], ACC=_TL_DTYPE[acc], MODE=mode)
    scaled = dict(SCALED=den is not None)
    NS = min(N, 128)
    if maps is not None and far == "walk":
        # (the walk adds its far field's dφ after the near field's kernels)
        raise ValueError("triton_soe: the fused maps need the stored states' far field, got far='walk'")
    if far == "walk":
        carries = (kept_h, kept_z) if kept_h is not None and kept_h.numel() else None
        return _soe_backward_walk(phi_q, phi_k, v, cn, wq, lgk, dnum, inv, dden, q_offset, T, NB, NS, acc, meta,
                                  den is not None, want_dcn, want_dwq, carries)
    if maps is None or len(groups) > 1:  # dφq, dφk: float32 sums between groups
        dq = torch.empty(B, H, Lq, F, dtype=acc, device=dev)
        dk = torch.empty(B, H, Lk, F, dtype=acc, device=dev)
    if maps is not None:
        from . import triton_soe_prf as tsp
    # dv written in bf16 by the kernel (`dv_in_bf16`); several launches add up in bf16 pairs
    dv_bf16 = dv_in_bf16(v, dt)
    dv = torch.empty(B, H, Lk, Dv, dtype=torch.bfloat16 if dv_bf16 else acc, device=dev)
    dvlo = torch.empty_like(dv) if dv_bf16 and len(groups) > 1 else dv
    dwq = []
    dq_kernel = _dq_kernel(mode)
    for i, (k0, k1) in enumerate(groups):
        Kg, wg, lg = k1 - k0, wq[:, k0:k1].contiguous(), lgk[k0:k1]
        flags = dict(NB=NB, NEAR=i == 0, ACCUM=i > 0)
        # the maps' backward in the last group's kernels, where dφ is whole (the earlier groups' sums read there)
        fuse = maps is not None and i == len(groups) - 1
        # the queries' side reads the states, the keys' side their gradients: one at a time
        if kept_h is not None and kept_h.numel():  # (kept for one group only: `_keeps_states`)
            h, z = kept_h, kept_z
        else:
            h, z = _soe_states(phi_k, v, lg, N, T, BF, BDV, BV, state_dtype, acc, meta, scan, state_terms)
        # each program's sums of the far weights' gradient (`DWQ`), or none: a frozen term's
        # (one float in their place, which the autotuner's reset may zero)
        dwq_g = (torch.zeros(B * H, NS, Kg, T, dtype=acc, device=dev) if want_dwq
                 else torch.zeros(1, dtype=acc, device=dev))
        if not fuse:
            dq_kernel[(NS, B * H)](phi_q, phi_k, v, dnum, inv, dden, cn, wg, h, z, dq, dwq_g,
                                   H, Lq, Lk, F, Dv, N, Kg, NS, q_offset, length_bucket(N), BT=T, BF=BF, BDV=BDV,
                                   DWQ=want_dwq, **flags, **meta, **scaled)
        else:  # dq of the queries themselves, from dφq in registers (plus the earlier groups')
            dq = tsp.launch_dq(maps, (NS, B * H), (phi_q, phi_k, v, dnum, inv, dden, cn, wg, h, z, dwq_g),
                               dq if i > 0 else None, (H, Lq, Lk, F, Dv, N, Kg, NS, q_offset), length_bucket(N),
                               dict(BT=T, BF=BF, BDV=BDV, DWQ=want_dwq, **flags, **meta, **scaled))
        del h, z
        if want_dwq:  # the programs' sums, reduced now ([H, Kg, T]: not held over the groups)
            dwq.append(dwq_g.view(B, H, NS, Kg, T).sum((0, 2)))
        del dwq_g
        dh = torch.zeros(B * H, Kg, N + 1, BF, BDV, dtype=state_dtype, device=dev)
        dz = torch.zeros(B * H, Kg, N + 1, BF, dtype=acc, device=dev)
        _soe_state_grads(phi_q, dnum, inv, dden, wg, lg, dh, dz, N, T, NB, BF, BDV, BV, q_offset, meta, scaled, scan,
                         state_terms)
        if not fuse:
            _soe_bwd_dkv_kernel[(N, B * H)](phi_q, phi_k, v, dnum, inv, dden, cn, lg, dh, dz, dk,
                                            *((dv.view(torch.int16), dvlo.view(torch.int16)) if dv_bf16
                                              else (dv, dv)), H, Lq, Lk, F, Dv, N, Kg, q_offset, length_bucket(N),
                                            BT=T, BF=BF, BDV=BDV, DV_BF16=dv_bf16, LAST=i == len(groups) - 1,
                                            **flags, **meta, **scaled)
        else:  # dk of the keys themselves, dv as above
            dk = tsp.launch_dkv(maps, (N, B * H), (phi_q, phi_k, v, dnum, inv, dden, cn, lg, dh, dz), dv, dvlo,
                                dk if i > 0 else None, (H, Lq, Lk, F, Dv, N, Kg, q_offset), length_bucket(N), dv_bf16,
                                dict(BT=T, BF=BF, BDV=BDV, **flags, **meta, **scaled))
        del dh, dz
    del dvlo
    dwq_h = torch.cat(dwq, 1).to(wq.dtype) if want_dwq else None
    dcn = _soe_dcn(phi_q, phi_k, v, dnum, inv, dden, cn, q_offset, T, NB, NS, acc, meta, den is not None) \
        if want_dcn else None
    if maps is None:
        dq, dk = dq.to(dt), dk.to(dt)
    return dq, dk, dv.to(v.dtype), dcn, dwq_h


def _dq_kernel(mode: int):
    """The dq kernel of products `mode`: bf16x3's tunes over pipelined configs only
    (`SOE_DQ_BF16X3_NOTE`)."""
    return _soe_bwd_dq_kernel_bf16x3 if mode == dot_mode("bf16x3") else _soe_bwd_dq_kernel


def _soe_dcn(phi_q: Tensor, phi_k: Tensor, v: Tensor, dnum: Tensor, inv: Tensor, dden: Tensor, cn: Tensor,
             q_offset: int, T: int, NB: int, NS: int, acc: torch.dtype, meta: dict, scaled: bool) -> Tensor:
    """The near table's gradient `[H, NB·T]` (`_soe_bwd_dcn_kernel`, its diagonals summed)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    BF, BDV, _, N, _ = _soe_sizes(phi_q, v, 1, q_offset, T, 1)
    p = torch.empty(B * H, NS, NB, T, T, dtype=acc, device=phi_q.device)
    _soe_bwd_dcn_kernel[(NS, B * H, NB)](phi_q, phi_k, v, dnum, inv, dden, p, Lq, Lk, F, Dv, N, NS, q_offset,
                                         length_bucket(N), BT=T, BF=BF, BDV=BDV, NB=NB, SCALED=scaled, **meta)
    return _diagonal_sums(p.view(B, H, NS, NB, T, T).sum((0, 2)), T).to(cn.dtype)


def _soe_backward_walk(phi_q: Tensor, phi_k: Tensor, v: Tensor, cn: Tensor, wq: Tensor, lgk: Tensor, dnum: Tensor,
                       inv: Tensor, dden: Tensor, q_offset: int, T: int, NB: int, NS: int, acc: torch.dtype,
                       meta: dict, scaled: bool, want_dcn: bool, want_dwq: bool,
                       carries: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_soe_backward` with the far field walked (`FAR_FIELD = "walk"`): the near field's
    gradients by `_soe_bwd_dq_kernel` and `_soe_bwd_dkv_kernel` with no terms, into dq, dk, dv
    in the accumulation dtype, the far field's added by `triton_soe_walk.far_backward` (from
    the forward's `carries` where it kept them)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt = phi_q.device, phi_q.dtype
    BF, BDV, _, N, _ = _soe_sizes(phi_q, v, 1, q_offset, T, 1)
    dq = torch.empty(B, H, Lq, F, dtype=acc, device=dev)
    dk = torch.empty(B, H, Lk, F, dtype=acc, device=dev)
    dv = torch.empty(B, H, Lk, Dv, dtype=acc, device=dev)
    near = dict(K=0, q_offset=q_offset, LB=length_bucket(N), BT=T, BF=BF, BDV=BDV, NB=NB, NEAR=True, ACCUM=False,
                SCALED=scaled, **meta)
    # (no far field: no dwq; its pointer a float of its own, which the autotuner's reset may zero:
    # it zeroed wq, passed there before, which the walk reads after)
    _dq_kernel(meta["MODE"])[(NS, B * H)](phi_q, phi_k, v, dnum, inv, dden, cn, wq, wq, wq, dq, dq.new_zeros(1), H,
                                          Lq, Lk, F, Dv, N, NS=NS, DWQ=False, **near)
    _soe_bwd_dkv_kernel[(N, B * H)](phi_q, phi_k, v, dnum, inv, dden, cn, lgk, wq, wq, dk, dv, dv, H, Lq, Lk, F,
                                    Dv, N, DV_BF16=False, LAST=True, **near)
    dwq = _walk.far_backward(phi_q, phi_k, v, wq, lgk, dnum, inv, dden, dq, dk, dv, q_offset, T, NB, meta, scaled,
                             carries)
    dcn = _soe_dcn(phi_q, phi_k, v, dnum, inv, dden, cn, q_offset, T, NB, NS, acc, meta, scaled) if want_dcn else None
    return dq.to(dt), dk.to(dt), dv.to(v.dtype), dcn, dwq.to(wq.dtype) if want_dwq else None


def _soe_backward_fake(phi_q, phi_k, v, cn, wq, lgk, den, dnum, dden, q_offset, T, NB, mode, state_dtype, group,
                       scan, want_dcn, want_dwq, kept_h=None, kept_z=None, far="states", state_terms=1):
    return (torch.empty_like(phi_q), phi_k.new_empty(phi_k.shape, dtype=phi_q.dtype), torch.empty_like(v),
            cn.new_empty(cn.shape) if want_dcn else phi_q.new_empty(0),
            wq.new_empty(wq.shape) if want_dwq else phi_q.new_empty(0))


_soe_forward_op = compile_opaque("triton_soe_forward", _soe_forward, _soe_forward_fake)
_soe_backward_op = compile_opaque("triton_soe_backward", _soe_backward, _soe_backward_fake)


class _SoE(torch.autograd.Function):
    """`(num, den)` by `_soe_forward`; custom ops under `torch.compile` (`compile_opaque`)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, cn, wq, lgk, q_offset: int, T: int, NB: int, out_dtype, mode: int, state_dtype,
                group: int, divide=None, state_terms: int = 1):
        keep_bytes = SAVE_STATES_BYTES if any(ctx.needs_input_grad[:5]) else -1  # (inference keeps none)
        num, den, h, z = _soe_forward_op(phi_q, phi_k, v, cn, wq, lgk, q_offset, T, NB, out_dtype, mode,
                                         state_dtype, group, divide, _tc.STATE_SCAN, keep_bytes, FAR_FIELD, state_terms)
        ctx.save_for_backward(phi_q, phi_k, v, cn, wq, lgk, den if divide is not None else None, h, z)
        # (the backward keeps the forward's settings, which a context manager may have set)
        ctx.cfg = (q_offset, T, NB, state_dtype, mode, group, _tc.STATE_SCAN, FAR_FIELD, state_terms)
        return num, den

    @staticmethod
    def backward(ctx, dnum, dden):
        phi_q, phi_k, v, cn, wq, lgk, den, h, z = ctx.saved_tensors
        q_offset, T, NB, hdt, mode, group, scan, far, terms = ctx.cfg
        want_dcn, want_dwq = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        dq, dk, dv, dcn, dwq = _soe_backward_op(phi_q, phi_k, v, cn, wq, lgk, den, dnum, dden, q_offset, T, NB, mode,
                                                hdt, group, scan, want_dcn, want_dwq, h, z, far, terms)
        return (dq, dk, dv, dcn if want_dcn else None, dwq if want_dwq else None,
                None, None, None, None, None, None, None, None, None, None)


#: the kernel tables of plans that take no gradient, per plan: a frozen term's plan is
#: kept (`soe.soe_plan_for`), and so, here, are the tables made from it (a dozen launches a call)
_KERNEL_TABLES = ByIdentity()


def kernel_tables(plan: SoEPlan, T: int, NB: int, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`(cn, wq, log γ)` as the kernels read them, contiguous in `acc` (`soe_tables`).

    A plan in the graph (`a` or `corr` requires grad, autograd on) gets them built on every
    call, so that gradients reach its parameters; any other plan's are built once per plan
    and the versions of its tensors (an in-place edit builds them again)."""
    def build():
        cn, wq = soe_tables(plan, T, NB)
        lgk = torch.log(plan.gamma.detach().to(torch.float64)).to(acc).contiguous()
        return cn.to(acc).contiguous(), wq.to(acc).contiguous(), lgk

    tensors = (plan.gamma, plan.a, plan.corr)
    if (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or torch.compiler.is_compiling():
        return build()
    key = (T, NB, acc, *((t.data_ptr(), t._version) for t in tensors))
    return kept(_KERNEL_TABLES, plan, key, build, entries=4)


def soe_tables(plan: SoEPlan, T: int, NB: int = 2) -> tuple[Tensor, Tensor]:
    """The plan as the kernels read it (float64, differentiable in `plan.a`, `plan.corr`):
    `cn: [H, NB·T]` the coefficient at distance `d = 0..NB·T-1` (exact below W, fitted beyond)
    and `wq: [H, K, T]` the far-field weight `a_hk γ_k^((NB-1)T+s+1)` of query s of a chunk."""
    d = torch.arange(NB * T, device=plan.a.device, dtype=torch.float64)
    g = plan.gamma.to(torch.float64)
    a = plan.a.to(torch.float64)
    cn = (a[:, None, :] * g[None, None, :] ** d[None, :, None]).sum(-1)  # (H, NB·T)
    cn = cn + torch.nn.functional.pad(plan.corr.to(torch.float64), (0, NB * T - plan.window))
    s = torch.arange(T, device=plan.a.device, dtype=torch.float64)
    wq = a[:, :, None] * g[None, :, None] ** ((NB - 1) * T + s + 1)[None, None, :]  # (H, K, T)
    return cn, wq


def kernelized_num_den_triton_soe(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    plan: SoEPlan,
    *,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    out_dtype: torch.dtype | None = None,
    precision: str = "ieee",
    state_dtype: torch.dtype | None = None,
    state_budget: int | None = None,
    divide: torch.dtype | None = None,
):
    """Causal `(num, den, log_scale)` with the coefficients of `plan` (exact below its window,
    its sum of exponentials beyond), in one fused Triton pass, forward and backward.

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`;
            v: `[B, H, Lk, Dv]` (read as it comes if bf16/fp16, else in phi_q's dtype).
        plan: `SoEPlan` (`soe.soe_plan`); gradients flow to `plan.a` and `plan.corr`.
        key_padding_mask: `[B, Lk]` bool, True = padding.
        chunk_size: T; the near field spans as many chunks as the window needs
            (`near_chunks`: 2 for W <= T + 1, up to `MAX_NEAR`, beyond that T is raised).
        out_dtype: dtype of num and den (default phi_q's).
        precision: how float32 features are multiplied on the GPU ("ieee" or "tf32x3",
            `triton_chunked.PRECISIONS`).
        state_dtype: storage of the K·N chunk states of float32 features (default float32;
            bfloat16 halves the largest buffer: 1.07 GB at L = 65,536, B·H = 8, F = 32, Dv = 64,
            K = 16 in float32). bf16/fp16 features always store them in their own dtype.
        state_budget: bytes the states of one launch may take (default `STATE_BUDGET`, 1 GiB):
            terms beyond it run in further launches that add to the first (`terms_per_group`),
            so memory stays bounded at any length (L = 1M, B·H = 8: one term's states are 0.5 GB
            in bf16). With `STATE_TERMS` > 1 a launch takes whole stacks of terms, one at least
            (`triton_soe_stacked.stacked_group`), past the budget if need be.
        divide: a dtype: the quotient `num/den` in it in place of num, as
            `triton_chunked.kernelized_num_den_triton_chunked` returns it.

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])`: the plan's `shift` per head
        (with `divide`: the quotient in place of num, den in the accumulation dtype).
    """
    why = triton_unavailable_reason(phi_q.device)
    if why is not None:
        raise FastRPEError(f"phi_q: the triton kernels cannot run on {phi_q.device}: {why}")
    dt = phi_q.dtype
    if dt not in _TL_DTYPE:
        raise FastRPEError(f"phi_q: dtype {dt} is not supported (float16, bfloat16, float32, float64)")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise FastRPEError(f"chunk_size: must be a power of two >= 16 (tl.dot), got {chunk_size}")
    B, H, Lq, F = phi_q.shape
    if plan.a.shape[0] != H:
        raise FastRPEError(f"plan: fitted for {plan.a.shape[0]} heads, phi_q has {H}")
    if v.shape[2] < 1:
        raise FastRPEError("v: needs at least one key")
    T, NB = near_chunks(plan.window, chunk_size)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    acc = acc_dtype(dt)
    cn, wq, lgk = kernel_tables(plan, T, NB, acc)
    N = -(-max(v.shape[2], q_offset + Lq) // T)
    sdt = state_storage(dt, state_dtype)
    terms = STATE_TERMS  # (read once: the groups, the forward's passes and the backward's)
    group = launch_group(B * H, N, F, v.shape[3], sdt, plan.num_terms, state_budget, terms)
    num, den = _SoE.apply(phi_q.contiguous(), phi_k.to(dt).contiguous(), v.to(value_dtype(v, dt)).contiguous(),
                          cn, wq, lgk, int(q_offset), T, NB, out_dtype or dt,
                          dot_mode(precision), sdt, group, divide, terms)
    if divide is not None:
        num = with_quotient_grad(num, den)
    return num, den, plan.log_scale(Lq, den.dtype)
