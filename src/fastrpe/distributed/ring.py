"""Exact attention with a positional term, key/value blocks passed around a ring: softmax
(below) and kernelized attention with any 1D Toeplitz term (`kernel_ring_attention`, at the
end of this module: block-Toeplitz products between rank pairs, each by the single-process
dense or FFT op).

Rank r holds queries, keys and values of its slice (global positions `off_r .. off_r+L_r-1`).
In P steps every key/value block visits every rank: at step t rank r holds the block of
rank `(r − t) mod P`, scores it against its queries,

    s_ij = w(j − i)·scale·q_i·k_j + b(j − i)        (b: the term's log-coefficients, w: its
                                                     logit weight, KERPLE bias+weight only)

with i, j global positions, and merges it into a running (max, sum, output) by log-sum-exp
(online softmax, as FlashAttention), tile by tile (at most `TILE_ELEMENTS` scores at once:
a million-token slice never materializes its `[L_r, L_s]` scores). Causal calls skip
blocks of later ranks (wholly in the future: their numbers never enter this rank's output)
and mask the diagonal block. Key padding masks travel with their keys. While a block is
scored, the next one is already in flight (`isend`/`irecv`).

Backward (a custom autograd Function, FlashAttention-2's form): the blocks go around the ring
again, now with their gradient accumulators `dk, dv`, which return to their owner after the
last step (causal: from the last rank, directly); each rank recomputes its scores tile by tile from the saved log-sum-exp, so
memory is one key block and one tile of scores at a time, never the `[L_r, L]` scores. The positional term enters as one coefficient
vector per rank (`b` and `w` at every offset its queries can see, `[H, L_r + L − 1]`), whose
gradient the backward accumulates along the blocks' diagonals; autograd takes it on to the
term's parameters (this rank's share; summed over ranks it is the single-process gradient).

Communication, bytes rank r sends per layer (B batch, H heads, L sequence, D/Dv widths, P
ranks, `b` bytes per element of the inputs, `b'` of the math dtype, float32 for half inputs;
`r+1` the next rank, mod P):
* forward, non-causal: every block but the next rank's own, `B·H·(L − L_{r+1})·(D + Dv)·b`;
  causal: a block stops at the last rank, so rank r sends the blocks of ranks 0..r,
  `B·H·(off_r + L_r)·(D + Dv)·b`, and the last rank sends nothing (half as much on average);
* backward: blocks (sent ahead, while the previous one is computed) and their
  accumulators, then the accumulators home; non-causal
  `B·H·((L − L_{r+1})·(D + Dv)·(b + b') + L_{r+1}·(D + Dv)·b')`; causal (blocks stop at the
  last rank, which sends each accumulator straight home) `B·H·(off_r + L_r)·(D + Dv)·(b + b')`,
  the last rank `B·H·(L − L_{P−1})·(D + Dv)·b'`;
* plus the `[B, L_s]` padding masks (one byte per key) beside the blocks when there are any.

Notation: n = L_r this rank's length, m = a block's length, P ranks, off_r / off_s offsets.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _index
from . import comm


def ring_reasons(p) -> list[str]:
    """Why the ring cannot run the whole-sequence problem `p` (empty: it can)."""
    if not p.softmax:
        return kernel_ring_reasons(p)
    r = []
    if p.additive:
        r.append("additive terms (" + ", ".join(type(t).__name__ for t in p.additive)
                 + ") are not in the ring (path 'gather' runs them)")
    return r


def _peer(group, r: int) -> int:
    """The global rank of rank `r` of `group` (point-to-point calls take global ranks)."""
    return r if group is None else dist.get_global_rank(group, r)


def _shift(tensors: list[Tensor], recv_shapes: list[tuple], group, name: str, send: bool = True,
           recv: bool = True, tag: int = 0) -> tuple[list, list[Tensor] | None]:
    """Send `tensors` to the next rank (if `send`) and receive the previous rank's (of
    `recv_shapes`, if `recv`; both sides of a pair must agree): returns the handles to
    `wait()` on (holding the sent tensors alive) and the receive buffers (None without recv)."""
    rank, size = comm.world(group)
    nxt, prv = _peer(group, (rank + 1) % size), _peer(group, (rank - 1) % size)
    bufs = [torch.empty(s, dtype=t.dtype, device=t.device) for t, s in zip(tensors, recv_shapes)] if recv else None
    sent = [t.contiguous() for t in tensors] if send else []
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + 10 * i) for i, t in enumerate(sent)]
    ops += [dist.P2POp(dist.irecv, b, prv, group, tag + 10 * i) for i, b in enumerate(bufs or [])]
    works = dist.batch_isend_irecv(ops) if ops else []
    comm._record(name, sum(t.numel() * t.element_size() for t in sent))
    return _Pending(works, sent), bufs


class _Pending(list):
    """The handles of a shift (call `wait()` on each), holding the sent tensors alive until then."""

    def __init__(self, works, sent):
        super().__init__(works)
        self.sent = sent


def _math_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_blocks(kv: Tensor, mask: Tensor | None, lengths, causal: bool, group):
    """The forward ring's schedule: yields `(src, kv block, mask block)` for every rank `src`
    whose keys this rank scores, starting with its own, while the next block is in flight.
    Causal: a later rank's block is wholly in the future and skipped, and a block goes no
    further than the last rank (no rank after a wrap reads it)."""
    rank, size = comm.world(group)
    B, H, _, C = kv.shape
    blk_mask = mask
    for t in range(size):
        src = (rank - t) % size
        if t < size - 1:
            m_in = lengths[(src - 1) % size]
            shapes = [(B, H, m_in, C)] + ([(B, m_in)] if mask is not None else [])
            send = not causal or (rank < size - 1 and t <= rank)
            recv = not causal or (rank >= 1 and t <= rank - 1)
            works, bufs = _shift([kv] + ([blk_mask] if mask is not None else []), shapes, group, "ring",
                                 send=send, recv=recv)
        if not (causal and src > rank):
            yield src, kv, blk_mask
        if t < size - 1:
            for w in works:
                w.wait()
            if bufs is not None:
                kv = bufs[0]
                blk_mask = bufs[1] if mask is not None else None


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, coef, wvec, mask, scale, causal, lengths, group):
        rank = comm.world(group)[0]
        dt = _math_dtype(q.dtype)
        B, H, n, D = q.shape
        Dv = v.shape[-1]
        off = sum(lengths[:rank])
        qm = q.to(dt)
        m = torch.full((B, H, n), float("-inf"), dtype=dt, device=q.device)  # running max
        l = torch.zeros(B, H, n, dtype=dt, device=q.device)  # running sum
        acc = torch.zeros(B, H, n, Dv, dtype=dt, device=q.device)
        kv = torch.cat([k, v], dim=-1)  # (B, H, n, D + Dv): one message per step
        for src, kv, blk_mask in _forward_blocks(kv, mask, lengths, causal, group):
            off_s = sum(lengths[:src])
            for i0, i1, j0, j1 in _tiles(B, H, n, kv.shape[2]):
                s = _scores(qm[:, :, i0:i1], kv[:, :, j0:j1, :D].to(dt), coef, wvec, scale, n, off + i0,
                            off_s + j0, off, causal, None if blk_mask is None else blk_mask[:, j0:j1])[0]
                mo = m[..., i0:i1]
                m_new = torch.maximum(mo, s.amax(-1))  # (B, H, rows)
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(mo - m_safe)
                l[..., i0:i1] = l[..., i0:i1] * alpha + p.sum(-1)
                acc[:, :, i0:i1] = acc[:, :, i0:i1] * alpha[..., None] + p @ kv[:, :, j0:j1, D:].to(dt)
                m[..., i0:i1] = m_new
        ok = l > 0
        out = torch.where(ok[..., None], acc / torch.where(ok, l, torch.ones_like(l))[..., None], torch.zeros_like(acc))
        lse = torch.where(ok, m + torch.log(torch.where(ok, l, torch.ones_like(l))), torch.full_like(l, float("inf")))
        ctx.save_for_backward(q, k, v, coef, wvec, mask, out, lse)
        ctx.cfg = (scale, causal, lengths, group)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, coef, wvec, mask, out, lse = ctx.saved_tensors
        scale, causal, lengths, group = ctx.cfg
        rank, size = comm.world(group)
        dt = _math_dtype(q.dtype)
        B, H, n, _ = q.shape
        off = sum(lengths[:rank])
        qm, do = q.to(dt), dout.to(dt)
        delta = (do * out).sum(-1)  # (B, H, n): rowsum(dO ∘ O)
        dq = torch.zeros_like(qm)
        dcoef = None if coef is None else torch.zeros(coef.shape, dtype=dt, device=q.device)
        dw = None if wvec is None else torch.zeros(wvec.shape, dtype=dt, device=q.device)

        def block_grad(src, kb, vb, blk_mask):
            kb, vb = kb.to(dt), vb.to(dt)
            m, off_s = kb.shape[2], sum(lengths[:src])
            g = torch.zeros(B, H, m, kb.shape[-1] + vb.shape[-1], dtype=dt, device=q.device)  # [dk, dv]
            for i0, i1, j0, j1 in _tiles(B, H, n, m):
                qt, kt, vt, dot = qm[:, :, i0:i1], kb[:, :, j0:j1], vb[:, :, j0:j1], do[:, :, i0:i1]
                s, qk, idx = _scores(qt, kt, coef, wvec, scale, n, off + i0, off_s + j0, off, causal,
                                     None if blk_mask is None else blk_mask[:, j0:j1])
                p = torch.exp(s - lse[..., i0:i1, None])  # (B, H, rows, keys); rows with no key: 0
                dv_t = p.transpose(-1, -2) @ dot  # (B, H, keys, Dv)
                ds = p * (dot @ vt.transpose(-1, -2) - delta[..., i0:i1, None])  # d(score)
                if dcoef is not None:
                    dcoef.index_add_(1, idx.reshape(-1), ds.sum(0).reshape(H, -1))
                if dw is not None:
                    dw.index_add_(1, idx.reshape(-1), (ds * qk).sum(0).reshape(H, -1))
                    ds = ds * wvec.to(dt)[:, idx]
                dq[:, :, i0:i1] += scale * (ds @ kt)
                g[:, :, j0:j1] += torch.cat([scale * (ds.transpose(-1, -2) @ qt), dv_t], dim=-1)
            return g

        grads = _backward_ring(k, v, mask, dt, lengths, group, causal, block_grad)
        D = k.shape[-1]
        dk, dv = grads[..., :D], grads[..., D:]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if dcoef is None else dcoef.to(coef.dtype), None if dw is None else dw.to(wvec.dtype),
                None, None, None, None, None)


def _backward_ring(k, v, mask, dt, lengths, group, causal, block_grad):
    """The backward's ring: every key/value block visits the ranks that read it again, and its
    gradient accumulator `[dk, dv]` (in the math dtype `dt`) follows it and finally returns
    home. `block_grad(src, kb, vb, mask_b) -> [B, H, m, D + Dv]` is this rank's contribution
    to the block of rank `src` (called for every block this rank's rows see). The next
    block's keys and values are in flight while one is computed; only the accumulator waits
    for the computation. Non-causal: all the way round, then one step home. Causal: a block
    goes from its owner to the last rank (no earlier rank reads it), which sends the
    accumulator straight home. Returns this rank's own `[B, H, n, D + Dv]`."""
    rank, size = comm.world(group)
    B, H, n, D = k.shape
    Dv = v.shape[-1]
    kv, blk_mask = torch.cat([k, v], dim=-1), mask  # (B, H, n, D + Dv), in the inputs' dtype
    acc = torch.zeros(B, H, n, D + Dv, dtype=dt, device=k.device)
    last = size - 1
    home = None
    if causal and size > 1 and rank < last:  # the last rank sends this rank's accumulator home
        home = torch.empty(B, H, n, D + Dv, dtype=dt, device=k.device)
        home_work = dist.irecv(home, _peer(group, last), group, tag=3)
    home_sends = []
    for t in range(size):
        src = (rank - t) % size
        if causal and src > rank:  # every block this rank reads is done
            break
        if t < size - 1:
            m_in = lengths[(src - 1) % size]
            send = not causal or (rank < last and t <= rank)
            recv = not causal or (rank >= 1 and t <= rank - 1)
            shapes = [(B, H, m_in, D + Dv)] + ([(B, m_in)] if mask is not None else [])
            kv_works, kv_bufs = _shift([kv] + ([blk_mask] if mask is not None else []), shapes, group,
                                       "ring.backward", send=send, recv=recv, tag=1)
        acc = acc + block_grad(src, kv[..., :D], kv[..., D:], blk_mask)
        if src == rank:
            mine = acc  # the last rank's own block is complete here (causal: no later rank)
        elif causal and rank == last:  # every rank that reads this block is done: straight home
            acc_c = acc.contiguous()
            home_sends.append((dist.isend(acc_c, _peer(group, src), group, tag=3), acc_c))
            comm._record("ring.backward", acc_c.numel() * acc_c.element_size())
        if t < size - 1:
            acc_works, acc_bufs = _shift([acc], [(B, H, m_in, D + Dv)], group, "ring.backward", send=send,
                                         recv=recv, tag=2)
            for w in (*kv_works, *acc_works):
                w.wait()
            if kv_bufs is not None:
                kv = kv_bufs[0]
                blk_mask = kv_bufs[1] if mask is not None else None
                acc = acc_bufs[0]
    for w, _ in home_sends:
        w.wait()
    if causal:
        if rank == last:
            return mine
        home_work.wait()
        return home
    if size > 1:  # the block here now belongs to the next rank: its accumulator goes home
        works, bufs = _shift([acc], [(B, H, n, D + Dv)], group, "ring.backward", tag=2)
        for w in works:
            w.wait()
        acc = bufs[0]
    return acc


#: score elements (B·H·rows·keys) one tile may hold: the ring never materializes more than
#: this much of the `[L_r, L_s]` scores of a block at once (256 MiB in float64)
TILE_ELEMENTS = 1 << 25


def _tiles(B: int, H: int, n: int, m: int):
    """`(i0, i1, j0, j1)` tiles of an `[n, m]` block with at most `TILE_ELEMENTS` scores each."""
    per_row = B * H
    cq = n if per_row * n * m <= TILE_ELEMENTS else max(1, min(n, int((TILE_ELEMENTS // per_row) ** 0.5)))
    ck = max(1, min(m, TILE_ELEMENTS // (per_row * cq)))
    for i0 in range(0, n, cq):
        for j0 in range(0, m, ck):
            yield i0, min(n, i0 + cq), j0, min(m, j0 + ck)


def _scores(qm, kb, coef, wvec, scale, n: int, q_pos: int, k_pos: int, off: int, causal: bool, blk_mask):
    """Scores of a tile: rows of this rank's queries at global positions `q_pos + 0..` against
    keys at `k_pos + 0..`. Returns `(s, qk, idx)`: `s` `[B, H, rows, keys]` masked to -inf
    where excluded (causal: keys after the query; padding), `qk = scale·q·kᵀ`, and `idx`
    `[rows, keys]` the index of each pair's offset in the coefficient vectors, whose entry
    `j − i + n − 1` belongs to this rank's row i (global `off + i`) and global key j."""
    rows, keys = qm.shape[2], kb.shape[2]
    qk = scale * (qm @ kb.transpose(-1, -2))  # (B, H, rows, keys)
    qp = torch.arange(q_pos, q_pos + rows, device=qm.device)[:, None]
    kp = torch.arange(k_pos, k_pos + keys, device=qm.device)[None, :]
    idx = kp - (qp - off) + (n - 1)  # (rows, keys)
    s = qk
    if wvec is not None:
        s = s * wvec.to(qm.dtype)[:, idx]
    if coef is not None:
        s = s + coef.to(qm.dtype)[:, idx]
    if causal and k_pos + keys - 1 > q_pos:  # some key after some query
        s = s.masked_fill(kp > qp, float("-inf"))
    if blk_mask is not None:
        s = s.masked_fill(blk_mask.bool()[:, None, None, :], float("-inf"))
    return s, qk, idx


def ring_attention(q: Tensor, k: Tensor, v: Tensor, p, *, key_padding_mask: Tensor | None, has_mask: bool,
                   lengths: list[int], group) -> Tensor:
    """This rank's rows of exact softmax attention over the whole sequence.

    Args:
        q, k: `[B, H, n, D]`, v: `[B, H, n, Dv]`, this rank's slice (global positions
            `off_r .. off_r + n − 1`).
        p: the whole-sequence `dispatch.Problem` (kernel softmax; its position, scale, causal).
        key_padding_mask: `[B, n]` bool or None; has_mask: whether any rank has one (then
            every rank sends one, None counting as no padding).
        lengths: every rank's n, in rank order; group: the process group.

    Returns:
        `[B, H, n, Dv]` in q's dtype.
    """
    rank, size = comm.world(group)
    B, H, n, D = q.shape
    L, off = sum(lengths), sum(lengths[:rank])
    scale = D ** -0.5 if p.scale is None else p.scale
    coef = wvec = None
    pos = p.position
    if pos is not None:
        # b(r) and w(r) at every offset this rank's queries see: r = -(off+n-1) .. L-1-off
        coef = pos.log_coefficients(n, L, off)  # (H, n + L - 1)
        if pos.weight is not None:
            dev = coef.device
            r = _index.offsets(n, L, off, device=dev)
            h = torch.arange(pos.num_heads, device=dev)[:, None]
            wvec = pos.weight(h, r[None, :]).expand(pos.num_heads, r.numel())
        coef = coef.to(q.device)
        wvec = None if wvec is None else wvec.to(q.device)
    mask = None
    if has_mask:
        mask = key_padding_mask if key_padding_mask is not None else torch.zeros(B, n, dtype=torch.bool,
                                                                                   device=q.device)
        mask = mask.to(torch.uint8)  # travels with its keys; gloo has no bool
    with torch.autocast(q.device.type, enabled=False):  # scores in float32/64, as the dense backend
        return _Ring.apply(q, k, v, coef, wvec, mask, float(scale), bool(p.causal), tuple(lengths), group)


# ---------------------------------------------------------------------------------------------
# Kernelized attention with an arbitrary Toeplitz term: block-Toeplitz products on the ring
#
# Luo et al. 2021 Eq. 10 for rank r's rows, `out_i = Σ_s num_s(i) / Σ_s den_s(i)` with
# `[num_s, den_s](i) = Σ_{j in rank s} φ(q_i)·φ(k_j)·c(j − i)·[v_j, 1]`: each rank pair's
# block is a Toeplitz product with offsets `off_s − off_r − L_r + 1 .. off_s − off_r + L_s − 1`,
# which the single-process FFT op computes (`q_offset = 0` on a slice of the coefficient
# vector). The blocks of `k, v` travel as in the softmax ring; partial sums carry their own
# row scales (`log_scale`), merged by a running maximum. Backward recomputes each block's op
# under autograd and sends `dk, dv` home with the blocks: one block in memory at a time.


def kernel_ring_reasons(p) -> list[str]:
    """Why the kernelized ring cannot run the whole-sequence problem `p` (empty: it can)."""
    from ..kernels import Exp, FeatureMap
    from ..positions.grid import GridTerm

    kern, r = p.kernel, []
    if not isinstance(kern, FeatureMap):
        return ["not a feature map"]
    if p.additive:
        r.append("additive terms (" + ", ".join(type(t).__name__ for t in p.additive)
                 + ") are not in the ring (path 'gather' runs them)")
    data_dependent = (isinstance(kern, Exp) and not kern.normalize) or \
        (type(kern).key_features is not FeatureMap.key_features and not isinstance(kern, Exp))
    if data_dependent:
        r.append(f"{type(kern).__name__} shifts keys by a data-dependent amount (path 'gather' runs it)")
    if any(prm.requires_grad for prm in kern.parameters()):
        r.append(f"{type(kern).__name__} has trainable parameters (path 'gather' trains them)")
    if p.position is not None and (p.position.softmax_only or isinstance(p.position, GridTerm)):
        r.append(f"{type(p.position).__name__} has no 1D kernelized form")
    return r


def _block_num_den(kernel, op, qm, kb, vb, coef_b, diagonal, mask_b):
    """`(num, den, log_scale)` of this rank's rows against one key block (`log_scale` as
    `[B, H, n]`): the single-process op `op(m, diagonal)` (dense or FFT) on the block's slice
    of the coefficients."""
    phi_q = kernel(qm, is_query=True)  # (B, H, n, F)
    phi_k, _ = kernel.key_features(kb, causal=False, key_padding_mask=mask_b)  # shift: data-independent
    num, den, ls = op(kb.shape[2], diagonal)(phi_q, phi_k, vb.to(phi_q.dtype), coef_b, causal=diagonal, q_offset=0,
                                             key_padding_mask=mask_b)
    return num, den, torch.broadcast_to(ls, den.shape)


def _block_ops(p, n: int, backend: str):
    """`op(m, diagonal)`: the inner-product algorithm for an `[n, m]` block: the FFT when
    `backend="fft"` is forced, else dense or FFT, whichever the single-process cost model
    says is cheaper for that block (dense wins for small blocks on CPU by a wide margin)."""
    import dataclasses

    from ..dispatch import BACKENDS, memory_limit
    from ..ops.kernelized import num_den_dense, num_den_fft

    cache: dict = {}

    def op(m: int, diagonal: bool):
        if backend == "fft":
            return num_den_fft
        if (m, diagonal) not in cache:
            pb = dataclasses.replace(p, Lq=n, Lk=m, q_offset=0, causal=diagonal, requires_grad=True)
            dense, fft = BACKENDS["dense"].cost(pb), BACKENDS["fft"].cost(pb)
            cheap = dense.seconds <= fft.seconds and dense.bytes <= memory_limit(p.device)
            cache[(m, diagonal)] = num_den_dense if cheap else num_den_fft
        return cache[(m, diagonal)]

    return op


class _KernelRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, coef, mask, kernel, op, causal, lengths, group):
        rank = comm.world(group)[0]
        n, D = q.shape[2], q.shape[3]
        num = den = top = None
        kv = torch.cat([k, v], dim=-1)  # (B, H, n, D + Dv)
        for src, kv, blk_mask in _forward_blocks(kv, mask, lengths, causal, group):
            m, off_s = kv.shape[2], sum(lengths[:src])
            coef_b = None if coef is None else coef[:, off_s:off_s + n + m - 1]
            nb, db, ls = _block_num_den(kernel, op, q, kv[..., :D], kv[..., D:], coef_b, causal and src == rank,
                                        None if blk_mask is None else blk_mask.bool())
            if num is None:
                num, den, top = nb, db, ls
            else:  # merge by the larger row scale
                new = torch.maximum(top, ls)
                a, b = torch.exp(top - new), torch.exp(ls - new)
                num, den, top = num * a[..., None] + nb * b[..., None], den * a + db * b, new
        ok = den != 0
        out = torch.where(ok[..., None], num / torch.where(ok, den, torch.ones_like(den))[..., None],
                          torch.zeros_like(num))
        ctx.save_for_backward(q, k, v, coef, mask, out, den, top)
        ctx.cfg = (kernel, op, causal, lengths, group)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, coef, mask, out, den, top = ctx.saved_tensors
        kernel, op, causal, lengths, group = ctx.cfg
        rank = comm.world(group)[0]
        n = q.shape[2]
        dt = out.dtype
        ok = den != 0
        safe = torch.where(ok, den, torch.ones_like(den))
        # out = N / Dn with N = Σ_s num_s·e^(ls_s − top), Dn likewise (top: a constant)
        g_num = torch.where(ok[..., None], dout.to(dt) / safe[..., None], torch.zeros_like(out))
        g_den = torch.where(ok, -(dout.to(dt) * out).sum(-1) / safe, torch.zeros_like(den))
        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        dcoef = None if coef is None else torch.zeros(coef.shape, dtype=dt, device=q.device)

        def block_grad(src, kb, vb, blk_mask):
            nonlocal dq
            m, off_s = kb.shape[2], sum(lengths[:src])
            with torch.enable_grad():
                qq = q.detach().requires_grad_()
                kb = kb.detach().requires_grad_()
                vb = vb.detach().requires_grad_()
                ins = [qq, kb, vb]
                coef_b = None
                if coef is not None:
                    coef_b = coef[:, off_s:off_s + n + m - 1].detach().requires_grad_()
                    ins.append(coef_b)
                nb, db, ls = _block_num_den(kernel, op, qq, kb, vb, coef_b, causal and src == rank,
                                            None if blk_mask is None else blk_mask.bool())
                w = torch.exp(ls - top)  # (B, H, n)
                surrogate = ((nb * g_num).sum(-1) * w).sum() + (db * g_den * w).sum()
                grads = torch.autograd.grad(surrogate, ins, allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, ins)]
            dq = dq + grads[0].to(dt)
            if coef is not None:
                dcoef[:, off_s:off_s + n + m - 1] += grads[3].to(dt)
            return torch.cat([grads[1].to(dt), grads[2].to(dt)], dim=-1)

        grads = _backward_ring(k, v, mask, dt, lengths, group, causal, block_grad)
        D = k.shape[-1]
        return (dq.to(q.dtype), grads[..., :D].to(k.dtype), grads[..., D:].to(v.dtype),
                None if dcoef is None else dcoef.to(coef.dtype), None, None, None, None, None, None)


def kernel_ring_attention(q: Tensor, k: Tensor, v: Tensor, p, *, key_padding_mask: Tensor | None, has_mask: bool,
                          lengths: list[int], group, backend: str = "auto") -> Tensor:
    """This rank's rows of kernelized attention with any 1D Toeplitz term (Luo Eq. 10) over the
    whole sequence, key/value blocks passed around the ring. Arguments as `ring_attention`;
    `backend`: "fft" runs every block by FFT, "auto" each block by dense or FFT, by cost."""
    rank, size = comm.world(group)
    B, H, n, D = q.shape
    L, off = sum(lengths), sum(lengths[:rank])
    coef = None
    if p.position is not None:
        coef = p.position.log_coefficients(n, L, off).to(q.device)  # (H, n + L - 1)
    mask = None
    if has_mask:
        mask = key_padding_mask if key_padding_mask is not None else torch.zeros(B, n, dtype=torch.bool,
                                                                                   device=q.device)
        mask = mask.to(torch.uint8)
    with torch.autocast(q.device.type, enabled=False):
        return _KernelRing.apply(q, k, v, coef, mask, p.kernel, _block_ops(p, n, backend), bool(p.causal),
                                 tuple(lengths), group)
