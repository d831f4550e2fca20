"""How good is the sum-of-exponentials (`soe`) approximation? Fit error and its effect on
the attention output, per decaying positional family and length.

For each case (one head, one parameter setting) and each length L, with the number of
exponentials the backend takes (`soe_terms`: the fewest of `TERM_CHOICES` within its check):
* fit error: the largest absolute error of the fitted far field `Σ_k a_k γ_k^d` over every
  distance `W <= d < L`, in units of the largest coefficient (`soe_fit_error`, on the
  fit length the backend really uses: max(L, SOE_FIT_LENGTH));
* output error: `soe` in float64 against the exact dense path in float64 (causal, NPRF
  features): the worst row's relative error `max_i ‖Δout_i‖ / ‖out_i‖` and the whole
  tensor's `‖Δout‖ / ‖out‖` — the approximation alone, no float32 round-off;
* gradient error (L <= --grad-max-length): `‖Δg‖ / ‖g‖` for q, k, v and the positional
  parameters, for a random cotangent.

Also, per several-head term and length (`TERM_LENGTHS`), the exponentials the backend takes
and that fit's weight error (`terms_table`; `--terms-only` prints it alone).

Usage: python benchmarks/soe_accuracy.py [--lengths 1024,4096,16384] [--out benchmarks/results] [--terms-only]
Writes soe_accuracy.json and prints markdown tables (docs/RESULTS.md quotes them).

`--grids 0.0625:4,...` compares the rates' grids instead (`soe.RATE_LO`, `soe.RATE_HI`: the
fastest time scale in band widths, the slowest in multiples of the term's reach): the terms a
frozen term takes under each over `grid_cases()` at 4k to 256k tokens, and, for the GPU bench's
two KERPLE terms at 64k, the weight errors of freely optimized rates against the grid's
(`free_rates`): how many terms a better grid could still save. Writes soe_grids.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

import fastrpe as fr
from fastrpe import positions as P
from fastrpe.ops.linear.soe import (DEFAULT_WINDOW, SOE_FIT_LENGTH, SOE_MAX_WEIGHT_ERROR, TERM_CHOICES,
                                   causal_log_coefficients, fewest_terms, soe_fit_error, soe_fit_length, soe_plan,
                                   soe_terms, soe_weight_error, weight_error_of)


def _table(values) -> P.LearnedTable:
    t = P.LearnedTable(1, max_distance=len(values) - 1, causal=True)
    with torch.no_grad():
        # causal table: entry max_distance - d holds b(-d); values[d] = b(-d)
        t.table[0] = torch.as_tensor(values, dtype=t.table.dtype).flip(0)
    return t


def cases() -> dict:
    """name -> a one-head positional term (float64)."""
    g = torch.Generator().manual_seed(0)
    d = torch.arange(201.0)
    out = {
        "kerple_log (init)": P.KerpleLog(1),
        "kerple_log r1=0.5 r2=0.1": P.KerpleLog(1, r1=[0.5], r2=[0.1]),
        "kerple_log r1=3 r2=2": P.KerpleLog(1, r1=[3.0], r2=[2.0]),
        "kerple_log3 (init)": P.KerpleLog3(1),
        "kerple_power r1=0.05 p=0.5": P.KerplePower(1, r1=[0.05], p=[0.5]),
        "kerple_power r1=1 p=1.5": P.KerplePower(1, r1=[1.0], p=[1.5]),
        "t5 (causal, random buckets)": P.make("t5", 1, causal=True, max_len=4096),
        "table to 200, smooth decay + noise": _table(-0.05 * d + 0.3 * torch.randn(201, generator=g)),
        "table to 200, random in [-3, 3]": _table(6 * torch.rand(201, generator=g) - 3),
    }
    with torch.no_grad():
        for p in out["t5 (causal, random buckets)"].parameters():
            p.copy_(torch.randn(p.shape, generator=g).sort(descending=True).values)  # decays with distance, noisy
    return {k: v.double() for k, v in out.items()}


def term_cases() -> dict:
    """name -> a several-head term whose heads decay at different speeds (float64): what one
    fit must serve at once (the rates are shared by the heads)."""
    t = torch.tensor
    return {k: v.double() for k, v in {
        "GPU bench KERPLE power (8 heads, r1 = 0.5, p = 0.5..1.5)": P.KerplePower(8, p=torch.linspace(0.5, 1.5, 8)),
        "GPU bench KERPLE log (8 heads, init)": P.KerpleLog(8),
        "KERPLE power r1 = 0.1, p = 0.25, 0.5, 0.75, 1": P.KerplePower(4, r1=0.1, p=t([0.25, 0.5, 0.75, 1.0])),
        "KERPLE power r1 = 2, p = 0.25, 0.5, 0.75, 1": P.KerplePower(4, r1=2.0, p=t([0.25, 0.5, 0.75, 1.0])),
        "KERPLE log r1 = 4, r2 = 0.1, 0.5, 1, 4": P.KerpleLog(4, r1=4.0, r2=t([0.1, 0.5, 1.0, 4.0])),
    }.items()}


#: lengths of the terms table (no attention is run: the fit and its check only)
TERM_LENGTHS = (4096, 65536)
#: lengths of the rate grids' comparison (`--grids`)
GRID_LENGTHS = (4096, 16384, 65536, 262144)


def grid_cases() -> dict:
    """name -> a several-head term (float64) for the rate grids' comparison: KERPLE log, power
    and 3-parameter log, 8 heads each, with the official code's random draws (seeds 0-5) and
    the mean init, and the terms table's cases."""
    out = {}
    for seed in range(6):
        for name, cls in (("log", P.KerpleLog), ("power", P.KerplePower), ("log3", P.KerpleLog3)):
            out[f"KERPLE {name}, random draw {seed}"] = cls(8, init="random", seed=seed)
    out.update({f"KERPLE {name}, mean init": cls(8) for name, cls in
                (("log", P.KerpleLog), ("power", P.KerplePower), ("log3", P.KerpleLog3))})
    return {**{k: v.double() for k, v in out.items()}, **term_cases()}


def grids_table(grids: list[tuple[float, float]]) -> tuple[list[dict], str]:
    """The terms each rate grid (`soe.RATE_LO`, `soe.RATE_HI`) takes over `grid_cases()` at
    `GRID_LENGTHS`: the sum over the cases (a refused case counts none) and the refusals."""
    from fastrpe.ops.linear import soe

    cases = grid_cases()
    rows = []
    before = soe.RATE_LO, soe.RATE_HI
    try:
        for L in GRID_LENGTHS:
            bs = {n: causal_log_coefficients(p, soe_fit_length(L)).detach() for n, p in cases.items()}
            for lo, hi in grids:
                soe.RATE_LO, soe.RATE_HI = lo, hi
                for name, b in bs.items():
                    K, err = fewest_terms(b)  # a frozen term's verdict; K None where it is a refusal
                    rows.append({"grid": [lo, hi], "L": L, "case": name,
                                 "terms": K if err <= SOE_MAX_WEIGHT_ERROR else None, "weight_error": err})
                got = [r for r in rows if r["grid"] == [lo, hi] and r["L"] == L]
                print(f"grid W*{lo:g} .. {hi:g}*reach  L={L:7d}: {sum(r['terms'] or 0 for r in got)} terms, "
                      f"{sum(r['terms'] is None for r in got)} refused", flush=True)
    finally:
        soe.RATE_LO, soe.RATE_HI = before
    head = ["rates' time scales"] + [f"terms @ {L:,} (refused)" for L in GRID_LENGTHS] + ["terms in all"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lo, hi in grids:
        got = [r for r in rows if r["grid"] == [lo, hi]]
        cells = [f"W·{lo:g} to {hi:g}× the reach" + (" (now)" if (lo, hi) == before else "")]
        for L in GRID_LENGTHS:
            at = [r for r in got if r["L"] == L]
            cells.append(f"{sum(r['terms'] or 0 for r in at)} ({sum(r['terms'] is None for r in at)})")
        cells.append(str(sum(r["terms"] or 0 for r in got)))
        out.append("| " + " | ".join(cells) + " |")
    return rows, f"{len(cases)} terms per length\n\n" + "\n".join(out)


def free_rates(L: int = 65536, counts=(8, 9, 10, 11, 12), steps: int = 300) -> tuple[list[dict], str]:
    """How far the grid is from the best rates: for the GPU bench's two KERPLE terms, the K-1
    time scales optimized freely (Adam on their logs from the grid's, `steps` steps, on a
    smooth maximum of the heads' weight errors; the weights fitted as the backend fits them)
    against the grid's, per number of terms. Seconds per K at 64k."""
    names = list(term_cases())[:2]
    rows = []
    for name in names:
        b = causal_log_coefficients(term_cases()[name], soe_fit_length(L)).detach()
        c = torch.exp(b - b.amax(-1, keepdim=True))
        for K in counts:
            grid = soe_plan(b, num_terms=K)
            err_grid = float(soe_weight_error(b, grid).max())
            log_tau = torch.log(-1.0 / torch.log(grid.gamma[:-1])).requires_grad_(True)
            opt = torch.optim.Adam([log_tau], lr=0.05)
            best = err_grid
            for _ in range(steps):
                gamma = torch.cat([torch.exp(-1.0 / log_tau.exp()), torch.ones(1, dtype=torch.float64)])
                per_head = weight_error_of(c, soe_plan(b, num_terms=K, gamma=gamma))
                best = min(best, float(per_head.detach().max()))
                loss = torch.logsumexp(per_head * 1e5, 0) / 1e5
                opt.zero_grad()
                loss.backward()
                opt.step()
            rows.append({"case": name, "L": L, "terms": K, "weight_error_grid": err_grid, "weight_error_free": best})
            print(f"{name[:40]:40s} K={K:2d}: grid {err_grid:.1e}, free rates {best:.1e}", flush=True)
    head = ["term", *(f"K = {K}: grid / free" for K in counts)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        at = {r["terms"]: r for r in rows if r["case"] == name}
        out.append("| " + " | ".join([name] + [f"{at[K]['weight_error_grid']:.1e} / {at[K]['weight_error_free']:.1e}"
                                                for K in counts]) + " |")
    return rows, "\n".join(out)


def terms_table() -> tuple[list[dict], str]:
    """`soe_terms` (the exponentials the backend takes, and that fit's weight error) per term
    and length, with a markdown table."""
    from fastrpe.ops.linear.soe import TRAINING_HEADROOM

    rows = []
    for name, pos in term_cases().items():
        for L in TERM_LENGTHS:
            for training in (False, True):
                if training:  # the verdict a term in training on a GPU keeps for its next steps
                    K, err = fewest_terms(causal_log_coefficients(pos, soe_fit_length(L)),
                                          SOE_MAX_WEIGHT_ERROR * TRAINING_HEADROOM)
                else:
                    with torch.no_grad():
                        K, err = soe_terms(pos, L)
                rows.append({"case": name, "L": L, "training_on_gpu": training, "terms": K, "weight_error": err,
                             "backend_accepts": err <= SOE_MAX_WEIGHT_ERROR})
    head = ["term"] + [f"{'in training on a GPU' if t else 'frozen'} @ {L:,}" for L in TERM_LENGTHS
                       for t in (False, True)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in term_cases():
        rs = {(r["L"], r["training_on_gpu"]): r for r in rows if r["case"] == name}
        out.append("| " + " | ".join([name] + [f"{rs[L, t]['terms']} ({rs[L, t]['weight_error']:.1e})"
                                                + ("" if rs[L, t]["backend_accepts"] else ", refused")
                                                for L in TERM_LENGTHS for t in (False, True)]) + " |")
    return rows, "\n".join(out)


def _soe_unchecked(q, k, v, kern, plan):
    """The `soe` op without the backend's fit check: causal kernelized attention."""
    from fastrpe.ops.common import safe_divide
    from fastrpe.ops.linear.soe import kernelized_num_den_soe

    phi_q, phi_k = kern(q, is_query=True), kern(k, is_query=False)
    num, den, _ = kernelized_num_den_soe(phi_q, phi_k, v, plan=plan)
    return safe_divide(num, den)


def measure(name: str, pos, L: int, grad: bool, D: int, F: int) -> dict:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, L, D, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(3))
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F).double()
    fit_len = soe_fit_length(L)
    b = causal_log_coefficients(pos, fit_len)
    with torch.no_grad():  # what the backend takes for a frozen term, the tightest fit it accepts
        K = soe_terms(pos, L)[0]  # (the most of TERM_CHOICES where none passes)
    plan = soe_plan(b.detach(), num_terms=K)
    fit, weight = soe_fit_error(b, num_terms=K), float(soe_weight_error(b, plan).max())
    t0 = time.perf_counter()
    with torch.set_grad_enabled(grad):
        ref = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="dense")
        # the op itself: the backend refuses terms it fits badly (the point of this table)
        out = _soe_unchecked(q, k, v, kern, soe_plan(b, num_terms=K))  # differentiable in the term
    diff = out - ref
    row = {"case": name, "L": L, "terms": K, "fit_error": fit, "weight_error": weight,
           "backend_accepts": weight <= SOE_MAX_WEIGHT_ERROR,
           "output_max_row_rel": float((diff.norm(dim=-1) / ref.norm(dim=-1)).max()),
           "output_rel": float(diff.norm() / ref.norm())}
    if grad:
        params = [q, k, v, *pos.parameters()]
        u = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        g_ref = torch.autograd.grad((ref * u).sum(), params)
        g_out = torch.autograd.grad((out * u).sum(), params)
        names = ["q", "k", "v"] + [n for n, _ in pos.named_parameters()]
        row["grad_rel"] = {n: float((a - b).norm() / b.norm()) if b.norm() > 0 else 0.0
                           for n, a, b in zip(names, g_out, g_ref)}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def markdown(rows: list[dict], lengths: list[int]) -> str:
    head = (["case", "terms @ " + ", ".join(f"{L:,}" for L in lengths), "fit error", "weight error", "soe accepts"]
            + [f"output, worst row @ {L}" for L in lengths] + ["grad (worst of q, k, v, params)"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(r["case"] for r in rows):
        rs = {r["L"]: r for r in rows if r["case"] == name}
        fit = max(r["fit_error"] for r in rs.values())
        grads = [max(r["grad_rel"].values()) for r in rs.values() if "grad_rel" in r]
        weight = max(r["weight_error"] for r in rs.values())
        cells = [name, ", ".join(str(rs[L]["terms"]) if L in rs else "—" for L in lengths), f"{fit:.1e}", f"{weight:.1e}", "yes" if all(r["backend_accepts"] for r in rs.values()) else "no"] + [f"{rs[L]['output_max_row_rel']:.1e}" if L in rs else "—" for L in lengths]
        cells.append(f"{max(grads):.1e}" if grads else "—")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _meta(argv) -> dict:
    """The command, machine and band width every JSON of this script records."""
    return {"command": "python benchmarks/soe_accuracy.py " + " ".join(argv if argv is not None else os.sys.argv[1:]),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
            "window": DEFAULT_WINDOW}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--grad-max-length", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--terms-only", action="store_true",
                    help="print the terms table alone (seconds; no attention run, nothing written): run it "
                         "with PYTHONPATH=<an older checkout>/src to see an older fit's choices")
    ap.add_argument("--grids", default=None, metavar="LO:HI,...",
                    help="compare rate grids instead (soe.RATE_LO:RATE_HI pairs; the current grid is added): the "
                         "terms each takes over grid_cases() at 4k-256k, and the free rates' errors at 64k; writes "
                         "soe_grids.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.terms_only:
        print(terms_table()[1])
        return
    if args.grids is not None:
        from fastrpe.ops.linear import soe

        grids = [(soe.RATE_LO, soe.RATE_HI)]
        grids += [g for g in (tuple(float(x) for x in p.split(":")) for p in args.grids.split(",") if p) if g not in grids]
        rows, table = grids_table(grids)
        free, free_table = free_rates()
        print(table + "\n\n" + free_table)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {**_meta(argv), "terms": f"the fewest of {TERM_CHOICES} within {SOE_MAX_WEIGHT_ERROR:g} (frozen)",
                "lengths": list(GRID_LENGTHS), "rows": rows, "markdown": table, "free_rates": free,
                "free_markdown": free_table}
        (out / "soe_grids.json").write_text(json.dumps(meta, indent=1))
        print(f"wrote {out / 'soe_grids.json'}")
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for name, pos in cases().items():
        for L in lengths:
            r = measure(name, pos, L, L <= args.grad_max_length, args.dim, args.features)
            rows.append(r)
            print(f"{name:36s} L={L:6d} K={r['terms']:2d} fit {r['fit_error']:.1e}  weight {r['weight_error']:.1e}  worst row {r['output_max_row_rel']:.1e}  "
                  f"tensor {r['output_rel']:.1e}" + (f"  grad {max(r['grad_rel'].values()):.1e}" if "grad_rel" in r else ""),
                  flush=True)
    table = markdown(rows, lengths)
    print(table)
    term_rows, term_table = terms_table()
    print(term_table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**_meta(argv), "terms": f"soe_terms: the fewest of {TERM_CHOICES} within {SOE_MAX_WEIGHT_ERROR:g}", "fit_length_min": SOE_FIT_LENGTH,
            "dim": args.dim, "features": args.features, "kernel": "nprf", "dtype": "float64", "rows": rows,
            "markdown": table, "term_rows": term_rows, "term_markdown": term_table}
    (out / "soe_accuracy.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out / 'soe_accuracy.json'}")


if __name__ == "__main__":
    main()
