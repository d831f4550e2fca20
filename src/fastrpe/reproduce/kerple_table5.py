"""KERPLE (Chi et al., NeurIPS 2022), Table 5: the complicated kernels (3-parameter log,
bias + weight) against the logarithmic variant.

The paper (§5.3): "these variants do not have clear advantage in extrapolation performance,
e.g., 3-para-log is slightly better in perplexity than the (two-parameter) logarithmic
variant." (GPT-NeoX, L = 512, 50k steps, five seeds; e.g. GitHub at 512: bias+wht
3.44 ± 0.21, 3-para-log 3.40 ± 0.20; at 8192: 2.76 ± 0.03 and 2.68 ± 0.04.)

Setting: the small causal byte-level LM of `fastrpe extrapolate` (softmax attention),
trained through `fastrpe.train` (`reproduce.lm.train_lm`) at length L with
`kerple_log`, `kerple_log3` and `kerple_bias_weight`, over several seeds; seed s gives
every variant the same initialization and batches, so runs are paired. Perplexity on
non-overlapping validation windows at 1, 2, 4, 8 × L; each variant against log by a paired
two-sided t-test over seeds on per-seed log-perplexity (`reproduce.extrapolation`'s test).
With 2 seeds (quick) the test has df = 1 and is a smoke test, not evidence.
"""
from __future__ import annotations

import math

from .lm import add_model_arguments, eval_nll, train_lm

VARIANTS = ("kerple_log", "kerple_log3", "kerple_bias_weight")


def add_arguments(p) -> None:
    p.add_argument("--seeds", type=int, default=None, help="runs per variant (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 600, quick 150)")
    p.add_argument("--train-length", "-L", type=int, default=None, help="default 64 (quick 32)")
    p.add_argument("--factors", default="1,2,4,8", help="evaluation lengths as multiples of L")
    add_model_arguments(p)
    p.add_argument("--eval-tokens", type=int, default=None, help="per length (default 16384, quick 4096)")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 4e6, quick 1e6)")


def run(args, out_dir) -> dict:
    from ..data.text import load_corpus
    from ..nn import LMConfig
    from .extrapolation import _json_number, _mean_std, paired_t_test

    seeds = args.seeds or (2 if args.quick else 3)
    steps = args.steps or (150 if args.quick else 600)
    L = args.train_length or (32 if args.quick else 64)
    eval_tokens = args.eval_tokens or (4096 if args.quick else 16384)
    factors = [int(f) for f in args.factors.split(",") if f.strip()]
    lengths = [f * L for f in factors]
    corpus = load_corpus("python-stdlib", max_bytes=args.max_bytes or (1_000_000 if args.quick else 4_000_000))
    runs = []
    for pos in VARIANTS:
        for s in range(seeds):
            seed = args.seed + s
            cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, kernel="softmax", position=pos, max_len=max(lengths))
            r = train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                         device=args.device, desc=f"{pos:<18s} seed {seed}")
            nll = {}
            for f, n in zip(factors, lengths):
                if r.diverged:
                    nll[str(n)] = None
                    continue
                total, count = eval_nll(r.model, corpus.validation, n, eval_tokens, max(1, args.batch_size // f),
                                        args.device)
                nll[str(n)] = _json_number(total / max(count, 1))
            runs.append({"position": pos, "seed": seed, "diverged": r.diverged, "nll": nll,
                         "train_seconds": round(r.seconds, 2)})
    table = {}
    for pos in VARIANTS:
        table[pos] = {}
        for n in lengths:
            mine = {r["seed"]: r["nll"][str(n)] for r in runs if r["position"] == pos and r["nll"][str(n)] is not None}
            base = {r["seed"]: r["nll"][str(n)] for r in runs
                    if r["position"] == "kerple_log" and r["nll"][str(n)] is not None}
            ppl = [math.exp(v) for v in mine.values()]
            mu, sd = _mean_std(ppl) if ppl else (None, None)
            cell = {"ppl_mean": mu, "ppl_std": sd, "seeds": len(ppl)}
            if pos != "kerple_log":
                common = sorted(set(mine) & set(base))
                t = paired_t_test([mine[x] for x in common], [base[x] for x in common])
                cell.update({"log_ppl_diff_vs_log": t["mean_diff"], "t_vs_log": _json_number(t["t"]) if t["t"]
                             is not None else None, "p_vs_log": t["p"],
                             "wins_vs_log": sum(mine[x] < base[x] for x in common), "pairs": len(common)})
            table[pos][str(n)] = cell
    for pos in VARIANTS:
        cells = []
        for n in lengths:
            c = table[pos][str(n)]
            txt = "diverged" if c["ppl_mean"] is None else f"{c['ppl_mean']:.3f}±{c['ppl_std']:.3f}"
            if c.get("p_vs_log") is not None:
                txt += f" (Δ{c['log_ppl_diff_vs_log']:+.4f}, p={c['p_vs_log']:.2g})"
            cells.append(txt)
        print(f"{pos:18s} " + "  ".join(cells))
    result = {"experiment": "kerple-table5", "corpus": "python-stdlib", "train_length": L, "factors": factors,
              "lengths": lengths, "steps": steps, "seeds": [args.seed + s for s in range(seeds)],
              "variants": list(VARIANTS), "lr": args.lr, "batch_size": args.batch_size, "d_model": args.d_model,
              "layers": args.layers, "heads": args.heads, "eval_tokens": eval_tokens,
              "test": "paired two-sided Student t-test over seeds on per-seed log-perplexity, variant vs kerple_log",
              "table": table, "runs": runs}
    _plot(result, out_dir / "kerple-table5.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    lengths = result["lengths"]
    for pos in result["variants"]:
        cells = [result["table"][pos][str(n)] for n in lengths]
        xs = [n for n, c in zip(lengths, cells) if c["ppl_mean"] is not None]
        ax.errorbar(xs, [c["ppl_mean"] for c in cells if c["ppl_mean"] is not None],
                    yerr=[c["ppl_std"] for c in cells if c["ppl_mean"] is not None], marker="o", capsize=2, label=pos)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.axvline(result["train_length"], color="gray", ls=":", lw=1)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity (bytes), mean ± std over seeds")
    ax.set_title(f"KERPLE Table 5: trained at L = {result['train_length']}, {len(result['seeds'])} seeds", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
