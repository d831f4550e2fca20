"""Fill the compilers' on-disk caches for `fastrpe bench --suite gpu` before it times anything,
in parallel (`fastrpe bench --suite gpu --warm first|rest`).

Why: a GPU session lasts minutes, and a cold bench spends them compiling, one kernel after
another. Each autotuned Triton kernel of fastrpe compiles once per autotuner config (three
since 2026-11-27, six before: `triton_chunked.TUNE_CONFIGS`), again for every new constexpr (the number of SoE terms
changes with L, the term groups at 1M), and compiled FlexAttention compiles forward and
backward per length. On a 2-core CPU, compiling the tuned kernels' variants for sm_90 takes
377 s, 70 s for the slowest single config (benchmarks/compile_time.py); the first H100 call
spent its 220-s bench budget before its third row.

How: worker processes per autotuner config (`WARM_WORKERS` in all), each with
`FASTRPE_TRITON_CONFIG` set to its config's index, run every Triton row of the pass once
between them, forward and backward. A one-config autotuner
launches that config with exactly the options a full one times it with, so the binaries land
in Triton's cache under the keys the bench's own autotuning looks up, and the bench only
times the configs. The rows that compile once whatever the config (Flex through Inductor,
fla's kernels, fastrpe's `+compiled` graphs) are dealt out among the workers. Nothing is timed here, and nothing here is a
result: the workers keep `auto`'s measured timings apart (`FASTRPE_CACHE_DIR`), hold at most
`MEMORY_FRACTION` of the GPU each (they may run beside the GPU tests), and stop at the budget;
the bench compiles whatever they did not reach. `gpu_warm.json` records what each worker
compiled and how long it took.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .gpu import (
    CONTEXT_LOST_EXIT,
    GRAPHED,
    GpuConfig,
    applies,
    compiled_row,
    done_pairs,
    lost_elsewhere,
    problems,
    registry,
    retry_errors,
    row_matches,
    row_pass,
    versions,
    wanted,
)
from .registry import Problem
from .runner import _first_line, context_lost

#: rows whose compilation does not depend on fastrpe's autotuner config: one worker each
SHARED = ("flex", "fla-chunk_simple_gla", "fla-chunk_linear_attn")
#: rows each worker leaves to its end: fla's kernels broke the CUDA context on the H100 image
#: (torch 2.11, triton 3.6; fla-org/flash-linear-attention#734), and a worker stops there
LAST = ("fla-chunk_simple_gla", "fla-chunk_linear_attn")
#: the share of the GPU's memory one worker may hold (six of them beside the GPU tests)
MEMORY_FRACTION = 0.125
#: a worker that broke its CUDA context (or died) at a row starts again after it while this
#: many seconds of the budget remain (a start: Python, torch and CUDA, about 10 s): on
#: 2026-11-28 one faulting row (the SoE walk's bf16x3, since fixed) ended four of the six
#: workers of each warm-up within 15 s, with most of their rows not reached
RESTART_MIN_S = 20.0
#: at most this many restarts a worker (a worker that dies at every row is not one bad row)
MAX_RESTARTS = 3


def tuned(name: str) -> bool:
    """A row that runs fastrpe's autotuned Triton kernels eagerly (a `+compiled` row runs the
    same kernels, with the same keys: its eager twin compiles them in every worker; so does a
    `+cudagraphs` row's, whose call is its twin's captured)."""
    return name.startswith("fastrpe-triton_") and not compiled_row(name) and not name.endswith(GRAPHED)


def shared(name: str) -> bool:
    """A row whose compilation does not depend on the autotuner's config: Flex, fla, and
    fastrpe's `+compiled` rows (Inductor's graph around the kernels), one worker each."""
    return name in SHARED or compiled_row(name)


def warm_items(cfg: GpuConfig, which: str = "first", done=frozenset()) -> list[tuple[Problem, str]]:
    """The (problem, competitor) rows that compile something (fastrpe's Triton rows, Flex,
    fla) in the order the bench runs them: `which="first"`, those the criteria read (its
    passes 0 and 1, `row_pass`); `"rest"`, those of every pass; either less those in `done`
    (`(tag, competitor)` pairs, what a resumed bench skips), and those `cfg` does not time
    (`gpu.wanted`); the rows of `cfg.warm_first` come first (`gpu.row_matches`: a pattern, or
    one at a length, "flex@65536"). `auto` is left out: it would time its candidates beside
    the other workers, and they are the Triton and PyTorch rows anyway."""
    if which not in ("first", "rest"):
        raise ValueError(f"which: expected 'first' or 'rest', got {which!r}")
    names = list(registry(cfg))
    items = [(p, n) for rank in ((0, 1) if which == "first" else (0, 1, 2)) for p in problems(cfg) for n in names
             if (tuned(n) or shared(n)) and applies(p, n) and wanted(cfg, n, p) and row_pass(p, n) == rank
             and (p.tag(), n) not in done]
    # the rows of `cfg.warm_first` before the others (stable: each group in the bench's order)
    return sorted(items, key=lambda it: warm_rank(it[0], it[1], cfg.warm_first))


def warm_rank(p: Problem, name: str, patterns) -> int:
    """Where the warm-up puts a row of `patterns` (`GpuConfig.warm_first`): the patterns at one
    length ("flex@65536") form a group, those at none another, each group ranked where its
    first pattern stands, the rows matching none last. So "flex@65536,flex@4096" compiles Flex
    at 64k before Flex at 4k, whatever the bench's order (shortest first)."""
    groups = list(dict.fromkeys(pat.partition("@")[2] for pat in patterns))
    for rank, at in enumerate(groups):
        if row_matches(p, name, [pat for pat in patterns if pat.partition("@")[2] == at]):
            return rank
    return len(groups)


#: the warm-up's worker processes at least: with fewer autotuner configs than this, several
#: workers share a config (worker i runs config i mod the configs' number) and deal its tuned
#: rows out among them, so that the compilers keep as many CPU cores busy (the H100 machines
#: have 16)
WARM_WORKERS = 6


def plan(items: list[tuple[Problem, str]], n_configs: int,
         n_workers: int | None = None) -> list[list[tuple[Problem, str]]]:
    """One list per worker (`max(n_configs, n_workers)` workers, `WARM_WORKERS` by default;
    worker i runs autotuner config i mod n_configs): each tuned row once for every config,
    dealt out in turn among that config's workers, and the shared rows dealt out in turn among
    all; each list in the order of `items` but for the `LAST` rows at its end."""
    n = max(n_configs, WARM_WORKERS if n_workers is None else n_workers)
    out: list[list] = [[] for _ in range(n)]
    turn = [0] * n_configs  # each config's next worker
    j = 0
    for it in sorted(items, key=lambda it: it[1] in LAST):  # stable: the order kept otherwise
        if tuned(it[1]):
            for c in range(n_configs):
                mine = range(c, n, n_configs)
                out[mine[turn[c] % len(mine)]].append(it)
                turn[c] += 1
        else:
            out[j % n].append(it)
            j += 1
    return out


def _record(path: Path, rec: dict) -> None:
    from .._io import atomic_write

    atomic_write(path, json.dumps(rec, indent=1).encode())


def watch_triton_compiles(counts: dict) -> None:
    """Count this process's Triton compilations into `counts` (Triton's compilation listener):
    "hits", found in the disk cache (a carried pack, or the kernels benchmarks/precompile.py
    built on a CPU machine), "misses", built here, and the first misses' kernel names (what a
    precompiled pack did not foresee). Inductor compiles in worker processes of its own, so
    this sees fastrpe's and fla's own kernels. Nothing where this triton has no listener."""
    try:
        from triton import knobs
        knobs.compilation.listener  # noqa: B018 - absent before triton 3.4
    except (ImportError, AttributeError):
        return
    for k, v in (("hits", 0), ("misses", 0), ("missed", [])):  # (a restarted worker's go on)
        counts.setdefault(k, v)

    def listen(*, src, cache_hit, **_):
        counts["hits" if cache_hit else "misses"] += 1
        if not cache_hit and len(counts["missed"]) < 20:
            counts["missed"].append(str(getattr(src, "name", src))[:80])

    knobs.compilation.listener = listen


def run_worker(plan_path: Path, index: int, start: int = 0) -> int:
    """Worker `index` of the plan at `plan_path`: each row once from its `start`-th, forward and
    backward; its record (`gpu_warm_<index>.json` beside the plan; a restart's goes on with
    the record so far) rewritten after every row. A row that breaks the CUDA context ends it
    (CONTEXT_LOST_EXIT), recorded: `warm` starts it again after that row."""
    spec = json.loads(plan_path.read_text())
    c = spec["config"]
    cfg = GpuConfig(**{**c, **{k: tuple(c[k]) for k in ("lengths", "families", "sections", "only", "skip", "warm_first")
                               if k in c}})
    dev, dt = torch.device(cfg.device), getattr(torch, cfg.dtype)
    if dev.type == "cuda":  # the index: torch 2.11 refuses a bare "cuda" here
        torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION, torch.cuda.current_device()
                                                   if dev.index is None else dev.index)
    reg = registry(cfg)
    out = plan_path.parent / f"gpu_warm_{index}.json"
    rec = {"worker": index, "triton_config": os.environ.get("FASTRPE_TRITON_CONFIG"), "rows": [],
           "triton_compiles": {}}
    if start and out.exists():  # a restart: the rows and counts so far go on
        rec = json.loads(out.read_text())
        rec.setdefault("triton_compiles", {})
    watch_triton_compiles(rec["triton_compiles"])
    t_start = time.perf_counter() - rec.get("seconds", 0.0)
    for item in spec["workers"][index][start:]:
        p, name = Problem(**item["problem"]), item["competitor"]
        row = {"tag": p.tag(), "competitor": name}
        t0 = time.perf_counter()
        fn = None
        try:
            fn = reg[name](p, dev, dt)
            if isinstance(fn, str):
                row["skipped"] = fn
            else:
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
        except (torch.cuda.OutOfMemoryError, MemoryError):
            row["skipped"] = "out of memory"
        except Exception as e:  # noqa: BLE001 - the bench meets it again and records it
            row["skipped"] = "error: " + _first_line(e)
            if context_lost(dev):  # every later row would fail here too
                row["context_lost"] = True
        fn = None
        gc.collect()
        if dev.type == "cuda" and not row.get("context_lost"):
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a fault surfacing late (on the H100: here) is the row's
                row.setdefault("skipped", "error: " + _first_line(e))
                row["context_lost"] = True
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rec["rows"].append(row)
        rec["seconds"] = round(time.perf_counter() - t_start, 2)
        _record(out, rec)
        print(f"[warm {index}] {row['tag']:40s} {name:32s} {row['seconds']:7.1f} s"
              + (f"  ({row['skipped'][:100]})" if "skipped" in row else ""), flush=True)
        if row.get("context_lost"):
            return CONTEXT_LOST_EXIT
    rec["finished"] = True
    _record(out, rec)
    return 0


def _worker_command(plan_path: Path, index: int, start: int) -> list[str]:
    return [sys.executable, "-m", "fastrpe.bench.gpu_warm", str(plan_path), str(index), str(start)]


def _log_tail(path: Path, n: int = 8) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:] if path.exists() else []


def _triton_key() -> str | None:
    """This Python's `triton_key()`, the start of every Triton cache key: a pack of kernels
    compiled elsewhere (benchmarks/precompile.py) hits only under the same one. On 2026-11-27
    the H100 image's differed from PyPI's triton 3.6.0 wheel's, so the pack built here missed;
    with this recorded, `precompile.py compile` can build for it."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    return triton_key()


def warm(cfg: GpuConfig, out: Path, *, which: str = "first", budget_s: float = 150.0, log=print) -> dict:
    """Run the workers side by side until they finish or `budget_s` passes (then each is
    killed with its process group), and write `out/gpu_warm.json` from their records. The
    rows `out/gpu.json` already holds are left out (see `warm_items`), but for the problems a
    `--retry-errors` run measures again (`gpu.retry_errors`)."""
    from ..ops.linear.triton_chunked import TUNE_CONFIGS

    out.mkdir(parents=True, exist_ok=True)
    done = set()  # rows a resumed bench will not run (an error's problem runs again: --retry-errors;
    if (out / "gpu.json").exists():  # a lost context under other versions too: gpu.lost_elsewhere)
        old = json.loads((out / "gpu.json").read_text())
        done = done_pairs(lost_elsewhere(old, retry_errors(old["rows"], cfg), versions(), cfg))
    workers = plan(warm_items(cfg, which, done), len(TUNE_CONFIGS))
    spec = {"config": cfg.to_dict(), "pass": which,
            "workers": [[{"problem": p.to_dict(), "competitor": n} for p, n in w] for w in workers]}
    # the plan, the workers' records and logs: in a folder of their own (a device call brings
    # back only a few files from its output folder); failed workers' log tails go to gpu_warm.json
    work = Path(tempfile.mkdtemp(prefix="fastrpe-warm-"))
    plan_path = work / "gpu_warm_plan.json"
    plan_path.write_text(json.dumps(spec, indent=1))
    if not any(workers):
        log(f"warm-up: nothing left to compile for the {which} pass")
        return {"pass": which, "budget_s": budget_s, "seconds": 0.0, "killed_at_budget": [], "workers": []}
    busy = [w for w in workers if w]
    log(f"warming the compile caches: {len(busy)} workers (worker i runs autotuner config i mod "
        f"{len(TUNE_CONFIGS)}; those with rows), "
        f"{min(map(len, busy))}-{max(map(len, busy))} rows each, at most {budget_s:g} s")
    auto_dir = tempfile.mkdtemp(prefix="fastrpe-warm-auto-")  # auto's timings, taken beside other workers: thrown away
    procs = {}  # worker index -> (process, log); a worker with nothing to compile is not started
    faults = {}  # worker index -> what ended each of its processes that a restart followed

    def start(i: int, first: int) -> None:
        env = {**os.environ, "FASTRPE_TRITON_CONFIG": str(i % len(TUNE_CONFIGS)), "FASTRPE_CACHE_DIR": auto_dir,
               "PYTHONUNBUFFERED": "1"}
        logf = open(work / f"gpu_warm_{i}.log", "a")  # noqa: SIM115 - the worker's output, closed below
        procs[i] = (subprocess.Popen(_worker_command(plan_path, i, first), env=env, stdout=logf,
                                     stderr=subprocess.STDOUT, start_new_session=True), logf)

    def restart(i: int, rc: int) -> bool:
        """Worker i's process ended with `rc` (not 0): start it again after the row it stopped
        at, while its plan has rows left and RESTART_MIN_S of the budget remain."""
        path = work / f"gpu_warm_{i}.json"
        rec = json.loads(path.read_text()) if path.exists() else {"worker": i, "rows": []}
        n = len(rec["rows"])  # a lost context's row is recorded; a crash's is not: it is skipped, said so
        nxt = n if rc == CONTEXT_LOST_EXIT else n + 1
        if nxt >= len(workers[i]) or budget_s - (time.perf_counter() - t0) < RESTART_MIN_S \
                or len(faults.get(i, [])) >= MAX_RESTARTS:
            return False
        at = n - 1 if rc == CONTEXT_LOST_EXIT and n else n  # the row it stopped at
        faults.setdefault(i, []).append({"row": at, "exit": rc, "log_tail": _log_tail(work / f"gpu_warm_{i}.log")})
        if nxt > n:
            item = workers[i][n]
            rec["rows"].append({"tag": item[0].tag(), "competitor": item[1], "skipped": f"the worker died here (exit {rc})"})
            _record(path, rec)
        procs[i][1].close()
        start(i, nxt)
        return True

    t0 = time.perf_counter()
    for i in range(len(workers)):
        if workers[i]:
            start(i, 0)
    killed = []
    try:
        running = set(procs)
        while running:
            for i in sorted(running):
                rc = procs[i][0].poll()
                if rc is not None and (rc == 0 or not restart(i, rc)):
                    running.discard(i)
            if not running:
                break
            if time.perf_counter() - t0 >= budget_s:
                killed = sorted(running)
                break
            time.sleep(0.1)
    finally:  # at the budget, or interrupted: no worker outlives this call (each leads its own group)
        for proc, logf in procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            logf.close()
    res = {"pass": which, "budget_s": budget_s, "seconds": round(time.perf_counter() - t0, 1),
           "killed_at_budget": killed, "work_dir": str(work), "triton_key": _triton_key(), "workers": []}
    for i, (proc, _) in procs.items():
        path = work / f"gpu_warm_{i}.json"
        rec = json.loads(path.read_text()) if path.exists() else {"worker": i, "rows": []}
        rec.update(returncode=proc.returncode, planned=len(workers[i]))
        if i in faults:
            rec["restarts"] = faults[i]
        if proc.returncode not in (0, None) and i not in killed:
            rec["log_tail"] = _log_tail(work / f"gpu_warm_{i}.log")
        res["workers"].append(rec)
        path.unlink(missing_ok=True)
    (out / "gpu_warm.json").write_text(json.dumps(res, indent=1))
    for rec in res["workers"]:
        ran = [r for r in rec["rows"] if "skipped" not in r]
        tc = rec.get("triton_compiles") or {}
        log(f"  worker {rec['worker']}: {len(rec['rows'])}/{rec['planned']} rows in {rec.get('seconds', 0):.0f} s "
            f"({len(ran)} ran), exit {rec['returncode']}"
            + (f"; Triton kernels from the cache {tc['hits']}, compiled {tc['misses']}" if "hits" in tc else "")
            + "".join(f"; started again after row {f['row']} (exit {f['exit']}: {rec['rows'][f['row']]['competitor']} "
                      f"{rec['rows'][f['row']]['tag']})" for f in rec.get("restarts", []) if f["row"] < len(rec["rows"])))
        for line in rec.get("log_tail", []):
            log(f"    | {line}")
    log(f"warm-up: {res['seconds']:.0f} s" + (f", workers {killed} stopped at the budget" if killed else "")
        + f"; wrote {out / 'gpu_warm.json'}")
    return res


if __name__ == "__main__":  # a worker: python -m fastrpe.bench.gpu_warm PLAN.json INDEX [START]
    sys.exit(run_worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0))
