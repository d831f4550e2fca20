"""Where fla's kernels fail on a GPU, one variant per process (a fault ends its process).

The first calls of fla-core 0.6.0's `chunk_simple_gla` on the H100 image (torch 2.11, triton
3.6) ended in "an illegal memory access" (2026-11-26); fla-org/flash-linear-attention#734
reports fla kernels crashing on H100 with triton 3.2-3.6. Each variant runs the GPU bench's
own setup (fastrpe.bench.gpu) under CUDA_LAUNCH_BLOCKING=1, forward and backward, so a fault
is raised at the launch that made it: the last frames name the fla kernel.

    python benchmarks/fla_probe.py            # every variant, one line each (+ frames on failure)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

#: (name, competitor, family, features K): the bench's rows, then K = D = 64
VARIANTS = [
    ("simple_gla K=32 (bench)", "fla-chunk_simple_gla", "alibi", 32),
    ("linear_attn K=32 (bench)", "fla-chunk_linear_attn", "none", 32),
    ("simple_gla K=64", "fla-chunk_simple_gla", "alibi", 64),
]


def child(competitor: str, family: str, features: int, L: int) -> None:
    import traceback

    import torch

    from fastrpe.bench import gpu
    from fastrpe.bench.registry import Problem

    p = Problem(position=family, kernel="nprf", causal=True, L=L, B=1, H=8, D=64, features=features)
    setup = gpu.registry(gpu.GpuConfig())[competitor]
    try:
        fn = setup(p, torch.device("cuda"), torch.bfloat16)
        if isinstance(fn, str):
            print("SKIP", fn)
            return
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"PASS first call {time.perf_counter() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001 - the probe's answer
        frames = traceback.extract_tb(e.__traceback__)
        print(f"FAIL {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
        for f in [f for f in frames if "/fla/" in f.filename or "triton" in f.filename][-6:]:
            print(f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}: {f.line}")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), 4096)
        return 0
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONUNBUFFERED": "1"}
    for name, competitor, family, k in VARIANTS:
        t0 = time.perf_counter()
        try:
            res = subprocess.run([sys.executable, __file__, "--child", competitor, family, str(k)], env=env,
                                 capture_output=True, text=True, check=False, timeout=float(os.environ.get("FLA_PROBE_S", "100")))
            out = (res.stdout.strip() or f"no answer, exit {res.returncode}: {res.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            out = "TIMEOUT"
        print(f"{name:26s} {time.perf_counter() - t0:6.1f} s  {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
