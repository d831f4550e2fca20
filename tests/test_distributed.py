"""`fastrpe.distributed.attention` across 4 CPU processes (gloo) against the single-process call.

One launch of 4 forked processes runs every multi-rank check and writes each check's largest
error; the tests below read them (forked from the test process, which has imported torch:
importing it four times over was most of the time). `python tests/test_distributed.py RANK
WORLD INIT OUT CASES` runs one rank as a script, and
`OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 tests/test_distributed.py` runs every check
under torchrun and prints each one's largest error.
The reference is the single-process `fastrpe.attention(..., backend="dense")` (materialized
weights) on the whole sequence, computed on every rank from the same seed.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

import fastrpe as fr
import fastrpe.distributed as frd
from fastrpe import FastRPEError

LENGTHS = (5, 17, 1, 40)  # uneven slices, one of length 1; total 63
WORLD = len(LENGTHS)
TOL = 1e-10  # float64


# ------------------------------------------------------------------------------------------
# the checks, run on every rank


def _position(name: str, H: int, causal: bool):
    g = torch.Generator().manual_seed(7)
    if name == "none":
        return None
    pos = {
        "alibi": lambda: fr.positions.ALiBi(H),
        "kerple_log": lambda: fr.positions.KerpleLog(H),
        "t5": lambda: fr.positions.T5Bias(H, num_buckets=8, max_distance=20, bidirectional=not causal),
        "learned": lambda: fr.positions.LearnedTable(H, max_distance=70),
        "bias_weight": lambda: fr.positions.KerpleBiasWeight(H),
    }[name]()
    with torch.no_grad():  # random parameter values, the same on every rank
        for prm in pos.parameters():
            prm.add_(0.3 * torch.randn(prm.shape, generator=g, dtype=prm.dtype))
    return pos.double()


def _kernel(name: str, D: int):
    return fr.kernels.get_kernel(name, head_dim=D, num_features=12) if name != "softmax" else "softmax"


def _compare(case: dict, rank: int, world: int) -> float:
    """Largest |distributed − single-process| over the output, the grads of q, k, v and of the
    positional parameters (summed over ranks), on this rank."""
    import torch.distributed as dist

    B, H, D, Dv = 2, 3, 8, 6
    lengths = case.get("lengths", LENGTHS)
    L, off, n = sum(lengths), sum(lengths[:rank]), lengths[rank]
    causal = case["causal"]
    g = torch.Generator().manual_seed(case.get("seed", 0))
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)
    mask = None
    if case.get("mask"):
        mask = torch.rand(B, L, generator=g) < 0.3
        mask[:, 0] = False  # every causal row keeps a key
    kernel = _kernel(case["kernel"], D)
    pos_ref = _position(case["position"], H, causal)
    pos = copy.deepcopy(pos_ref)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = fr.attention(qr, kr, vr, kernel, pos_ref, causal=causal, key_padding_mask=mask,
                       backend=case.get("ref_backend", "dense"))
    (ref * go).sum().backward()

    sl = slice(off, off + n)
    ql, kl, vl = (t[:, :, sl].clone().requires_grad_() for t in (q, k, v))
    if case.get("strided"):  # [B, L, H, D] projections viewed as [B, H, L, D]: not contiguous
        ql, kl, vl = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (ql, kl, vl))
        leaves, (ql, kl, vl) = (ql, kl, vl), (t.transpose(1, 2) for t in (ql, kl, vl))
    kw = dict(causal=causal, key_padding_mask=None if mask is None else mask[:, sl], path=case["path"],
              backend=case.get("backend", "auto"))
    from fastrpe.distributed import ring

    saved, saved_tile = frd._memory_limit, ring.TILE_ELEMENTS
    if "memory_limit" in case:  # a device too small to hold the gathered keys
        frd._memory_limit = lambda device: case["memory_limit"]
    ring.TILE_ELEMENTS = case.get("tile", saved_tile)  # small tiles: the ring's tiling is exercised
    try:
        if "expect" in case:  # the path auto takes
            said = frd.explain(ql, kl, vl, kernel, pos, **kw).splitlines()[0]
            if f"path {case['expect']!r}" not in said:
                raise AssertionError(f"expected path {case['expect']!r}: {said}")
        out = frd.attention(ql, kl, vl, kernel, pos, **kw)
    finally:
        frd._memory_limit, ring.TILE_ELEMENTS = saved, saved_tile
    (out * go[:, :, sl]).sum().backward()
    errs = [(out - ref[:, :, sl]).abs().max()]
    mine = [t.grad.transpose(1, 2) for t in leaves] if case.get("strided") else [t.grad for t in (ql, kl, vl)]
    for g_mine, theirs in zip(mine, (qr, kr, vr)):
        errs.append((g_mine - theirs.grad[:, :, sl]).abs().max())
    if pos is not None:
        for a, b in zip(pos.parameters(), pos_ref.parameters()):
            ga = a.grad.clone() if a.grad is not None else torch.zeros_like(a)
            dist.all_reduce(ga)  # every rank holds its share of the parameter gradient
            gb = b.grad if b.grad is not None else torch.zeros_like(b)
            errs.append((ga - gb).abs().max())
    errs = [e.detach() for e in errs]
    if not bool(torch.isfinite(torch.stack(errs)).all()):
        return float("inf")
    return float(torch.stack(errs).max())


def _no_leak(case: dict, rank: int, world: int) -> float:
    """Causal: new keys/values on the last rank leave every earlier rank's output bit-identical.
    Returns 0 when identical on this rank (or this is the last rank), 1 otherwise."""
    B, H, D, Dv = 1, 2, 8, 5
    lengths = LENGTHS
    off, n = sum(lengths[:rank]), lengths[rank]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, sum(lengths), d, generator=g, dtype=torch.float64) for d in (D, D, Dv))
    sl = slice(off, off + n)
    pos = _position(case["position"], H, True)
    kernel = _kernel(case["kernel"], D)
    a = frd.attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], kernel, pos, causal=True, path=case["path"])
    if rank == world - 1:
        k2, v2 = k[:, :, sl] * 3 + 1, -v[:, :, sl]
    else:
        k2, v2 = k[:, :, sl], v[:, :, sl]
    b = frd.attention(q[:, :, sl], k2, v2, kernel, pos, causal=True, path=case["path"])
    if rank == world - 1:
        return 0.0 if not torch.equal(a, b) else 1.0  # the perturbation must matter somewhere
    return 0.0 if torch.equal(a, b) else 1.0


def _refusal(case: dict, rank: int, world: int) -> float:
    """Calls every rank must refuse with a FastRPEError (and no rank left hanging)."""
    q = torch.randn(1, 2, 3 + rank, 4, dtype=torch.float64)
    kind = case["what"]
    try:
        if kind == "q_offset":
            frd.attention(q, q, q, q_offset=5)
        elif kind == "grid":
            frd.attention(q, q, q, "elu", fr.positions.Table2D(2, (2, 2)))
        elif kind == "one_rank_nan":
            bad = q.clone()
            if rank == 1:
                bad[0, 0, 0, 0] = float("nan")
            frd.attention(bad, q, q)
        elif kind == "mixed_causal":
            frd.attention(q, q, q, causal=rank == 2)
        elif kind == "features_differ":
            frd.attention(q, q, q, fr.kernels.get_kernel("prf", head_dim=4, seed=rank))
        else:
            raise AssertionError(kind)
    except FastRPEError as e:
        return 0.0 if str(e) and "\n" not in str(e) else 1.0
    return 1.0


def _world1_equal(case: dict, rank: int, world: int) -> float:
    """A group of one rank (a subgroup) gives exactly `fastrpe.attention`."""
    import torch.distributed as dist

    sub = None
    for r in range(world):  # every rank creates every subgroup, in the same order
        grp = dist.new_group([r])
        sub = grp if r == rank else sub
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    pos = _position("kerple_log", 3, True)
    a = frd.attention(q, k, v, "nprf", pos, causal=True, group=sub)
    b = fr.attention(q, k, v, "nprf", pos, causal=True)
    return 0.0 if torch.equal(a, b) else 1.0


def _lowp(case: dict, rank: int, world: int) -> float:
    """bfloat16 inputs: the distributed path's error against float64 (output and grads of q, k,
    v) within `LOWP_FACTOR` of the single-process dense path's own bfloat16 error (STYLE §9).
    Returns the ratio error / allowance (<= 1 passes)."""
    from fastrpe.testing import LOWP_FACTOR

    B, H, D, Dv = 1, 2, 16, 8
    L, off, n = sum(LENGTHS), sum(LENGTHS[:rank]), LENGTHS[rank]
    g = torch.Generator().manual_seed(5)
    q, k, v, go = (torch.randn(B, H, L, d, generator=g, dtype=torch.float64) for d in (D, D, Dv, Dv))
    kernel, pos = _kernel(case["kernel"], D), _position(case["position"], H, True).float()
    sl = slice(off, off + n)

    def run(dtype, distributed, pos):
        xs = [t.detach().to(dtype).clone().requires_grad_()
              for t in ((q[:, :, sl], k[:, :, sl], v[:, :, sl]) if distributed else (q, k, v))]
        if distributed:
            out = frd.attention(*xs, kernel, pos, causal=True, path=case["path"])
        else:
            out = fr.attention(*xs, kernel, pos, causal=True, backend="dense")
        (out.double() * (go[:, :, sl] if distributed else go)).sum().backward()
        parts = [out] + [x.grad for x in xs]
        return [t.double() if distributed else t.double()[:, :, sl] for t in parts]

    ref = run(torch.float64, False, copy.deepcopy(pos).double())
    naive, fast = run(torch.bfloat16, False, pos), run(torch.bfloat16, True, pos)
    worst = 0.0
    for f, nv, r in zip(fast, naive, ref):
        err_f, err_n = (f - r).abs().max().item(), (nv - r).abs().max().item()
        worst = max(worst, err_f / (LOWP_FACTOR * err_n + 1e-6 * max(1.0, r.abs().max().item())))
    return worst


def _bytes(case: dict, rank: int, world: int) -> float:
    """What `comm.counting()` records equals the formulas of docs/DISTRIBUTED.md (forward and
    backward, float64, B=2, H=3, D=8, Dv=6). Returns |recorded − formula| summed."""
    from fastrpe.distributed import comm

    B, H, D, Dv, b = 2, 3, 8, 6, 8
    L, n_next, top, P = sum(LENGTHS), LENGTHS[(rank + 1) % world], max(LENGTHS), world
    g = torch.Generator().manual_seed(2)
    sl = slice(sum(LENGTHS[:rank]), sum(LENGTHS[:rank + 1]))
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64)[:, :, sl].requires_grad_() for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=g, dtype=torch.float64)[:, :, sl].requires_grad_()
    kernel = case["kernel"]
    with comm.counting() as c:
        out = frd.attention(q, k, v, kernel, fr.positions.KerpleLog(H).double(), causal=case["causal"],
                            path=case["path"])
    fwd = c.total
    with comm.counting() as c:
        out.sum().backward()
    bwd = c.total
    if case["path"] == "ring" and case["causal"]:  # blocks stop at the last rank, which sends dk, dv home
        want_f = B * H * sum(LENGTHS[:rank + 1]) * (D + Dv) * b if rank < P - 1 else 0
        want_b = (B * H * sum(LENGTHS[:rank + 1]) * 2 * (D + Dv) * b if rank < P - 1
                  else B * H * (L - LENGTHS[-1]) * (D + Dv) * b)
    elif case["path"] == "ring":
        want_f = B * H * (L - n_next) * (D + Dv) * b
        want_b = B * H * ((L - n_next) * 2 * (D + Dv) + n_next * (D + Dv)) * b
    else:  # gather: two all-gathers padded to the longest slice; backward all-reduces the stacks
        want_f = (P - 1) * B * H * top * (D + Dv) * b
        want_b = 2 * (P - 1) * B * H * top * (D + Dv) * b
    return float(abs(fwd - want_f) + abs(bwd - want_b))


def _autocast(case: dict, rank: int, world: int) -> float:
    """float32 inputs under bfloat16 autocast give the float32 result bit for bit (the paths
    run their math with autocast off, as the single-process backends do). 0 when identical."""
    g = torch.Generator().manual_seed(9)
    n, off = LENGTHS[rank], sum(LENGTHS[:rank])
    q, k, v = (torch.randn(1, 2, sum(LENGTHS), 8, generator=g)[:, :, off:off + n] for _ in range(3))
    pos = _position("kerple_log", 2, True).float()
    kernel = _kernel(case["kernel"], 8)
    a = frd.attention(q, k, v, kernel, pos, causal=True, path=case["path"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = frd.attention(q, k, v, kernel, pos, causal=True, path=case["path"])
    return 0.0 if b.dtype == torch.float32 and torch.equal(a, b) else 1.0


def _cases() -> dict[str, dict]:
    cases = {}
    for causal in (False, True):
        c = "causal" if causal else "full"
        for pos in ("alibi", "kerple_log", "t5", "none"):
            cases[f"ring-{pos}-{c}"] = dict(fn="compare", kernel="softmax", position=pos, causal=causal, path="ring")
        cases[f"ring-kerple_log-mask-{c}"] = dict(fn="compare", kernel="softmax", position="kerple_log",
                                                  causal=causal, path="ring", mask=True)
        cases[f"ring-bias_weight-{c}"] = dict(fn="compare", kernel="softmax", position="bias_weight",
                                              causal=causal, path="ring")
        cases[f"gather-nprf-kerple_log-{c}"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                    causal=causal, path="gather")
        cases[f"gather-nprf-learned-mask-{c}"] = dict(fn="compare", kernel="nprf", position="learned",
                                                      causal=causal, path="gather", mask=True)
        cases[f"gather-softmax-t5-{c}"] = dict(fn="compare", kernel="softmax", position="t5", causal=causal,
                                               path="gather")
        cases[f"auto-nprf-kerple_log-{c}"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                  causal=causal, path="auto", expect="gather")
        cases[f"auto-lowmem-nprf-kerple_log-{c}"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                         causal=causal, path="auto", expect="ring", memory_limit=1)
        # the kernelized ring: block-Toeplitz FFT products, k/v blocks passed around
        cases[f"ring-nprf-learned-mask-{c}"] = dict(fn="compare", kernel="nprf", position="learned", causal=causal,
                                                    path="ring", mask=True)
        cases[f"ring-prf-kerple_log-{c}"] = dict(fn="compare", kernel="prf", position="kerple_log", causal=causal,
                                                 path="ring")
        cases[f"ring-elu-none-{c}"] = dict(fn="compare", kernel="elu", position="none", causal=causal, path="ring")
        cases[f"ring-fft-nprf-kerple_log-mask-{c}"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                           causal=causal, path="ring", backend="fft", mask=True)
        cases[f"auto-softmax-alibi-{c}"] = dict(fn="compare", kernel="softmax", position="alibi", causal=causal,
                                                path="auto", expect="ring")
        # E1's state-passing paths, reached through the public dispatcher
        for pos, kind in (("alibi", "chunked"), ("t5", "band"), ("none", "chunked" if causal else "bidirectional")):
            cases[f"auto-linear-{kind}-nprf-{pos}-{c}"] = dict(fn="compare", kernel="nprf", position=pos, causal=causal,
                                                             path="auto", expect="linear", mask=pos == "t5")
        cases[f"fft-forced-nprf-alibi-{c}"] = dict(fn="compare", kernel="nprf", position="alibi", causal=causal,
                                                   path="auto", backend="fft", expect="gather")
        cases[f"dense-forced-nprf-kerple_log-{c}"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                          causal=causal, path="auto", backend="dense", expect="gather")
    for path, kernel in (("ring", "softmax"), ("ring", "nprf"), ("gather", "nprf")):
        cases[f"strided-{path}-{kernel}-causal"] = dict(fn="compare", kernel=kernel, position="kerple_log",
                                                        causal=True, path=path, strided=True, mask=True,
                                                        backend="fft" if kernel == "nprf" else "auto")
    cases["soe-forced-nprf-kerple_log-causal"] = dict(fn="compare", kernel="nprf", position="kerple_log",
                                                      causal=True, path="auto", backend="soe", ref_backend="soe",
                                                      expect="linear")
    for causal in (False, True):
        cases[f"ring-tiled-bias_weight-mask-{'causal' if causal else 'full'}"] = dict(
            fn="compare", kernel="softmax", position="bias_weight", causal=causal, path="ring", mask=True, tile=64)
    cases["ring-alibi-causal-two-long"] = dict(fn="compare", kernel="softmax", position="alibi", causal=True,
                                               path="ring", lengths=(30, 33, 1, 1))
    for path, kernel, pos in (("ring", "softmax", "kerple_log"), ("ring", "nprf", "kerple_log"),
                              ("gather", "nprf", "kerple_log"), ("linear", "nprf", "alibi"), ("linear", "nprf", "t5")):
        cases[f"noleak-{path}-{kernel}-{pos}"] = dict(fn="no_leak", kernel=kernel, position=pos, path=path)
    for what in ("q_offset", "grid", "one_rank_nan", "mixed_causal", "features_differ"):
        cases[f"refuse-{what}"] = dict(fn="refusal", what=what)
    cases["world1"] = dict(fn="world1")
    for path, kernel in (("ring", "softmax"), ("ring", "nprf"), ("gather", "nprf")):
        cases[f"autocast-{path}-{kernel}"] = dict(fn="autocast", kernel=kernel, path=path)
    for path, kernel in (("ring", "softmax"), ("ring", "nprf"), ("gather", "nprf")):
        cases[f"lowp-bf16-{path}-{kernel}"] = dict(fn="lowp", kernel=kernel, position="kerple_log", path=path)
        cases[f"bytes-{path}-{kernel}-causal"] = dict(fn="bytes", path=path, kernel=kernel, causal=True)
    cases["broadcast-parameters"] = dict(fn="broadcast")
    cases["bytes-ring-softmax-full"] = dict(fn="bytes", path="ring", kernel="softmax", causal=False)
    cases["bytes-ring-nprf-full"] = dict(fn="bytes", path="ring", kernel="nprf", causal=False)
    return cases


def _broadcast(case: dict, rank: int, world: int) -> float:
    """`broadcast_parameters` gives every rank rank 0's parameters and buffers and bumps every
    tensor's version (caches keyed on `_version`, the decode step's constants, see the change)."""
    from fastrpe.train.distributed import broadcast_parameters

    def model(seed):
        torch.manual_seed(seed)
        return torch.nn.ModuleList([torch.nn.Linear(3, 4), fr.positions.T5Bias(2), fr.positions.ALiBi(2)])

    m = model(100 + rank)
    tensors = list(m.parameters()) + list(m.buffers())
    before = [t._version for t in tensors]
    broadcast_parameters(m)
    want = list(model(100).parameters()) + list(model(100).buffers())
    same = all(torch.equal(a, b) for a, b in zip(tensors, want))
    bumped = all(t._version > v for t, v in zip(tensors, before))
    return 0.0 if same and bumped else 1.0


_FNS = {"broadcast": _broadcast, "compare": _compare, "no_leak": _no_leak, "refusal": _refusal, "world1": _world1_equal, "lowp": _lowp,
        "bytes": _bytes, "autocast": _autocast}


def _worker(rank: int, world: int, init: str, out: str, names: list[str]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://" if init == "env" else f"file://{init}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    cases, results = _cases(), {}
    for name in names:
        try:
            err = _FNS[cases[name]["fn"]](cases[name], rank, world)
        except Exception:  # a failure is a result: report it, do not hang the others
            err, tb = float("inf"), traceback.format_exc()
            results.setdefault("_tracebacks", {})[f"{name}@{rank}"] = tb
        e = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        results[name] = float(e)
    tbs = [None] * world
    dist.all_gather_object(tbs, results.pop("_tracebacks", {}))
    if rank == 0:
        results["_tracebacks"] = {k: v for t in tbs for k, v in t.items()}
        if out == "-":  # torchrun: print the table
            for k, v in results.items():
                print(f"{k:45s} {v}" if k != "_tracebacks" else "\n".join(v.values()))
        else:
            Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _forked(rank: int, world: int, init: str, out: str, names: list[str], log: str) -> None:
    """A forked child: torch is already imported (start-up costs nothing); its output goes to a log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        _worker(rank, world, init, out, names)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def _launch(tmp: Path, names: list[str]) -> dict:
    """Run the checks `names` on WORLD forked processes (gloo, `file://` rendezvous under tmp)."""
    import multiprocessing as mp

    init, out = tmp / "init", tmp / "out.json"
    ctx = mp.get_context("fork")  # the parent has imported torch and fastrpe: the children need not
    logs = [tmp / f"rank{r}.log" for r in range(WORLD)]
    procs = [ctx.Process(target=_forked, args=(r, WORLD, str(init), str(out), names, str(logs[r])))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    text = "\n".join(f.read_text(errors="replace") for f in logs if f.exists())
    assert not alive, "the processes did not finish in 240 s\n" + text[-4000:]
    assert all(p.exitcode == 0 for p in procs), text[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("dist"), list(_cases()))


def _case_ids(fn: str) -> list[str]:
    return [n for n, c in _cases().items() if c["fn"] == fn]


@pytest.mark.parametrize("name", _case_ids("compare"))
def test_matches_single_process(results, name):
    """Output and gradients of q, k, v and of the positional parameters within 1e-10 (float64),
    slices 5, 17, 1, 40."""
    tb = {k: v for k, v in results["_tracebacks"].items() if k.startswith(name + "@")}
    assert results[name] <= TOL, f"{name}: max error {results[name]}\n" + "\n".join(tb.values())


@pytest.mark.parametrize("name", _case_ids("no_leak"))
def test_causal_no_leak_across_ranks(results, name):
    tb = {k: v for k, v in results["_tracebacks"].items() if k.startswith(name + "@")}
    assert results[name] == 0.0, "\n".join(tb.values()) or "an earlier rank's output changed"


@pytest.mark.parametrize("name", _case_ids("refusal"))
def test_refusals_on_every_rank(results, name):
    assert results[name] == 0.0, "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith(name))


@pytest.mark.parametrize("name", _case_ids("lowp"))
def test_low_precision_against_float64(results, name):
    tb = "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith(name + "@"))
    assert results[name] <= 1.0, tb or f"bfloat16 error {results[name]:.3g} x the allowance"


@pytest.mark.parametrize("name", _case_ids("bytes"))
def test_bytes_sent_match_the_documented_formula(results, name):
    tb = "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith(name + "@"))
    assert results[name] == 0.0, tb or f"recorded bytes differ from the formula by {results[name]}"


@pytest.mark.parametrize("name", _case_ids("autocast"))
def test_autocast_leaves_the_math_alone(results, name):
    tb = "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith(name + "@"))
    assert results[name] == 0.0, tb or "bfloat16 autocast changed a float32 result"


def test_group_of_one_rank_is_fastrpe_attention(results):
    assert results["world1"] == 0.0, "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith("world1"))


# ------------------------------------------------------------------------------------------
# single process: no process group


def test_without_process_group_is_fastrpe_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for kernel, pos in (("softmax", fr.positions.ALiBi(3)), ("nprf", fr.positions.KerpleLog(3).double())):
        for causal in (False, True):
            a = frd.attention(q, k, v, kernel, pos, causal=causal)
            b = fr.attention(q, k, v, kernel, pos, causal=causal)
            assert torch.equal(a, b)


@pytest.mark.parametrize("kw,match", [
    (dict(q_offset=3), "q_offset"),
    (dict(path="ringg"), "path"),
    (dict(group=object()), "group"),
])
def test_single_process_refusals(kw, match):
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(FastRPEError, match=match):
        frd.attention(q, q, q, **kw)


def test_single_process_refuses_cross_attention():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 6, 4)
    with pytest.raises(FastRPEError, match="k: each rank"):
        frd.attention(q, k, k)


def _whole(kernel, position, causal, L=4096, **kw):
    """The whole-sequence `Problem` (what every rank agrees on) for the path choice."""
    from fastrpe.api import _problem

    q = torch.randn(1, 2, L, 8)
    return _problem(q, q, q, kernel, position, causal, None, None, None)[0]


@pytest.mark.parametrize("kernel,position,causal,backend,expected", [
    ("softmax", "alibi", True, "auto", "ring"),
    ("softmax", "t5", False, "auto", "ring"),
    ("softmax", "fastrpb", False, "auto", "gather"),  # additive terms are not in the ring
    ("nprf", "kerple_log", False, "auto", "ring"),  # arbitrary table: block-Toeplitz FFT products on the ring
    ("nprf", "kerple_log", True, "auto", "ring"),  # soe is approximate: only when asked for
    ("nprf", "kerple_log", True, "dense", "gather"),  # a forced backend runs as such on the gathered keys
    ("exp", "kerple_log", False, "auto", "gather"),  # SIKF's shift depends on every key
    ("nprf", "kerple_log", True, "soe", "linear"),
    ("nprf", "alibi", True, "auto", "linear"),
    ("nprf", "alibi", False, "auto", "linear"),
    ("nprf", "alibi", True, "fft", "ring"),  # the forced FFT op, block by block
    ("nprf", "t5", False, "auto", "linear"),
    ("nprf", "none", False, "auto", "linear"),
    ("nprf", "shaw", True, "auto", "gather"),
], ids=lambda x: str(x))
def test_path_choice(kernel, position, causal, backend, expected):
    H = 2
    pos = {"alibi": fr.positions.ALiBi(H), "t5": fr.positions.T5Bias(H, bidirectional=not causal),
           "kerple_log": fr.positions.KerpleLog(H), "none": None, "fastrpb": fr.positions.FastRPB1D(H, 4096),
           "shaw": fr.positions.ShawRelative(H, 8, 4)}[position]
    p = _whole(kernel, pos, causal)
    assert frd.choose_path(p, backend) == expected


def test_kernelized_auto_gathers_when_it_fits_else_rings():
    """gather (one FFT over `[L_r, L]`, the faster) when the gathered keys and its op fit the
    memory limit, the ring (one key block in memory) when they do not."""
    p = _whole("nprf", fr.positions.KerpleLog(2), True, L=4096)
    lengths = [1024] * 4
    need = frd.gather_bytes(p, lengths)
    assert need > 2 * 4096 * 16 * 4  # at least the gathered k, v
    assert frd.choose_path(p, "auto", lengths=lengths, memory_limit=need) == "gather"
    assert frd.choose_path(p, "auto", lengths=lengths, memory_limit=need - 1) == "ring"
    assert frd.choose_path(p, "fft", lengths=lengths, memory_limit=need) == "gather"
    soft = _whole("softmax", fr.positions.KerpleLog(2), True, L=4096)
    assert frd.choose_path(soft, "auto", lengths=lengths, memory_limit=1 << 40) == "ring"


@pytest.mark.parametrize("kernel,position,causal,path,match", [
    ("exp", "kerple_log", False, "ring", "data-dependent"),
    ("softmax", "alibi", False, "linear", "kernelized"),
    ("nprf", "kerple_log", False, "linear", "no exact state-passing form"),
    ("nprf", "grid", False, "gather", "2D grid"),
], ids=lambda x: str(x))
def test_path_refusals(kernel, position, causal, path, match):
    pos = fr.positions.Table2D(2, (4, 4)) if position == "grid" else \
        {"kerple_log": fr.positions.KerpleLog(2), "alibi": fr.positions.ALiBi(2)}[position]
    p = _whole(kernel, pos, causal, L=16)
    with pytest.raises(FastRPEError, match=match) as e:
        frd.choose_path(p, "auto", path)
    assert "\n" not in str(e.value)


if __name__ == "__main__":
    if len(sys.argv) == 1:  # torchrun --nproc_per_node 4 tests/test_distributed.py: every check, printed
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env", "-", list(_cases()))
    else:
        _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5].split(","))


def test_broadcast_parameters_copies_rank0_and_bumps_versions(results):
    tb = "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith("broadcast-parameters@"))
    assert results["broadcast-parameters"] == 0.0, tb or "values differ from rank 0's, or a version did not change"
