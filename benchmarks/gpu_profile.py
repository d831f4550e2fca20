"""Where a GPU bench row's time goes: each kernel's device time per call, and how much of the
call the GPU was busy at all (the rest is the host: Python, launches, autograd).

The first H100 rows (2026-11-26, docs/RESULTS.md) left two questions this answers:
- at 4,096 tokens every fastrpe row took 1.8-3.8 ms against Flex's 0.9-1.6 (triton_chunked:
  1.96 ms at 4k, 5.85 at 64k, so about 1.6 ms does not grow with L): host-bound?
- at 65,536 tokens which kernels hold triton_chunked's 5.85 ms (the state passes are
  sequential over 1,024 chunks) and triton_tiled's 282 ms?
And, for the eager rows' fixed part, how much of it a compiled call (`+compiled`) still has,
in each of `--compile-modes` (reduce-overhead: CUDA graphs; `benchmarks/host_time.py` found
compiling alone raised the host time on the CPU).

Each case is the bench's own row (`fastrpe.bench.gpu.registry`: the same inputs, forward and
backward), called twice to warm, then profiled over `--calls` calls (torch.profiler, CPU and
CUDA) and timed with CUDA events. The GPU's busy time, the launches and `top` count the
device-side events alone (kernels, memcpy, memset: `is_kernel`); `ops` lists the host ops
(aten ops, autograd Functions) by the device time of the kernels they launched. Until
2026-11-27 both were summed, each kernel counted twice (busy_share 1.94 on the H100). 4,096 tokens run first (`--lengths`): the 64k
kernels are known from that session, and whether the 4k rows are host-bound is not.

    python benchmarks/gpu_profile.py --out runs/gpu/gpu_profile.json
    python benchmarks/gpu_profile.py --device cpu --lengths 64 --cases fastrpe-chunked:alibi  # smoke
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastrpe.bench import gpu
from fastrpe.bench.registry import Problem

CASES = ("fastrpe-triton_chunked:alibi", "fastrpe-triton_chunked+sequential-scan:alibi", "fastrpe-triton_soe:kerple_log",
         "fastrpe-triton_band:t5", "fastrpe-triton_band+sequential-scan:t5",
         "fastrpe-triton_tiled:learned", "flex:alibi",
         # under torch.compile (4k only: longer lengths refuse, `compiled_max_length`); last, it compiles
         "fastrpe-triton_chunked+compiled:alibi")


def _device_us(e) -> float:
    """An event's self time on the device, in µs (the attribute's name changed across torch)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def is_kernel(e) -> bool:
    """Whether a profiler event (torch's FunctionEventAvg) is device-side work: a kernel, or a
    memcpy / memset on the GPU. The host's events carry device time too, that of the kernels
    they launched (an aten op, an autograd Function such as `_ChunkedDecayBackward`), and so
    do the GPU-side spans of `record_function` ranges (user annotations); summing them with
    the kernels counted each kernel twice or more (busy_share 1.94 on the H100, 2026-11-27)."""
    return getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def summarize(events, calls: int, on_device: bool, top: int) -> dict:
    """Per call: the device's busy time and launches (kernel events only, `is_kernel`), the
    heaviest kernels (`top`) and the host ops that launched the most device time (`ops`: the
    time of the kernels each op launched itself, not through its child ops: torch's self device
    time of a host event, the same kernels again, so never added to `busy_ms`). Without a
    device: the CPU's own ops by self time, in `top`."""
    def rows(evs, us):
        out = [(e.key, e.count / calls, us(e) / 1e3 / calls) for e in evs if us(e) > 0]
        return sorted(out, key=lambda k: -k[2])

    def listed(ks):
        return [{"name": n[:120], "per_call": round(c, 2), "ms": round(ms, 4)} for n, c, ms in ks[:top]]

    if on_device:
        kernels = rows([e for e in events if is_kernel(e)], _device_us)
        ops = rows([e for e in events if not is_kernel(e) and not getattr(e, "is_user_annotation", False)],
                   _device_us)
    else:  # no device: the CPU's own ops, self time
        kernels, ops = rows(events, lambda e: e.self_cpu_time_total), None
    res = {"busy_ms": round(sum(k[2] for k in kernels), 4),
           "launches_per_call": round(sum(k[1] for k in kernels), 1), "top": listed(kernels)}
    if ops is not None:
        res["ops"] = listed(ops)
    return res


def profile_case(fn, device: torch.device, calls: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):  # compile (from the warm caches) and settle the autotuners
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / calls
    else:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    s = summarize(prof.key_averages(), calls, device.type == "cuda", top)
    return {"wall_ms": round(wall_ms, 4), "host_ms_profiled": round(host_ms, 4), "busy_ms": s["busy_ms"],
            "busy_share": round(s["busy_ms"] / wall_ms, 3) if wall_ms else None,
            **{k: v for k, v in s.items() if k != "busy_ms"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="4096,65536",
                    help="in this order (4k first: whether those rows are host-bound is the open question; the 64k "
                         "kernels are known, 2026-11-27, and at 64k all 45 s went to five cases)")
    ap.add_argument("--cases", default=",".join(CASES), help="competitor:family, comma-separated")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=60.0, help="start no new case after this many seconds")
    ap.add_argument("--out", default="runs/gpu/gpu_profile.json")
    ap.add_argument("--compile-modes", default="default,reduce-overhead",
                    help="torch.compile modes a +compiled case runs in, each in turn (reduce-overhead: CUDA graphs)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: needs CUDA (--device cpu profiles the CPU's ops)")
        return 2
    cfg = gpu.GpuConfig(device=args.device) if dev.type == "cuda" else gpu.smoke_config()
    dt = getattr(torch, cfg.dtype)
    modes = [m for m in args.compile_modes.split(",") if m]
    bad = [m for m in modes if m not in gpu.COMPILE_MODES]
    if bad or not modes:
        print(f"gpu_profile: --compile-modes takes some of {', '.join(gpu.COMPILE_MODES)}, got {args.compile_modes!r}")
        return 2
    regs = {m: gpu.registry(replace(cfg, compile_mode=m)) for m in modes}
    res = {"device": gpu.environment(dev)["device"], "torch": torch.__version__, "dtype": cfg.dtype,
           "python": platform.python_version(), "command": "python benchmarks/gpu_profile.py " + " ".join(
               argv if argv is not None else sys.argv[1:]), "calls": args.calls, "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    for L in (int(x) for x in args.lengths.split(",")):
        items = []
        for case in args.cases.split(","):
            name, fam = case.split(":")
            items += [(name, fam, m) for m in (modes if name.endswith(gpu.COMPILED) else modes[:1])]
        for name, fam, mode in items:
            reg = regs[mode]
            row = {"competitor": name, "family": fam, "L": L}
            if name.endswith(gpu.COMPILED):
                row["compile_mode"] = mode
            if time.perf_counter() - t_start > args.budget_s:
                row["skipped"] = "budget spent"
            else:
                p = Problem(position=fam, kernel=cfg.kernel, causal=gpu.family_causal(fam), L=L, B=cfg.B, H=cfg.H,
                            D=cfg.D, features=cfg.features, backward=True)
                try:
                    fn = reg[name](p, dev, dt)
                    if isinstance(fn, str):
                        row["skipped"] = fn
                    else:
                        row.update(profile_case(fn, dev, args.calls, args.top))
                        row.update(getattr(fn, "after", dict)() or {})  # autotuned, cudagraph_skips
                except Exception as e:  # noqa: BLE001 - recorded, the next case goes on
                    row["skipped"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                fn = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            res["cases"].append(row)
            out.write_text(json.dumps(res, indent=1))
            head = row.get("skipped") or (f"{row['wall_ms']:8.3f} ms, GPU busy {row['busy_ms']:8.3f} ms "
                                          f"({row['launches_per_call']:.0f} launches); top: " + ", ".join(
                                              f"{k['name'][:40]} {k['ms']:.3f}" for k in row["top"][:3]))
            label = name + (f" ({mode})" if name.endswith(gpu.COMPILED) else "")
            print(f"{label:28s} {fam:11s} L={L:<7d} {head}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
