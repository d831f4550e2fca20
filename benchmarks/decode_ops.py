"""Aten operations and CPU time of one decoding step, `MultiheadAttention.step(x, state)`, for
the GPU bench's decode rows (`fastrpe.bench.gpu.decode_rows`): the three constant-size states
(`LinearState` for ALiBi, `SoEState` for KERPLE-log, `BandState` for T5, NPRF features) and a
KV cache (ALiBi, NPRF, exact), built as the bench builds them, on CPU.

A constant-size step does almost no arithmetic; on a GPU its time is kernel launches and the
Python between them, so the number of aten operations it dispatches is what to cut. Counted
with a `TorchDispatchMode` (the ops that reach the backend, after autograd and the composite
decompositions): `ops` is all of them, `launches` those that are not views (nor `NO_KERNEL`;
on a GPU, roughly one kernel each). `us_per_step` is the median wall time of `--repeats` steps on CPU.

The rows "..., fused Triton step" are the same layers with `attention.FUSED_STEP = "always"`:
their one Triton launch (`triton_recurrent.prf_linear_token_triton`, `prf_soe_token_triton`,
`prf_band_token_triton`: features, state, quotient) is not an aten op, so `launches` adds
`triton_launches`. Without CUDA the kernels run under Triton's interpreter: counted, not timed
(`us_per_step` null).

`--host` adds `host_us_per_step` to those rows: the same step with its Triton launch counted,
not run, at `--host-dims` widths (default H = 1, D = 4, 2 features), so that no matmul does
real work on the CPU. What is left is the step's Python and aten dispatch, which the widths do
not change, and which is most of an eager step on a GPU: on the H100 (2026-11-27,
`benchmarks/results/gpu/h100-2026-11-27c.json`'s decode rows) the bf16 fused steps took 461 to
634 µs eager and 20 to 31 µs replayed from a CUDA graph.

    python benchmarks/decode_ops.py --out benchmarks/results/decode_ops.json

`--profile STEPS` instead profiles the fused steps' host time with cProfile, on CUDA where
there is one (`benchmarks/gpu_run.sh first` runs it after the GPU tests):

    python benchmarks/decode_ops.py --profile 200 --dtypes bfloat16 --context 65536
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():  # the fused step's kernel runs under the interpreter (set before triton loads;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --host-jit wants TRITON_INTERPRET=0: compiled, not run)


#: ops that are not views by their schema but launch nothing either
NO_KERNEL = (torch.ops.aten._unsafe_view.default, torch.ops.aten.promote_types.default)


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it (`ops`), and the ones that are not views."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def launches(self) -> int:
        return sum(n for f, n in self.ops.items() if not (f.is_view or f in NO_KERNEL))

    def by_name(self) -> dict:
        return {str(f): n for f, n in self.ops.most_common()}


def count_ops(fn) -> OpCounter:
    with torch.no_grad(), OpCounter() as c:
        fn()
    return c


def cases(cfg, device, dtype, seed: int = 0):
    """`(name, layer, state, x)` of each decode row, as `decode_rows` builds them."""
    import fastrpe as fr
    from fastrpe.bench.gpu import make_position
    from fastrpe.nn.attention import KVCache

    H, D, ctx = cfg.H, cfg.D, cfg.decode_context
    E = H * D
    g = torch.Generator().manual_seed(seed)

    def layer(kernel, position, backend):
        torch.manual_seed(0)
        return fr.nn.MultiheadAttention(E, H, kernel=kernel, position=position, causal=True,
                                        backend=backend).to(device=device, dtype=dtype).eval()

    def nprf():
        return fr.kernels.get_kernel(cfg.kernel, head_dim=D, num_features=cfg.features)

    x = torch.randn(cfg.B, 1, E, generator=g).to(device=device, dtype=dtype)
    prompt = torch.randn(cfg.B, min(cfg.decode_prompt, ctx), E, generator=g).to(device=device, dtype=dtype)

    def state_of(mha):
        with torch.no_grad():
            _, st = mha.step(prompt, max_length=ctx + 64)
        return replace(st, length=ctx)

    def kv_cache(mha):
        kk = torch.randn(cfg.B, H, ctx, D, generator=g).to(device=device, dtype=dtype)
        return KVCache(kk, torch.randn(cfg.B, H, ctx, D, generator=g).to(device=device, dtype=dtype))

    rows = []
    for name, make in (
            ("state-linear (alibi, nprf)", lambda: layer(nprf(), fr.positions.ALiBi(H), "auto")),
            ("state-soe (kerple_log, nprf)", lambda: layer(nprf(), fr.positions.KerpleLog(H), "soe")),
            ("state-band (t5, nprf)", lambda: layer(nprf(), make_position("t5", H, ctx), "auto"))):
        rows += [(name, make, state_of), (name + FUSED, make, state_of)]  # PyTorch ops, then the fused step
    rows.append(("kv-cache (alibi, nprf, exact)", lambda: layer(nprf(), fr.positions.ALiBi(H), "auto"), kv_cache))
    for name, make, state in rows:
        mha = make()
        yield name, mha, state(mha), x


#: the suffix of the rows that take the fused Triton step
FUSED = ", fused Triton step"

#: the fused steps' kernels (`ops/linear/triton_recurrent.py`)
FUSED_KERNELS = ("_prf_step_kernel", "_prf_band_step_kernel", "_prf_soe_step_kernel")


class _Launches:
    """Launches of the kernels wrapped by `fused_step`, counted in `n`; with `skip` they only
    count (the interpreter's own aten ops would be counted as the step's)."""

    def __init__(self):
        self.n, self.skip = 0, False


class _CountedKernel:
    """A Triton kernel whose launches (`kernel[grid](...)`) are counted in `launches`."""

    def __init__(self, kernel, launches: _Launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        launch, n = self.kernel[grid], self.launches

        def counted(*args, **kwargs):
            n.n += 1
            return None if n.skip else launch(*args, **kwargs)
        return counted


@contextlib.contextmanager
def fused_step():
    """`FUSED_STEP = "always"` with the fused steps' kernels counted (one `_Launches`); None
    where triton cannot run."""
    from fastrpe.nn import attention
    from fastrpe.ops.linear import triton_recurrent
    from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if triton_unavailable_reason(device) is not None:
        yield None
        return
    kernels, mode = {k: getattr(triton_recurrent, k) for k in FUSED_KERNELS}, attention.FUSED_STEP
    launches = _Launches()
    for k, kernel in kernels.items():
        setattr(triton_recurrent, k, _CountedKernel(kernel, launches))
    attention.FUSED_STEP = "always"
    try:
        yield launches
    finally:
        for k, kernel in kernels.items():
            setattr(triton_recurrent, k, kernel)
        attention.FUSED_STEP = mode


def median_us(step, repeats: int) -> float | None:
    """Median µs of `repeats` calls of `step()` (None for none)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 if times else None


def host_time(step, kern, repeats: int, warmup: int) -> float:
    """Median µs of `step()` with its fused kernel's launches counted, not run (`kern.skip`);
    an error if a step launched no kernel (it took the PyTorch ops: nothing fused to time)."""
    kern.skip, n0 = True, kern.n
    try:
        for _ in range(warmup):
            step()
        us = median_us(step, repeats)
    finally:
        kern.skip = False
    if kern.n - n0 < warmup + repeats:
        raise RuntimeError(f"{kern.n - n0} fused launches in {warmup + repeats} steps: the step did not take the kernel")
    return us


def measure_host(cfg, dtype, repeats: int, warmup: int) -> dict[str, float]:
    """`{method: host µs per step}` of the fused rows at `cfg`'s (small) widths (`host_time`)."""
    out = {}
    for name, mha, st, x in cases(cfg, torch.device("cpu"), dtype):
        if not name.endswith(FUSED):
            continue
        with torch.no_grad(), fused_step() as kern:
            if kern is None:
                return out
            out[name] = host_time(lambda: mha.step(x, st), kern, repeats, warmup)  # noqa: B023
    return out


def measure_host_jit(cfg, dtype, repeats: int, warmup: int) -> dict[str, tuple[float, float]]:
    """`{method: (µs with Triton's launch path, µs with the launch stubbed)}` of the fused rows
    at `cfg`'s widths, the kernels compiled (not interpreted) for an H100 by a Triton driver
    that runs nothing (`precompile.py`'s `no_gpu_driver`, `on_a_gpu`, `compile_only`): the
    first is the step's host time up to the driver's launch, `JITFunction.run`'s binding and
    specialization of every argument included, which `--host` (the launch counted, not run)
    leaves out. Needs TRITON_INTERPRET=0 and a Triton that compiles for sm_90 here; the
    first step compiles each kernel (Triton's cache keeps it)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import precompile

    out = {}
    with precompile.no_gpu_driver(), precompile.on_a_gpu(), precompile.compile_only():
        for name, mha, st, x in cases(cfg, torch.device("cpu"), dtype):
            if not name.endswith(FUSED):
                continue
            with torch.no_grad(), fused_step() as kern:
                step = lambda: mha.step(x, st)  # noqa: E731
                for _ in range(warmup):
                    step()
                jit = median_us(step, repeats)
                out[name] = (jit, host_time(step, kern, repeats, warmup))
    return out


def measure(cfg, device, dtype, repeats: int, warmup: int) -> list[dict]:
    out = []
    for name, mha, st, x in cases(cfg, device, dtype):
        step = lambda: mha.step(x, st)  # noqa: E731
        with torch.no_grad(), (fused_step() if name.endswith(FUSED) else contextlib.nullcontext(False)) as kern:
            if kern is None:
                continue  # no triton here
            for _ in range(warmup):
                step()
            if kern:
                kern.skip, n0 = True, kern.n
            c = count_ops(step)
            row = {"method": name, "dtype": str(dtype).replace("torch.", ""), "state": type(st).__name__,
                   "ops": c.total, "launches": c.launches}
            if kern:
                kern.skip = False
                row.update(triton_launches=kern.n - n0, launches=c.launches + kern.n - n0)
            interpreted = kern and os.environ.get("TRITON_INTERPRET") == "1"
            us = median_us(step, 0 if interpreted else repeats)
        row.update(us_per_step=us, op_counts=c.by_name())
        out.append(row)
    return out


def profile_steps(cfg, device, dtype, steps: int, top: int = 25) -> list[str]:
    """Where an eager fused step's host time goes, on `device` (the H100's eager steps were
    10-15x their CUDA-graph replays, 2026-11-27): per fused row, the wall µs per step over
    `steps` steps, then cProfile's `top` functions by own time over as many more. On a CPU
    the fused kernel's launches are counted, not run (as `host_time`): the interpreter's time
    would drown the step's own."""
    import cProfile
    import io
    import pstats

    lines = []
    for name, mha, st, x in cases(cfg, device, dtype):
        if not name.endswith(FUSED):
            continue
        step = lambda: mha.step(x, st)  # noqa: E731
        with torch.no_grad(), fused_step() as kern:
            if kern is None:
                return [f"{name}: no triton here"]
            kern.skip, n0 = device.type != "cuda", kern.n
            for _ in range(20):
                step()
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            us = (time.perf_counter() - t0) / steps * 1e6
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(steps):
                step()
            sync()
            prof.disable()
            kern.skip = False
            if kern.n - n0 < 20 + 2 * steps:
                raise RuntimeError(f"{name}: the step did not take the fused kernel: nothing fused to profile")
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        lines += [f"---- {name} ({dtype}, {device.type}): {us:.1f} µs per eager step over {steps} steps"
                  + (" (fused launches counted, not run)" if device.type != "cuda" else "") + " ----",
                  *[ln for ln in buf.getvalue().splitlines() if ln.strip()][3:]]
    return lines


def source_commit() -> str | None:
    """The git commit of the fastrpe being measured (`+dirty` if its sources differ from it)."""
    import subprocess
    from pathlib import Path

    import fastrpe

    src = Path(fastrpe.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=src, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main() -> None:
    from fastrpe.bench.gpu import GpuConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="tokens of context (the KV cache's length)")
    ap.add_argument("--prompt", type=int, default=512, help="tokens that build the constant-size states")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; the GPU bench runs bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (steadier timings)")
    ap.add_argument("--ops", action="store_true", help="also print each row's ops by name")
    ap.add_argument("--host", action="store_true",
                    help="also time the fused steps' host code (launches stubbed) at --host-dims")
    ap.add_argument("--host-dims", default="1,4,2", help="H,D,features of the --host timings")
    ap.add_argument("--host-jit", action="store_true",
                    help="only the fused steps' host time with Triton's launch path, compiled for sm_90 by a driver "
                         "that runs nothing (measure_host_jit; TRITON_INTERPRET=0), at --host-dims; print, "
                         "and write --out")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="only profile the fused steps' host time (cProfile) on CUDA if there is one, at the "
                         "GPU bench's shape and --dtypes' first dtype, STEPS steps each; print and exit")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.profile:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cfg = GpuConfig(decode_context=a.context, decode_prompt=a.prompt, device=device.type)
        print("\n".join(profile_steps(cfg, device, getattr(torch, a.dtypes.split(",")[0]), a.profile)))
        return
    dtypes = a.dtypes.split(",")
    cfg = GpuConfig(decode_context=a.context, decode_prompt=a.prompt, device="cpu")
    if a.host_jit:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("decode_ops --host-jit: compiles the kernels: set TRITON_INTERPRET=0")
            sys.exit(2)
        Hh, Dh, Fh = (int(n) for n in a.host_dims.split(","))
        small = replace(cfg, H=Hh, D=Dh, features=Fh)
        rows = []
        for dt in dtypes:
            for name, (jit, stub) in measure_host_jit(small, getattr(torch, dt), a.repeats, a.warmup).items():
                rows.append({"method": name, "dtype": dt, "host_jit_us_per_step": jit, "host_us_per_step": stub,
                             "jit_launch_us": jit - stub})
                print(f"{name:52s} {dt:9s} {jit:8.1f} us with Triton's launch path, {stub:8.1f} stubbed "
                      f"({jit - stub:.1f} us Triton's)")
        if a.out:
            import triton

            meta = {"command": " ".join(["python", *sys.argv]), "fastrpe_commit": source_commit(),
                    "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                    "machine": platform.machine(), "threads": a.threads,
                    "host_dims": {"H": Hh, "D": Dh, "features": Fh}, "repeats": a.repeats}
            with open(a.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            print(f"wrote {a.out}")
        return
    rows = [r for dt in dtypes for r in measure(cfg, torch.device("cpu"), getattr(torch, dt), a.repeats, a.warmup)]
    host_dims = None
    if a.host:
        Hh, Dh, Fh = (int(n) for n in a.host_dims.split(","))
        host_dims = {"H": Hh, "D": Dh, "features": Fh}
        small = replace(cfg, H=Hh, D=Dh, features=Fh)
        for dt in dtypes:
            host = measure_host(small, getattr(torch, dt), a.repeats, a.warmup)
            for r in rows:
                if r["dtype"] == dt and r["method"] in host:
                    r["host_us_per_step"] = host[r["method"]]
    print(f"{'method':52s} {'dtype':9s} {'state':12s} {'ops':>5s} {'launches':>8s} {'us/step':>9s} {'host us':>8s}")
    for r in rows:
        us = "interp." if r["us_per_step"] is None else f"{r['us_per_step']:9.1f}"
        host = f"{r['host_us_per_step']:8.1f}" if "host_us_per_step" in r else ""
        print(f"{r['method']:52s} {r['dtype']:9s} {r['state']:12s} {r['ops']:5d} {r['launches']:8d} {us:>9s} {host:>8s}")
        if a.ops:
            for f, n in r["op_counts"].items():
                print(f"    {n:4d}  {f}")
    if a.out:
        meta = {"command": " ".join(["python", *sys.argv]), "fastrpe_commit": source_commit(),
                "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.machine(), "threads": a.threads,
                "config": {"B": cfg.B, "H": cfg.H, "D": cfg.D, "features": cfg.features, "kernel": cfg.kernel,
                           "dtypes": dtypes, "context": a.context, "prompt": a.prompt, "repeats": a.repeats},
                "host_dims": host_dims}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
