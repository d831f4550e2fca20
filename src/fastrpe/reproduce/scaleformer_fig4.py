"""Scaleformer (Favier & Dal'Maz Silva, 2021), Figure 4: the Shaw term `A_rel` computed
naively and in linear time, CPU time against length (d = 256, k = 10).

`A_rel` is Shaw's contribution to the kernelized numerator and denominator (Scaleformer
Eq. 10): `num_i = Σ_j S_ij·v_j`, `den_i = Σ_j S_ij`, `S_ij = φ(q_i)·RP[clip(i - j, -k, k)]`.
Naive: `fastrpe.ops.shaw.naive.shaw_num_den_naive` materializes `S` (`L × L`); linear:
`fastrpe.ops.shaw.linear.shaw_num_den_linear` (prefix sums beyond the band, 2k - 1 shifted
slices inside it). Both masked (causal) and bidirectional, forward only, `[1, 1, L, 256]`
inputs, one thread (`torch.set_num_threads(1)`), fastest of `--repeats` calls after a warm-up,
cells timed round-robin (`luo_fig1a.interleaved_best_seconds`).
The paper's reading: on a log2-log2 plot a linear algorithm has slope 1, a quadratic one 2.
The results of the two are checked equal (relative error printed) at every length.
"""
from __future__ import annotations

import torch

from .luo_fig1a import interleaved_best_seconds, parse_ints, set_timing_threads, slope


def add_arguments(p) -> None:
    p.add_argument("--lengths", default=None, help="default 256..8192 (quick 256..2048)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--k", type=int, default=10, help="Shaw's clipping distance")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per cell (default 7, quick 5)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def run(args, out_dir) -> dict:
    from ..bench.runner import device_name
    from ..ops.shaw.linear import shaw_num_den_linear
    from ..ops.shaw.naive import shaw_num_den_naive

    lengths = parse_ints(args.lengths) if args.lengths else (
        [256, 512, 1024, 2048] if args.quick else [256, 512, 1024, 2048, 4096, 8192])
    repeats = args.repeats or (5 if args.quick else 7)
    ops = {"naive": shaw_num_den_naive, "linear": shaw_num_den_linear}
    prev = set_timing_threads(args.threads)
    rows = []
    try:
        with torch.no_grad():
            cells, errs = {}, {}
            for L in lengths:
                g = torch.Generator().manual_seed(args.seed)
                phi_q = torch.rand(1, 1, L, args.dim, generator=g)  # positive features
                v = torch.randn(1, 1, L, args.dim, generator=g)
                rp = torch.randn(1, 2 * args.k + 1, args.dim, generator=g)
                for causal in (True, False):
                    mode = "masked" if causal else "bidirectional"
                    for name, op in ops.items():
                        cells[(name, mode, L)] = (lambda op=op, phi_q=phi_q, v=v, rp=rp, L=L, causal=causal:
                                                  op(phi_q, v, rp, Lk=L, causal=causal))
                    ref, _ = cells[("naive", mode, L)]()
                    num, _ = cells[("linear", mode, L)]()
                    errs[(mode, L)] = float((num - ref).abs().max() / ref.abs().max())
            best = interleaved_best_seconds(cells, repeats)
        for (name, mode, L), s in best.items():
            err = errs[(mode, L)] if name == "linear" else None
            rows.append({"algorithm": name, "mode": mode, "L": L, "seconds": s, "rel_err_vs_naive": err})
            print(f"L={L:6d} {mode:13s} {name:6s} {s * 1e3:9.2f} ms"
                  + (f"  rel. err {err:.1e}" if err is not None else ""), flush=True)
    finally:
        torch.set_num_threads(prev)
    slopes = {}
    for mode in ("masked", "bidirectional"):
        for name in ops:
            pts = [(r["L"], r["seconds"]) for r in rows if r["mode"] == mode and r["algorithm"] == name]
            slopes[f"{mode} | {name}"] = slope([p[0] for p in pts], [p[1] for p in pts])
    for key, s in slopes.items():
        print(f"{key:24s} log-log slope {s:.2f}")
    result = {"experiment": "scaleformer-fig4", "device": device_name(torch.device("cpu")), "threads": args.threads,
              "dim": args.dim, "k": args.k, "lengths": lengths, "repeats": repeats, "rows": rows, "slopes": slopes}
    _plot(result, out_dir / "scaleformer-fig4.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, s in result["slopes"].items():
        mode, name = key.split(" | ")
        pts = [(r["L"], r["seconds"]) for r in result["rows"] if r["mode"] == mode and r["algorithm"] == name]
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", ls="-" if mode == "masked" else "--",
                label=f"{name}, {mode} (slope {s:.2f})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("A_rel forward ms (fastest of the repeats)")
    ax.set_title(f"Scaleformer Fig. 4 on CPU, {result['threads']} thread: d = {result['dim']}, k = {result['k']}",
                 fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
