"""Compile the GPU bench's own Triton kernels for the H100 image on this CPU machine, into a
Triton cache that benchmarks/gpu_run.sh unpacks before its first process: the device then
finds every fastrpe kernel the bench launches already built.

Why: compiling is what the GPU sessions ran out of. On 2026-11-27 the warm-up (six processes,
one per autotuner config) reached about 10 of 36 rows in 140 s in `first` and 10 of 292 in
90 s in `rest`; fastrpe's own kernels in every autotuner config took 377 s on this 2-core CPU
(benchmarks/results/compile_time-sm90.json). A session has 15 minutes of device time in all.

How (the image: Python 3.12, torch 2.11.0+cu130, triton 3.6.0; gpu.json's `python`, `triton`):
1. `key`, under the image's Python and triton (a venv: python3.12 -m venv V; V/bin/pip install
   triton==3.6.0; no torch needed) prints `triton_key()`. Every Triton cache key starts with
   it; it hashes triton's own files, libtriton.so among them, which differs per Python version.
2. `record`, under this project's Python with torch and the same triton version (the image's
   torch, 2.11.0+cu130, runs on a CPU): the bench's fastrpe rows (`fastrpe.bench.gpu.registry`:
   every Triton backend and its variant rows; `--families`, `--lengths`), with their float32
   accuracy calls, the decoding steps (`--decode`) and the PRF sweep's launches, once each,
   forward and backward, on CPU tensors. Triton's driver is replaced by one that says "CUDA,
   sm_90" and runs nothing: each kernel reaching its compile calls `knobs.runtime.jit_cache_hook`,
   which keeps its `specialization_data` (the signature, constexprs, alignment attributes and
   launch options, as Triton serializes them) and skips the kernel; every autotuner config is
   tried once. The host decides as on a GPU (`on_a_gpu`: the kernels accept CPU tensors, bf16
   calls take CUDA's precision and state dtype, the chunk scan sees 132 SMs, the feature maps
   and decoding steps take their Triton routes). Writes the specializations as JSON.
3. `compile`: `JITFunction.preload` of each specialization under the same driver, with
   `triton_key()` answering the image's (step 1), in `--jobs` processes, into `--triton-dir`.
   Then `compile_cache.py pack` makes the pack a device call carries (.gpu_cache/).

What can make it miss (then the device compiles as before; the unpacking costs seconds): an
image whose triton is not PyPI's 3.6.0 wheel (gpu_run.sh compares the image's `triton_key`
with the one recorded in .gpu_cache/precompiled.json and says which), cache-invalidating
environment variables set there (none are), or a launch whose arguments differ from the CPU
run's (a tensor's alignment, an integer that is 1 or a multiple of 16 there and not here).

    /tmp/venv312/bin/python benchmarks/precompile.py key > /tmp/triton_key.txt
    python benchmarks/precompile.py record --out runs/precompile/specs.json
    python benchmarks/precompile.py compile --specs runs/precompile/specs.json \\
        --triton-key-file /tmp/triton_key.txt --triton-dir runs/precompile/triton --jobs 2
    python benchmarks/compile_cache.py pack --triton-dir runs/precompile/triton \\
        --inductor-dir runs/precompile/inductor --out .gpu_cache/compile_cache.tar.xz --max-bytes 16711680
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

#: the image's GPU: Triton's target for an H100 (compute capability 9.0, 32-thread warps)
TARGET = ("cuda", 90, 32)
#: the H100's streaming multiprocessors (triton_chunked.auto_blocked compares the scan's grid with them)
SM_COUNT = 132


class _NoGPU:
    """Triton's driver interface, as far as compiling and autotuning use it: a CUDA sm_90
    target, device 0, stream 0, and a benchmarker that runs each config once (which compiles,
    or here records it) and reports the same time for all."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(*TARGET)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        def bench(fn, quantiles=None, **kwargs):
            fn()
            return [1.0, 1.0, 1.0] if quantiles else 1.0

        return bench


@contextlib.contextmanager
def no_gpu_driver():
    """Triton's active driver is `_NoGPU` inside (restored after)."""
    from triton.runtime.driver import driver

    before = driver._active
    driver.set_active(_NoGPU())
    try:
        yield
    finally:
        driver._active = before


@contextlib.contextmanager
def recording(specs: dict):
    """Every kernel about to compile adds `{full name: {key: specialization_data}}` to `specs`
    and is skipped (nothing compiles, nothing launches)."""
    from triton import knobs

    def hook(*, key, fn, compile, **kwargs):
        name = f"{fn.module}:{fn.name}"
        specs.setdefault(name, {})[str(key)] = compile["specialization_data"]
        return True

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = before


def _zero_qkv(p, device, dtype, layout: str = "bhld", k_width: int | None = None):
    """`gpu._qkv`'s inputs, zeros: the kernels they feed are recorded, not run."""
    import torch

    shape = (p.B, p.H, p.L) if layout == "bhld" else (p.B, p.L, p.H)
    kw = p.D if k_width is None else k_width
    return tuple(torch.zeros(*shape, w, device=device, dtype=dtype, requires_grad=p.backward) for w in (kw, kw, p.D))


@contextlib.contextmanager
def on_a_gpu():
    """The host-side choices a CUDA device makes, for CPU tensors, with the kernels compiled
    (not interpreted): every Triton path accepts the CPU, bf16 problems take CUDA's dot
    precision (`backends_triton.lowp_dots`), the chunk scan's "auto" sees the H100's SMs, and
    the feature maps and decoding steps take their Triton routes. Restored after."""
    import torch

    import fastrpe.backends_triton as bt
    from fastrpe import api, kernels
    from fastrpe.nn import attention
    from fastrpe.ops import triton_prf  # noqa: F401 - loaded, so that its reason is replaced too
    from fastrpe.ops.linear import (  # noqa: F401
        triton_band,
        triton_recurrent,
        triton_soe,
        triton_tiled,
    )
    from fastrpe.ops.linear import triton_chunked as tc

    from fastrpe.bench import gpu

    cuda = torch.device("cuda")
    saved = []

    def put(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    auto_blocked = tc.auto_blocked

    def blocked_as_on_the_h100(N, programs, device):
        if device is None or programs is None or N < tc.AUTO_BLOCKED_MIN_CHUNKS:
            return auto_blocked(N, programs, device)
        return programs < tc.AUTO_BLOCKED_SM_SHARE * SM_COUNT

    lowp_dots, check = bt.lowp_dots, api.check_qkv
    try:
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("fastrpe.") and hasattr(mod, "triton_unavailable_reason"):
                put(mod, "triton_unavailable_reason", lambda device: None)
        put(bt, "INTERPRET_ON_CPU", True)
        put(bt, "lowp_dots", lambda p: lowp_dots(dataclasses.replace(p, device=cuda)))
        put(tc, "auto_blocked", blocked_as_on_the_h100)
        put(kernels, "TRITON_FEATURES", "always")
        put(attention, "FUSED_STEP", "always")
        # the non-finite check reads CPU tensors only: not on a GPU
        put(api, "check_qkv", lambda q, k, v, **kw: check(q, k, v, check_finite=False))
        # nothing runs, so no output needs zeroing or restoring around an autotuner's configs
        # (at 1M the clones and copies of the kept states took 33 of a KERPLE row's 58 s), and
        # the bench's inputs need no values (seeded normals in float32, then bf16: 6 s a row)
        for tuned in tc.TUNED:
            put(tuned, "reset_to_zero", [])
            put(tuned, "restore_value", [])
        put(gpu, "_qkv", _zero_qkv)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def bench_rows(families, lengths, log=print, only=()) -> int:
    """Each fastrpe Triton row of the GPU bench's registry (eager: a `+compiled` row runs the
    same kernels as custom ops; those matching a pattern of `only`, if any) once, forward and
    backward, on CPU tensors; the rows at `accuracy_length` run their float32 accuracy calls
    too (the setup does). Returns rows run."""
    import torch

    from fastrpe.bench import gpu
    from fastrpe.bench.registry import Problem
    from fastrpe.ops.linear import triton_chunked as tc

    cfg = gpu.GpuConfig()
    reg = gpu.registry(cfg)
    names = [n for n in reg if n.startswith("fastrpe-triton_") and not gpu.compiled_row(n)
             and (not only or gpu.matches(n, only))]
    n_run = 0
    for L in lengths:
        for fam in families:
            p = Problem(position=fam, kernel=cfg.kernel, causal=gpu.family_causal(fam), L=L, B=cfg.B, H=cfg.H,
                        D=cfg.D, features=cfg.features, backward=True)
            for name in names:
                t0 = time.perf_counter()
                # the stand-in benchmarker ties every config, so an autotuner that has a choice
                # for a key would launch only that one for a later specialization under the key
                for tuned in tc.TUNED:
                    tuned.cache.clear()
                try:
                    run = reg[name](p, torch.device("cpu"), torch.bfloat16)
                    if isinstance(run, str):
                        continue  # the backend refuses this problem (as on the GPU)
                    run()
                except Exception as e:  # noqa: BLE001 - said; the other rows go on
                    log(f"  {name} {fam} L={L}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                n_run += 1
                log(f"  {name:45s} {fam:12s} L={L:8d} {time.perf_counter() - t0:6.1f} s")
    return n_run


def decode_steps(log=print) -> None:
    """The bench's decoding rows' layers (`gpu.decode_rows`): each state's fused step, at the
    bench's context (an SoE state is fitted for it: its term count is the step's) from a short
    prompt (the state's size does not depend on it)."""
    import torch

    from fastrpe.bench import gpu

    cfg = dataclasses.replace(gpu.GpuConfig(), decode_prompt=64, repeats=1, warmup=0)

    def timer(fn, device, repeats, warmup, cpu_peak=False):
        fn()
        return 0.0, 0

    from fastrpe.bench import runner

    real = runner._time
    runner._time = timer
    try:
        gpu.decode_rows(cfg, torch.device("cpu"), torch.bfloat16, log=lambda line: log(f"  decode: {line}"))
    finally:
        runner._time = real


def prf_sweep_launches(L: int = 65536) -> None:
    """benchmarks/prf_sweep.py's launch choices at its shape (query and key maps, both ways)."""
    import torch

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import prf_sweep

    from fastrpe import kernels
    from fastrpe.ops import triton_prf as tp

    kern = kernels.get_kernel("nprf", head_dim=64, num_features=32)
    x = torch.randn(1, 8, L, 64).to(torch.bfloat16)
    w = kern.w.float().contiguous()
    shift = kern.key_log_shift().float().reshape(-1)
    F = kern.num_features(64)
    phi, dphi, dx = torch.empty(1, 8, L, F), torch.randn(1, 8, L, F), torch.empty_like(x)
    for spec in prf_sweep.CONFIGS:
        choices = tp.parse_launch(spec)._asdict()
        for is_query in (True, False):
            tp.prf_forward_launch(x, w, shift, phi, kern, is_query, **choices)
            tp.prf_backward_launch(x, w, shift, dphi, dx, kern, is_query, **choices)


def fft_local_launches() -> None:
    """The causal FFT path's chunks' own pairs (`fft.causal.local_product`): triton_tiled's
    kernels on the FFT's float32 features and values, multiplied as a 16-bit call multiplies them
    (`causal.local_products`), forward and backward, a frozen table. The bench's `fft` rows are
    not run here (their FFTs on this CPU would take minutes), and one chunk length compiles what
    every one does: the sizes are specialized on their divisibility by 16 only, which every
    power-of-two chunk shares, and the weight table's block is `min(1024, 2T)`, 1,024 for the
    chunks of 512 and more that the plan takes on the bench's problems."""
    import torch

    from fastrpe.ops.linear.fft import causal

    B, H, T, n, F, Dv = 1, 8, 1024, 2, 32, 64
    L = n * T
    pq, pk = (torch.zeros(B, H, L, F, requires_grad=True) for _ in range(2))
    vv = torch.zeros(B, H, L, Dv + 1, requires_grad=True)
    lc, scale = torch.zeros(H, 2 * L - 1), torch.zeros(H, L)
    y = causal.local_product(pq, pk, vv, lc, scale, 0, T, causal.local_products(torch.bfloat16))
    y.sum().backward()


def record(out: Path, families, lengths, decode: bool, prf: bool, log=print, only=()) -> dict:
    import torch
    import triton

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    specs: dict = {}
    t0 = time.perf_counter()
    with no_gpu_driver(), recording(specs), on_a_gpu():
        n = bench_rows(families, lengths, log, only)
        fft_local_launches()
        if decode:
            decode_steps(log)
        if prf:
            prf_sweep_launches()
    count = sum(len(v) for v in specs.values())
    res = {"meta": {"command": " ".join(["python", "benchmarks/precompile.py", *sys.argv[1:]]),
                    "triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version(),
                    "target": list(TARGET), "rows_run": n, "seconds": round(time.perf_counter() - t0, 1),
                    "specializations": count},
           "specs": specs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    log(f"{count} specializations of {len(specs)} kernels from {n} rows in {res['meta']['seconds']} s -> {out}")
    return res


def _jit_function(full_name: str):
    """The `triton.jit` function behind `module:name` (through an autotuner's `fn`)."""
    module, _, name = full_name.partition(":")
    obj = _jit_of(getattr(importlib.import_module(module), name.split(".")[-1]))
    if obj is None:
        raise AttributeError(f"{full_name} is no Triton kernel")
    return obj


def _jit_of(obj):
    """The `triton.jit` function behind `obj` (through an autotuner's `fn`), or None."""
    while obj is not None and not hasattr(obj, "preload"):
        obj = getattr(obj, "fn", None)
    return obj


def _compile_some(args) -> tuple[int, list[str]]:
    """Worker: preload the specializations `items` (`(full name, data)`) into `triton_dir`
    under `_NoGPU`, with `triton_key()` answering `key`. Returns (compiled, failures)."""
    items, key, triton_dir = args
    os.environ["TRITON_CACHE_DIR"] = triton_dir
    from triton.runtime import cache

    cache.triton_key = lambda: key  # get_cache_key reads the module's global
    done, failed = 0, []
    with no_gpu_driver():
        for full_name, data in items:
            try:
                _jit_function(full_name).preload(data)
                done += 1
            except Exception as e:  # noqa: BLE001 - said
                failed.append(f"{full_name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return done, failed


@contextlib.contextmanager
def compile_only():
    """Every kernel launch compiles (or finds its binary in the cache) and runs nothing:
    `JITFunction.run` with `warmup=True`, autotuned configs included."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warm
    try:
        yield
    finally:
        JITFunction.run = run


def verify(key: str, triton_dir: Path, families, lengths, log=print) -> dict:
    """The rows `record` ran, again, each kernel compiled from `triton_dir` under `key` as the
    device would look it up (not launched): `{"hits", "misses", "missed"}` from Triton's
    compilation listener. Every kernel recorded should be a hit; a miss is a launch whose
    arguments the recording did not see the same way (and is compiled into `triton_dir`:
    run it on a copy to keep a pack's folder as built)."""
    os.environ["TRITON_CACHE_DIR"] = str(triton_dir)
    from triton.runtime import cache

    from fastrpe.bench.gpu_warm import watch_triton_compiles

    cache.triton_key = lambda: key
    counts: dict = {}
    watch_triton_compiles(counts)  # as the device's warm-up workers count them
    with no_gpu_driver(), compile_only(), on_a_gpu():
        bench_rows(families, lengths, log=lambda line: None)
    log(f"verify: {counts['hits']} kernels from the cache, {counts['misses']} compiled"
        + (f" ({', '.join(counts['missed'])})" if counts["missed"] else ""))
    return counts


def kernel_keys(names) -> dict[str, str]:
    """`{kernel: its cache_key}`: Triton's hash of a kernel's source, its line in the file and
    the functions and globals it uses, the part of a cache entry's key that an edit changes."""
    return {n: _jit_function(n).cache_key for n in sorted(names)}


def stale_kernels(built: dict) -> list[str]:
    """The kernels whose `cache_key` differs from the pack's record (edited since, or gone)."""
    out = []
    for name, key in built.get("kernels", {}).items():
        try:
            now = _jit_function(name).cache_key
        except Exception:  # noqa: BLE001 - gone or broken: it will not hit either
            now = None
        if now != key:
            out.append(name.partition(":")[2])
    return out


def library_kernels() -> set[str]:
    """Every `module:name` Triton kernel (a `triton.jit` function named `*_kernel*`, autotuned or
    not; not the helpers they call) of fastrpe's Triton modules (`fastrpe.ops.triton_*`,
    `fastrpe.ops.linear.triton_*`)."""
    import pkgutil

    import fastrpe.ops
    import fastrpe.ops.linear

    out = set()
    for pkg in (fastrpe.ops, fastrpe.ops.linear):
        for m in pkgutil.iter_modules(pkg.__path__):
            if not m.name.startswith("triton_"):
                continue
            mod = importlib.import_module(f"{pkg.__name__}.{m.name}")
            for name, obj in vars(mod).items():
                f = _jit_of(obj)
                if f is not None and "_kernel" in name and getattr(f, "__module__", mod.__name__) == mod.__name__:
                    out.add(f"{mod.__name__}:{name}")
    return out


def pack_outdated(built: dict) -> list[str]:
    """Why a pack's record no longer covers the library: kernels edited since (`stale_kernels`)
    and kernels added to the library since it was built (a record before 2026-11-29 lists no
    library: its changed kernels only); empty: it does."""
    stale = stale_kernels(built)
    new = sorted(n.partition(":")[2] for n in library_kernels() - set(built.get("library", library_kernels())))
    return [f"changed: {n}" for n in stale] + [f"new: {n}" for n in new]


def compile_all(specs_files, key: str, triton_dir: Path, jobs: int, log=print) -> dict:
    """Preload every specialization of `specs_files` (one path or several, `record`'s JSON; a
    specialization in several is built once) in `jobs` processes; `precompiled.json`'s record."""
    import multiprocessing as mp

    files = [specs_files] if isinstance(specs_files, (str, Path)) else list(specs_files)
    unique = {}
    for f in files:
        for name, per_key in json.loads(Path(f).read_text())["specs"].items():
            for data in per_key.values():
                unique[data] = name
    items = sorted(((name, data) for data, name in unique.items()), key=lambda x: x[0])
    triton_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    chunks = [(items[i::jobs], key, str(triton_dir)) for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        results = pool.map(_compile_some, chunks)
    done = sum(r[0] for r in results)
    failed = [f for r in results for f in r[1]]
    for f in failed:
        log("  failed: " + f)
    info = {"triton_key_sha256": hashlib.sha256(key.encode()).hexdigest(), "compiled": done, "failed": len(failed),
            "kernels": kernel_keys({name for name, _ in items}), "library": sorted(library_kernels()),
            "seconds": round(time.perf_counter() - t0, 1), "specs": [str(f) for f in files],
            "made": time.strftime("%Y-%m-%d %H:%M:%S")}
    log(f"compiled {done} of {len(items)} in {info['seconds']} s into {triton_dir}")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("key", help="print this Python's triton_key() (run it under the image's Python and triton)")
    kh = sub.add_parser("key-hash", help="sha256 of this Python's triton_key(), as precompiled.json records it")
    kh.add_argument("--expect", default=None, help="precompiled.json: say whether this image's key is the one built for")
    r = sub.add_parser("record")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--families", default="alibi,kerple_log,kerple_power,t5,learned,learned_full")
    r.add_argument("--lengths", default="4096,16384,65536,262144")
    r.add_argument("--only", default="", help="comma-separated fnmatch patterns of the rows to run (default all)")
    r.add_argument("--no-decode", action="store_true")
    r.add_argument("--no-prf-sweep", action="store_true")
    o = sub.add_parser("outdated", help="exit 1 and say why when precompiled.json no longer covers the library's kernels")
    o.add_argument("--info", type=Path, required=True)
    v = sub.add_parser("verify", help="run rows again, compiling from --triton-dir under the key: count the hits")
    v.add_argument("--triton-key-file", type=Path, required=True)
    v.add_argument("--triton-dir", type=Path, required=True)
    v.add_argument("--families", default="alibi,kerple_log,kerple_power,t5,learned,learned_full")
    v.add_argument("--lengths", default="4096,65536")
    c = sub.add_parser("compile")
    c.add_argument("--specs", type=Path, nargs="+", required=True)
    c.add_argument("--triton-key-file", type=Path, required=True)
    c.add_argument("--triton-dir", type=Path, required=True)
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    c.add_argument("--info", type=Path, default=None, help="write precompiled.json here (gpu_run.sh reads it)")
    a = ap.parse_args(argv)
    if a.cmd in ("key", "key-hash"):
        from triton.runtime.cache import triton_key

        if a.cmd == "key":
            sys.stdout.write(triton_key())
            return 0
        mine = hashlib.sha256(triton_key().encode()).hexdigest()
        if a.expect is None:
            print(mine)
            return 0
        try:
            built = json.loads(Path(a.expect).read_text())
        except (OSError, ValueError) as e:
            print(f"precompiled kernels: no record ({e})")
            return 0
        same = built.get("triton_key_sha256") == mine
        stale = stale_kernels(built)
        print(f"precompiled kernels ({built.get('compiled')} from {built.get('made')}): "
              + ("built for this image's triton, expect cache hits" if same else
                 f"built for another triton ({built.get('triton_key_sha256', '?')[:12]} vs {mine[:12]} here): "
                 "they will miss, the kernels compile here as before")
              + (f"; {len(stale)} kernels changed since, they compile here: {', '.join(stale)}" if stale else ""))
        return 0
    if a.cmd == "outdated":
        try:
            built = json.loads(a.info.read_text())
        except (OSError, ValueError) as e:
            print(f"no pack record ({e})")
            return 1
        why = pack_outdated(built)
        print(f"the pack is outdated: {len(why)} kernels ({'; '.join(why)})" if why else "the pack covers every kernel")
        return 1 if why else 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(f"precompile {a.cmd}: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")
        return 2
    if a.cmd == "record":
        if os.environ.get("FASTRPE_TRITON_CONFIG"):
            print("precompile record: unset FASTRPE_TRITON_CONFIG (every autotuner config is recorded)")
            return 2
        record(a.out, [f for f in a.families.split(",") if f], [int(x) for x in a.lengths.split(",") if x],
               decode=not a.no_decode, prf=not a.no_prf_sweep, only=tuple(x for x in a.only.split(",") if x))
        return 0
    key = a.triton_key_file.read_text()
    if a.cmd == "verify":
        counts = verify(key, a.triton_dir, [f for f in a.families.split(",") if f],
                        [int(x) for x in a.lengths.split(",") if x])
        return 1 if counts["misses"] or not counts.get("hits") else 0
    info = compile_all(a.specs, key, a.triton_dir, max(1, a.jobs))
    if a.info is not None:
        a.info.parent.mkdir(parents=True, exist_ok=True)
        a.info.write_text(json.dumps(info, indent=1))
    return 1 if info["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
