"""Peak memory and time of the FFT Toeplitz path (forward + backward) on CPU.

Each configuration runs in a fresh subprocess; peak = ru_maxrss after the call minus
ru_maxrss after building the inputs. The dense path's need is computed, not run.

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
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
pos = fr.positions.KerpleLog(H)
kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.perf_counter()
out = fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend="fft")
out.sum().backward()
sec = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": sec, "peak_extra_bytes": peak - base, "finite": bool(torch.isfinite(out).all())}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/fft_memory.json")
    a = ap.parse_args()
    rows = []
    for causal in (False, True):
        res = subprocess.run([sys.executable, "-c", CHILD, str(a.length), str(a.heads), str(a.dim), str(a.features),
                              "1" if causal else "0"], capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        # dense: the [L, L] weights, saved for backward, plus a same-size gradient, in float32
        dense = a.heads * a.length * a.length * 4 * 3
        r.update(causal=causal, dense_estimate_bytes=dense)
        rows.append(r)
        print(f"causal={causal!s:5s} fwd+bwd {r['seconds']:7.2f} s  peak extra {r['peak_extra_bytes'] / 2**30:5.2f} GiB"
              f"  (dense would need ~{dense / 2**30:.0f} GiB)")
    meta = {"machine": f"{platform.machine()} {platform.processor()} {os.cpu_count()} cores", "L": a.length,
            "H": a.heads, "D": a.dim, "features": a.features, "dtype": "float32", "rows": rows,
            "command": "python benchmarks/fft_memory.py " + " ".join(sys.argv[1:])}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(meta, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
