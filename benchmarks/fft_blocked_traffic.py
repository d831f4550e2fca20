"""What the causal FFT path's chunk choice costs in memory traffic, counted on CPU
(`byte_count.ByteCounter`: each aten op's reads and writes, a lower bound on a GPU's traffic):

* `level`: the causal recursion (no blocked product) at a few lengths, forward + backward with
  the coefficients' gradient; the bytes each extra halving level adds, per position and feature
  channel, are `plan.LEVEL_BYTES`;
* `matrix`: the blocked product alone with one channel a block, where its lag matrices
  (`[H, T+1, nb, na]` complex) are most of what it moves: their reads and writes per block of
  channels, in matrices' worth, kept whole and built a slice of frequencies at a time
  (`plan.MATRIX_PASSES_KEPT`, `MATRIX_PASSES_SLICED`);
* `model`: the whole causal path at one problem for each chunk count it may take (and the
  recursion), its bytes in full-length levels against `plan.causal_levels`' estimate;
* `plan`: the chunks `plan.causal_chunk` picks at the GPU bench's problems (B = 1, F = 32,
  Dv = 64; the default budget of the CPU, an 80 GB H100 and an H200, `plan.device_budget`)
  and what the blocked product over the most chunks (the choice before 2026-11-28's seventh
  CPU session) would have cost there, in levels;
* `at_scale` (only with `--at-scale`): `fft_at_scale.py`'s call (the H200's budget, the plan's
  chunks) with the blocked product's sums over chunks on the torch path and on the Triton
  kernels (`fft.blocked.KERNEL`), under `FakeTensorMode`. A launch is no aten op, so the
  kernels' bytes come from their shapes (`fft.triton_blocked.count_traffic`, launching nothing):
  `kernel_gib_lower` each operand once (`ByteCounter`'s convention), `kernel_gib_upper` the
  spectra as often as the kernels' tiles read them, no reuse in the cache. Both routes' rows
  contract after each inverse transform by `fft.triton_rowsum`'s kernel, as on a GPU: its
  bytes (`rowsum_gib`, `torch_rowsum_gib`) are in `torch_gib` and `kernels_aten_gib` (from
  `fft_at_scale.row`).

    python benchmarks/fft_blocked_traffic.py --out benchmarks/results/fft_blocked_traffic.json
    python benchmarks/fft_blocked_traffic.py --at-scale 65536,262144 --only-at-scale \
        --out benchmarks/results/fft_blocked_kernels_at_scale.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_count import ByteCounter  # noqa: E402

F, DV = 32, 64  # the GPU bench's features and value width (--features, --value-dim)


def _table(H: int, L: int, F: int, Dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(1, H, L, F, generator=g).requires_grad_()
    pk = torch.rand(1, H, L, F, generator=g).requires_grad_()
    v = torch.randn(1, H, L, Dv, generator=g).requires_grad_()
    lc = (0.3 * torch.randn(H, 2 * L - 1, generator=g)).requires_grad_()  # a learned table: its gradient too
    return pq, pk, v, lc


def _causal_bytes(H: int, L: int, F: int, Dv: int, budget: int | None) -> tuple[int, int]:
    from fastrpe.ops.linear.fft import kernelized_num_den_fft

    pq, pk, v, lc = _table(H, L, F, Dv)
    with ByteCounter() as c:
        num, den, _ = kernelized_num_den_fft(pq, pk, v, lc, causal=True, memory_budget_bytes=budget)
        (num.sum() + den.sum()).backward()
    return c.bytes, c.launches


def level_rows(lengths: list[int], F: int = F, Dv: int = DV) -> dict:
    from fastrpe.ops.linear.fft import causal as fc

    saved, fc.BLOCKED = fc.BLOCKED, "never"
    rows = []
    try:
        for L in lengths:
            b, n = _causal_bytes(1, L, F, Dv, None)
            rows.append({"L": L, "bytes_per_position_channel": b / (L * F * (Dv + 1)), "launches": n})
            print(f"level   L={L:6d}  {rows[-1]['bytes_per_position_channel']:7.1f} B per position and channel",
                  flush=True)
    finally:
        fc.BLOCKED = saved
    steps = [b["bytes_per_position_channel"] - a["bytes_per_position_channel"] for a, b in zip(rows, rows[1:])]
    return {"rows": rows, "per_level": steps}


def matrix_rows(T: int = 256, chunks: int = 64, H: int = 2) -> dict:
    """The blocked product with F = 2, Dv = 1 (4 channels) one channel a block (4 blocks) and
    all in one block: the difference is 3 blocks' matrix traffic."""
    import fastrpe.ops.linear.fft.blocked as bl
    from fastrpe.ops.linear.fft.scale import row_scale

    L, f, dv = T * chunks, 2, 1
    pq, pk, v, lc = _table(H, L, f, dv)
    vv = torch.cat([v.detach(), torch.ones_like(v[..., :1])], -1).requires_grad_()
    lc = lc.detach().masked_fill(torch.arange(2 * L - 1) > L - 1, float("-inf")).requires_grad_()
    scale = row_scale(lc.detach(), L, L)
    _, nb, na = bl.chunk_layout(L, L, 0, T)
    m = H * (T + 1) * nb * na * 8
    kept = bl.MATRIX_BYTES
    out = {"T": T, "chunks": chunks, "H": H, "matrix_bytes": m}
    for what, limit in (("kept", 1 << 62), ("sliced", m // 8 + 1)):
        bl.MATRIX_BYTES = limit
        per = {}
        for name, block in (("one_block", (f, dv + 1)), ("four_blocks", (1, 1))):
            with ByteCounter() as c:
                y, _ = bl.blocked_product(pq, pk, vv, lc, scale, 0, T, block)
                y.sum().backward()
            per[name] = c.bytes / m
            pq.grad = pk.grad = vv.grad = lc.grad = None
        out[what] = {**per, "passes_per_block": (per["four_blocks"] - per["one_block"]) / 3}
        print(f"matrix  {what:6s}  {out[what]['passes_per_block']:5.1f} matrices' worth per block of channels", flush=True)
    bl.MATRIX_BYTES = kept
    return out


def model_rows(L: int, H: int, budget: int, F: int = F, Dv: int = DV) -> dict:
    """Each chunk count the model weighs at (L, H, budget), counted, against its estimate."""
    from fastrpe.ops.linear.fft import causal as fc
    from fastrpe.ops.linear.fft import plan

    leaf = plan.causal_leaf(1, H, torch.float32, budget)
    shape = plan.Shape(1, H, F, Dv, torch.float32, budget)
    unit = plan.LEVEL_BYTES * H * F * (Dv + 1) * L
    rows = []
    saved = fc.chunk_on
    try:
        for T in [None, *plan.chunk_choices(L, 0, leaf)]:
            fc.chunk_on = lambda *a, T=T, **k: T
            b, n = _causal_bytes(H, L, F, Dv, budget)
            rows.append({"chunks": None if T is None else L // T, "chunk": T, "levels_counted": b / unit,
                         "levels_estimated": plan.causal_levels(L, 0, leaf, T, shape), "launches": n})
            print(f"model   L={L} H={H} chunks={rows[-1]['chunks']}: {rows[-1]['levels_counted']:6.2f} levels' worth "
                  f"counted, {rows[-1]['levels_estimated']:6.2f} above the leaves estimated", flush=True)
    finally:
        fc.chunk_on = saved
    picked = plan.causal_chunk(L, 0, leaf, shape)
    return {"L": L, "H": H, "budget": budget, "leaf": leaf, "picked_chunks": None if picked is None else L // picked,
            "rows": rows}


def plan_rows() -> list[dict]:
    from fastrpe.ops.linear.fft import plan

    rows = []
    budgets = {"cpu": plan.DEFAULT_BUDGET, "H100 80GB": plan.budget_for_memory(int(80e9)),
               "H200": plan.budget_for_memory(int(141e9))}
    for (where, budget), H, L in ((b, H, L) for b in budgets.items() for H in (1, 8) for L in (65536, 262144, 1048576)):
        leaf = plan.causal_leaf(1, H, torch.float32, budget)
        shape = plan.Shape(1, H, F, DV, torch.float32, budget)
        most = next(iter(plan.chunk_choices(L, 0, leaf)), None)
        picked = plan.causal_chunk(L, 0, leaf, shape)
        rows.append({"budget": where, "budget_bytes": budget, "H": H, "L": L,
                     "picked_chunks": None if picked is None else L // picked,
                     "picked_levels": plan.causal_levels(L, 0, leaf, picked, shape),
                     "most_chunks": None if most is None else L // most,
                     "most_chunks_levels": plan.causal_levels(L, 0, leaf, most, shape)})
        r = rows[-1]
        print(f"plan    {where:9s} H={H} L={L:7d}: picks {r['picked_chunks']} chunks ({r['picked_levels']:.1f} levels); "
              f"{r['most_chunks']} chunks: {r['most_chunks_levels']:.1f}", flush=True)
    return rows


def at_scale_rows(lengths: list[int], gpu: str = "h200", family: str = "learned", chunks=(None,),
                  local: bool = True, row_sums: bool = True) -> list[dict]:
    """`fft_at_scale.row` with the sums over chunks on the torch path, then on the kernels, each
    with the plan's chunk (None) or the chunk length of `chunks` ("none": the recursion; the
    torch path is then counted at the plan's chunk only: `fft_at_scale.py --chunks` has it);
    `local`: each chunk's own pairs by triton_tiled (`fft.causal.LOCAL`), else the recursion
    inside the chunks; `row_sums`: the row contractions by `fft.triton_rowsum`'s kernel, else the
    torch expression."""
    import fft_at_scale as fs

    from fastrpe.ops.linear.fft import blocked, triton_blocked

    rows = []
    for L, chunk in ((L, c) for L in lengths for c in chunks):
        with blocked.use_kernel("never"):
            before = fs.row(family, L, gpu, local=local, row_sums=row_sums) if chunk is None else None
        with triton_blocked.count_traffic(simulate=True) as t, blocked.use_kernel("always"):
            class Counted(ByteCounter):  # the kernels' count over the counted call only (row() warms up first)
                def __enter__(self):
                    t.lower = t.upper = t.launches = 0
                    return super().__enter__()

            saved_counter, fs.ByteCounter = fs.ByteCounter, Counted
            try:
                after = fs.row(family, L, gpu, chunk=chunk, local=local, row_sums=row_sums)
            finally:
                fs.ByteCounter = saved_counter
        gib = 2 ** 30
        r = {"L": L, "gpu": gpu, "family": family, "chunk": "plan" if chunk is None else chunk, "local": local,
             "row_sums": "kernel" if row_sums else "torch"}
        if before is not None:
            r.update({"torch_gib": before["gib_moved"], "torch_launches": before["launches"],
                      "torch_peak_gib": before["peak_gib_above_inputs"], "torch_rowsum_gib": before["rowsum_gib"]})
        r.update({"kernels_aten_gib": after["gib_moved"], "kernel_gib_lower": t.lower / gib,
                  "kernel_gib_upper": t.upper / gib, "kernels_gib_lower": after["gib_moved"] + t.lower / gib,
                  "kernels_gib_upper": after["gib_moved"] + t.upper / gib,
                  "kernels_launches": after["launches"] + t.launches, "kernel_launches": t.launches,
                  "rowsum_gib": after["rowsum_gib"], "rowsum_launches": after["rowsum_launches"],
                  "kernels_peak_gib": after["peak_gib_above_inputs"], "kernels_peak_gib_in_all": after["peak_gib_in_all"]})
        if before is not None:
            r["torch_by_op"] = before["by_op"]
        r["kernels_by_op"] = after["by_op"]
        rows.append(r)
        torch_part = ("" if before is None else f"torch path {r['torch_gib']:8.1f} GiB ({r['torch_launches']} launches, "
                                                 f"peak {r['torch_peak_gib']:.2f}); ")
        print(f"at scale L={L:7d} {gpu} chunk {r['chunk']}: {torch_part}kernels {r['kernels_gib_lower']:8.1f} to "
              f"{r['kernels_gib_upper']:8.1f} GiB ({r['kernel_gib_lower']:.1f} to {r['kernel_gib_upper']:.1f} in "
              f"{t.launches} kernel launches, {r['kernels_launches']} launches in all, peak {r['kernels_peak_gib']:.2f})",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="8192,16384,32768", help="the recursion's lengths (H = 1)")
    ap.add_argument("--model", default="16384:8:16777216",
                    help="L:H:budget of the model check (a small budget, so that few channels fit a block)")
    ap.add_argument("--features", type=int, default=F, help="for level and model (the plan's rows: the bench's)")
    ap.add_argument("--value-dim", type=int, default=DV)
    ap.add_argument("--matrix-chunk", type=int, default=256, help="T of the matrix rows (64 chunks of it)")
    ap.add_argument("--at-scale", default="", help="lengths of the at_scale rows (none by default: minutes each)")
    ap.add_argument("--only-at-scale", action="store_true", help="the at_scale rows alone")
    ap.add_argument("--at-scale-chunks", default=None,
                    help="comma-separated chunk lengths of the at_scale rows' kernel route ('none': the recursion; "
                         "default: the plan's, beside the torch path's)")
    ap.add_argument("--at-scale-local", default="on", choices=("on", "off"),
                    help="the at_scale rows' chunks' own pairs by triton_tiled (on) or the recursion (off)")
    ap.add_argument("--at-scale-row-sums", default="on", choices=("on", "off"),
                    help="the at_scale rows' row contractions by triton_rowsum's kernel (on) or torch (off)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from fastrpe.ops.linear.fft import causal as fc

    out = {"meta": {"command": "python benchmarks/fft_blocked_traffic.py " + " ".join(sys.argv[1:]),
                    "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
                    "problem": {"B": 1, "F": a.features, "Dv": a.value_dim, "dtype": "float32",
                                "table": "learned (its gradient too)"}}}
    if a.only_at_scale:
        del out["meta"]["problem"]  # (the rows below)
    if a.at_scale:  # before the rows below change SEGMENT_BLOCKS (fft_at_scale sets its own)
        out["meta"]["at_scale_problem"] = {"B": 1, "H": 8, "D": 64, "features": 32, "kernel": "nprf",
                                           "dtype": "bfloat16", "table": "frozen", "backward": True,
                                           "budget": "the H200's (fft_at_scale.py)"}
        chunks = (None,) if a.at_scale_chunks is None else \
            tuple(c if c == "none" else int(c) for c in a.at_scale_chunks.split(","))
        out["at_scale"] = at_scale_rows([int(x) for x in a.at_scale.split(",")], chunks=chunks,
                                        local=a.at_scale_local == "on", row_sums=a.at_scale_row_sums == "on")
    if not a.only_at_scale:
        fc.SEGMENT_BLOCKS = "always"  # each recursion product's blocks from its own segment, as on CUDA
        L, H, budget = (int(x) for x in a.model.split(":"))
        out.update({"level": level_rows([int(x) for x in a.levels.split(",")], a.features, a.value_dim),
                    "matrix": matrix_rows(a.matrix_chunk),
                    "model": model_rows(L, H, budget, a.features, a.value_dim),
                    "plan": plan_rows()})
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
