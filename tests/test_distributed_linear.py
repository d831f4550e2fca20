"""Context parallelism for the linear-time paths (`fastrpe.distributed.linear`, issue 17):
4 CPU processes on gloo, float64, uneven slices (5, 17, 1, 40: one shorter than every band
width). Each rank runs the single-process `fastrpe.attention` on the whole sequence (the
dense reference, or `backend="soe"` for the sum of exponentials, whose fit is the same) and
compares its slice of the output and of the q, k, v gradients, and the positional
parameters' gradients summed over ranks, within 1e-10. The causal no-leak test perturbs
rank 3's keys and values and wants ranks 0-2 bit-identical.

Several checks share each launch: starting 4 processes costs seconds on a loaded machine.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.distributed import comm
from fastrpe.distributed import linear as dl
from fastrpe.ops.linear.soe import soe_plan
from fastrpe.testing import assert_lowp_close

WORLD = 4
LENGTHS = [5, 17, 1, 40]
B, H, D, DV = 2, 3, 6, 5
TOL = dict(atol=1e-10, rtol=1e-10)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


# ---------------------------------------------------------------------------------------------
# Workers (module level: the child processes import this module)


def _inputs(seed: int, lengths=LENGTHS, kpm: bool = False):
    """The whole sequence (the same on every rank): q, k, v `[B, H, N, .]` and a padding mask."""
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, N, DV, generator=g, dtype=torch.float64)
    mask = None
    if kpm:
        mask = torch.zeros(B, N, dtype=torch.bool)
        mask[1, 2::3] = True
    return q, k, v, mask


def _slice(x, rank, lengths=LENGTHS, dim=2):
    o = sum(lengths[:rank])
    return x.narrow(dim, o, lengths[rank])


def _make_position(name: str):
    torch.manual_seed(7)  # the same term on every rank
    if name == "none":
        return None
    if name == "alibi":
        return P.ALiBi(H).double()  # float32 slopes: chunked and dense differ by 5e-8 in float64 calls
    if name == "geometric":
        return P.GeometricDecay(H, gamma=[0.9, 0.6, 0.97], learnable=True).double()
    if name == "table":  # W = 8 > 5, 1: the halo spans several ranks
        return P.LearnedTable(H, max_distance=8, init_std=1.0).double()
    if name == "table_extreme":  # c = 0 somewhere, a huge tail: per-row scales must keep rows finite
        pos = P.LearnedTable(H, max_distance=8, init_std=1.0).double()
        with torch.no_grad():
            pos.table[0, 5] = float("-inf")
            pos.table[2, 0] = 40.0  # b(-8): every far key outweighs the band
            pos.table[1, 16] = -60.0  # b(+8)
        return pos
    if name == "t5":
        return P.T5Bias(H, num_buckets=8, max_distance=12).double()
    if name == "kerple_log":
        return P.KerpleLog(H).double()
    raise ValueError(name)


def _params(pos):
    return [] if pos is None else [p for p in pos.parameters() if p.requires_grad]


def _check_attention(rank, kernel, pos_name, causal, kpm, backend, seed):
    """This rank's output and gradients against the single-process call; returns the output."""
    q, k, v, mask = _inputs(seed, kpm=kpm)
    pos = _make_position(pos_name)
    w = torch.randn(B, H, sum(LENGTHS), DV, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    # the single-process reference on the whole sequence
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = fr.attention(qf, kf, vf, kernel, pos, causal=causal, key_padding_mask=mask, backend=backend)
    (ref * w).sum().backward()
    ref_pg = [p.grad.clone() for p in _params(pos)]
    for p in _params(pos):
        p.grad = None
    # this rank's slice
    ql, kl, vl = (_slice(t, rank).clone().requires_grad_() for t in (q, k, v))
    ml = None if mask is None else _slice(mask, rank, dim=1)
    out = dl.attention(ql, kl, vl, kernel, pos, causal=causal, key_padding_mask=ml)
    (out * _slice(w, rank)).sum().backward()
    what = f"rank {rank} {kernel} {pos_name} causal={causal} kpm={kpm}"
    torch.testing.assert_close(out, _slice(ref, rank), **TOL, msg=f"{what}: output")
    for name, a, b in (("q", ql, qf), ("k", kl, kf), ("v", vl, vf)):
        torch.testing.assert_close(a.grad, _slice(b.grad, rank), **TOL, msg=f"{what}: grad {name}")
    for p, g in zip(_params(pos), ref_pg):
        total = p.grad.clone()
        dist.all_reduce(total)  # each rank holds the part of the gradient it computed
        torch.testing.assert_close(total, g, **TOL, msg=f"{what}: grad of the positional parameters")
    return out.detach()


def _check_no_leak(rank, kernel, pos_name, seed):
    """Causal: changing rank 3's keys and values leaves ranks 0-2 bit-identical."""
    q, k, v, _ = _inputs(seed)
    pos = _make_position(pos_name)
    outs = []
    for perturb in (False, True):
        kk, vv = k.clone(), v.clone()
        if perturb:
            o3 = sum(LENGTHS[:3])
            kk[:, :, o3:] += 3.0 * torch.randn_like(kk[:, :, o3:])
            vv[:, :, o3:] -= 5.0
        with torch.no_grad():
            outs.append(dl.attention(_slice(q, rank), _slice(kk, rank), _slice(vv, rank), kernel, pos, causal=True))
    if rank < 3:
        assert torch.equal(outs[0], outs[1]), f"rank {rank} {pos_name}: a later rank's keys changed the output"
    else:
        assert not torch.equal(outs[0], outs[1])  # the perturbation is real


def _check_two_layers(rank):
    """Two layers (chunked causal, then band non-causal) and one backward: every rank runs
    the backward collectives in the same order; the input's gradient equals the single-process one."""
    q, k, v, _ = _inputs(80)
    wq = torch.randn(DV, D, generator=torch.Generator().manual_seed(81), dtype=torch.float64)
    geo, tab = _make_position("geometric"), _make_position("table")
    xf = q.clone().requires_grad_()
    y = fr.attention(xf, k + xf, v, "elu", geo, causal=True, backend="dense")
    fr.attention(y @ wq, k, y, "elu", tab, causal=False, backend="dense").sum().backward()
    xl = _slice(q, rank).clone().requires_grad_()
    kl, vl = _slice(k, rank), _slice(v, rank)
    y = dl.attention(xl, kl + xl, vl, "elu", geo, causal=True)
    dl.attention(y @ wq, kl, y, "elu", tab, causal=False).sum().backward()
    torch.testing.assert_close(xl.grad, _slice(xf.grad, rank), **TOL, msg=f"rank {rank}: two layers")


def _check_comm(rank):
    """The differentiable collectives: values, gradients (the sum over every rank's loss) and bytes."""
    x = torch.arange(3, dtype=torch.float64).add(10 * rank).requires_grad_()
    c_rank = float(rank + 1)  # rank q's loss weighs what it receives by q + 1
    with comm.counting() as c:
        lens = comm.slice_lengths(rank + 2)
        st = comm.all_gather(x)  # (P, 3)
        pre = comm.exclusive_prefix(x, lambda s: 2.0 ** s)
        suf = comm.exclusive_suffix(x, lambda s: 3.0)
        tot = comm.all_reduce_sum(x)
        parts = comm.all_gather_varlen(torch.full((rank + 2,), float(rank), dtype=torch.float64), 0, lens)
        mx = comm.all_reduce_max(x)
        loss = c_rank * (st.sum() + pre.sum() + suf.sum() + tot.sum())
    assert lens == [2, 3, 4, 5] and [p.tolist() for p in parts] == [[float(s)] * (s + 2) for s in range(WORLD)]
    assert torch.equal(st[:, 0], torch.arange(WORLD, dtype=torch.float64) * 10)
    assert torch.equal(pre, sum((2.0 ** s * (torch.arange(3.0) + 10 * s) for s in range(rank)), torch.zeros(3)).double())
    assert torch.equal(suf, sum((3.0 * (torch.arange(3.0) + 10 * s) for s in range(rank + 1, WORLD)),
                                torch.zeros(3)).double())
    assert torch.equal(mx, torch.arange(3.0).double() + 10 * (WORLD - 1))
    n = 3 * 8
    assert c.by_op() == {"slice_lengths": 3 * 8, "all_gather": 3 * n * 3 + 3 * 5 * 8, "all_reduce": 2 * 3 * n // 4,
                         "all_reduce_max": 2 * 3 * n // 4}, c.by_op()
    loss.backward()
    # d(Σ_q (q+1)·loss_q)/dx_r: stack 10, prefix Σ_{q>r} (q+1)·2^r, suffix Σ_{q<r} (q+1)·3, all-reduce 10
    want = 10 + sum(q + 1 for q in range(rank + 1, WORLD)) * 2.0 ** rank + sum(q + 1 for q in range(rank)) * 3 + 10
    torch.testing.assert_close(x.grad, torch.full((3,), want, dtype=torch.float64), atol=0, rtol=0)


def _dense_soe(phi_q, phi_k, v, plan):
    """Reference for the SoE coefficients (its module's formula, not its code):
    `c(d) = Σ_k a_k γ_k^d + corr(d)·[d < W]` for `d >= 0`, weights materialized."""
    N = phi_q.shape[2]
    d = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).double()  # (N, N)
    c = (plan.a[:, None, None, :] * plan.gamma ** d.clamp_min(0)[..., None]).sum(-1)  # (H, N, N)
    di = d.long()
    c = c + torch.where((di >= 0) & (di < plan.window), plan.corr[:, di.clamp(0, plan.window - 1)], 0.0)
    c = c.masked_fill(di[None] < 0, 0.0)
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k) * c[None]
    return a @ v, a.sum(-1)


def _worker(rank, path, suite, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        if suite == "causal":
            for i, (kernel, pos, kpm) in enumerate([("elu", "none", True), ("nexp", "alibi", False),
                                                    ("elu", "geometric", True), ("elu", "table", True),
                                                    ("elu", "table_extreme", False), ("relu", "t5", False)]):
                _check_attention(rank, kernel, pos, True, kpm, "dense", 10 + i)
            _check_attention(rank, "elu", "kerple_log", True, True, "soe", 20)  # the same fit: equal to 1e-10
            for pos in ("none", "geometric", "table", "kerple_log"):
                _check_no_leak(rank, "elu", pos, 30)
            _check_two_layers(rank)
        elif suite == "noncausal":
            for i, (kernel, pos, kpm) in enumerate([("elu", "none", True), ("exp", "none", True),
                                                    ("elu", "alibi", False), ("elu", "geometric", True),
                                                    ("elu", "table", True), ("elu", "table_extreme", True),
                                                    ("relu", "t5", True)]):
                _check_attention(rank, kernel, pos, False, kpm, "dense", 40 + i)
        elif suite == "soe_small_window":
            # a plan with W = 8 < N: far field by the K states, exact band across the halo
            torch.manual_seed(3)
            b = -0.3 * torch.arange(300, dtype=torch.float64).sqrt().expand(H, -1).clone()
            b[1] = -torch.log1p(torch.arange(300, dtype=torch.float64))
            b.requires_grad_()
            plan = soe_plan(b, window=8, num_terms=6)  # one fit per backward pass (its graph is freed)
            g = torch.Generator().manual_seed(5)
            N = sum(LENGTHS)
            pq = torch.rand(B, H, N, 4, generator=g, dtype=torch.float64)
            pk = torch.rand(B, H, N, 4, generator=g, dtype=torch.float64)
            v = torch.randn(B, H, N, DV, generator=g, dtype=torch.float64)
            w = torch.randn(B, H, N, DV + 1, generator=g, dtype=torch.float64)
            refs = [t.clone().requires_grad_() for t in (pq, pk, v)]
            num, den = _dense_soe(*refs, plan)
            gref = torch.autograd.grad((torch.cat([num, den[..., None]], -1) * w).sum(), [*refs, b])
            loc = [_slice(t, rank).clone().requires_grad_() for t in (pq, pk, v)]
            n2, d2 = dl.num_den(*loc, kind="soe", causal=True, group=None, plan=soe_plan(b, window=8, num_terms=6))
            y = torch.cat([n2, d2[..., None]], -1)
            torch.testing.assert_close(y, _slice(torch.cat([num, den[..., None]], -1), rank).detach(), **TOL)
            got = torch.autograd.grad((y * _slice(w, rank)).sum(), [*loc, b])
            for a, e in zip(got[:3], gref[:3]):
                torch.testing.assert_close(a, _slice(e, rank), **TOL)
            gb = got[3].clone()
            dist.all_reduce(gb)
            torch.testing.assert_close(gb, gref[3], **TOL)
        elif suite == "comm":
            _check_comm(rank)
        elif suite == "float32":
            # low precision judged against float64: the distributed float32 error within a small
            # factor of the single-process float32 error (fastrpe.testing.assert_lowp_close)
            q, k, v, mask = _inputs(70, kpm=True)
            for pos_name, causal, backend in (("alibi", True, "chunked"), ("table", True, "band"),
                                              ("table", False, "band"), ("kerple_log", True, "soe")):
                pos = _make_position(pos_name)
                ref64 = fr.attention(q, k, v, "elu", pos, causal=causal, key_padding_mask=mask, backend=backend)
                single = fr.attention(q.float(), k.float(), v.float(), "elu", pos.float(), causal=causal,
                                      key_padding_mask=mask, backend=backend)
                out = dl.attention(*(_slice(t, rank).float() for t in (q, k, v)), "elu", pos, causal=causal,
                                   key_padding_mask=_slice(mask, rank, dim=1))
                assert out.dtype == torch.float32
                assert_lowp_close(out, _slice(single, rank), _slice(ref64, rank), msg=f"{pos_name} causal={causal}")
        elif suite == "bytes":
            q, k, v, _ = _inputs(50)
            ql, kl, vl = (_slice(t, rank).clone().requires_grad_() for t in (q, k, v))
            with comm.counting() as c:
                out = dl.attention(ql, kl, vl, "elu", P.ALiBi(H), causal=True, lengths=LENGTHS)
            F, C = D, DV + 1
            assert c.calls() == {"all_gather": 1}, c.records
            assert c.total == (WORLD - 1) * B * H * F * C * 8, c.records  # one state per rank
            with comm.counting() as c:
                out.sum().backward()
            assert c.calls() == {"all_gather.backward": 1}, c.records
            # through the public entry point: its dispatcher picks these paths
            import fastrpe.distributed as frd
            for pos, causal, backend in ((P.ALiBi(H).double(), True, "chunked"), (None, False, "auto"),
                                         (_make_position("table"), True, "band")):
                a = frd.attention(_slice(q, rank), _slice(k, rank), _slice(v, rank), "elu", pos, causal=causal,
                                  backend=backend)
                b = dl.attention(_slice(q, rank), _slice(k, rank), _slice(v, rank), "elu", pos, causal=causal)
                torch.testing.assert_close(a, b, atol=0, rtol=0)
            torch.save({"ok": True}, os.path.join(out_dir, f"bytes{rank}.pt"))
        else:
            raise ValueError(suite)
    finally:
        dist.destroy_process_group()


def _launch(tmp_path, suite):
    # fork: the children share the parent's imports (spawn re-imports torch: seconds per process)
    mp.start_processes(_worker, args=(str(tmp_path / "init"), suite, str(tmp_path)), nprocs=WORLD,
                       start_method="fork" if sys.platform == "linux" else "spawn")


@pytest.mark.parametrize("suite", ["comm", "causal", "noncausal", "soe_small_window", "float32", "bytes"])
def test_distributed_linear(tmp_path, suite):
    _launch(tmp_path, suite)


# ---------------------------------------------------------------------------------------------
# Single process (no group initialized: one rank)


def test_one_rank_equals_single_process():
    q, k, v, mask = _inputs(60, lengths=[23], kpm=True)
    for pos_name, causal in (("geometric", True), ("table", False), ("none", False)):
        pos = _make_position(pos_name)
        a = dl.attention(q, k, v, "elu", pos, causal=causal, key_padding_mask=mask)
        b = fr.attention(q, k, v, "elu", pos, causal=causal, key_padding_mask=mask, backend="dense")
        torch.testing.assert_close(a, b, **TOL)


def test_refusals():
    assert dl.refusal("soe", causal=False) is not None
    assert dl.refusal("bidirectional", causal=True) is not None
    assert "running maximum" in dl.refusal("chunked", causal=True, kernel="exp")
    assert dl.refusal("chunked", causal=True, kernel="nexp") is None
    assert "softmax" in dl.refusal("chunked", causal=True, kernel="softmax")
    assert dl.refusal("band", causal=True, position=P.KerpleLog(2)) is not None
    assert dl.refusal("band", causal=True, position=P.LearnedTable(2, 4)) is None
    assert dl.refusal("fft", causal=True) is not None
    from fastrpe.api import _problem
    x = torch.randn(1, 2, 9, 4)
    p, _ = _problem(x, x, x, "elu", [P.ALiBi(2), P.FastRPB1D(2, 16)], True, None, None, None)
    assert "additive" in dl.refusal("chunked", p)
    p, _ = _problem(x, x, x, "nexp", P.ALiBi(2), True, None, None, None)
    assert dl.refusal("chunked", p) is None
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(fr.FastRPEError, match="kind"):
        dl.attention(q, q, q, "exp", None, causal=True)
    with pytest.raises(fr.FastRPEError, match="position"):
        dl.attention(q, q, q, "elu", P.KerpleLog(2), causal=False)
    with pytest.raises(fr.FastRPEError, match="lengths"):
        dl.attention(q, q, q, "elu", None, causal=True, lengths=[3])
