"""Scaleformer (Favier & Dal'Maz Silva, 2021), Figure 6: bidirectional multi-head attention,
vanilla softmax against kernelized attention whose algorithm is chosen per call.

Scaleformer picks, per call and from the shapes, between a naive (quadratic) and a linear
algorithm for each term. fastrpe's equivalent is `backend="auto"` (`fastrpe.explain` says
which backend it takes and why). Setting: `[1, H, L, D]` inputs (default 8 heads × 32 = 256
wide, as the paper's d = 256), bidirectional, forward only, one thread
(`torch.set_num_threads(1)`), fastest of `--repeats` calls after a warm-up. Competitors:
vanilla softmax (no RPE, auto), kernelized elu+1 with Shaw's relative vectors (k = 10,
`elu(RP) + 1` as Scaleformer's code; auto), and kernelized elu+1 without RPE (auto).
Every row records the backend `auto` chose, and the time of every other backend that
accepts the call (forced), so that the choice can be judged against the fastest.
"""
from __future__ import annotations

import torch

from .luo_fig1a import best_seconds, parse_ints, set_timing_threads, slope


def add_arguments(p) -> None:
    p.add_argument("--lengths", default=None, help="default 256..8192 (quick 256..4096)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=32, help="head width")
    p.add_argument("--k", type=int, default=10, help="Shaw's clipping distance")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 7, quick 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def competitors(H: int, D: int, k: int, seed: int) -> dict:
    """name -> (kernel, position)."""
    import fastrpe as fr

    torch.manual_seed(seed)
    shaw = fr.positions.ShawRelative(H, D, k, positive=True)  # elu+1 keeps D features: F = D
    return {"vanilla softmax": ("softmax", None), "elu + Shaw (auto)": ("elu", shaw),
            "elu, no RPE (auto)": ("elu", None)}


def run(args, out_dir) -> dict:
    import fastrpe as fr

    from ..bench.runner import device_name

    lengths = parse_ints(args.lengths) if args.lengths else (
        [256, 512, 1024, 2048, 4096] if args.quick else [256, 512, 1024, 2048, 4096, 8192])
    repeats = args.repeats or (5 if args.quick else 7)
    comps = competitors(args.heads, args.dim, args.k, args.seed)
    prev = set_timing_threads(args.threads)
    rows = []
    try:
        with torch.no_grad():
            for L in lengths:
                g = torch.Generator().manual_seed(args.seed)
                q, k, v = (torch.randn(1, args.heads, L, args.dim, generator=g) for _ in range(3))
                for name, (kern, pos) in comps.items():
                    ex = fr.explain(q, k, v, kernel=kern, position=pos)
                    s = best_seconds(lambda kern=kern, pos=pos: fr.attention(q, k, v, kernel=kern, position=pos),
                                     repeats)
                    # every other backend that accepts the call, forced: was auto's choice the fastest?
                    forced = {c.backend: best_seconds(lambda kern=kern, pos=pos, b=c.backend: fr.attention(
                        q, k, v, kernel=kern, position=pos, backend=b), repeats)
                        for c in ex.candidates if not c.reasons and c.backend != ex.chosen}
                    forced[ex.chosen] = s
                    fastest = min(forced, key=forced.get)
                    rows.append({"competitor": name, "L": L, "seconds": s, "auto_chose": ex.chosen,
                                 "forced_seconds": forced, "fastest_backend": fastest,
                                 "auto_over_fastest": s / forced[fastest]})
                    print(f"L={L:6d} {name:20s} {s * 1e3:9.2f} ms  auto -> {ex.chosen}; forced: "
                          + ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in forced.items()), flush=True)
    finally:
        torch.set_num_threads(prev)
    slopes = {n: slope([r["L"] for r in rows if r["competitor"] == n],
                       [r["seconds"] for r in rows if r["competitor"] == n]) for n in comps}
    crossover = {}  # first length where the competitor beats vanilla softmax
    for n in comps:
        if n == "vanilla softmax":
            continue
        base = {r["L"]: r["seconds"] for r in rows if r["competitor"] == "vanilla softmax"}
        faster = [r["L"] for r in rows if r["competitor"] == n and r["seconds"] < base[r["L"]]]
        crossover[n] = faster[0] if faster else None
    for n, s in slopes.items():
        print(f"{n:20s} log-log slope {s:.2f}" + (f"; faster than softmax from L={crossover[n]}"
                                                 if crossover.get(n) else ""))
    result = {"experiment": "scaleformer-fig6", "device": device_name(torch.device("cpu")), "threads": args.threads,
              "heads": args.heads, "dim": args.dim, "k": args.k, "lengths": lengths, "repeats": repeats,
              "rows": rows, "slopes": slopes, "faster_than_softmax_from": crossover}
    _plot(result, out_dir / "scaleformer-fig6.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for n, s in result["slopes"].items():
        pts = [r for r in result["rows"] if r["competitor"] == n]
        line, = ax.plot([r["L"] for r in pts], [r["seconds"] * 1e3 for r in pts], marker="o",
                        label=f"{n} (slope {s:.2f})")
        for r in pts:
            if n != "vanilla softmax":
                ax.annotate(r["auto_chose"], (r["L"], r["seconds"] * 1e3), fontsize=6, color=line.get_color(),
                            xytext=(2, 3), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("forward ms (fastest of the repeats); labels: backend auto chose")
    ax.set_title(f"Scaleformer Fig. 6 on CPU, {result['threads']} thread: bidirectional, "
                 f"{result['heads']} heads × {result['dim']}", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
