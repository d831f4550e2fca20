"""CPU time of the sum-of-exponentials op, forward + backward (KERPLE-log, causal).

    OMP_NUM_THREADS=1 python benchmarks/soe_speed.py [--lengths 4096 16384] [--module fastrpe.ops.linear.soe]

Prints one JSON line per length: median seconds over `--repeats` runs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time

import torch

from fastrpe import positions as P


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--dv", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--module", default="fastrpe.ops.linear.soe")
    a = ap.parse_args()
    soe = importlib.import_module(a.module)
    pos = P.KerpleLog(a.heads)
    for L in a.lengths:
        g = torch.Generator().manual_seed(0)
        pq = torch.rand(1, a.heads, L, a.features, generator=g, requires_grad=True)
        pk = torch.rand(1, a.heads, L, a.features, generator=g, requires_grad=True)
        v = torch.randn(1, a.heads, L, a.dv, generator=g, requires_grad=True)
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            plan = soe.soe_plan(soe.causal_log_coefficients(pos, max(L, soe.SOE_FIT_LENGTH)))
            num, den, _ = soe.kernelized_num_den_soe(pq, pk, v, plan=plan)
            (num.sum() + den.sum()).backward()
            times.append(time.perf_counter() - t0)
        times.sort()
        print(json.dumps({"L": L, "H": a.heads, "F": a.features, "Dv": a.dv, "module": a.module,
                          "fwd_bwd_s": round(times[len(times) // 2], 4), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
