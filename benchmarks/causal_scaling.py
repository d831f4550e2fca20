"""Time and peak memory of causal kernelized attention against sequence length on CPU:
prefix (Scaleformer's cumsum) vs chunked vs FFT vs dense, forward + backward.

Each (backend, L) runs in a fresh subprocess and is measured twice: the time and the
growth of ru_maxrss (resident memory) on one call, and the allocator's peak (the most
memory the call's tensors held at once, from the profiler's allocation events:
`fastrpe.bench.memory`) on a second. RSS growth depends on how malloc reuses pages and
is noisy; the allocator peak is what the memory complexity predicts. Writes JSON and a
log-log plot, and prints the least-squares log-log slope of each backend's allocator
peak from 4k to the longest length it ran.

    python benchmarks/causal_scaling.py --out benchmarks/results/causal_scaling.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from fastrpe.bench.runner import loglog_slope

CHILD = r"""
import json, resource, sys, time, torch
import fastrpe as fr
backend, L, H, D, F = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
kern = fr.kernels.get_kernel("nelu")
# warm-up on a tiny problem so thread pools and first-call allocations are not counted
w = torch.randn(1, H, 64, D, requires_grad=True)
fr.attention(w, w, w, kernel=kern, causal=True, backend=backend).sum().backward()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
out = fr.attention(q, k, v, kernel=kern, position=None, causal=True, backend=backend)
out.sum().backward()
sec = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
q.grad = k.grad = v.grad = None
del out
from fastrpe.bench.memory import allocator_peak_bytes
peak, _ = allocator_peak_bytes(
    lambda: fr.attention(q, k, v, kernel=kern, position=None, causal=True, backend=backend).sum().backward())
print(json.dumps({"seconds": sec, "rss_extra_bytes": rss, "peak_extra_bytes": peak}))
"""

def markdown_table(rows: list[dict], backends: list[str]) -> str:
    """Cells `time / allocator peak` per length and backend ("—" where not run)."""
    lengths = sorted({r["L"] for r in rows})
    cell = {(r["backend"], r["L"]): r for r in rows}
    out = ["| L | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for L in lengths:
        cells = []
        for b in backends:
            r = cell.get((b, L), {})
            cells.append(f"{r['seconds']:.2f} s / {r['peak_extra_bytes'] / 2**20:.0f} MiB" if "seconds" in r else "—")
        out.append(f"| {L} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# longest length each backend is run at on a 2-core, 24 GiB machine (beyond: minutes or out of memory)
MAX_L = {"dense": 8192, "fft": 16384, "prefix": 32768, "chunked": 65536}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--backends", default="prefix,chunked,fft,dense")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64, help="D = Dv; elu features: F = D")
    ap.add_argument("--out", default="benchmarks/results/causal_scaling.json")
    a = ap.parse_args()
    rows = []
    for b in a.backends.split(","):
        for L in (int(x) for x in a.lengths.split(",")):
            if L > MAX_L.get(b, L):
                rows.append({"backend": b, "L": L, "skipped": f"beyond {MAX_L[b]} on this machine"})
                continue
            res = subprocess.run([sys.executable, "-c", CHILD, b, str(L), str(a.heads), str(a.dim), str(a.dim)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                rows.append({"backend": b, "L": L, "skipped": res.stderr.strip().splitlines()[-1][:200]})
            else:
                rows.append({"backend": b, "L": L, **json.loads(res.stdout.strip().splitlines()[-1])})
            r = rows[-1]
            print(f"{b:8s} L={L:6d} " + (f"{r['seconds']:8.2f} s  allocator peak {r['peak_extra_bytes'] / 2**20:8.1f} MiB"
                                        f"  RSS growth {r['rss_extra_bytes'] / 2**20:8.1f} MiB"
                                        if "seconds" in r else r["skipped"]), flush=True)
    slopes = {}
    for b in a.backends.split(","):
        pts = [(r["L"], r["peak_extra_bytes"]) for r in rows if r["backend"] == b and "seconds" in r and r["L"] >= 4096]
        if len(pts) >= 2 and all(m > 0 for _, m in pts):
            slopes[b] = loglog_slope([p[0] for p in pts], [p[1] for p in pts])
    for b, s in slopes.items():
        print(f"memory log-log slope {b}: {s:.2f}")
    print("\n" + markdown_table(rows, a.backends.split(",")))
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "H": a.heads, "D": a.dim, "kernel": "nelu",
            "dtype": "float32", "rows": rows, "memory_slope_from_4k": slopes, "memory": "allocator peak (peak_extra_bytes); RSS growth in rss_extra_bytes",
            "command": "python benchmarks/causal_scaling.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for b in a.backends.split(","):
            pts = [(r["L"], r["seconds"], r["peak_extra_bytes"]) for r in rows if r["backend"] == b and "seconds" in r]
            if pts:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
                axes[1].plot([p[0] for p in pts], [max(p[2], 1) / 2**20 for p in pts], marker="o",
                             label=b + (f" (slope {slopes[b]:.2f})" if b in slopes else ""))
        for ax, yl in zip(axes, ["seconds (fwd+bwd)", "allocator peak MiB (fwd+bwd)"]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(yl)
            ax.legend(fontsize=8)
        fig.suptitle(f"causal kernelized attention, H={a.heads}, D={a.dim}, CPU ({meta['machine']})", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.out.replace(".json", ".png"), dpi=120)
    except ImportError:
        print("no plot: pip install matplotlib")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
