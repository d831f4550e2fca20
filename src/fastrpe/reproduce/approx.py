"""Luo et al. (NeurIPS 2021), Figure 1(b): how well random features approximate one row
of softmax attention.

d = 64; a query and 1,024 keys drawn uniformly on the unit sphere and scaled by R; the
L1 distance between the exact softmax row `softmax(q·k_j)` and the row estimated with m
random features, for m = 4 … 1,024. Several independent queries (each with its own keys),
several independent feature draws each: the median L1 error with its quartiles.
The data and the features come from independent generators: when both were seeded 0,
the first feature draw's first projection row *was* the query direction (cosine 1.0000),
which inflated the R = 1 errors about 1.6x and invented an ordering of the maps.
The paper's claim: at R = 1 the error is small and falls with m; at large R it is huge and
barely falls — the motivation for normalizing q and k (NPRF). TRF, ORF and sphere-PRF are
extra lines.
"""
from __future__ import annotations

import math

import torch

from ..kernels import PRF, TRF

MAPS = {
    "PRF": lambda d, m, seed: PRF(d, m, projection="iid", seed=seed, input_scale=1.0),
    "ORF": lambda d, m, seed: PRF(d, m, projection="orthogonal", seed=seed, input_scale=1.0),
    "sphere-PRF": lambda d, m, seed: PRF(d, m, projection="sphere", seed=seed, input_scale=1.0),
    # same-norm keys: the Gaussian kernel's per-key factor is constant, so its row is softmax's
    "TRF": lambda d, m, seed: TRF(d, m, seed=seed, input_scale=1.0, normalize=False),
}


def add_arguments(p) -> None:
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--keys", type=int, default=1024)
    p.add_argument("--radii", default="1,2,4")
    p.add_argument("--features", default="4,8,16,32,64,128,256,512,1024")
    p.add_argument("--trials", type=int, default=None, help="feature draws per query (default 10, quick 5)")
    p.add_argument("--queries", type=int, default=None, help="independent query/key draws (default 10, quick 6)")


def _sphere(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def feature_seeds(seed: int, count: int) -> list[int]:
    """Seeds of the feature draws: a generator of their own, never one of the data's."""
    g = torch.Generator().manual_seed(seed + 7919)
    return [int(s) for s in torch.randint(1 << 40, 1 << 62, (count,), generator=g)]


def row_error(make, d: int, m: int, seed: int, q: torch.Tensor, k: torch.Tensor, exact: torch.Tensor) -> float:
    """L1 distance between the exact row and its estimate with one draw of m features."""
    fm = make(d, m, seed).double()
    a = (fm(q[None, None], is_query=True) @ fm(k[None, None], is_query=False).transpose(-1, -2))[0, 0, 0]
    den = a.sum()
    if den == 0 or not math.isfinite(float(den)):
        return float("nan")
    return float((a / den - exact).abs().sum())


def _quantiles(x: list[float]) -> tuple[float, float, float]:
    t = torch.tensor(x, dtype=torch.float64)
    return tuple(float(v) for v in torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)))


def run(args, out_dir) -> dict:
    trials = args.trials or (5 if args.quick else 10)
    queries = args.queries or (6 if args.quick else 10)
    radii = [float(r) for r in args.radii.split(",")]
    feats = [int(m) for m in args.features.split(",")]
    if args.quick:
        feats = [m for m in feats if m <= 256]
    d, n = args.dim, args.keys
    g = torch.Generator().manual_seed(args.seed)
    data = [(_sphere(1, d, g), _sphere(n, d, g)) for _ in range(queries)]
    seeds = feature_seeds(args.seed, queries * trials)
    rows = []
    for R in radii:
        exact = [torch.softmax((q0 * R) @ (k0 * R).T, -1)[0] for q0, k0 in data]  # (n,) per query
        for name, make in MAPS.items():
            for m in feats:
                errs = [row_error(make, d, m, seeds[i * trials + t], data[i][0] * R, data[i][1] * R, exact[i])
                        for i in range(queries) for t in range(trials)]
                finite = [e for e in errs if math.isfinite(e)]
                lo, med, hi = _quantiles(finite) if finite else (None, None, None)
                rows.append({"R": R, "map": name, "features": m, "l1_median": med, "l1_q25": lo, "l1_q75": hi,
                             "l1_mean": sum(finite) / len(finite) if finite else None,
                             "l1_all": [e if math.isfinite(e) else None for e in errs],
                             "non_finite": len(errs) - len(finite)})
    result = {"experiment": "approx", "dim": d, "keys": n, "queries": queries, "trials": trials,
              "seed": args.seed, "rows": rows}
    _plot(result, radii, out_dir / "approx.png")
    return result


def _plot(result: dict, radii, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(radii), figsize=(4.5 * len(radii), 3.8), squeeze=False, sharey=True)
    for ax, R in zip(axes[0], radii):
        for name in MAPS:
            pts = [r for r in result["rows"] if r["R"] == R and r["map"] == name and r["l1_median"] is not None]
            xs = [r["features"] for r in pts]
            line, = ax.plot(xs, [r["l1_median"] for r in pts], marker="o", label=name)
            ax.fill_between(xs, [r["l1_q25"] for r in pts], [r["l1_q75"] for r in pts], alpha=0.15,
                            color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"R = {R:g}")
        ax.set_xlabel("random features m")
        ax.set_ylabel("L1 error of the attention row")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['queries']} queries × {result['trials']} feature draws, {result['keys']} keys on the "
                 f"sphere of radius R, d = {result['dim']}: median and quartiles", fontsize=9)
    save(fig, path)
