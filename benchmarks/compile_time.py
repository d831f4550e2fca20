"""Seconds to compile each Triton kernel for Hopper (sm_90) in each autotuner config, with a
cold cache, on this machine's CPU (no GPU needed: triton ships ptxas).

Why: a GPU session's first bench compiles everything before it times anything, each
autotuned kernel once per config (`triton_chunked.TUNE_CONFIGS`). This is what
`fastrpe bench --suite gpu --warm` (fastrpe.bench.gpu_warm) spreads over one process per
config. The kernels and their constexprs are tests/test_triton_compile.py's list (as the
backends launch them); that file's script is run here with each config's warps and stages.

    python benchmarks/compile_time.py --out benchmarks/results/compile_time-sm90.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/compile_time-sm90.json")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastrpe-compile-time-")  # cold
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch
    import triton
    from test_triton_compile import SCRIPT

    from fastrpe.ops.linear.triton_chunked import TUNE_CONFIGS

    ns: dict = {"RUN": False}
    exec(compile(SCRIPT, "test_triton_compile.SCRIPT", "exec"), ns)  # noqa: S102 - the test's own list, run as it runs it
    rows = []
    for dt, kernel, types, consts in ns["all_cases"]():
        tuned = type(kernel).__name__ == "Autotuner"
        for w, s in TUNE_CONFIGS if tuned else ((8, 1),):  # untuned: once, as test_triton_compile compiles it
            t0 = time.perf_counter()
            k = ns["compile_for_h100"](kernel, types, consts, num_warps=w, num_stages=s)
            sec = time.perf_counter() - t0
            rows.append({"features": dt, "kernel": k.metadata.name, "NB": consts.get("NB"), "tuned": tuned,
                         "num_warps": w, "num_stages": s, "seconds": round(sec, 3)})
            print(f"{dt:5s} {k.metadata.name:28s} warps={w} stages={s} {sec:6.2f} s", flush=True)
    total = sum(r["seconds"] for r in rows)
    tuned_s = sum(r["seconds"] for r in rows if r["tuned"])
    per_config = {f"{w}x{s}": round(sum(r["seconds"] for r in rows if r["tuned"] and (r["num_warps"], r["num_stages"])
                                        == (w, s)), 1) for w, s in TUNE_CONFIGS}
    res = {"command": "python benchmarks/compile_time.py --out " + args.out, "target": "cuda sm_90 (ptxas of triton)",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores (one compile at a time)",
           "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
           "compilations": len(rows), "seconds_total": round(total, 1), "seconds_tuned": round(tuned_s, 1),
           "seconds_tuned_per_config": per_config, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{len(rows)} compilations, {total:.0f} s ({tuned_s:.0f} s for the autotuned kernels' "
          f"{len(TUNE_CONFIGS)} configs, {max(per_config.values()):.0f} s the most for one config); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
