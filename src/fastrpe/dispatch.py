"""Backends, what they support, what they cost, and the `auto` choice.

Each backend answers `not_supported_reasons(problem) -> list[str]` (empty when
it can run the call) and `cost(problem) -> Cost` estimated from the shapes;
`auto` takes the cheapest one that fits (xformers' dispatcher does the same).
Forcing a backend that does not fit raises one error listing its reasons.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._validate import FastRPEError
from .kernels import Kernel, Softmax
from .positions.base import AdditiveTerm, Position


@dataclass
class Problem:
    """Everything a backend needs to decide whether, and how fast, it can run a call."""

    B: int
    H: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    dtype: torch.dtype
    device: torch.device
    kernel: Kernel
    position: Position | None
    additive: tuple[AdditiveTerm, ...]
    causal: bool
    q_offset: int
    has_padding_mask: bool
    requires_grad: bool
    scale: float | None = None

    @property
    def softmax(self) -> bool:
        return isinstance(self.kernel, Softmax)

    @property
    def F(self) -> int:
        """Feature width of a kernelized call (D for softmax)."""
        return self.D if self.softmax else self.kernel.num_features(self.D)

    @property
    def bytes_per_el(self) -> int:
        """Bytes of one element in the math dtype (half inputs run in float32)."""
        return 8 if self.dtype == torch.float64 else 4


@dataclass
class Cost:
    """Estimated run time (seconds, from a flop/byte model) and peak extra memory (bytes)."""

    seconds: float
    bytes: int

    def __str__(self) -> str:
        return f"~{_fmt_time(self.seconds)}, ~{_fmt_bytes(self.bytes)}"


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.3g} {unit}"
        b /= 1024
    return f"{b:.3g} TiB"  # pragma: no cover


# Rough machine model: sustained flop rate and memory bandwidth, and a per-call overhead. On
# CPU, a call whose working set outgrows the caches streams from DRAM at `bw_far` (one thread:
# dense kernelized attention at L = 4096 moved its [B, H, L, L] weights ~4x slower than at
# L = 256; benchmarks/auto_cpu_check.py). The GPU's rates are one guess for every GPU: there
# `auto` measures by default (`set_auto_policy`).
_MACHINE = {
    "cpu": {"flops": 5e10, "bw": 1e10, "overhead": 2e-5, "cache": 8 << 20, "bw_far": 2.5e9},
    "cuda": {"flops": 5e13, "bw": 2e12, "overhead": 1e-5},
}


def machine_time(device: torch.device, flops: float, bytes_moved: float, calls: int = 1,
                 working_set: float = 0) -> float:
    """Seconds for `flops` and `bytes_moved` in `calls` kernel launches / op calls; `working_set`
    (bytes live at once) beyond the CPU's caches moves at its DRAM rate."""
    m = _MACHINE.get(device.type, _MACHINE["cpu"])
    bw = m["bw_far"] if "cache" in m and working_set > m["cache"] else m["bw"]
    return flops / m["flops"] + bytes_moved / bw + calls * m["overhead"]


def _host_memory_limit() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 8 << 30


#: memory limits per device, read once: `os.sysconf` cannot be traced by torch.compile, and a
#: device's memory does not change while a process runs
_MEMORY_LIMITS: dict[str, int] = {"cpu": _host_memory_limit()}


def memory_limit(device: torch.device) -> int:
    """Bytes `auto` may plan for one call: half the device memory (all of it is not ours)."""
    key = str(device) if device.type == "cuda" else device.type
    lim = _MEMORY_LIMITS.get(key)
    if lim is None:
        if device.type == "cuda" and torch.cuda.is_available():
            lim = torch.cuda.get_device_properties(device).total_memory // 2
        else:
            lim = _MEMORY_LIMITS["cpu"]
        _MEMORY_LIMITS[key] = lim
    return lim


@dataclass
class Backend:
    """A way to compute attention. Subclasses fill in the three methods."""

    name: str
    exact: bool = True
    description: str = ""

    def not_supported_reasons(self, p: Problem) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def cost(self, p: Problem) -> Cost:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, q: Tensor, k: Tensor, v: Tensor, p: Problem, key_padding_mask: Tensor | None) -> Tensor:
        raise NotImplementedError  # pragma: no cover


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    clear_dispatch_cache()
    return backend


@dataclass
class Candidate:
    backend: str
    reasons: list[str]
    cost: Cost | None
    exact: bool
    #: measured seconds under the "measure" policy (forward, or forward+backward with grad)
    measured: float | None = None


@dataclass
class Explanation:
    """What `auto` picks for a call and why; `str()` gives a readable table."""

    chosen: str | None
    problem: Problem
    candidates: list[Candidate] = field(default_factory=list)
    #: "model" or "measure" (see `set_auto_policy`)
    policy: str = "model"
    #: the timings `auto` took for this call's signature bucket, if it has measured it
    measurement: "Measurement | None" = None

    def __str__(self) -> str:
        p = self.problem
        kern = "softmax" if p.softmax else f"{type(p.kernel).__name__} (F={p.F})"
        pos = type(p.position).__name__ if p.position is not None else "none"
        add = ", ".join(type(t).__name__ for t in p.additive) or "none"
        lines = [
            f"attention B={p.B} H={p.H} Lq={p.Lq} Lk={p.Lk} D={p.D} Dv={p.Dv} {str(p.dtype).replace('torch.', '')} "
            f"on {p.device}; kernel={kern}; position={pos}; additive={add}; causal={p.causal}; "
            f"q_offset={p.q_offset}; grad={p.requires_grad}",
            f"auto picks: {self.chosen or 'nothing (no backend supports this call)'}",
            _policy_line(self),
        ]
        m = self.measurement
        w = max((len(c.backend) for c in self.candidates), default=10)  # one column for every name
        for c in sorted(self.candidates, key=lambda c: (bool(c.reasons), c.cost.seconds if c.cost else 0)):
            tag = "exact" if c.exact else "APPROXIMATE"
            if c.reasons:
                lines.append(f"  {c.backend:{w}s} refused: " + "; ".join(c.reasons))
            else:
                mark = "*" if c.backend == self.chosen else " "
                meas = ""
                if c.measured is not None:
                    meas = f", measured {_fmt_time(c.measured)}"
                elif m is not None:
                    meas = f", not measured: {m.not_measured.get(c.backend, 'not eligible when measured')}"
                lines.append(f"{mark} {c.backend:{w}s} {c.cost}{meas}  ({tag})")
        return "\n".join(lines)


def _policy_line(e: "Explanation") -> str:
    if e.policy == "model":
        return "policy: model (estimated times below; fastrpe.set_auto_policy('measure') times the candidates)"
    p, m = e.problem, e.measurement
    bucket = f"Lq<={_bucket(p.Lq)}, Lk<={_bucket(p.Lk)}"
    if m is None:
        return (f"policy: measure (not measured yet: the first call with this signature times every exact "
                f"candidate within {MEASURE_FACTOR:g}x of the best estimate, once per bucket {bucket}; "
                "until then, the model's pick)")
    return (f"policy: measure (timed {m.what} at the first call in bucket {bucket}: lengths are bucketed to "
            "the next power of two, so other lengths in it reuse these timings)")


def explain_problem(p: Problem, allow_approximate: bool = False, *, eligible_only: bool = False,
                    measured: bool = True) -> Explanation:
    """Every backend's reasons and cost, and the cheapest one that may run. With
    `eligible_only`, backends that `auto` may not pick anyway (approximate ones, unless
    allowed) are left out instead of asked: their reasons can cost a fit per call. With
    `measured` (and the "measure" policy for p's device), timings `auto` took for p's
    signature bucket are shown, and the fastest measured candidate is the pick."""
    cands = []
    for b in BACKENDS.values():
        if eligible_only and not b.exact and not allow_approximate:
            continue
        reasons = list(b.not_supported_reasons(p))
        if not reasons and not b.exact and not allow_approximate:
            reasons_auto = ["approximate (pass backend explicitly or allow_approximate=True)"]
        else:
            reasons_auto = []
        cost = None if reasons else b.cost(p)
        if cost is not None and cost.bytes > memory_limit(p.device):
            reasons_auto.append(f"would need {_fmt_bytes(cost.bytes)} > memory limit {_fmt_bytes(memory_limit(p.device))}")
        cands.append(Candidate(b.name, reasons + reasons_auto, cost, b.exact))
    chosen, best = None, None
    for c in cands:  # the first cheapest, as min(); a loop, which torch.compile traces (min(key=) it does not)
        if not c.reasons and (best is None or c.cost.seconds < best):
            chosen, best = c.backend, c.cost.seconds
    ex = Explanation(chosen, p, cands)
    if measured and not torch.compiler.is_compiling():
        ex.policy = auto_policy(p.device)
        if ex.policy == "measure":
            _overlay_measurement(ex, allow_approximate)
    return ex


# `auto`'s decisions, cached per problem signature: asking every backend for its reasons and
# cost on every call is work a training loop repeats with identical shapes. Exact backends'
# reasons depend on shapes, dtypes, flags and the *structure* of the kernel and terms (their
# class and configuration, never their parameter values), so the key holds those. A term's
# decisions live in a weak table keyed by the term object itself (they die with it, and an id
# reused by a later object can never hit them). After changing a term's configuration in
# place (not its parameters), call `clear_dispatch_cache()`. The "measure" policy's timings
# are kept apart (`_MEASUREMENTS`), keyed by structure alone: a backend's speed does not depend
# on parameter values, so twelve layers with twelve KERPLE terms share one measurement.
_AUTO_CACHE: "weakref.WeakKeyDictionary[object, OrderedDict]" = weakref.WeakKeyDictionary()
_AUTO_CACHE_NO_POSITION: OrderedDict = OrderedDict()
_AUTO_CACHE_SIZE = 256
_MEASUREMENTS: OrderedDict = OrderedDict()


def clear_dispatch_cache() -> None:
    """Forget every cached `auto` decision and timing held in memory (backends registered,
    terms reconfigured in place, the policy changed). The on-disk timings stay (`_disk_path`)."""
    _AUTO_CACHE.clear()
    _AUTO_CACHE_NO_POSITION.clear()
    _MEASUREMENTS.clear()
    _DISK.clear()


def _structure(obj) -> tuple:
    """A kernel's or term's class and configuration (`extra_repr`), not its parameter values."""
    extra = obj.extra_repr() if hasattr(obj, "extra_repr") else repr(obj)
    return type(obj).__module__, type(obj).__qualname__, extra


def _signature(p: Problem) -> tuple:
    return (p.B, p.H, p.Lq, p.Lk, p.D, p.Dv, p.dtype, p.device, _structure(p.kernel), p.F,
            tuple((_structure(t), id(t)) for t in p.additive), p.causal, p.q_offset, p.has_padding_mask,
            p.requires_grad, p.scale, tuple(BACKENDS))


def _table(p: Problem, create: bool = True) -> OrderedDict | None:
    if p.position is None:
        return _AUTO_CACHE_NO_POSITION
    return _AUTO_CACHE.setdefault(p.position, OrderedDict()) if create else _AUTO_CACHE.get(p.position)


def _key(p: Problem, policy: str) -> tuple:
    sig = _signature(p) if p.position is None else (_signature(p), _structure(p.position))
    return policy, sig


def _bucket(n: int) -> int:
    """The next power of two >= n (lengths in one bucket share one measurement)."""
    return 1 << max(0, n - 1).bit_length()


def _bucket_key(p: Problem) -> str:
    """p's signature bucket, by structure only (no object ids), as a string that is the same in
    every process: lengths (and a nonzero q_offset) rounded up to a power of two."""
    pos = _structure(p.position) if p.position is not None else None
    return repr((p.B, p.H, _bucket(p.Lq), _bucket(p.Lk), p.D, p.Dv, str(p.dtype), str(p.device), _structure(p.kernel),
                 p.F, tuple(_structure(t) for t in p.additive), pos, p.causal, _bucket(p.q_offset) if p.q_offset else 0,
                 p.has_padding_mask, p.requires_grad, p.scale, tuple(BACKENDS)))


def _cache_put(table: OrderedDict, key, value) -> None:
    table[key] = value
    if len(table) > _AUTO_CACHE_SIZE:
        table.popitem(last=False)


# --- the `auto` policy: the cost model, or the first call's own timings ---------------------

_POLICIES = ("model", "measure")
_AUTO_POLICY: str | None = None  # None: per device, see `auto_policy`
#: "measure" times the exact candidates whose modelled time is within this factor of the best
MEASURE_FACTOR = 4.0
#: timed runs per candidate after one warm-up (fewer when one run is slow)
MEASURE_REPEATS = 3


def set_auto_policy(policy: str | None) -> None:
    """How `backend="auto"` chooses among the backends that support a call.

    Args:
        policy: "model" (the cheapest by the flop/byte cost model, `Backend.cost`), "measure"
            (the first call of each problem signature times every exact candidate within
            `MEASURE_FACTOR` of the model's best on the call's own tensors, and keeps the
            fastest; lengths are bucketed to the next power of two, so a new length in a
            measured bucket costs no new timing), or None for the default: "measure" on CUDA,
            "model" elsewhere. Approximate backends are never timed. Under torch.compile
            tracing, CUDA-graph capture or CUDA sync debug mode nothing is timed: the model
            decides. Changing the policy forgets every cached decision.

    Timings are shared by every term of the same structure (class and configuration) and
    kept on disk per device and torch version, so that a new process does not time again:
    `$FASTRPE_CACHE_DIR/auto_timings-<device>-torch<version>.json` (any device), else
    `~/.cache/fastrpe/...` on CUDA (CPU timings stay in memory). Delete the file after
    upgrading fastrpe.
    """
    global _AUTO_POLICY
    if policy is not None and policy not in _POLICIES:
        raise FastRPEError(f"policy: expected one of {', '.join(map(repr, _POLICIES))} or None, got {policy!r}")
    _AUTO_POLICY = policy
    clear_dispatch_cache()


def auto_policy(device: torch.device) -> str:
    """The policy `auto` uses on `device` ("model" or "measure"; see `set_auto_policy`)."""
    if _AUTO_POLICY is not None:
        return _AUTO_POLICY
    # CUDA: one flop/byte model cannot know every GPU, kernel library and Triton version, while
    # a warmed-up call timed with CUDA events is steady. CPU: the model is calibrated there
    # (benchmarks/auto_cpu_check.py), and a first call's timings are noisy (thread pools and
    # the allocator warming up, other processes on the cores).
    return "measure" if device.type == "cuda" else "model"


def _can_measure(device: torch.device) -> bool:
    if device.type == "cuda":
        # timings synchronize the stream: not while a graph is captured, nor where the user
        # asked to be told about every synchronization
        if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
            return False
    return True


@dataclass
class Measurement:
    """Timings of one signature bucket's candidates (seconds) and why others were not timed."""

    what: str  # "forward" or "forward+backward"
    times: dict[str, float]
    not_measured: dict[str, str]

    def fastest(self, allowed) -> str | None:
        best = None
        for name, s in self.times.items():
            if name in allowed and (best is None or s < self.times[best]):
                best = name
        return best


def _timer(device: torch.device):
    """`timer(fn) -> seconds` of one call of `fn`: CUDA events on GPU, perf_counter elsewhere."""
    if device.type == "cuda":
        def timer(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return timer

    import time

    def timer(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return timer


def time_backend(backend: Backend, inputs: tuple, p: Problem, repeats: int = MEASURE_REPEATS,
                 give_up_after: float = float("inf")) -> float:
    """Seconds of one `backend.run` on `inputs = (q, k, v, key_padding_mask)`: one warm-up,
    then the best of `repeats` timed runs (one when a run takes longer than `give_up_after` or
    0.5 s). A warm-up over 10x `give_up_after` is followed by a second call, since a first call
    may compile; when that one is over it too, its time is returned and no more are run.
    With `p.requires_grad` the backward pass is included, through `torch.autograd.grad` on
    detached copies of the leaves (no `.grad` is written, the caller's graph is not touched);
    without, the forward runs under no_grad."""
    q, k, v, kpm = inputs
    if p.requires_grad:
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
        params = [prm for t in (p.position, *p.additive, p.kernel) if isinstance(t, torch.nn.Module)
                  for prm in t.parameters() if prm.requires_grad]
        wrt = [t for t in leaves if t.requires_grad] + params

        def fn():
            with torch.enable_grad():
                out = backend.run(*leaves, p, kpm)
                torch.autograd.grad(out, wrt, grad_outputs=torch.ones_like(out), allow_unused=True)
    else:
        def fn():
            with torch.no_grad():
                backend.run(q, k, v, p, kpm)
    timer = _timer(p.device)
    best = timer(fn)  # the warm-up (Triton compiles and autotunes, Flex compiles, caches fill)
    if best > 10 * give_up_after:
        # a first call that compiled is no measure of the next ones, and the choice is cached
        # (on disk too): judge by a second call before giving up
        best = timer(fn)
        if best > 10 * give_up_after:
            return best
    for _ in range(max(1, repeats)):
        best = min(best, timer(fn))
        if best > min(give_up_after, 0.5):
            break
    return best


def measure_problem(p: Problem, inputs: tuple, allow_approximate: bool = False,
                    factor: float | None = None) -> Measurement:
    """Time every eligible backend whose modelled time is within `factor` (default
    `MEASURE_FACTOR`) of the model's best, on `inputs = (q, k, v, key_padding_mask)`.
    The RNG state is restored afterwards; a candidate that raises is recorded, not timed."""
    factor = MEASURE_FACTOR if factor is None else factor
    ex = explain_problem(p, allow_approximate, eligible_only=True, measured=False)
    ok = [c for c in ex.candidates if not c.reasons]
    best_model = min((c.cost.seconds for c in ok), default=0.0)
    times, not_measured = {}, {}
    devices = [p.device] if p.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for c in sorted(ok, key=lambda c: c.cost.seconds):
            if c.cost.seconds > factor * best_model:
                not_measured[c.backend] = f"estimate {c.cost.seconds / best_model:.3g}x the best (> {factor:g}x)"
                continue
            try:
                fastest = min(times.values(), default=float("inf"))
                times[c.backend] = time_backend(BACKENDS[c.backend], inputs, p, give_up_after=4 * fastest)
            except Exception as e:  # noqa: BLE001 - a candidate that fails (out of memory) is not chosen
                not_measured[c.backend] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return Measurement("forward+backward" if p.requires_grad else "forward", times, not_measured)


def _overlay_measurement(ex: Explanation, allow_approximate: bool) -> None:
    """Show the timings `auto` took for ex's bucket; the fastest eligible one is the pick."""
    m = _lookup_measurement(ex.problem)
    if m is None:
        return
    ex.measurement = m
    for c in ex.candidates:
        c.measured = m.times.get(c.backend)
    chosen = m.fastest({c.backend for c in ex.candidates if not c.reasons})
    if chosen is not None and not allow_approximate:  # `auto` itself never runs approximate backends
        ex.chosen = chosen


# --- where timings live: in memory, and (CUDA, or FASTRPE_CACHE_DIR set) in a JSON file per
# device and torch version, so that a new process does not time again ---
_DISK: dict = {}  # path -> {bucket key: Measurement}, read once per path


def _disk_path(device: torch.device):
    """The timings file for `device`, or None: `$FASTRPE_CACHE_DIR` (any device) or
    `~/.cache/fastrpe` (CUDA only: CPU timings are kept in memory unless asked)."""
    import os
    import re
    from pathlib import Path

    root = os.environ.get("FASTRPE_CACHE_DIR")
    if root is None:
        if device.type != "cuda":
            return None
        root = Path.home() / ".cache" / "fastrpe"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type}-{os.cpu_count()}cpu"
    tag = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{name}-torch{torch.__version__}")
    return Path(root) / f"auto_timings-{tag}.json"


def _disk_table(path) -> dict:
    import json

    if path not in _DISK:
        try:
            raw = json.loads(path.read_text())
            _DISK[path] = {k: Measurement(v["what"], dict(v["times"]), dict(v["not_measured"])) for k, v in raw.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or unreadable: time again
            _DISK[path] = {}
    return _DISK[path]


def _lookup_measurement(p: Problem) -> Measurement | None:
    key = _bucket_key(p)
    m = _MEASUREMENTS.get(key)
    if m is None:
        path = _disk_path(p.device)
        m = _disk_table(path).get(key) if path is not None else None
        if m is not None:
            _cache_put(_MEASUREMENTS, key, m)
    return m


def _store_measurement(p: Problem, m: Measurement) -> None:
    import json
    import warnings

    from ._io import atomic_write

    key = _bucket_key(p)
    _cache_put(_MEASUREMENTS, key, m)
    path = _disk_path(p.device)
    if path is None:
        return
    table = _disk_table(path)
    table[key] = m
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {k: {"what": v.what, "times": v.times, "not_measured": v.not_measured} for k, v in table.items()}
        atomic_write(path, (json.dumps(data, indent=0, sort_keys=True) + "\n").encode())
    except OSError as e:  # a cache: the timings stay in memory
        warnings.warn(f"fastrpe: could not write auto timings to {path}: {e}", stacklevel=3)


def _measured_choice(p: Problem, inputs: tuple, may_time: bool = True) -> str | None:
    """The fastest timed candidate of p's bucket that supports p itself (timing the bucket first
    if needed and `may_time`); None when none does, or when the bucket has no timings and
    nothing may be timed now (the model decides then)."""
    m = _lookup_measurement(p)
    if m is None:
        if not may_time:
            return None
        m = measure_problem(p, inputs)
        _store_measurement(p, m)
    ex = explain_problem(p, eligible_only=True, measured=False)
    return m.fastest({c.backend for c in ex.candidates if not c.reasons})


def _auto_choice(p: Problem, inputs: tuple | None = None) -> str:
    if torch.compiler.is_compiling():
        # torch.compile traces the decision itself (once per compiled graph; its guards on the
        # shapes and the terms' configuration recompile it when they change): the cache, a
        # weak table keyed by objects, is not read or written under tracing, and nothing is
        # timed. The model's uncached decision is the one the "model" policy caches, so
        # compiled and eager calls pick one backend; under "measure" eager calls may pick a
        # faster one.
        chosen = explain_problem(p, eligible_only=True, measured=False).chosen
        if chosen is None:
            raise FastRPEError("backend: no backend supports this call (run it eagerly, or fastrpe.explain, "
                               "for every backend's reasons)")
        return chosen
    table = _table(p)
    if inputs is not None and auto_policy(p.device) == "measure":
        key = _key(p, "measure")
        chosen = table.get(key)
        if chosen is not None:
            table.move_to_end(key)
            return chosen
        # while a CUDA graph is captured (or syncs are watched) nothing is timed, but timings
        # taken before (an eager warm-up, the disk cache) still decide: the captured graph runs
        # the backend the eager calls ran, already compiled and tuned
        may_time = _can_measure(p.device)
        chosen = _measured_choice(p, inputs, may_time=may_time)
        if chosen is None and may_time:  # no timed candidate supports p: the model's pick, kept
            chosen = explain_problem(p, eligible_only=True, measured=False).chosen
            if chosen is None:
                raise FastRPEError("backend: no backend supports this call:\n" + str(explain_problem(p)))
        if chosen is not None:
            _cache_put(table, key, chosen)
            return chosen
    key = _key(p, "model")
    chosen = table.get(key)
    if chosen is None:
        chosen = explain_problem(p, eligible_only=True, measured=False).chosen
        if chosen is None:
            raise FastRPEError("backend: no backend supports this call:\n" + str(explain_problem(p)))
        _cache_put(table, key, chosen)
    else:
        table.move_to_end(key)
    return chosen


def select_backend(p: Problem, backend: str, inputs: tuple | None = None) -> Backend:
    """The backend to run: `auto`'s choice (cached per problem signature), or the forced one
    if it supports the call. `inputs = (q, k, v, key_padding_mask)` lets the "measure" policy
    time the candidates on the call's own tensors (without them the model decides)."""
    if backend == "auto":
        return BACKENDS[_auto_choice(p, inputs)]
    if backend not in BACKENDS:
        raise FastRPEError(f"backend: unknown backend {backend!r}; known: {', '.join(['auto', *BACKENDS])}")
    b = BACKENDS[backend]
    reasons = b.not_supported_reasons(p)
    if reasons:
        raise FastRPEError(f"backend={backend!r} cannot run this call: " + "; ".join(reasons))
    return b


# --- decoding: which state `step` keeps between calls (chosen here like the forward backend) ---

#: forced forward backends whose function each constant-size decoder reproduces ("auto" for all
#: exact ones); any other forced backend decodes over a KV cache with that backend
DECODER_BACKENDS = {
    "linear": ("auto", "chunked", "prefix", "soe", "triton_chunked"),
    "band": ("auto", "band"),
    "soe": ("soe", "triton_soe"),
}


@dataclass
class DecoderChoice:
    """The decode state a causal layer keeps: "linear" (`LinearState`), "band" (`BandState`),
    "soe" (`SoEState`, approximate like the `soe` backend) or "kv" (`KVCache`, exact for
    everything), with every refused constant-size state's reasons. `str()` explains."""

    name: str
    refused: dict[str, list[str]] = field(default_factory=dict)
    #: why decoding cannot honour the forced backend at all (the soe fit is refused), else None
    fatal: str | None = None

    def __str__(self) -> str:
        lines = [f"decoding keeps: {self.name}" + (f" (cannot decode: {self.fatal})" if self.fatal else "")]
        lines += [f"  {k:7s} refused: " + "; ".join(r) for k, r in self.refused.items()]
        return "\n".join(lines)


def _constant_state_reasons(p: Problem) -> list[str]:
    r = []
    if p.softmax:
        r.append("softmax weighs every key by its own score (no constant-size state)")
    if not p.causal:
        r.append("decoding is causal")
    if p.additive:
        r.append("additive terms (" + ", ".join(type(t).__name__ for t in p.additive) + ") read every key")
    if getattr(p.kernel, "per_key_shift_when_causal", False):
        r.append(f"{type(p.kernel).__name__} shifts each key by a running maximum")
    pos = p.position
    from .positions.grid import GridPosition

    if pos is not None and (pos.softmax_only or isinstance(pos, GridPosition)):
        r.append(f"{type(pos).__name__} has no 1D kernelized form")
    return r


def decoder_reasons(name: str, p: Problem, backend: str) -> list[str]:
    """Why decoder `name` cannot decode this layer (empty: it can). `p` describes the
    layer (its `Lk` is the sequence length decoding will reach); `backend` is the layer's."""
    if name == "kv":
        return []
    r = _constant_state_reasons(p)
    if backend not in DECODER_BACKENDS[name]:
        r.append(f"backend={backend!r} is forced (a {name} state reproduces "
                 + ", ".join(repr(b) for b in DECODER_BACKENDS[name]) + ")")
    pos = p.position
    if r:
        return r
    if name == "linear" and pos is not None and pos.geometric_decay() is None:
        r.append(f"{type(pos).__name__} is not a geometric decay")
    elif name == "band" and (pos is None or pos.finite_support() is None):
        r.append("needs a finite-support term" if pos is None else
                 f"{type(pos).__name__} is not constant beyond a finite distance")
    elif name == "soe":
        if pos is None or pos.geometric_decay() is not None:
            r.append("needs a decaying term that is not geometric (the soe backend refuses the others)")
        else:
            why = _soe_fit_reason(p)
            if why:
                r.append(why)
    return r


def _soe_fit_reason(p: Problem) -> str | None:
    from .ops.linear.soe import soe_fit_refusal

    with torch.no_grad():
        return soe_fit_refusal(p.position, p.Lk)


def select_decoder(p: Problem, backend: str = "auto") -> DecoderChoice:
    """The decode state for a layer: the first constant-size one (linear, band, soe) that
    reproduces the layer's forward backend, else the KV cache."""
    refused = {}
    for name in ("linear", "band", "soe"):
        r = decoder_reasons(name, p, backend)
        if not r:
            return DecoderChoice(name, refused)
        refused[name] = r
    fatal = None
    if backend in DECODER_BACKENDS["soe"] and not _constant_state_reasons(p) and p.position is not None \
            and p.position.geometric_decay() is None:
        fatal = _soe_fit_reason(p)  # the term passed every other check: only the fit refused it
    return DecoderChoice("kv", refused, fatal)
