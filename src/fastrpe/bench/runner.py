"""Run a suite: each competitor on each problem, median time and peak memory, JSON + plot."""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .memory import allocator_peak_bytes
from .registry import COMPETITORS, Problem


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"


def _time(fn, device, repeats: int, warmup: int, totals: dict | None = None,
          cpu_peak: bool = True) -> tuple[float, int | None]:
    """Median seconds of `fn()` and the peak bytes of one call (the CUDA allocator's peak on a
    GPU; on CPU the allocator peak from the profiler's allocation events). On a GPU the peak
    is counted above what was allocated before the timed calls (inputs and their gradients
    included there); `totals`, if given, receives `peak_total_bytes`, the allocator's peak
    with everything counted. `cpu_peak=False` skips the profiled call on CPU (peak None)."""
    for _ in range(warmup):
        fn()
    peak = None
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        peak = torch.cuda.max_memory_allocated(device) - base
        if totals is not None:
            totals["peak_total_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        peak = allocator_peak_bytes(fn)[0] if cpu_peak else None  # one more call, under the profiler
    return statistics.median(times), peak


class CallTimeout(Exception):
    """A call ran past the hard cap of `run_suite(call_cap_s=...)`."""


class _hard_cap:
    """Raise `CallTimeout` in the main thread after `seconds` (SIGALRM; a no-op where there
    is none or off the main thread). It interrupts Python between kernel launches, not a
    kernel already running on the device."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.armed = False

    def __enter__(self):
        import signal
        import threading

        if not self.seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
            return self

        def handler(signum, frame):
            raise CallTimeout(f"exceeded the hard cap of {self.seconds:g} s per call")

        self.old = signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        self.armed = True
        return self

    def __exit__(self, *exc):
        if self.armed:
            import signal

            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
        return False


class ContextLost(RuntimeError):
    """A row's error left the CUDA context unusable (an illegal memory access, say): every
    later CUDA call of this process fails, so the suite stops after recording that row, and a
    new process resumes it (`fastrpe bench --suite gpu --resume`)."""


def context_lost(device: torch.device) -> bool:
    """Whether `device`'s CUDA context is broken: a synchronize raises once a kernel faulted."""
    if device.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - any error here means the context cannot go on
        return True
    return False


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _projected(points: list, L: int) -> float | None:
    """Seconds at length `L` extrapolated from timed `(length, seconds)` points: the last
    point scaled by `(L / length) ** slope`, the slope from the last two points (at least 1)."""
    if not points:
        return None
    slope = loglog_slope([x for x, _ in points[-2:]], [y for _, y in points[-2:]]) if len(points) > 1 else None
    L0, s0 = points[-1]
    return s0 * (L / L0) ** max(1.0, slope or 1.0)


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (None with fewer than two points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


def run_suite(problems: list[Problem], competitors: list[str], *, device: str = "cpu", dtype: str = "float32",
              repeats: int = 5, warmup: int = 1, time_limit_s: float = 30.0, log=print,
              registry: dict | None = None, select=None, catch_errors: bool = False,
              call_cap_s: float | None = None, done: set | None = None, on_row=None,
              cpu_peak: bool = True, limit_on: str = "probe") -> dict:
    """Time every competitor on every problem (in order). A competitor whose first call on a
    problem takes longer than `time_limit_s` is timed once more (not `repeats` times) and
    skipped, with that reason, at every longer length of the same problem family; one that
    ran out of memory is skipped at the longer lengths too. `registry` defaults to `COMPETITORS`.

    `select(problem, name) -> bool` leaves pairs out (no row). `catch_errors` records any
    other exception as the row's reason instead of raising, except one that leaves the CUDA
    context broken: that row is recorded (`context_lost`), then `ContextLost` raised.
    `call_cap_s` interrupts a call (warm-up or timed) after that many seconds (see `_hard_cap`). `done` holds
    `(problem.tag(), name)` pairs already measured (resuming): they are not run again.
    `on_row(row)` is called after every row; a timed row also says how long its first call
    took (`first_call_seconds`: compilation, or loading from a warmed cache, included). A
    setup's closure may carry a dict `extra`
    (accuracy, notes), copied into its row, and a function `after`, whose dict is copied into
    a timed row after its calls. `cpu_peak=False`: no profiled peak on CPU.
    `limit_on="timed"`: a slow first call (compilation) is followed by one timed warm call,
    and that call decides the time limit; a longer length is then still run while its time,
    projected from the timed lengths (log-log slope, at least 1), stays under `call_cap_s`."""
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    registry = COMPETITORS if registry is None else registry
    rows = []
    slow: dict[tuple, tuple[int, str]] = {}  # (competitor, problem without L) -> (length, why skipped beyond)
    history: dict[tuple, list] = {}  # (competitor, problem without L) -> [(length, seconds)] timed
    for p in problems:
        family = tuple(sorted((k, v) for k, v in p.to_dict().items() if k != "L"))
        for name in competitors:
            if select is not None and not select(p, name):
                continue
            if done is not None and (p.tag(), name) in done:
                continue
            row = {"problem": p.to_dict(), "competitor": name}
            projected = _projected(history.get((name, family), []), p.L)
            if (name, family) in slow and p.L > slow[(name, family)][0] and not (
                    limit_on == "timed" and call_cap_s and slow[(name, family)][1].startswith("exceeded")
                    and projected is not None and projected < call_cap_s):
                row["skipped"] = slow[(name, family)][1]
            else:
                fn, crashed = None, True
                try:
                    fn = registry[name](p, dev, dt)
                    if isinstance(fn, str):
                        row["skipped"] = fn
                    else:
                        row.update(getattr(fn, "extra", None) or {})
                        with _hard_cap(call_cap_s):
                            t0 = time.perf_counter()
                            fn()  # compile / warm caches; also our time-limit probe
                            if dev.type == "cuda":
                                torch.cuda.synchronize(dev)
                        first_call = time.perf_counter() - t0
                        row["first_call_seconds"] = round(first_call, 4)  # compilation and cache loads included
                        n, timed = repeats, None
                        totals: dict = {}
                        if first_call > time_limit_s:
                            if limit_on == "timed":  # the probe may have been compilation: time a warm call
                                with _hard_cap(call_cap_s):
                                    timed = _time(fn, dev, 1, 0, totals, cpu_peak)
                            if timed is None or timed[0] > time_limit_s:
                                slow[(name, family)] = (p.L, f"exceeded {time_limit_s:g} s per call at L={p.L}")
                                n = 1  # one timed call, not `repeats`
                        if timed is None or n > 1:
                            w = 0 if n == 1 else warmup
                            with _hard_cap(call_cap_s and call_cap_s * (n + w + (0 if cpu_peak is False else 1))):
                                timed = _time(fn, dev, n, w, totals, cpu_peak)
                        sec, peak = timed
                        row.update(seconds=sec, peak_bytes=peak, repeats=n, **totals)
                        after = getattr(fn, "after", None)
                        if after is not None:  # what the calls left to say (e.g. the autotuners' choices)
                            row.update(after() or {})
                        history.setdefault((name, family), []).append((p.L, sec))
                    crashed = False
                except (torch.cuda.OutOfMemoryError, MemoryError):
                    row["skipped"] = "out of memory"
                    slow[(name, family)] = (p.L, f"out of memory at L={p.L}")
                except CallTimeout as e:
                    row["skipped"] = str(e)
                    slow[(name, family)] = (p.L, f"{e} at L={p.L}")
                except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
                    if not catch_errors:
                        raise
                    row["skipped"] = "error: " + _first_line(e)
                    if context_lost(dev):  # nothing more can run here: record the row, then stop
                        row["context_lost"] = True
                        rows.append(row)
                        if on_row is not None:
                            on_row(row)
                        log(f"{p.tag():40s} {name:16s} {row['skipped']} (the CUDA context is lost)")
                        raise ContextLost(f"{name} on {p.tag()}: {_first_line(e)}") from e
                    if "out of memory" in str(e).lower():
                        slow[(name, family)] = (p.L, f"out of memory at L={p.L}")
                fn = None
                # a full collection costs ~1 s once dynamo has run; only after an exception (its
                # traceback's frames can hold the call's tensors in a cycle) is it needed
                gc.collect() if crashed else gc.collect(1)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if on_row is not None:
                on_row(row)
            msg = row.get("skipped") or f"{row['seconds'] * 1e3:9.2f} ms" + (
                f"  {row['peak_bytes'] / 2**30:6.2f} GiB" if row.get("peak_bytes") is not None else "")
            log(f"{p.tag():40s} {name:16s} {msg}")
    return {"device": device_name(dev), "dtype": dtype, "repeats": repeats, "rows": rows}


def ratios(result: dict, baseline: str = "flex-same-rpe") -> list[dict]:
    """Per problem: every competitor's time as a multiple of `baseline`'s time (same run)."""
    by_problem: dict[str, dict] = {}
    for r in result["rows"]:
        key = json.dumps(r["problem"], sort_keys=True)
        by_problem.setdefault(key, {})[r["competitor"]] = r.get("seconds")
    out = []
    for key, comp in by_problem.items():
        base = comp.get(baseline)
        out.append({"problem": json.loads(key), "speedup_vs_" + baseline:
                    {c: (base / s if base and s else None) for c, s in comp.items()}})
    return out


def plot(result: dict, path: Path) -> Path | None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    groups: dict[str, dict[str, list]] = {}
    for r in result["rows"]:
        if "seconds" not in r:
            continue
        p = r["problem"]
        g = f"{p['position']} {p['kernel']} {'causal' if p['causal'] else 'full'}"
        groups.setdefault(g, {}).setdefault(r["competitor"], []).append((p["L"], r["seconds"]))
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False)
    for ax, (g, comps) in zip(axes[0], groups.items()):
        for c, pts in comps.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y * 1e3 for _, y in pts], marker="o", label=c)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms (fwd+bwd)" if result["rows"][0]["problem"]["backward"] else "ms (fwd)")
        ax.set_title(g)
        ax.legend(fontsize=8)
    fig.suptitle(result["device"], fontsize=9)
    save(fig, path)
    return path
