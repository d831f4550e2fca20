"""Luo et al. (NeurIPS 2021), Figure 1(b): how well random features approximate one row
of softmax attention.

d = 64; one query and 1,024 keys drawn uniformly on the unit sphere and scaled by R; the
L1 distance between the exact softmax row `softmax(q·k_j)` and the row estimated with m
random features, for m = 4 … 1,024, averaged over independent draws of the features.
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
    p.add_argument("--trials", type=int, default=None, help="feature draws per point (default 20, quick 5)")


def _sphere(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def run(args, out_dir) -> dict:
    trials = args.trials or (5 if args.quick else 20)
    radii = [float(r) for r in args.radii.split(",")]
    feats = [int(m) for m in args.features.split(",")]
    if args.quick:
        feats = [m for m in feats if m <= 256]
    d, n = args.dim, args.keys
    g = torch.Generator().manual_seed(args.seed)
    q0, k0 = _sphere(1, d, g), _sphere(n, d, g)
    rows = []
    for R in radii:
        q, k = q0 * R, k0 * R
        exact = torch.softmax(q @ k.T, -1)[0]  # (n,)
        for name, make in MAPS.items():
            for m in feats:
                errs = []
                for t in range(trials):
                    fm = make(d, m, args.seed * 1000 + t).double()
                    a = (fm(q[None, None], is_query=True) @ fm(k[None, None], is_query=False).transpose(-1, -2))[0, 0, 0]
                    den = a.sum()
                    est = a / den if den != 0 and math.isfinite(float(den)) else torch.full_like(a, float("nan"))
                    errs.append(float((est - exact).abs().sum()))
                finite = [e for e in errs if math.isfinite(e)]
                rows.append({"R": R, "map": name, "features": m, "l1_mean": sum(finite) / max(1, len(finite)),
                             "l1_all": errs, "non_finite": len(errs) - len(finite)})
    result = {"experiment": "approx", "dim": d, "keys": n, "trials": trials, "rows": rows}
    _plot(result, radii, out_dir / "approx.png")
    return result


def _plot(result: dict, radii, path) -> None:
    from ..plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(radii), figsize=(4.5 * len(radii), 3.8), squeeze=False, sharey=True)
    for ax, R in zip(axes[0], radii):
        for name in MAPS:
            pts = [(r["features"], r["l1_mean"]) for r in result["rows"] if r["R"] == R and r["map"] == name]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"R = {R:g}")
        ax.set_xlabel("random features m")
        ax.set_ylabel("L1 error of the attention row")
        ax.legend(fontsize=8)
    fig.suptitle(f"one query, {result['keys']} keys on the sphere of radius R, d = {result['dim']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
