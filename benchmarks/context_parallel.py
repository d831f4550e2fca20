"""Context parallelism on CPU (gloo): bytes each rank sends per attention layer, and time,
for every path of `fastrpe.distributed.attention`, against one process.

For each path and sequence length L, one causal attention layer (forward + backward, B=1,
H=4, D=Dv=32, 32 NPRF features) runs over `--ranks` gloo processes, each holding L/ranks
positions, and the same call runs in one process (`fastrpe.attention`, the same kernel,
term and backend):

    path             kernel + term                 single-process backend   sends per rank
    ring             softmax + ALiBi               auto (sdpa)              O(L·(D+Dv))
    ring_kernelized  NPRF + KERPLE log             auto                     O(L·(D+Dv)), one block held
    gather           NPRF + KERPLE log (any table) auto                     O(L·(D+Dv)), all keys held
    chunked  NPRF + ALiBi (geometric decay)    chunked                  O(F·Dv)
    band     NPRF + T5 (finite support)        band                     O(F·Dv + W·(F+Dv))
    soe      NPRF + KERPLE log                 soe (approximate)        O(K·F·Dv + W·(F+Dv))

Bytes come from `fastrpe.distributed.comm.counting()` (every collective of the paths,
forward and backward; the 14-number agreement all-gather of each call is not counted). Time
is the slowest rank's forward + backward (best of `--repeats`), every process on one thread.

    python benchmarks/context_parallel.py                 # launches the ranks itself
    python benchmarks/context_parallel.py --lengths 1024,4096 --paths chunked,ring

Writes `benchmarks/results/context_parallel.json` and `docs/img/context_parallel.png`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

B, H, D, DV, F = 1, 4, 32, 32, 32

#: path -> (kernel, position, single-process backend, distributed path, longest L measured)
PATHS = {
    "ring": ("softmax", "alibi", "auto", "ring", 8192),
    "ring_kernelized": ("nprf", "kerple_log", "auto", "ring", 8192),
    "gather": ("nprf", "kerple_log", "auto", "gather", 8192),
    "chunked": ("nprf", "alibi", "chunked", "linear", 32768),
    "band": ("nprf", "t5", "band", "linear", 32768),
    "soe": ("nprf", "kerple_log", "soe", "linear", 32768),
}
#: one process runs dense softmax (an [H, L, L] score matrix) only up to this length
SINGLE_SOFTMAX_MAX = 8192


def _problem(name: str, L: int):
    """Inputs for the whole sequence (the same on every rank: seeded) and the call's pieces."""
    import fastrpe as fr

    kernel, position, backend, path, _ = PATHS[name]
    g = torch.Generator().manual_seed(L)
    q, k = (torch.randn(B, H, L, D, generator=g) for _ in range(2))
    v = torch.randn(B, H, L, DV, generator=g)
    kern = "softmax" if kernel == "softmax" else fr.kernels.get_kernel(kernel, head_dim=D, num_features=F, seed=1)
    pos = {"alibi": lambda: fr.positions.ALiBi(H), "kerple_log": lambda: fr.positions.KerpleLog(H),
           "t5": lambda: fr.positions.T5Bias(H, num_buckets=32, max_distance=128, bidirectional=False)}[position]()
    return q, k, v, kern, pos, backend, path


def _fwd_bwd(fn, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.square().sum().backward()
    return time.perf_counter() - t0


def single(names, lengths, repeats) -> dict:
    """`{(path, L): seconds}` of the one-process call."""
    import fastrpe as fr

    torch.set_num_threads(1)
    times, times_by_call = {}, {}
    for name in names:
        for L in lengths:
            if L > PATHS[name][4] or (PATHS[name][0] == "softmax" and L > SINGLE_SOFTMAX_MAX):
                continue
            q, k, v, kern, pos, backend, _ = _problem(name, L)

            def fn(q, k, v, kern=kern, pos=pos, backend=backend):
                return fr.attention(q, k, v, kern, pos, causal=True, backend=backend)

            key = (PATHS[name][:3], L)  # ring_kernelized and gather share their 1-process call
            if key not in times_by_call:
                times_by_call[key] = min(_fwd_bwd(fn, q, k, v) for _ in range(repeats))
            times[f"{name}/{L}"] = times_by_call[key]
            print(f"1 process  {name:15s} L={L:6d}  {times[f'{name}/{L}']:.3f} s", flush=True)
    return times


def worker(rank: int, world: int, init: str, out: str, names, lengths, repeats) -> None:
    """One rank: every (path, L), bytes sent by this rank and the slowest rank's time."""
    from datetime import timedelta

    import torch.distributed as dist

    import fastrpe.distributed as frd
    from fastrpe.distributed import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    rows = []
    for name in names:
        for L in lengths:
            if L > PATHS[name][4]:
                continue
            q, k, v, kern, pos, backend, path = _problem(name, L)
            n = L // world
            sl = slice(rank * n, (rank + 1) * n if rank < world - 1 else L)

            def fn(q, k, v, kern=kern, pos=pos, backend=backend, path=path):
                return frd.attention(q, k, v, kern, pos, causal=True, backend=backend, path=path)

            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                with comm.counting() as c:
                    t = _fwd_bwd(fn, q[:, :, sl], k[:, :, sl], v[:, :, sl])
                best = min(best, t)
            by_op = c.by_op()
            fwd = sum(b for op, b in by_op.items() if "backward" not in op)
            bwd = sum(b for op, b in by_op.items() if "backward" in op)
            sent = [None] * world
            dist.all_gather_object(sent, {"fwd": fwd, "bwd": bwd, "ops": by_op, "seconds": best})
            if rank == 0:
                slow = max(s["seconds"] for s in sent)
                rows.append({"path": name, "L": L, "ranks": world, "seconds": slow,
                             "bytes_fwd": [s["fwd"] for s in sent], "bytes_bwd": [s["bwd"] for s in sent],
                             "ops_rank0": sent[0]["ops"]})
                print(f"{world} ranks    {name:15s} L={L:6d}  {slow:.3f} s  max bytes/rank "
                      f"{max(s['fwd'] + s['bwd'] for s in sent) / 2**20:.3f} MiB", flush=True)
                Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, names, lengths, repeats) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init, out = Path(tmp) / "init", Path(tmp) / "rows.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        args = [",".join(names), ",".join(map(str, lengths)), str(repeats)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(init), str(out),
                                   *args], env=env) for r in range(world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return json.loads(out.read_text())


def plot(rows: list[dict], path: Path) -> None:
    from fastrpe.plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, name in enumerate(PATHS):
        rs = sorted((r for r in rows if r["path"] == name), key=lambda r: r["L"])
        if not rs:
            continue
        L = [r["L"] for r in rs]
        # markers of decreasing size: paths that send the same bytes stay visible on one line
        a.plot(L, [max(f + w for f, w in zip(r["bytes_fwd"], r["bytes_bwd"])) for r in rs], "-",
               marker="osD^vP"[i % 6], markersize=10 - i, label=name)
        b.plot(L, [r["seconds"] for r in rs], "o-", label=f"{name}, {rs[0]['ranks']} ranks")
        one = [(r["L"], r["single_seconds"]) for r in rs if r.get("single_seconds") is not None]
        if one:
            b.plot(*zip(*one), "x--", color=b.lines[-1].get_color(), label=f"{name}, 1 process")
    a.set_title("communication (ring, kernelized ring and gather coincide)")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.grid(True, which="both", alpha=0.3)
    a.set_ylabel("bytes sent per rank per layer (fwd + bwd, largest rank)")
    b.set_ylabel("seconds, fwd + bwd (slowest rank)")
    b.set_title("time on 2 shared CPU cores (not a speed claim)")
    a.legend(fontsize=8)
    b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"fastrpe.distributed, causal, B={B} H={H} D=Dv={D} F={F}, gloo")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, init, out, names, lengths, repeats = sys.argv[2:9]
        worker(int(r), int(w), init, out, names.split(","), [int(x) for x in lengths.split(",")], int(repeats))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/context_parallel.json")
    ap.add_argument("--plot", default="docs/img/context_parallel.png")
    a = ap.parse_args()
    names = a.paths.split(",")
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        ap.error(f"--paths: unknown {unknown[0]!r}; known: {', '.join(PATHS)}")
    lengths = [int(x) for x in a.lengths.split(",")]
    t0 = time.perf_counter()
    rows = launch(a.ranks, names, lengths, a.repeats)
    one = single(names, lengths, a.repeats)
    for r in rows:
        r["single_seconds"] = one.get(f"{r['path']}/{r['L']}")
    meta = {"command": "python benchmarks/context_parallel.py " + " ".join(sys.argv[1:]),
            "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}, "
                       f"{a.ranks} gloo processes sharing the cores, one thread each",
            "shape": {"B": B, "H": H, "D": D, "Dv": DV, "F": F, "causal": True},
            "paths": {k: dict(zip(("kernel", "position", "backend", "path", "max_L"), v)) for k, v in PATHS.items()},
            "wall_seconds": time.perf_counter() - t0}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, Path(a.plot))  # or again from the JSON: plot(json.load(open(out))["rows"], path)
    print(f"wrote {out} and {a.plot} ({meta['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
