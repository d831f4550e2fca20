"""CPU time of T5-bucket kernelized attention, forward + backward: the exact `band`
backend (linear time) against `fft` and `dense` (both exact too).

    OMP_NUM_THREADS=1 python benchmarks/band_speed.py [--lengths 4096 16384] [--backends band fft dense]

Prints one JSON line per (length, backend): median seconds over `--repeats` runs.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fastrpe as fr
from fastrpe import positions as P


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--backends", nargs="+", default=["band", "fft", "dense"])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="skip a backend after a call this slow")
    a = ap.parse_args()
    pos = P.T5Bias(a.heads, bidirectional=False)
    kern = fr.kernels.get_kernel("nprf", head_dim=a.dim, num_features=a.features)
    slow = set()
    for L in a.lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, a.heads, L, a.dim, generator=g).requires_grad_() for _ in range(3))
        for b in a.backends:
            if b in slow:
                continue
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=b).sum().backward()
                times.append(time.perf_counter() - t0)
                if times[-1] > a.max_seconds:
                    slow.add(b)
                    break
            times.sort()
            print(json.dumps({"L": L, "backend": b, "H": a.heads, "D": a.dim, "F": a.features,
                              "fwd_bwd_s": round(times[len(times) // 2], 4), "threads": torch.get_num_threads()}),
                  flush=True)


if __name__ == "__main__":
    main()
