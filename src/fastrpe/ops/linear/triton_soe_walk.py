"""The far field of `triton_soe`'s sum of exponentials by walking blocks of chunks with
several terms' states held in registers (`triton_soe.FAR_FIELD = "walk"`), instead of storing
every term's state at every chunk. Same sums as the stored states (`triton_soe`'s
docstring has the notation); the dense reference is `naive.py` with the plan's coefficients.

Why: the stored states are K·N tiles of `[F, Dv]`, so at L = 1M (B·H = 8, F = 32, Dv = 64)
one term's take 0.5 GB in bf16 and `STATE_BUDGET` lets one term run per launch group: every
term is then a full pass over the queries, keys and values, forward and backward (240 ms for
KERPLE-log's 15 terms on the H100, 2026-11-27, against 34 ms for ALiBi's one). Here memory is
the blocks' carries, `K · NBK` states (NBK blocks, about `WALK_PROGRAMS / (B·H)`), whatever L.

The chunks are cut into NBK blocks of G. For each block:

  * `_walk_totals_kernel` (grid (NBK, B·H, BDV/BV)): the block's own total from zero,
    `Σ_{j in block} γ_k^(end-1-j) φk_j ⊗ [v_j, 1]`, for every term; then
    `triton_chunked._block_carries` turns totals into each block's starting state S_k(blk·G);
  * `_walk_out_kernel` (same grid): from that carry, chunk by chunk, query chunk
    `n = m + NB - 1` reads `S_k(m)` (`o += (φq ⊙ w_k) S_k`) and the keys of chunk m enter
    (`S_k <- γ_k^T S_k + (φk ⊙ γ_k^(T-1-t))ᵀ v`), adding to num/den that the near-field
    launch wrote (`triton_soe._soe_out_kernel` with no terms).

KG terms at a time (`WALK_TERMS`) are stacked into one `[KG·F, Dv]` state, so that both
products are `[T, KG·F] x [KG·F, Dv]` and `[KG·F, T] x [T, Dv]` tensor-core tiles, and the
program walks its block once per group of KG terms. The output tile of a query chunk belongs to
one program: it adds to it without atomics, in the same order every run.

Backward: the forward's carries (kept; made again if not), `_walk_dq_kernel` (forward walk:
dφq and the far weights' gradient), the reverse totals of the states' gradients
(`_walk_rtotals_kernel`, `dS_k(n) = γ_k^T dS_k(n+1) + (φq_(n+NB-1) ⊙ w_k / den)ᵀ do`) with
their carries, and `_walk_dkv_kernel` (reverse walk: dφk and dv from `dS_k(n+1)`). The near
field's gradients are `triton_soe`'s kernels with no terms. Notation as `triton_soe`'s; KG
terms a group, G chunks a block, NBK blocks.

Those two walks multiply by the transposed state (`do·S_kᵀ`, `v·dS_kᵀ`). Where an operand is
rounded to 16 bits (bf16 features, "bf16x3") they hold it transposed instead, `[Dv, KG·F]`,
updated by its own products, so that no `tl.trans` of a product feeds `tl.dot`: the pattern
Triton 3.4-3.7.0 miscompiles on Hopper (`triton_chunked.HOPPER_TRANS_NOTE`). With it, the
H100 stopped at the walk's first bf16x3 call with an illegal memory access (2026-11-28);
tests/test_triton_compile.py checks their sm_90 code for it."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .triton_chunked import HAS_TRITON, _block_carries, _pow2, _tuned

#: programs a walk launch aims for (NBK · B·H, `walk_blocks`): an H100 has 132 SMs, and each
#: program's walk is a chain of G dependent steps, so more, shorter blocks hide the latency
WALK_PROGRAMS = 1024
#: terms stacked into one state (KG): `[KG·F, Dv]` in float32 registers; a walk goes over its
#: block ceil(K / KG) times, each time adding to the output tiles it owns (float32 read and
#: written: at 1M tokens, B·H = 8, 4.3 GB for num alone), so more terms a state move fewer bytes,
#: until the registers spill
WALK_TERMS = 4
#: the walk kernels' warps in every autotuner config (`triton_chunked._tuned`): compiled for
#: sm_90 on the CPU (`benchmarks/walk_ptxas.py`, results/walk_ptxas-sm90.json), at 4 warps every
#: kernel but the totals' spilled at KG = 4 (up to 2.4 KB a thread, float32 features, tf32x3);
#: at 8 warps up to 1.3 KB (the dk/dv walk), bf16 features nothing
WALK_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_chunked import _dot, _load_rows, _row_inv

    @triton.jit
    def _stack(x, s, BT: tl.constexpr, KG: tl.constexpr, BF: tl.constexpr):
        """`[BT, KG·BF]`: x `[BT, BF]` scaled row-wise by each term's `s[:, k]` (`[BT, KG]`),
        the terms side by side (column k·BF + f)."""
        return tl.reshape(x[:, None, :] * s[:, :, None], [BT, KG * BF])

    @triton.jit
    def _terms(lgk_ptr, wq_ptr, hh, k0, K, t, BT: tl.constexpr, KG: tl.constexpr, BF: tl.constexpr,
               ACC: tl.constexpr):
        """Terms k0 .. k0+KG-1 (padding past K: weight 0, γ = 1): `(ok [KG], w [BT, KG] far
        weights of the chunk's queries, kdec [BT, KG] γ^(T-1-t) of its keys, g [KG·BF, 1] γ^T
        per stacked state row)`."""
        kk = k0 + tl.arange(0, KG)
        ok = kk < K
        lg = tl.load(lgk_ptr + kk, mask=ok, other=0.0).to(ACC)
        w = tl.load(wq_ptr + (hh * K + kk[None, :]) * BT + t[:, None], mask=ok[None, :], other=0.0).to(ACC)
        kdec = tl.exp(lg[None, :] * (BT - 1 - t)[:, None].to(ACC))
        g = tl.reshape(tl.broadcast_to(tl.exp(lg * BT)[:, None], [KG, BF]), [KG * BF])
        return ok, w, kdec, g

    @triton.jit
    def _carry_at(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF: tl.constexpr, BDV: tl.constexpr,
                  KG: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr, TRANS: tl.constexpr = False):
        """Block blk's carries of terms k0.. stacked: `(S [KG·BF, W], z [KG·BF])` (W = len(c); TRANS:
        S loaded transposed, `[W, KG·BF]`); the carries are `[B·H·K, NBK, BF, BDV]` and
        `[B·H·K, NBK, BF]`."""
        row = bh * K + k0 + tl.arange(0, KG)
        at = (row * NBK + blk) * BF
        z = tl.load(cz_ptr + at[:, None] + f[None, :], mask=ok[:, None], other=0.0).to(ACC)
        if TRANS:
            S = tl.reshape(tl.load(c_ptr + (at[None, :, None] + f[None, None, :]) * BDV + c[:, None, None],
                                   mask=ok[None, :, None], other=0.0).to(ACC), [W, KG * BF])
        else:
            S = tl.reshape(tl.load(c_ptr + (at[:, None, None] + f[None, :, None]) * BDV + c[None, None, :],
                                   mask=ok[:, None, None], other=0.0).to(ACC), [KG * BF, W])
        return S, tl.reshape(z, [KG * BF])

    @triton.jit
    def _store_total(c_ptr, cz_ptr, S, z, bh, k0, K, blk, NBK, f, c, ok, iv, BF: tl.constexpr,
                     BDV: tl.constexpr, KG: tl.constexpr, W: tl.constexpr):
        """A block's totals of terms k0.. (the stacked S, z) into `_carry_at`'s layout; z by
        the first value block (iv = 0) only."""
        row = bh * K + k0 + tl.arange(0, KG)
        at = (row * NBK + blk) * BF
        tl.store(c_ptr + (at[:, None, None] + f[None, :, None]) * BDV + c[None, None, :],
                 tl.reshape(S, [KG, BF, W]), mask=ok[:, None, None])
        tl.store(cz_ptr + at[:, None] + f[None, :], tl.reshape(z, [KG, BF]),
                 mask=ok[:, None] & ((f + iv * BF) < BF)[None, :])

    @triton.jit
    def _key_step(S, z, g, kb, vb, kdec, n, Lk, F, Dv, t, f, c, BT: tl.constexpr, BF: tl.constexpr,
                  KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                  TRANS: tl.constexpr = False):
        """`S_k(n+1)` from `S_k(n)` (stacked S, z): `γ^T·S` plus key chunk n's
        `(φk ⊙ γ^(T-1-t))ᵀ [v, 1]` (TRANS: S transposed, its product `vᵀ (φk ⊙ γ^(T-1-t))`)."""
        pos = n * BT + t
        km = pos < Lk
        kd = _stack(_load_rows(kb, pos, km, f, F, F).to(ACC), kdec, BT, KG, BF)
        v = _load_rows(vb, pos, km, c, Dv, Dv)
        if TRANS:
            S = S * g[None, :] + _dot(tl.trans(v), kd, DT, ACC, MODE)
        else:
            S = S * g[:, None] + _dot(tl.trans(kd), v, DT, ACC, MODE)
        return S, z * g + tl.sum(kd, 0)

    @triton.jit
    def _add_tile(ptr, x, mask):
        """`*ptr += x` on a tile this program owns (no other program writes it meanwhile)."""
        tl.store(ptr, (tl.load(ptr, mask=mask, other=0.0) + x).to(ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["G"])
    def _walk_totals_kernel(k_ptr, v_ptr, lgk_ptr, wq_ptr, c_ptr, cz_ptr, H, Lk, F, Dv, N, K, G, NBK,
                            BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                            KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr):
        """Grid (NBK, B·H, BDV/BV): block blk's totals from zero, every term."""
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        kb, vb = k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        for k0 in range(0, K, KG):
            ok, _, kdec, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
            S = tl.zeros([KG * BF, BV], dtype=ACC)
            z = tl.zeros([KG * BF], dtype=ACC)
            for n in range(blk * G, tl.minimum(blk * G + G, N)):
                S, z = _key_step(S, z, g, kb, vb, kdec, n, Lk, F, Dv, t, f, c, BT, BF, KG, DT, ACC, MODE)
            _store_total(c_ptr, cz_ptr, S, z, bh, k0, K, blk, NBK, f, c, ok, iv, BF, BDV, KG, BV)

    @triton.jit(do_not_specialize=["G"])
    def _walk_out_kernel(q_ptr, k_ptr, v_ptr, lgk_ptr, wq_ptr, c_ptr, cz_ptr, num_ptr, den_ptr,
                         H, Lq, Lk, F, Dv, N, K, G, NBK, q_offset,
                         BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                         NB: tl.constexpr, KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                         MODE: tl.constexpr):
        """Grid (NBK, B·H, BDV/BV): the far field of query chunks m + NB - 1 for the chunks m of
        block blk, added to num/den (accumulation dtype; den by the first value block)."""
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        qb, kb, vb = q_ptr + bh * Lq * F, k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        for k0 in range(0, K, KG):
            ok, w, kdec, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
            S, z = _carry_at(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BDV, KG, BV, ACC)
            hi = tl.minimum(blk * G + G, N - NB + 1)
            for m in range(blk * G, hi):
                qi = (m + NB - 1) * BT + t - q_offset
                qm = (qi >= 0) & (qi < Lq)
                qw = _stack(_load_rows(qb, qi, qm, f, F, F).to(ACC), w, BT, KG, BF)
                _add_tile(num_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], _dot(qw, S, DT, ACC, MODE),
                          qm[:, None] & (c[None, :] < Dv))
                _add_tile(den_ptr + bh * Lq + qi, tl.sum(qw * z[None, :], 1), qm & ((t + iv * BT) < BT))
                if m + 1 < hi:  # (the block's last state is no one's)
                    S, z = _key_step(S, z, g, kb, vb, kdec, m, Lk, F, Dv, t, f, c, BT, BF, KG, DT, ACC, MODE)

    @triton.jit(do_not_specialize=["G"])
    def _walk_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lgk_ptr, wq_ptr, c_ptr, cz_ptr, dq_ptr,
                        dwq_ptr, H, Lq, Lk, F, Dv, N, K, G, NBK, q_offset,
                        BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr,
                        KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                        SCALED: tl.constexpr):
        """Grid (NBK, B·H): the far field's dφq of query chunks m + NB - 1 (added to dq) and
        this block's sums of the far weights' gradient, `dwq [B·H, NBK, K, BT]`:
        `dq += Σ_k w_k (inv·do S_kᵀ + dd z_k)`, `dw_k += Σ_f φq ⊙ (inv·do S_kᵀ + dd z_k)`."""
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        qb, kb, vb = q_ptr + bh * Lq * F, k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        dob, ivb, ddb = do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        TRANS: tl.constexpr = DT == tl.bfloat16 or DT == tl.float16 or MODE >= 3  # (the module's docstring)
        for k0 in range(0, K, KG):
            ok, w, kdec, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
            S, z = _carry_at(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BDV, KG, BDV, ACC, TRANS)
            dw = tl.zeros([BT, KG], dtype=ACC)
            hi = tl.minimum(blk * G + G, N - NB + 1)
            for m in range(blk * G, hi):
                qi = (m + NB - 1) * BT + t - q_offset
                qm = (qi >= 0) & (qi < Lq)
                q = _load_rows(qb, qi, qm, f, F, F).to(ACC)
                do = _load_rows(dob, qi, qm, c, Dv, Dv)
                dd = tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)
                inv = _row_inv(ivb, qi, qm, ACC, SCALED)
                if TRANS:  # (S held transposed)
                    Y = tl.reshape(_dot(do, S, DT, ACC, MODE), [BT, KG, BF])  # do·S_kᵀ
                else:
                    Y = tl.reshape(_dot(do, tl.trans(S), DT, ACC, MODE), [BT, KG, BF])
                Gk = inv[:, None, None] * Y + dd[:, None, None] * tl.reshape(z, [KG, BF])[None, :, :]
                _add_tile(dq_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], tl.sum(w[:, :, None] * Gk, 1),
                          qm[:, None] & (f[None, :] < F))
                dw += tl.sum(q[:, None, :] * Gk, 2)
                if m + 1 < hi:  # (the block's last state is no one's)
                    S, z = _key_step(S, z, g, kb, vb, kdec, m, Lk, F, Dv, t, f, c, BT, BF, KG, DT, ACC, MODE, TRANS)
            kk = k0 + tl.arange(0, KG)
            tl.store(dwq_ptr + ((bh * NBK + blk) * K + kk[None, :]) * BT + t[:, None], dw, mask=ok[None, :])

    @triton.jit
    def _reverse_step(D, dz, g, qb, dob, ivb, ddb, w, n, Lq, F, Dv, q_offset, t, f, c,
                      BT: tl.constexpr, BF: tl.constexpr, NB: tl.constexpr, KG: tl.constexpr,
                      DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                      TRANS: tl.constexpr = False):
        """`dS_k(n)` from `dS_k(n+1)` (stacked D, dz): `γ^T·D` plus what query chunk n + NB - 1
        reads of `S_k(n)`, `(φq ⊙ w_k / den)ᵀ do` (and `(φq ⊙ w_k)ᵀ dd` for dz; TRANS: D
        transposed, its product `doᵀ (φq ⊙ w_k / den)`)."""
        qi = (n + NB - 1) * BT + t - q_offset
        qm = (qi >= 0) & (qi < Lq)
        q = _load_rows(qb, qi, qm, f, F, F).to(ACC)
        qw = _stack(q, w, BT, KG, BF)
        qs = _stack(q * _row_inv(ivb, qi, qm, ACC, SCALED)[:, None], w, BT, KG, BF)
        do = _load_rows(dob, qi, qm, c, Dv, Dv)
        if TRANS:
            D = D * g[None, :] + _dot(tl.trans(do), qs, DT, ACC, MODE)
        else:
            D = D * g[:, None] + _dot(tl.trans(qs), do, DT, ACC, MODE)
        dz = dz * g + tl.sum(qw * tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)[:, None], 0)
        return D, dz

    @triton.jit(do_not_specialize=["G"])
    def _walk_rtotals_kernel(q_ptr, do_ptr, inv_ptr, dd_ptr, lgk_ptr, wq_ptr, c_ptr, cz_ptr,
                             H, Lq, F, Dv, N, K, G, NBK, q_offset,
                             BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                             NB: tl.constexpr, KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                             MODE: tl.constexpr, SCALED: tl.constexpr):
        """Grid (NBK, B·H, BDV/BV): block blk's totals of the states' gradients from zero at its
        top, chunks blk·G+G-1 down to blk·G, every term (`_reverse_step`)."""
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        qb, dob, ivb, ddb = q_ptr + bh * Lq * F, do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        n_hi = tl.minimum(blk * G + G, N)
        for k0 in range(0, K, KG):
            ok, w, _, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
            D = tl.zeros([KG * BF, BV], dtype=ACC)
            dz = tl.zeros([KG * BF], dtype=ACC)
            for i in range(n_hi - blk * G):
                D, dz = _reverse_step(D, dz, g, qb, dob, ivb, ddb, w, n_hi - 1 - i, Lq, F, Dv, q_offset, t, f, c,
                                      BT, BF, NB, KG, DT, ACC, MODE, SCALED)
            _store_total(c_ptr, cz_ptr, D, dz, bh, k0, K, blk, NBK, f, c, ok, iv, BF, BDV, KG, BV)

    @triton.jit(do_not_specialize=["G"])
    def _walk_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lgk_ptr, wq_ptr, c_ptr, cz_ptr, dk_ptr,
                         dv_ptr, H, Lq, Lk, F, Dv, N, K, G, NBK, q_offset,
                         BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, NB: tl.constexpr,
                         KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                         SCALED: tl.constexpr):
        """Grid (NBK, B·H): the far field's dφk and dv of key chunks n of block blk, walked
        down from its carry `dS_k(blk·G+G)`: with `D = dS_k(n+1)`, `dk += Σ_k γ_k^(T-1-t) (v Dᵀ
        + dz)`, `dv += Σ_k (φk ⊙ γ_k^(T-1-t)) D`, then D becomes `dS_k(n)` (`_reverse_step`)."""
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        qb, kb, vb = q_ptr + bh * Lq * F, k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        dob, ivb, ddb = do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        n_hi = tl.minimum(blk * G + G, N)
        TRANS: tl.constexpr = DT == tl.bfloat16 or DT == tl.float16 or MODE >= 3  # (the module's docstring)
        for k0 in range(0, K, KG):
            ok, w, kdec, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
            D, dz = _carry_at(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BDV, KG, BDV, ACC, TRANS)
            for i in range(n_hi - blk * G):
                n = n_hi - 1 - i
                pos = n * BT + t
                km = pos < Lk
                k = _load_rows(kb, pos, km, f, F, F).to(ACC)
                v = _load_rows(vb, pos, km, c, Dv, Dv)
                if TRANS:  # (D held transposed: dv's tile formed transposed too)
                    vd = tl.reshape(_dot(v, D, DT, ACC, MODE), [BT, KG, BF])
                else:
                    vd = tl.reshape(_dot(v, tl.trans(D), DT, ACC, MODE), [BT, KG, BF])
                dk = tl.sum(kdec[:, :, None] * (vd + tl.reshape(dz, [KG, BF])[None, :, :]), 1)
                _add_tile(dk_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], dk, km[:, None] & (f[None, :] < F))
                if TRANS:
                    _add_tile(dv_ptr + bh * Lk * Dv + pos[None, :] * Dv + c[:, None],
                              _dot(D, tl.trans(_stack(k, kdec, BT, KG, BF)), DT, ACC, MODE),
                              km[None, :] & (c[:, None] < Dv))
                else:
                    _add_tile(dv_ptr + bh * Lk * Dv + pos[:, None] * Dv + c[None, :],
                              _dot(_stack(k, kdec, BT, KG, BF), D, DT, ACC, MODE), km[:, None] & (c[None, :] < Dv))
                if n > blk * G:  # (the block's first gradient is no one's)
                    D, dz = _reverse_step(D, dz, g, qb, dob, ivb, ddb, w, n, Lq, F, Dv, q_offset, t, f, c,
                                          BT, BF, NB, KG, DT, ACC, MODE, SCALED, TRANS)

    # (G, the chunks a block, never specialized on: 1 at 4k, 8 at 64k, 128 at 1M would be three
    # compilations of each kernel for a loop bound.) The adding kernels put back what they add
    # to before each timed config; KG in the keys; `WALK_WARPS` warps
    _WKEY = ["F", "Dv", "K", "BT", "NB", "KG", "MODE"]
    _walk_totals_kernel = _tuned(_walk_totals_kernel, ["F", "Dv", "K", "BT", "KG", "MODE"], num_warps=WALK_WARPS)
    _walk_out_kernel = _tuned(_walk_out_kernel, _WKEY, restore=["num_ptr", "den_ptr"], num_warps=WALK_WARPS)
    _walk_dq_kernel = _tuned(_walk_dq_kernel, _WKEY + ["SCALED"], restore=["dq_ptr"], num_warps=WALK_WARPS)
    _walk_rtotals_kernel = _tuned(_walk_rtotals_kernel, _WKEY + ["SCALED"], num_warps=WALK_WARPS)
    _walk_dkv_kernel = _tuned(_walk_dkv_kernel, _WKEY + ["SCALED"], restore=["dk_ptr", "dv_ptr"],
                              num_warps=WALK_WARPS)


def walk_blocks(N: int, rows: int, programs: int | None = None) -> tuple[int, int]:
    """`(G, NBK)`: chunks per block and blocks, so that `NBK · rows` is about `programs`
    (default `WALK_PROGRAMS`), at least one chunk a block."""
    programs = WALK_PROGRAMS if programs is None else programs
    nbk = max(1, min(N, -(-programs // max(1, rows))))
    G = -(-N // nbk)
    return G, -(-N // G)


def walk_terms(K: int) -> int:
    """KG: the terms one state stacks, `WALK_TERMS` at most, a power of two."""
    return min(_pow2(K, 1), _pow2(WALK_TERMS, 1))


class _Sizes(NamedTuple):
    """A walk's sizes: rows B·H, heads, lengths, widths, terms, chunks N, chunks a block G,
    blocks NBK, the feature and value tiles BF, BDV, the output walk's value block BV, KG."""
    BH: int
    H: int
    Lq: int
    Lk: int
    F: int
    Dv: int
    K: int
    N: int
    G: int
    NBK: int
    BF: int
    BDV: int
    BV: int
    KG: int


def _sizes(phi_q: Tensor, v: Tensor, K: int, q_offset: int, T: int) -> _Sizes:
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    N = -(-max(Lk, q_offset + Lq) // T)
    G, NBK = walk_blocks(N, B * H)
    BDV = _pow2(Dv)
    return _Sizes(B * H, H, Lq, Lk, F, Dv, K, N, G, NBK, _pow2(F), BDV, min(BDV, 64), walk_terms(K))


def _carry_shapes(s: _Sizes) -> tuple[tuple, tuple]:
    """The blocks' states `[B·H·K, NBK, BF, BDV]` and z's `[B·H·K, NBK, BF]` (totals and carries)."""
    return (s.BH * s.K, s.NBK, s.BF, s.BDV), (s.BH * s.K, s.NBK, s.BF)


def _carries(s: _Sizes, totals, lgk: Tensor, acc: torch.dtype, T: int, reverse: bool) -> tuple[Tensor, Tensor]:
    """Each block's starting state (and z's, `_carry_shapes`) from the blocks' totals, which
    `totals[grid](tot, totz)` writes (grid (NBK, B·H, BDV/BV))."""
    hs, zs = _carry_shapes(s)
    tot = torch.empty(hs, dtype=acc, device=lgk.device)
    totz = torch.empty(zs, dtype=acc, device=lgk.device)
    totals((s.NBK, s.BH, s.BDV // s.BV), tot, totz)
    return _block_carries(tot, totz, lgk, None, None, s.N, s.G, T, s.N * T, reverse)


def _key_carries(s: _Sizes, phi_k: Tensor, v: Tensor, wq: Tensor, lgk: Tensor, acc: torch.dtype, T: int,
                 meta: dict) -> tuple[Tensor, Tensor]:
    """`S_k(blk·G)` for every block and term (`_walk_totals_kernel`, then the carries)."""
    return _carries(s, lambda grid, tot, totz: _walk_totals_kernel[grid](
        phi_k, v, lgk, wq, tot, totz, s.H, s.Lk, s.F, s.Dv, s.N, s.K, s.G, s.NBK, BT=T, BF=s.BF, BV=s.BV,
        BDV=s.BDV, KG=s.KG, **meta), lgk, acc, T, reverse=False)


def carries_shapes(phi_q: Tensor, v: Tensor, K: int, q_offset: int, T: int) -> tuple[tuple, tuple]:
    """The shapes of `far_forward`'s carries (S's and z's), from the inputs' shapes alone."""
    return _carry_shapes(_sizes(phi_q, v, K, q_offset, T))


def far_forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, wq: Tensor, lgk: Tensor, num: Tensor, den: Tensor,
                q_offset: int, T: int, NB: int, meta: dict) -> tuple[Tensor, Tensor]:
    """Adds the far field of every term to `num`, `den` (the accumulation dtype; the near
    field already in them); returns the blocks' carries (`carries_shapes`), which the
    backward may take instead of making them again. `meta`: DT, ACC, MODE as `triton_soe`'s
    kernels take them."""
    s = _sizes(phi_q, v, lgk.numel(), q_offset, T)
    carry, carryz = _key_carries(s, phi_k, v, wq, lgk, num.dtype, T, meta)
    _walk_out_kernel[(s.NBK, s.BH, s.BDV // s.BV)](
        phi_q, phi_k, v, lgk, wq, carry, carryz, num, den, s.H, s.Lq, s.Lk, s.F, s.Dv, s.N, s.K, s.G, s.NBK,
        q_offset, BT=T, BF=s.BF, BV=s.BV, BDV=s.BDV, NB=NB, KG=s.KG, **meta)
    return carry, carryz


def far_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, wq: Tensor, lgk: Tensor, dnum: Tensor, inv: Tensor,
                 dden: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, q_offset: int, T: int, NB: int, meta: dict,
                 scaled: bool, carries: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Adds the far field's gradients to `dq`, `dk`, `dv` (the accumulation dtype; the near
    field's already in them) and returns the far weights' `[H, K, T]` (summed over batch and
    blocks). `dnum`, `inv`, `dden` as `triton_chunked._numerator_grads` makes them; `carries`,
    the forward's (else made again)."""
    s = _sizes(phi_q, v, lgk.numel(), q_offset, T)
    acc = dq.dtype
    ints = (s.H, s.Lq, s.Lk, s.F, s.Dv, s.N, s.K, s.G, s.NBK, q_offset)
    consts = dict(BT=T, BF=s.BF, BDV=s.BDV, NB=NB, KG=s.KG, SCALED=scaled, **meta)
    carry, carryz = carries if carries is not None else _key_carries(s, phi_k, v, wq, lgk, acc, T, meta)
    dwq = torch.empty(s.BH, s.NBK, s.K, T, dtype=acc, device=dq.device)
    _walk_dq_kernel[(s.NBK, s.BH)](phi_q, phi_k, v, dnum, inv, dden, lgk, wq, carry, carryz, dq, dwq, *ints,
                                   **consts)
    del carry, carryz
    # dS_k(blk·G + G) for every block: the reverse totals of the states' gradients, then their carries
    carry, carryz = _carries(s, lambda grid, tot, totz: _walk_rtotals_kernel[grid](
        phi_q, dnum, inv, dden, lgk, wq, tot, totz, s.H, s.Lq, s.F, s.Dv, s.N, s.K, s.G, s.NBK, q_offset,
        BV=s.BV, **consts), lgk, acc, T, reverse=True)
    _walk_dkv_kernel[(s.NBK, s.BH)](phi_q, phi_k, v, dnum, inv, dden, lgk, wq, carry, carryz, dk, dv, *ints,
                                    **consts)
    return dwq.view(-1, s.H, s.NBK, s.K, T).sum((0, 2))


__all__ = ["WALK_PROGRAMS", "WALK_TERMS", "carries_shapes", "far_backward", "far_forward", "walk_blocks",
           "walk_terms"]
