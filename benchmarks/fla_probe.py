"""Where fla's kernels fail on a GPU, one variant per process (a fault ends its process).

The first calls of fla-core 0.6.0's `chunk_simple_gla` on the H100 image (torch 2.11, triton
3.6) ended in "an illegal memory access" (2026-11-26); fla-org/flash-linear-attention#734
reports fla kernels crashing on H100 with triton 3.2-3.6. Each variant runs the GPU bench's
own setup (fastrpe.bench.gpu) under CUDA_LAUNCH_BLOCKING=1, forward and backward, so a fault
is raised at the launch that made it: the last frames name the fla kernel.

Each child writes straight into this process's stdout and stderr (gpu_run.sh: a log that it
appends to gpu_tests.log whatever the exit), so what a variant printed stays even when the
probe is killed at its time limit: on 2026-11-27 the log was only kept on exit 0, and the probe
exits non-zero exactly when a variant failed or ran out of time. A SIGTERM / SIGINT (the
script's `timeout`) prints which variant was running and for how long, then the summary.
Exit 0: every variant passed (or skipped); 1: one failed; 2: one ran out of time or none ran.

    python benchmarks/fla_probe.py            # every variant, one line each (+ frames on failure)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: (name, competitor, family, features K, environment): the bench's rows (fla's oversized tiles
#: pruned, `gpu.prune_fla_oversized_tiles`), the first again with fla's own configs, then
#: K = D = 64
VARIANTS = [
    ("simple_gla K=32 (bench)", "fla-chunk_simple_gla", "alibi", 32, {}),
    ("linear_attn K=32 (bench)", "fla-chunk_linear_attn", "none", 32, {}),
    ("simple_gla K=32 fla's tiles", "fla-chunk_simple_gla", "alibi", 32, {"FASTRPE_FLA_PRUNE": "0"}),
    ("simple_gla K=64", "fla-chunk_simple_gla", "alibi", 64, {}),
]


def child(competitor: str, family: str, features: int, L: int) -> int:
    import traceback

    import torch

    from fastrpe.bench import gpu
    from fastrpe.bench.registry import Problem

    versions = [f"torch {torch.__version__}"]
    for mod in ("triton", "fla"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception as e:  # noqa: BLE001 - said; the setup below says the rest
            versions.append(f"{mod}: {type(e).__name__}: {e}")
    print(", ".join(versions), flush=True)
    p = Problem(position=family, kernel="nprf", causal=True, L=L, B=1, H=8, D=64, features=features)
    setup = gpu.registry(gpu.GpuConfig())[competitor]
    try:
        fn = setup(p, torch.device("cuda"), torch.bfloat16)
        if isinstance(fn, str):
            print("SKIP", fn, flush=True)
            return 0
        print("fla's oversized tiles pruned in:", ", ".join(fn.extra.get("fla_pruned") or ["none"]), flush=True)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        print(f"PASS first call {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - the probe's answer
        frames = traceback.extract_tb(e.__traceback__)
        print(f"FAIL {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
        for f in [f for f in frames if "/fla/" in f.filename or "triton" in f.filename][-6:]:
            print(f"    {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}: {f.line}")
        sys.stdout.flush()
        return 1


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]), 4096)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONUNBUFFERED": "1"}
    cap = float(os.environ.get("FLA_PROBE_S", "100"))
    done: list[str] = []  # each variant's summary line
    now: dict = {}  # the variant running: name, start, process

    def summary() -> None:
        print("fla probe, per variant:", flush=True)
        for line in done:
            print("  " + line, flush=True)

    def stopped(signum, frame):  # the script's timeout: say where it stopped, then the summary
        if now:
            done.append(f"{now['name']:26s} {time.perf_counter() - now['t0']:6.1f} s  KILLED by "
                        f"{signal.Signals(signum).name} (the probe's time ran out; its output so far is above)")
            if now["proc"].poll() is None:
                now["proc"].kill()
        summary()
        sys.exit(2)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    rc = 0
    for name, competitor, family, k, extra in VARIANTS:
        print(f"== {name}: {competitor} {family} K={k} {extra or ''}(CUDA_LAUNCH_BLOCKING=1, at most {cap:.0f} s)",
              flush=True)
        t0 = time.perf_counter()
        # the child's stdout and stderr are this process's: nothing is held back in a pipe
        proc = subprocess.Popen([sys.executable, __file__, "--child", competitor, family, str(k)], env={**env, **extra})
        now.update(name=name, t0=t0, proc=proc)
        try:
            code = proc.wait(timeout=cap)
            verdict = {0: "PASS (or SKIP)", 1: "FAIL"}.get(code, f"CRASHED, exit {code}")
            rc = max(rc, 0 if code == 0 else 1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            verdict, rc = f"TIMEOUT after {cap:.0f} s (FLA_PROBE_S)", 2
        now.clear()
        done.append(f"{name:26s} {time.perf_counter() - t0:6.1f} s  {verdict}")
        print(f"== {done[-1]}", flush=True)
    summary()
    return rc


if __name__ == "__main__":
    sys.exit(main())
