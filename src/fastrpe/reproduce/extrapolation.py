"""KERPLE (NeurIPS 2022) Table 3: perplexity from L to 16L with KERPLE, ALiBi, T5, sinusoidal, rotary.

Chi, Fan, Ramadge and Rudnicky, "KERPLE: Kernelized Relative Positional Embedding for
Length Extrapolation" (NeurIPS 2022). The claim tested: a causal LM trained at length L
with a KERPLE bias (log variant `-r1·log(1+r2·|r|)`, power variant `-r1·|r|^r2`) keeps its
perplexity when evaluated on longer sequences, the log variant best of all; ALiBi and T5
also extrapolate but less well; sinusoidal and rotary positions blow up past L. In the
paper (GPT-NeoX small, L = 512, evaluated up to 32L on OpenWebText2 / GitHub / ArXiv, five
seeds) the best method per length is marked when it is significantly better than the others.

Setting here: the small causal byte-level LM of `fastrpe extrapolate` (d_model 64, 2 layers,
4 heads by default) trained on the embedded Python-stdlib corpus at length L with each
positional encoding (kernel softmax by default; `--kernels softmax,nprf` adds NPRF
kernelized attention), over several seeds. Seed s gives the same initialization and the
same training batches for every configuration, so runs are paired by seed. Perplexity is
measured at L, 2L, 4L, 8L, 16L on non-overlapping validation windows (every token scored
once, as in KERPLE), on roughly the same `--eval-tokens` validation tokens at every length.

Significance: for each kernel and evaluation length the best configuration is the one with
the lowest mean log-perplexity over seeds; it is compared with every other configuration by
a paired two-sided Student t-test over seeds on per-seed log-perplexity (mean negative
log-likelihood in nats/token), pairs being runs with the same seed. The official code
(github chijames/KERPLE: generate_ymls.py, test.sh) confirms five seeds and the evaluation
lengths 512 … 16384; the exact test named in the paper's Table 3 caption could not be
confirmed from the sources at hand, so this paired t-test is our choice. There is no
correction for multiple comparisons. With `--quick` (2 seeds, df = 1) a difference is
significant at 0.05 only if |t| > 12.7: the quick run is a smoke test, not evidence.
"""
from __future__ import annotations

import math

from .._validate import FastRPEError
from .lm import add_model_arguments, eval_nll, train_lm

DEFAULT_POSITIONS = ["kerple_log", "kerple_power", "alibi", "t5", "sinusoidal", "rotary"]


def add_arguments(p) -> None:
    p.add_argument("--seeds", type=int, default=None, help="runs per configuration (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 800, quick 150)")
    p.add_argument("--train-length", "-L", type=int, default=None, help="training length L (default 64, quick 32)")
    p.add_argument("--factors", default="1,2,4,8,16", help="evaluation lengths as multiples of L")
    p.add_argument("--positions", default=",".join(DEFAULT_POSITIONS), help="comma-separated position names")
    p.add_argument("--kernels", default="softmax", help="comma-separated kernels, e.g. softmax,nprf")
    add_model_arguments(p)
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="validation tokens scored at each length (default 16384, quick 4096)")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 8e6, quick 1e6)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the paired test")


# ---------------------------------------------------------------------------------------
# Student t-test, in plain Python (scipy is not a base dependency)


def _beta_continued_fraction(a: float, b: float, x: float, eps: float = 1e-15, max_iter: int = 1000) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz evaluation);
    converges fast for `x < (a + 1) / (a + b + 2)`."""
    tiny = 1e-300

    def guard(v: float) -> float:
        return tiny if abs(v) < tiny else v

    c, d = 1.0, 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, max_iter + 1):
        # even step, then odd step of the fraction's coefficients
        num = m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        d = 1.0 / guard(1.0 + num * d)
        c = guard(1.0 + num / c)
        h *= d * c
        num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))
        d = 1.0 / guard(1.0 + num * d)
        c = guard(1.0 + num / c)
        h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function `I_x(a, b)` for `a, b > 0`, `0 <= x <= 1`."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: need a, b > 0, got a={a}, b={b}")
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    # the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast regime
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """Two-sided p-value `P(|T| >= |t|)` of Student's t with `df` degrees of freedom."""
    if df <= 0 or math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 0.0
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t * t)))


def paired_t_test(x: list[float], y: list[float]) -> dict:
    """Paired two-sided t-test of `mean(x - y) = 0`.

    Returns `{"t", "df", "p", "mean_diff", "n"}`; `t` and `p` are None with fewer than two
    pairs. Differences all equal: `p = 1` if they are zero, else `p = 0` (`t = ±inf`).
    """
    if len(x) != len(y):
        raise ValueError(f"paired_t_test: samples of different sizes {len(x)} and {len(y)}")
    d = [a - b for a, b in zip(x, y)]
    n = len(d)
    if n < 2:
        return {"t": None, "df": max(n - 1, 0), "p": None, "mean_diff": d[0] if d else None, "n": n}
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    if sd == 0.0:
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / (sd / math.sqrt(n))
    return {"t": t, "df": n - 1, "p": t_two_sided_p(t, n - 1), "mean_diff": mean, "n": n}


# ---------------------------------------------------------------------------------------
# the experiment


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def _json_number(v):
    return v if v is None or math.isfinite(v) else None


def summarize(runs: list[dict], kernels: list[str], positions: list[str], lengths: list[int], alpha: float) -> dict:
    """Per kernel and evaluation length: each configuration's perplexity over seeds, the best
    configuration (lowest mean log-perplexity) and its paired test against every other.

    `runs[i]["nll"][str(length)]` is the mean NLL (nats/token = log-perplexity) of one seed,
    None if that run diverged. Only seeds finite for both configurations enter a test.
    """
    out = {}
    for kernel in kernels:
        out[kernel] = {}
        for n in lengths:
            key = str(n)
            per = {}  # position -> {seed: log-ppl}
            for pos in positions:
                per[pos] = {r["seed"]: r["nll"][key] for r in runs if r["kernel"] == kernel and r["position"] == pos
                            and r["nll"].get(key) is not None and math.isfinite(r["nll"][key])}
            configs = {}
            for pos in positions:
                vals = list(per[pos].values())
                if vals:
                    ppl_mean, ppl_std = _mean_std([math.exp(v) for v in vals])
                    log_mean = sum(vals) / len(vals)
                else:
                    ppl_mean = ppl_std = log_mean = None
                configs[pos] = {"ppl_mean": ppl_mean, "ppl_std": ppl_std, "log_ppl_mean": log_mean, "seeds": len(vals)}
            ranked = [p for p in positions if configs[p]["log_ppl_mean"] is not None]
            best = min(ranked, key=lambda p: configs[p]["log_ppl_mean"]) if ranked else None
            for pos in positions:
                c = configs[pos]
                c.update({"t_vs_best": None, "p_vs_best": None, "best_significantly_better": False})
                if best is None or pos == best or c["log_ppl_mean"] is None:
                    continue
                seeds = sorted(set(per[best]) & set(per[pos]))
                test = paired_t_test([per[best][s] for s in seeds], [per[pos][s] for s in seeds])
                c["t_vs_best"], c["p_vs_best"] = _json_number(test["t"]), test["p"]
                c["best_significantly_better"] = test["p"] is not None and test["p"] < alpha and test["mean_diff"] < 0
            out[kernel][key] = {"best": best, "configs": configs}
    return out


def format_tables(summary: dict, positions: list[str], lengths: list[int], L: int, alpha: float) -> str:
    """Markdown: per kernel, mean ± std perplexity per length, then the best's p-values."""
    parts = []
    for kernel, by_len in summary.items():
        head = "| position | " + " | ".join(f"ppl@{n} ({n // L}L)" for n in lengths) + " |"
        sep = "|---|" + "---|" * len(lengths)
        rows, prow = [], []
        for pos in positions:
            cells, pcells = [], []
            for n in lengths:
                s = by_len[str(n)]
                c = s["configs"][pos]
                if c["ppl_mean"] is None:
                    cells.append("diverged")
                    pcells.append("—")
                    continue
                mark = " *" if s["best"] == pos else (" †" if c["best_significantly_better"] else "")
                cells.append(f"{c['ppl_mean']:.3f} ± {c['ppl_std']:.3f}{mark}")
                p = c["p_vs_best"]
                pcells.append("best" if s["best"] == pos else ("n/a" if p is None else f"{p:.3g}"))
            rows.append(f"| {pos} | " + " | ".join(cells) + " |")
            prow.append(f"| {pos} | " + " | ".join(pcells) + " |")
        parts += [f"kernel {kernel}: perplexity (bytes), mean ± std over seeds; * best (lowest mean log-ppl), "
                  f"† best is significantly better (paired two-sided t-test, p < {alpha})", head, sep, *rows, "",
                  f"kernel {kernel}: p-value of the best against each configuration", head.replace("ppl@", "p@"), sep,
                  *prow, ""]
    return "\n".join(parts).rstrip()


def run(args, out_dir) -> dict:
    from ..data.text import load_corpus
    from ..kernels import get_kernel
    from ..nn import LMConfig
    from ..nn.block import POSITION_NAMES

    seeds = args.seeds or (2 if args.quick else 3)
    steps = args.steps or (150 if args.quick else 800)
    L = args.train_length or (32 if args.quick else 64)
    eval_tokens = args.eval_tokens or (4096 if args.quick else 16384)
    max_bytes = args.max_bytes or (1_000_000 if args.quick else 8_000_000)
    factors = [int(f) for f in args.factors.split(",") if f]
    positions = [s for s in args.positions.split(",") if s]
    kernels = [s for s in args.kernels.split(",") if s]
    known_pos = POSITION_NAMES  # none, sinusoidal, rotary, shaw and every positions family
    if any(p not in known_pos for p in positions):
        raise FastRPEError(f"extrapolation: unknown position(s) {[p for p in positions if p not in known_pos]}; "
                         f"known: {', '.join(known_pos)}")
    for k in kernels:
        try:
            get_kernel(k, head_dim=max(1, args.d_model // args.heads))
        except ValueError as e:
            raise FastRPEError(f"extrapolation: {e}") from None
    lengths = [f * L for f in factors]
    corpus = load_corpus("python-stdlib", max_bytes=max_bytes)
    runs = []
    for kernel in kernels:
        for position in positions:
            for s in range(seeds):
                seed = args.seed + s
                cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers,
                               n_heads=args.heads, kernel=kernel, position=position, max_len=max(lengths + [L]))
                r = train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr,
                             seed=seed, device=args.device, desc=f"{kernel:>7s} {position:<13s} seed {seed}")
                nll = {}
                for f, n in zip(factors, lengths):
                    if r.diverged:
                        nll[str(n)] = None
                        continue
                    total, count = eval_nll(r.model, corpus.validation, n, eval_tokens,
                                            max(1, args.batch_size // f), args.device)
                    nll[str(n)] = _json_number(total / max(count, 1))
                runs.append({"kernel": kernel, "position": position, "seed": seed, "diverged": r.diverged,
                             "train_seconds": round(r.seconds, 2), "final_train_loss": _json_number(r.losses[-1]),
                             "nll": nll, "ppl": {k: (None if v is None else math.exp(v)) for k, v in nll.items()}})
    summary = summarize(runs, kernels, positions, lengths, args.alpha)
    print(format_tables(summary, positions, lengths, L, args.alpha))
    for kernel, by_len in summary.items():
        print(f"{kernel}: best by length: " + ", ".join(f"{n}: {by_len[str(n)]['best']}" for n in lengths))
    result = {"experiment": "extrapolation", "corpus": "python-stdlib", "max_bytes": max_bytes, "train_length": L,
              "factors": factors, "lengths": lengths, "steps": steps, "seeds": [args.seed + s for s in range(seeds)],
              "kernels": kernels, "positions": positions, "lr": args.lr, "batch_size": args.batch_size,
              "d_model": args.d_model, "layers": args.layers, "heads": args.heads, "eval_tokens": eval_tokens,
              "alpha": args.alpha,
              "test": "paired two-sided Student t-test over seeds on per-seed log-perplexity, best vs each other",
              "summary": summary, "runs": runs}
    _plot(result, out_dir / "extrapolation.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    from matplotlib.ticker import ScalarFormatter

    kernels, lengths, L = result["kernels"], result["lengths"], result["train_length"]
    fig, axes = plt.subplots(1, len(kernels), figsize=(5.5 * len(kernels), 4), squeeze=False, sharey=True)
    for ax, kernel in zip(axes[0], kernels):
        for pos in result["positions"]:
            xs, mean, std, lo, hi = [], [], [], [], []
            for n in lengths:
                vals = [r["ppl"][str(n)] for r in result["runs"] if r["kernel"] == kernel and r["position"] == pos
                        and r["ppl"][str(n)] is not None]
                if vals:
                    m, s = _mean_std(vals)
                    xs.append(n), mean.append(m), std.append(s), lo.append(min(vals)), hi.append(max(vals))
            if not xs:
                continue
            line = ax.errorbar(xs, mean, yerr=std, marker="o", ms=3, capsize=2, lw=1.2, label=pos)
            ax.fill_between(xs, lo, hi, color=line[0].get_color(), alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [f"{n}\n({n // L}L)" for n in lengths])
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.axvline(L, color="gray", ls=":", lw=1)
        ax.set_title(f"{kernel}: trained at L={L}, {len(result['seeds'])} seeds", fontsize=9)
        ax.set_xlabel("evaluation length (tokens)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("perplexity (bytes): mean ± std, band min–max")
    save(fig, path)
