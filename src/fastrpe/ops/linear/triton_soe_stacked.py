"""triton_soe's chunk-state passes with several terms a program: the states of KG terms stacked
(`[KG·F, BV]`), each chunk's keys (forward) or queries and output gradients (backward) loaded
once for all of them, where `triton_soe._soe_state_kernel` and `_soe_bwd_state_kernel` run a
program per term and each loads them again. Opt-in (`triton_soe.STATE_TERMS`) until a GPU has
timed it.

Why: those loads are most of what the state passes move. For the GPU bench's KERPLE-power at
65,536 tokens (B·H = 8, 9 terms, NPRF's 32 float32 features, bf16 values) the forward's pass
moves 1.52 GB, 1.21 of it φk and v read once per term, and the backward's 1.56 GB, 1.25 of it
φq, the output gradient and the row scales (`benchmarks/soe_traffic.py`); on the H100 the two
passes took about 40% of the call (h100-2026-11-27-profile.json: 2.5 and 2.5 of 11.7 ms, 16
terms then). Stacked by KG, those reads fall KG-fold, and the product of a chunk's keys with
its values is one `[KG·F, T] x [T, BV]` tensor-core product instead of KG of `[F, T] x [T, BV]`.

The same recurrences, states and carries as the per-term kernels (`S_k(n+1) = γ_k^T S_k(n) +
(φk ⊙ γ_k^(T-1-t))ᵀ [v, 1]` over key chunk n; the gradients' in reverse), in the same layouts
(`h [B·H, K, N, BF, BDV]`, `dh [B·H, K, N+1, BF, BDV]`, carries `[B·H·K, NBK, BF, BDV]`), so
`triton_chunked._state_pass` runs them sequentially or blocked alike; terms past K in the last
stack (γ = 1, weight 0) are computed and never stored. The step and the carries' loads and
stores are the SoE walk's (`triton_soe_walk`), whose totals kernel is this forward pass less
its stores (ptxas, sm_90, 4 warps: no spill at KG = 2 in any mode, 244-632 B at KG = 4 with
float32 features: `benchmarks/walk_ptxas.py`).
"""
from __future__ import annotations

import torch

from .triton_chunked import HAS_TRITON, _state_pass

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_chunked import _dot, _load_rows, _row_inv
    from .triton_soe_walk import _carry_at, _key_step, _stack, _store_total, _terms

    @triton.jit
    def _stack_program(NBK, BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, KG: tl.constexpr):
        """A stacked pass's program of grid (B·H, BDV/BV, stacks·NBK): `(bh, value block iv,
        first term k0, chunk block blk, t, f, c)`, c the block's value columns."""
        iv = tl.program_id(1)
        return (tl.program_id(0).to(tl.int64), iv, (tl.program_id(2) // NBK) * KG, tl.program_id(2) % NBK,
                tl.arange(0, BT), tl.arange(0, BF), iv * BV + tl.arange(0, BV))

    @triton.jit
    def _stacked_start(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF: tl.constexpr, BV: tl.constexpr,
                       BDV: tl.constexpr, KG: tl.constexpr, ACC: tl.constexpr, PHASE: tl.constexpr):
        """A stacked pass's start: the block's carries (PHASE 2), else zero."""
        if PHASE == 2:
            S, z = _carry_at(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BDV, KG, BV, ACC)
        else:
            S = tl.zeros([KG * BF, BV], dtype=ACC)
            z = tl.zeros([KG * BF], dtype=ACC)
        return S, z

    @triton.jit
    def _store_stacked(h_ptr, z_ptr, S, z, at, f, c, ok, iv, BF: tl.constexpr, BDV: tl.constexpr,
                       KG: tl.constexpr, BV: tl.constexpr):
        """The stacked S `[KG·BF, BV]`, z `[KG·BF]` into each term's state at row `at` `[KG]`
        (`h[at, f, c]`, `z[at, f]`: `at` counts states of BF rows); z by the first value block."""
        tl.store(h_ptr + (at[:, None, None] * BF + f[None, :, None]) * BDV + c[None, None, :],
                 tl.reshape(S, [KG, BF, BV]).to(h_ptr.dtype.element_ty), mask=ok[:, None, None])
        tl.store(z_ptr + at[:, None] * BF + f[None, :], tl.reshape(z, [KG, BF]),
                 mask=ok[:, None] & ((f + iv * BF) < BF)[None, :])

    @triton.jit
    def _stacked_state_kernel(k_ptr, v_ptr, lgk_ptr, h_ptr, z_ptr, c_ptr, cz_ptr, Lk, F, Dv, N, K, GB, NBK,
                              BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                              KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                              PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, ceil(K/KG)·NBK): `triton_soe._soe_state_kernel`'s states of the
        terms k0 .. k0+KG-1 (k0 = KG · program_id(2) // NBK), over chunks blk·GB .. of block
        blk; PHASE as its (1: the block's totals alone, into c/cz; 2: from the carries)."""
        bh, iv, k0, blk, t, f, c = _stack_program(NBK, BT, BF, BV, KG)
        kk = k0 + tl.arange(0, KG)
        ok = kk < K
        lg = tl.load(lgk_ptr + kk, mask=ok, other=0.0).to(ACC)  # (padding: γ = 1, never stored)
        kdec = tl.exp(lg[None, :] * (BT - 1 - t)[:, None].to(ACC))  # [BT, KG]
        g = tl.reshape(tl.broadcast_to(tl.exp(lg * BT)[:, None], [KG, BF]), [KG * BF])
        S, z = _stacked_start(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BV, BDV, KG, ACC, PHASE)
        row = (bh * K + k0 + tl.arange(0, KG)) * N
        kb, vb = k_ptr + bh * Lk * F, v_ptr + bh * Lk * Dv
        for n in range(blk * GB, tl.minimum(blk * GB + GB, N)):
            if PHASE != 1:
                _store_stacked(h_ptr, z_ptr, S, z, row + n, f, c, ok, iv, BF, BDV, KG, BV)
            S, z = _key_step(S, z, g, kb, vb, kdec, n, Lk, F, Dv, t, f, c, BT, BF, KG, DT, ACC, MODE)
        if PHASE == 1:
            _store_total(c_ptr, cz_ptr, S, z, bh, k0, K, blk, NBK, f, c, ok, iv, BF, BDV, KG, BV)

    @triton.jit
    def _stacked_bwd_state_kernel(q_ptr, do_ptr, inv_ptr, dd_ptr, wq_ptr, lgk_ptr, dh_ptr, dz_ptr, c_ptr, cz_ptr,
                                  H, Lq, F, Dv, N, K, GB, NBK, q_offset,
                                  BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                                  NB: tl.constexpr, KG: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                                  MODE: tl.constexpr, SCALED: tl.constexpr, PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, ceil(K/KG)·NBK): `triton_soe._soe_bwd_state_kernel`'s gradients of
        the states of terms k0 .. k0+KG-1, chunks blk·GB+GB-1 down to blk·GB; dh[bh, k, N] stays
        0; PHASE as `_stacked_state_kernel`'s."""
        bh, iv, k0, blk, t, f, c = _stack_program(NBK, BT, BF, BV, KG)
        ok, w, _, g = _terms(lgk_ptr, wq_ptr, bh % H, k0, K, t, BT, KG, BF, ACC)
        D, dz = _stacked_start(c_ptr, cz_ptr, bh, k0, K, blk, NBK, f, c, ok, BF, BV, BDV, KG, ACC, PHASE)
        row = (bh * K + k0 + tl.arange(0, KG)) * (N + 1)
        qb, dob, ivb, ddb = q_ptr + bh * Lq * F, do_ptr + bh * Lq * Dv, inv_ptr + bh * Lq, dd_ptr + bh * Lq
        n_hi = tl.minimum(blk * GB + GB, N)
        for i in range(n_hi - blk * GB):
            n = n_hi - 1 - i
            qi = (n + NB - 1) * BT + t - q_offset  # the query chunk that reads S_k(n)
            qm = (qi >= 0) & (qi < Lq)
            qw = _stack(_load_rows(qb, qi, qm, f, F, F).to(ACC), w, BT, KG, BF)  # [BT, KG·BF]
            do = _load_rows(dob, qi, qm, c, Dv, Dv)
            dd = tl.load(ddb + qi, mask=qm, other=0.0).to(ACC)
            qs = qw * _row_inv(ivb, qi, qm, ACC, SCALED)[:, None]
            D = D * g[:, None] + _dot(tl.trans(qs), do, DT, ACC, MODE)
            dz = dz * g + tl.sum(qw * dd[:, None], 0)
            if PHASE != 1:
                _store_stacked(dh_ptr, dz_ptr, D, dz, row + n, f, c, ok, iv, BF, BDV, KG, BV)
        if PHASE == 1:
            _store_total(c_ptr, cz_ptr, D, dz, bh, k0, K, blk, NBK, f, c, ok, iv, BF, BDV, KG, BV)


#: the stacked passes' warps: at four terms a program and 4 warps the walk's totals kernel, this
#: forward pass less its stores, spilled 244-632 B a thread with float32 features (sm_90, triton
#: 3.6.0, results/walk_ptxas-sm90.json); at 8 warps 0-52 B. Like the per-term passes, not tuned
#: (Triton's default 3 stages)
STACK_WARPS = 8


def stack_size(K: int, terms: int) -> int:
    """KG: the terms a program stacks for K terms, at most `terms` a program (a power of two,
    no more than K's next one)."""
    KG = 1
    while KG * 2 <= max(1, terms) and KG < K:
        KG *= 2
    return KG


def stacked_group(group: int, K: int, terms: int) -> int:
    """The terms a launch group of K takes where the state passes stack up to `terms` a program,
    from the state budget's `group` (`soe.terms_per_group`): all K where the budget holds them,
    else whole stacks, at least one even past the budget. At L = 1M, B·H = 8 the budget (1 GiB)
    holds one term's states (0.55 GB in bf16); a group of one stacks nothing, so four terms a
    program take four a group: 2.2 GB of states, and as much again for their gradients in the
    backward (`benchmarks/composition_memory.py --state-terms 4` for the call's peak)."""
    KG = stack_size(K, terms)
    if KG == 1 or group >= K:
        return group
    return max(KG, group // KG * KG)


def forward_states(phi_k, v, lgk, N, T, BF, BDV, BV, hdt, acc, meta, scan, KG: int):
    """`triton_soe._soe_states` by `_stacked_state_kernel`: `(h [B·H, K, N, BF, BDV],
    z [B·H, K, N, BF])`."""
    B, H, Lk, F = phi_k.shape
    Dv, K = v.shape[3], lgk.numel()
    h = torch.empty(B * H, K, N, BF, BDV, dtype=hdt, device=phi_k.device)
    z = torch.empty(B * H, K, N, BF, dtype=acc, device=phi_k.device)
    stacks = -(-K // KG)
    _state_pass(lambda nb, h, z, c, cz, G, NBK, phase: _stacked_state_kernel[(B * H, BDV // BV, stacks * nb)](
        phi_k, v, lgk, h, z, c, cz, Lk, F, Dv, N, K, G, NBK, BT=T, BF=BF, BV=BV, BDV=BDV, KG=KG, PHASE=phase,
        num_warps=STACK_WARPS, **meta), h, z, lgk, N, T, N * T, reverse=False, mode=scan,
        programs=B * H * (BDV // BV) * stacks, from_zero=True)
    return h, z


def backward_states(phi_q, dnum, inv, dden, wq, lgk, dh, dz, N, T, NB, BF, BDV, BV, q_offset, meta, scaled: dict,
                    scan, KG: int) -> None:
    """The gradients of the states into `dh`, `dz` (zeros, `[B·H, K, N+1, ...]`), as
    `triton_soe._soe_state_grads` makes them by `_soe_bwd_state_kernel`, by `_stacked_bwd_state_kernel`."""
    B, H, Lq, F = phi_q.shape
    Dv, K = dnum.shape[3], lgk.numel()
    stacks = -(-K // KG)
    _state_pass(lambda nb, dh, dz, c, cz, G, NBK, phase: _stacked_bwd_state_kernel[(B * H, BDV // BV, stacks * nb)](
        phi_q, dnum, inv, dden, wq, lgk, dh, dz, c, cz, H, Lq, F, Dv, N, K, G, NBK, q_offset, BT=T, BF=BF, BV=BV,
        BDV=BDV, NB=NB, KG=KG, PHASE=phase, num_warps=STACK_WARPS, **meta, **scaled), dh, dz, lgk, N, T, N * T,
        reverse=True, mode=scan, programs=B * H * (BDV // BV) * stacks, from_zero=True)
