"""`auto`'s per-call overhead against a forced backend (issue: within 10 % at L = 64).

    python benchmarks/auto_overhead.py [--length 64] [--repeats 7]

For each case, the best of `--repeats` rounds of 200 calls, one thread, forward only; the
forced backend is the one `auto` picks, so the difference is the dispatch alone. Writes
benchmarks/results/auto_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import fastrpe as fr


def per_call_ms(fn, calls: int, repeats: int) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "auto_overhead.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B, H, L, D = 1, 4, a.length, 32
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    cases = [("softmax", fr.positions.KerpleLog(H), True), ("softmax", fr.positions.T5Bias(H), False),
             ("nprf", fr.positions.KerpleLog(H), True), ("nprf", fr.positions.ALiBi(H), True),
             ("nelu", None, True)]
    rows = []
    for kern, pos, causal in cases:
        kernel = fr.kernels.get_kernel(kern, head_dim=D)  # one object, as a layer holds it
        forced = fr.explain(q, k, v, kernel, pos, causal=causal).chosen
        auto = per_call_ms(lambda: fr.attention(q, k, v, kernel, pos, causal=causal), 200, a.repeats)
        frc = per_call_ms(lambda: fr.attention(q, k, v, kernel, pos, causal=causal, backend=forced), 200, a.repeats)
        rows.append({"kernel": kern, "position": type(pos).__name__ if pos is not None else None, "causal": causal,
                     "backend": forced, "auto_ms": auto, "forced_ms": frc, "ratio": auto / frc})
        print(f"{kern:8s} {rows[-1]['position'] or '-':10s} causal={causal!s:5s} {forced:8s} "
              f"auto {auto:.3f} ms  forced {frc:.3f} ms  ratio {auto / frc:.3f}")
    out = {"command": "python benchmarks/auto_overhead.py " + " ".join(argv or []), "length": L,
           "machine": f"{platform.machine()}, {torch.get_num_threads()} thread, torch {torch.__version__}",
           "rows": rows, "max_ratio": max(r["ratio"] for r in rows)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"max ratio {out['max_ratio']:.3f}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
