"""Luo et al. (NeurIPS 2021), Figure 1(a): non-causal forward time against length,
softmax attention vs kernelized attention with RPE by FFT.

The paper's setting (§4.1 "forward cost"): 1 head, embedding 64, synthetic inputs of
length 1k–40k, feature dimensions m ∈ {16, 32, 64}, ten trials on a V100. Here on CPU,
one thread (`torch.set_num_threads(1)`, so that a shared machine's load does not decide
the ranking): `[1, 1, L, 64]` inputs, forward only under `no_grad`, the fastest of
`--repeats` calls after one warm-up call, every (competitor, length) cell timed
round-robin so that the shared machine's changing load hits all cells alike.
Competitors: standard softmax attention (no RPE,
`backend="auto"`: SDPA), softmax with the same learned RPE table (dense bias), and NPRF
with a learned table `b[j - i]` over every offset multiplied by FFT (`backend="fft"`,
Luo's algorithm). Slopes: least-squares log-log fits over the lengths each ran.
"""
from __future__ import annotations

import time

import torch

FEATURES = (16, 32, 64)


def set_timing_threads(threads: int) -> int:
    """Pin intra-op threads for timing (returns the previous count)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    return prev


def best_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Fastest wall time of `fn()` over `repeats` calls after `warmup` untimed calls.

    The minimum, not the median: on a shared machine other processes only ever add time,
    so the fastest call is the best estimate of the call's own cost."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def interleaved_best_seconds(cells: dict, repeats: int) -> dict:
    """`{key: fn}` -> `{key: fastest seconds}`, timing the cells round-robin: each round
    calls every cell once, so a change in a shared machine's load during the run hits all
    cells alike instead of the lengths timed last. One untimed warm-up call each first."""
    for fn in cells.values():
        fn()
    best = {key: float("inf") for key in cells}
    for _ in range(repeats):
        for key, fn in cells.items():
            t = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t)
    return best


def slope(xs, ys) -> float | None:
    from ..bench.runner import loglog_slope

    return loglog_slope(list(xs), list(ys))


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p) -> None:
    p.add_argument("--lengths", default=None, help="default 1024..16384 (quick 1024..4096)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--features", default=",".join(map(str, FEATURES)))
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 7, quick 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def competitors(L: int, D: int, feats: list[int], seed: int) -> dict:
    """name -> zero-argument forward call on fresh `[1, 1, L, D]` inputs."""
    import fastrpe as fr

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, L, D, generator=g) for _ in range(3))
    torch.manual_seed(seed)
    table = fr.positions.LearnedTable(1, max_distance=L, init_std=0.1)  # b[j - i] for every offset
    out = {"softmax (standard)": lambda: fr.attention(q, k, v),
           "softmax + RPE (dense)": lambda: fr.attention(q, k, v, position=table, backend="dense")}
    for m in feats:
        kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=m, seed=seed)
        out[f"NPRF + RPE fft, m={m}"] = lambda kern=kern: fr.attention(q, k, v, kernel=kern, position=table,
                                                                       backend="fft")
    return out


def run(args, out_dir) -> dict:
    lengths = parse_ints(args.lengths) if args.lengths else (
        [1024, 2048, 3072, 4096] if args.quick else [1024, 2048, 4096, 8192, 12288, 16384])
    repeats = args.repeats or (5 if args.quick else 7)
    feats = parse_ints(args.features)
    prev = set_timing_threads(args.threads)
    rows = []
    try:
        with torch.no_grad():
            cells = {(name, L): fn for L in lengths for name, fn in competitors(L, args.dim, feats, args.seed).items()}
            best = interleaved_best_seconds(cells, repeats)
        for (name, L), s in best.items():
            rows.append({"competitor": name, "L": L, "seconds": s})
            print(f"L={L:6d}  {name:26s} {s * 1e3:9.2f} ms", flush=True)
    finally:
        torch.set_num_threads(prev)
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    slopes = {n: slope([r["L"] for r in rows if r["competitor"] == n],
                       [r["seconds"] for r in rows if r["competitor"] == n]) for n in names}
    ratio = {}  # time(longest) / time(shortest): a quadratic method grows by (L_max/L_min)^2
    for n in names:
        ts = [r["seconds"] for r in rows if r["competitor"] == n]
        ratio[n] = ts[-1] / ts[0]
    for n in names:
        print(f"{n:26s} slope {slopes[n]:.2f}  growth x{ratio[n]:.1f} over {lengths[0]}..{lengths[-1]}")
    from ..bench.runner import device_name

    result = {"experiment": "luo-fig1a", "device": device_name(torch.device("cpu")), "threads": args.threads,
              "heads": 1, "dim": args.dim, "features": feats, "lengths": lengths, "repeats": repeats,
              "rows": rows, "slopes": slopes, "growth": ratio}
    _plot(result, out_dir / "luo-fig1a.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for n, s in result["slopes"].items():
        pts = [(r["L"], r["seconds"]) for r in result["rows"] if r["competitor"] == n]
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=f"{n} (slope {s:.2f})")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("forward ms (fastest of the repeats)")
    ax.set_title(f"Luo Fig. 1(a) on CPU, {result['threads']} thread: 1 head, d = {result['dim']}", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
