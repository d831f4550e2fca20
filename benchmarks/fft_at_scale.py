"""The FFT path for a table over all offsets at the GPU bench's lengths, on shapes alone: bytes
moved and memory held, forward + backward, at 65,536 to 1,048,576 tokens, where one counted
call on this CPU took over ten minutes from 262,144 tokens on (`table_paths.py`).

The call runs under `FakeTensorMode`: every op computes its output's shape and dtype and
nothing else, so a million-token call takes seconds. The op sequence is the GPU's:
the blocked product and the per-segment blocks (`fft.causal.BLOCKED`, `SEGMENT_BLOCKS` =
"always", what "cuda" means there), the static recompute schedule (`static_schedule`: no host
read, as on a GPU), and the memory budget of the GPU named (`plan.budget_for_memory`). The
eager CPU check that q, k, v are finite reads values, which fake tensors have none of; a GPU
call does not make it either, so it is off here.

The FFT products' row contractions (`out += (a * b).sum(dim)` after each inverse transform)
take `fft.triton_rowsum`'s kernel, as `ROW_SUMS = "cuda"` routes them on a GPU: a launch is no
aten op, so its bytes come from its shapes (`triton_rowsum.count_traffic(simulate=True)`,
launching nothing; `rowsum_gib`: `a` and `b` read once, `out` read and written;
`rowsum_gib_upper`: `b` once per tile of kept rows), added to the count. `row(...,
row_sums=False)`: the torch expression (the count before it also had a `copy_` of each output
slice onto itself, which torch skips: `triton_rowsum.ROW_SUMS`).

Two counts, each checked against the real call in tests/test_live_peak.py:

* `byte_count.ByteCounter`: each aten op's reads and writes, a lower bound on the traffic;
* `live_peak.LivePeak`: the bytes the call's allocations hold at their peak (what
  `torch.cuda.max_memory_allocated` reports above the inputs, less the caching allocator's
  rounding), with the largest storages held then.

The bench's problem: B = 1, H = 8, D = 64, NPRF with 32 features, bf16 q, k, v, a frozen
table (`bench.gpu.make_position`), `fastrpe.attention(..., backend="fft")`.

    python benchmarks/fft_at_scale.py --lengths 65536,262144,1048576 --out benchmarks/results/fft_at_scale.json
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_count import ByteCounter  # noqa: E402
from live_peak import LivePeak  # noqa: E402

#: memory of the GPUs whose default budgets the rows take (`plan.budget_for_memory`), bytes
GPUS = {"h100-80gb": 80 * 10**9, "h200": 141 * 10**9}
#: HBM peaks, bytes/s: the H100 SXM's HBM3 and the H200's HBM3e
HBM = {"h100-80gb": 3.35e12, "h200": 4.8e12}
GIB = 2 ** 30


@contextlib.contextmanager
def gpu_schedule(budget: int):
    """The FFT path's GPU routing and the budget `budget`, restored after."""
    import fastrpe.api as api
    from fastrpe import _validate
    from fastrpe.ops.linear.fft import causal, plan, static_schedule

    saved = (causal.BLOCKED, causal.SEGMENT_BLOCKS, plan.DEFAULT_BUDGET, api.check_qkv)
    causal.BLOCKED, causal.SEGMENT_BLOCKS, plan.DEFAULT_BUDGET = "always", "always", budget
    api.check_qkv = functools.partial(_validate.check_qkv, check_finite=False)
    try:
        with static_schedule():
            yield
    finally:
        causal.BLOCKED, causal.SEGMENT_BLOCKS, plan.DEFAULT_BUDGET, api.check_qkv = saved


@contextlib.contextmanager
def tiled_on_shapes(local: bool = True):
    """The causal path's chunks' own pairs by `triton_tiled` (`fft.causal.LOCAL`, what "cuda"
    means on a GPU) on fake CPU tensors: its launches replaced by their shapes (the custom ops'
    fake implementations), their bytes tallied; yields the tally (`triton_blocked.Traffic`: each
    operand read and each result written once, `lower` and `upper` alike; the kernels read a
    chunk's key tiles again for each tile of its queries, from the cache where they fit).
    `local=False`: the recursion inside each chunk (`LOCAL = "never"`), the path before."""
    from fastrpe.ops.linear import triton_chunked, triton_tiled
    from fastrpe.ops.linear.fft import causal
    from fastrpe.ops.linear.fft.triton_blocked import Traffic

    tally = Traffic()

    def shapes_of(fake, n_in):
        def call(*args):
            out = fake(*args)
            n = sum(t.numel() * t.element_size() for t in (*args[:n_in], *out) if isinstance(t, torch.Tensor))
            tally.add(n, n)
            return out
        return call

    saved = (triton_tiled._tiled_forward_op, triton_tiled._tiled_backward_op,
             triton_chunked.triton_unavailable_reason, triton_tiled.triton_unavailable_reason)
    triton_tiled._tiled_forward_op = shapes_of(triton_tiled._tiled_forward_fake, 5)
    triton_tiled._tiled_backward_op = shapes_of(triton_tiled._tiled_backward_fake, 12)
    triton_chunked.triton_unavailable_reason = triton_tiled.triton_unavailable_reason = lambda device: None
    try:
        with causal.use_local("always" if local else "never"):
            yield tally
    finally:
        (triton_tiled._tiled_forward_op, triton_tiled._tiled_backward_op,
         triton_chunked.triton_unavailable_reason, triton_tiled.triton_unavailable_reason) = saved


@contextlib.contextmanager
def rowsum_on_shapes(on: bool = True):
    """The FFT products' row contractions by `triton_rowsum`'s kernel (`ROW_SUMS = "always"`,
    what "cuda" means on a GPU) on fake tensors: no launch, their bytes tallied; yields the
    `count_traffic` tally (`lower`: `a` and `b` read once, `out` read and written). `on=False`:
    the torch expression (`ROW_SUMS = "never"`), counted by `ByteCounter` as before."""
    from fastrpe.ops.linear.fft import triton_rowsum

    with triton_rowsum.use_row_sums("always" if on else "never"), triton_rowsum.count_traffic(simulate=True) as t:
        yield t


@contextlib.contextmanager
def forced_chunk(chunk):
    """The causal path's chunk length forced to `chunk` ("none": the recursion over the whole
    length; None: the plan's own pick, `fft.plan.causal_chunk`)."""
    from fastrpe.ops.linear.fft import causal

    saved = causal.chunk_on
    if chunk is not None:
        causal.chunk_on = lambda *a, **k: None if chunk == "none" else int(chunk)
    try:
        yield
    finally:
        causal.chunk_on = saved


def row(family: str, L: int, gpu: str, H: int = 8, D: int = 64, F: int = 32, chunk=None, local: bool = True,
        row_sums: bool = True) -> dict:
    import fastrpe as fr
    from fastrpe.bench.gpu import _closure, family_causal, make_position
    from fastrpe.ops.linear.fft.plan import budget_for_memory

    budget = budget_for_memory(GPUS[gpu])
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    pos, causal = make_position(family, H, L), family_causal(family)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), gpu_schedule(budget), forced_chunk(chunk), tiled_on_shapes(local) as tiled, \
            FakeTensorMode(allow_non_fake_inputs=True), rowsum_on_shapes(row_sums) as rows:
        warnings.simplefilter("ignore")  # fake tensors' data_ptr, read by the memo of a frozen table
        q, k, v = (torch.empty(1, H, L, D, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        call = _closure(lambda q, k, v: fr.attention(q, k, v, kernel=kern, position=pos, causal=causal,
                                                     backend="fft"), q, k, v, backward=True)
        call()  # the frozen table's coefficients kept, as the bench's timed calls find them
        for x in (q, k, v):
            x.grad = None
        for t in (tiled, rows):  # (the counted call's launches only: the call above warmed up)
            t.lower = t.upper = t.launches = 0
        with LivePeak() as m, ByteCounter() as c:
            call()
    inputs = 3 * H * L * D * 2 + sum(p.numel() * p.element_size() for p in (*pos.parameters(), *kern.parameters()))
    return {"family": family, "causal": causal, "L": L, "gpu": gpu, "budget_bytes": budget,
            "chunk": "plan" if chunk is None else chunk, "local": local if causal else None,
            "row_sums": "kernel" if row_sums else "torch",
            "gib_moved": (c.bytes + tiled.lower + rows.lower) / GIB,
            "launches": c.launches + tiled.launches + rows.launches,
            "tiled_gib": tiled.lower / GIB, "tiled_launches": tiled.launches,
            "rowsum_gib": rows.lower / GIB, "rowsum_gib_upper": rows.upper / GIB, "rowsum_launches": rows.launches,
            "ms_at_hbm_peak": (c.bytes + tiled.lower + rows.lower) / HBM[gpu] * 1e3,
            "peak_gib_above_inputs": m.peak / GIB, "inputs_gib": inputs / GIB,
            "peak_gib_in_all": (m.peak + inputs) / GIB,
            "held_at_peak": [{"gib": n / GIB, "op": op} for n, op in m.at_peak],
            "by_op": [{"op": op, "gib": b / GIB, "launches": n} for op, b, n in c.top(12)],
            "cpu_seconds": time.perf_counter() - t0}


def family_is_causal(family: str) -> bool:
    from fastrpe.bench.gpu import family_causal

    return family_causal(family)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="65536,262144,1048576")
    ap.add_argument("--families", default="learned,learned_full", help="comma-separated, of learned, learned_full")
    ap.add_argument("--gpus", default="h200,h100-80gb", help=f"comma-separated, of {', '.join(GPUS)}")
    ap.add_argument("--chunks", default=None,
                    help="comma-separated chunk lengths to force on the causal path, 'none' the recursion "
                         "(default: the plan's pick only)")
    ap.add_argument("--local", default="on", choices=("on", "off", "both"),
                    help="the causal path's chunks' own pairs by triton_tiled (on, fft.causal.LOCAL's GPU route), "
                         "by the recursion inside each chunk (off, the path before), or both")
    ap.add_argument("--row-sums", default="on", choices=("on", "off"),
                    help="the FFT products' row contractions by triton_rowsum's kernel (on, its GPU route) "
                         "or by the torch expression (off, the path before)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    chunks = [None] if a.chunks is None else a.chunks.split(",")
    locals_ = {"on": (True,), "off": (False,), "both": (False, True)}[a.local]
    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        for fam in a.families.split(","):
            for gpu, chunk, local in ((g, c, lo) for g in a.gpus.split(",") for c in chunks for lo in locals_):
                if local and not family_is_causal(fam) and len(locals_) > 1:
                    continue  # (the not-causal path has no chunks: one row)
                r = row(fam, L, gpu, chunk=chunk, local=local, row_sums=a.row_sums == "on")
                rows.append(r)
                inside = "not causal" if r["local"] is None else ("tiled" if local else "recursion") + " inside"
                print(f"{fam:13s} L={L:8d} {gpu:10s} chunk {r['chunk']:>6} {inside}, "
                      f"budget {r['budget_bytes'] / GIB:4.2f} GiB: "
                      f"{r['gib_moved']:9.1f} GiB moved, {r['launches']:6d} launches, >= {r['ms_at_hbm_peak']:7.1f} ms; "
                      f"peak {r['peak_gib_above_inputs']:6.2f} GiB above the inputs, {r['peak_gib_in_all']:6.2f} in all "
                      f"({r['cpu_seconds']:.0f} s)", flush=True)
    out = {"meta": {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
                    "command": "python benchmarks/fft_at_scale.py " + " ".join(sys.argv[1:]),
                    "problem": {"B": 1, "H": 8, "D": 64, "features": 32, "kernel": "nprf", "dtype": "bfloat16",
                                "table": "frozen", "backward": True},
                    "gpus_bytes": GPUS, "hbm_bytes_per_s": HBM,
                    "method": "FakeTensorMode: shapes only; benchmarks/byte_count.py and live_peak.py"},
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
