"""Time and memory against sequence length: Luo et al. Figure 1(a), FastRPB Figure 3,
Scaleformer Figures 4–6.

The papers' claim: softmax attention (with or without RPE) grows quadratically in time
and memory, the FFT path for kernelized attention with RPE as O(n log n), and the
prefix-sum / chunked causal forms linearly. Here every competitor runs forward + backward
on causal problems `[1, H, L, D]` with three positional terms — KERPLE-log (no exact
linear-time form: fft, soe), ALiBi (a geometric decay: chunked) and none (prefix sums) —
against dense softmax with the bias, SDPA with a materialized bias, SDPA without RPE
(FlashAttention on a GPU), and FlexAttention with the same `score_mod` (GPU; on CPU
FlexAttention has no backward in torch 2.13 and is skipped with that reason).
Time: median of `--repeats` calls. Memory: the allocator's peak during one call (CUDA
allocator on a GPU; profiler allocation events on CPU: `fastrpe.bench.memory`). A
competitor is skipped at a length when its own cost model predicts more than
`--memory-limit-gib`, or after one call at a shorter length took over `--time-limit` s.
Slopes: least-squares log-log fits over the lengths each competitor ran.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .._validate import FastRPEError
from ..bench.registry import Problem, _position, fastrpe_backend, flex_same_position, sdpa_no_rpe

POSITIONS = ("kerple_log", "alibi", "none")


def _with_kernel(kernel: str, backend: str):
    inner = fastrpe_backend(backend)

    def setup(p: Problem, device, dtype):
        return inner(replace(p, kernel=kernel), device, dtype)

    return setup


def _predicted_bytes(p: Problem, kernel: str, backend: str) -> float | None:
    """The backend's own memory estimate for this call (None when it refuses)."""
    import fastrpe as fr

    x = torch.zeros(1, 1, 1, 1).expand(p.B, p.H, p.L, p.D)  # shapes only, no memory
    kern = fr.kernels.get_kernel(kernel, head_dim=p.D, num_features=p.features)
    pos = _position(p, "cpu")
    try:
        ex = fr.explain(x.requires_grad_(p.backward) if p.backward else x, x, x, kernel=kern, position=pos, causal=p.causal,
                        allow_approximate=True)
    except Exception:  # noqa: BLE001 - an estimate only; the run itself reports real errors
        return None
    for c in ex.candidates:
        if c.backend == backend and not c.reasons and c.cost is not None:
            return c.cost.bytes
    return None


def competitors(memory_limit: float) -> dict:
    """name -> setup, each refusing (with a reason) above the memory limit."""
    table = {
        "softmax dense + RPE": ("softmax", "dense"),
        "softmax sdpa + RPE": ("softmax", "sdpa"),
        "nprf dense": ("nprf", "dense"),
        "nprf fft": ("nprf", "fft"),
        "nprf chunked": ("nprf", "chunked"),
        "nprf prefix": ("nprf", "prefix"),
        "nprf soe": ("nprf", "soe"),
    }
    out = {}
    for name, (kernel, backend) in table.items():
        def setup(p, device, dtype, _k=kernel, _b=backend):
            need = _predicted_bytes(p, _k, _b)
            if need is not None and need > memory_limit:
                return f"predicted {need / 2**30:.1f} GiB > limit {memory_limit / 2**30:.1f} GiB"
            return _with_kernel(_k, _b)(p, device, dtype)

        out[name] = setup
    out["flex + same RPE"] = flex_same_position
    out["sdpa, no RPE"] = sdpa_no_rpe

    def sdpa_guarded(p, device, dtype):
        need = 3 * p.B * p.H * p.L * p.L * 4
        if device.type != "cuda" and need > memory_limit:
            return f"predicted {need / 2**30:.1f} GiB > limit {memory_limit / 2**30:.1f} GiB (math kernel on CPU)"
        return sdpa_no_rpe(p, device, dtype)

    out["sdpa, no RPE"] = sdpa_guarded
    return out


def add_arguments(p) -> None:
    p.add_argument("--lengths", default=None, help="default 1024..16384 (quick 256..4096); 65536 on a GPU")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 3, quick 2)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per call before longer lengths are "
                   "skipped (default 60, quick 3)")
    p.add_argument("--memory-limit-gib", type=float, default=8.0)
    p.add_argument("--positions", default=",".join(POSITIONS))
    p.add_argument("--competitors", default=None, help="comma-separated subset of the competitors (default: all): "
                   + ", ".join(competitors(0)))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def run(args, out_dir) -> dict:
    from ..bench.runner import loglog_slope, run_suite

    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    elif args.quick:
        lengths = [256, 512, 1024, 2048, 4096]
    else:
        lengths = [1024, 2048, 4096, 8192, 16384] + ([32768, 65536] if args.device.startswith("cuda") else [])
    repeats = args.repeats or (2 if args.quick else 3)
    limit = args.time_limit or (3.0 if args.quick else 60.0)
    comps = competitors(args.memory_limit_gib * 2**30)
    if args.competitors:
        names = [c.strip() for c in args.competitors.split(",") if c.strip()]
        unknown = [c for c in names if c not in comps]
        if unknown:
            raise FastRPEError(f"speed: unknown competitor(s) {unknown}; known: {', '.join(comps)}")
        comps = {c: comps[c] for c in names}
    problems = [Problem(position=pos, kernel="nprf", causal=True, L=L, H=args.heads, D=args.dim,
                        features=args.features, backward=True)
                for pos in args.positions.split(",") for L in lengths]
    res = run_suite(problems, list(comps), device=args.device, repeats=repeats, warmup=0, time_limit_s=limit,
                    registry=comps, log=lambda m: print(m, flush=True))
    slopes = {}
    for pos in args.positions.split(","):
        for name in comps:
            pts = [(r["problem"]["L"], r["seconds"], r.get("peak_bytes")) for r in res["rows"]
                   if r["competitor"] == name and r["problem"]["position"] == pos and "seconds" in r]
            if len(pts) >= 2:
                slopes[f"{pos} | {name}"] = {
                    "time": loglog_slope([x for x, _, _ in pts], [t for _, t, _ in pts]),
                    "memory": loglog_slope([x for x, _, _ in pts], [m for _, _, m in pts]),
                    "lengths": [pts[0][0], pts[-1][0]]}
    for key, s in slopes.items():
        print(f"{key:40s} time slope {s['time']:.2f}  memory slope "
              + (f"{s['memory']:.2f}" if s["memory"] is not None else "-"))
    result = {"experiment": "speed", "device": res["device"], "lengths": lengths, "heads": args.heads,
              "dim": args.dim, "features": args.features, "repeats": repeats, "time_limit_s": limit,
              "memory_limit_gib": args.memory_limit_gib, "rows": res["rows"], "slopes": slopes}
    _plot(result, args.positions.split(","), out_dir / "speed.png")
    return result


def _plot(result: dict, positions: list[str], path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, len(positions), figsize=(5 * len(positions), 7.5), squeeze=False)
    names = sorted({r["competitor"] for r in result["rows"]})
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    for j, pos in enumerate(positions):
        for name in names:
            pts = sorted((r["problem"]["L"], r["seconds"], r.get("peak_bytes")) for r in result["rows"]
                         if r["competitor"] == name and r["problem"]["position"] == pos and "seconds" in r)
            if not pts:
                continue
            s = result["slopes"].get(f"{pos} | {name}", {})
            ts = f" ({s['time']:.2f})" if s.get("time") is not None else ""
            ms = f" ({s['memory']:.2f})" if s.get("memory") is not None else ""
            axes[0][j].plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", color=colors[name],
                            label=name + ts)
            if all(p[2] for p in pts):
                axes[1][j].plot([p[0] for p in pts], [p[2] / 2**20 for p in pts], marker="o", color=colors[name],
                                label=name + ms)
        axes[0][j].set_title(f"causal, position: {pos}", fontsize=9)
        axes[0][j].set_ylabel("ms, forward + backward")
        axes[1][j].set_ylabel("peak MiB (allocator)")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length (slope in the legend)")
            ax.legend(fontsize=6)
    fig.suptitle(result["device"], fontsize=9)
    save(fig, path, dpi=110)

