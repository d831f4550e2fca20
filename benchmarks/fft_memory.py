"""Peak memory and time of the FFT Toeplitz path (forward + backward) on CPU.

`fastrpe.attention(..., kernel="nprf", position=KerpleLog, backend="fft")` on
`q, k, v: [1, H, L, D]` float32, causal and not. Each configuration runs in a fresh
subprocess; peak = ru_maxrss after forward + backward minus ru_maxrss once the inputs are
built (after a tiny warm-up call, so thread pools and one-time allocations are not
counted). Besides wall time it reports the process's CPU time, which other work sharing
the machine disturbs less (compare before/after runs with it on a busy machine). The dense path's need is computed, not run: the `[H, L, L]` float32 weights,
their copy saved for backward and their gradient.

    python benchmarks/fft_memory.py --length 65536 --out benchmarks/results/fft_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, torch
import fastrpe as fr
L, H, D, F, causal = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
budget = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "default" else None
import fastrpe.ops.linear.fft as fftmod
if len(sys.argv) > 7 and sys.argv[7] != "default":
    fftmod.causal.BLOCKED = sys.argv[7]
if budget is not None:
    import fastrpe.ops.linear.fft.plan as fftplan
    fftplan.DEFAULT_BUDGET = budget
pos = fr.positions.KerpleLog(H)
kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
w = torch.randn(1, H, 300, D, requires_grad=True)  # warm-up (above the causal leaf size)
fr.attention(w, w, w, kernel=kern, position=pos, causal=causal, backend="fft").sum().backward()
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t, c = time.perf_counter(), time.process_time()
out = fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend="fft")
fwd = time.perf_counter() - t
out.sum().backward()
sec, cpu = time.perf_counter() - t, time.process_time() - c
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))
flops, est = fftmod.estimate_fft_cost(1, H, L, L, F, D, torch.float32)
from fastrpe.ops.toeplitz.fft import fft_length
print(json.dumps({"seconds": sec, "cpu_seconds": cpu, "forward_seconds": fwd, "peak_extra_bytes": peak - base,
                  "baseline_rss_bytes": base, "finite": finite, "estimated_peak_bytes": est,
                  "block": fftmod.fft_block_size(1, H, L, L, F, D, torch.float32),
                  "fft_length": fft_length(2 * L - 1)}))
"""


def machine() -> str:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{platform.machine()} {name or 'unknown CPU'}, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64, help="D = Dv")
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--budget", default="default", help="memory_budget_bytes of the op (default: its own)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--causal-blocked", choices=["default", "always", "never", "cuda"], default="default",
                    help="fft.causal.BLOCKED: the causal pairs across chunks by the blocked product, or the recursion")
    ap.add_argument("--out", default="benchmarks/results/fft_memory.json")
    a = ap.parse_args()
    import torch

    rows = []
    modes = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    gib = 2 ** 30
    print(f"machine: {machine()}; torch {torch.__version__}; L={a.length} H={a.heads} D=Dv={a.dim} "
          f"F={a.features} float32, forward + backward")
    print(f"{'causal':>6} | {'fwd s':>7} | {'fwd+bwd s':>9} | {'cpu s':>7} | {'peak extra GiB':>14} | {'model GiB':>9} | "
          f"{'block':>5} | {'dense would need GiB':>20}")
    for causal in modes:
        res = subprocess.run([sys.executable, "-c", CHILD, str(a.length), str(a.heads), str(a.dim), str(a.features),
                              "1" if causal else "0", a.budget, a.causal_blocked], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"child failed (causal={causal}):\n{res.stderr}")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        dense = a.heads * a.length * a.length * 4 * 3
        r.update(causal=causal, dense_estimate_bytes=dense)
        rows.append(r)
        print(f"{causal!s:>6} | {r['forward_seconds']:7.2f} | {r['seconds']:9.2f} | {r['cpu_seconds']:7.2f} | "
              f"{r['peak_extra_bytes'] / gib:14.3f} | "
              f"{r['estimated_peak_bytes'] / gib:9.3f} | {r['block']:5d} | {dense / gib:20.0f}")
    meta = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "L": a.length,
            "H": a.heads, "D": a.dim, "Dv": a.dim, "features": a.features, "dtype": "float32",
            "budget": a.budget, "causal_blocked": a.causal_blocked, "rows": rows,
            "command": "python benchmarks/fft_memory.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
