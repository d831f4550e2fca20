"""Luo et al. (NeurIPS 2021), Figure 3(a): sensitivity of NPRF + RPE to the feature dimension.

The paper trains NPRF-Transformers with RPE (a learned `b[j - i]`) from scratch on WMT14
En-De with feature dimensions m ∈ {8, 16, 32, 64} and reports that "the feature map
dimension is not sensitive regarding the final performance. Setting the dimensionality to
16 is even a slightly better choice." Here: the small causal byte-level LM of `fastrpe
extrapolate` (trained through `fastrpe.train`, `reproduce.lm.train_lm`) with NPRF attention
and a learned relative table (`--position learned`, Luo's b[j - i]; `kerple_log` also works)
for each m, over several seeds; seed s gives every m the same initialization and batches
(paired). Reported: validation loss (nats/byte) mean ± std over seeds per m, and each m's
paired difference from the best m.
"""
from __future__ import annotations

import math

from .._validate import FastRPEError
from .lm import add_model_arguments, eval_nll, train_lm

FEATURES = (8, 16, 32, 64)


def add_arguments(p) -> None:
    p.add_argument("--features", default=",".join(map(str, FEATURES)), help="feature dimensions m")
    p.add_argument("--position", default="learned", help="relative term: learned (Luo's b[j-i]) or kerple_log")
    p.add_argument("--seeds", type=int, default=None, help="runs per m (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 600, quick 150)")
    p.add_argument("--train-length", type=int, default=None, help="default 64 (quick 32)")
    add_model_arguments(p)
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 4e6, quick 1e6)")
    p.add_argument("--eval-tokens", type=int, default=8192)


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def run(args, out_dir) -> dict:
    from ..data.text import load_corpus
    from ..nn import LMConfig
    from .extrapolation import paired_t_test

    if args.position not in ("learned", "kerple_log"):
        raise FastRPEError(f"luo-fig3a: --position must be learned or kerple_log, got {args.position!r}")
    feats = [int(m) for m in args.features.split(",") if m.strip()]
    seeds = args.seeds or (2 if args.quick else 3)
    steps = args.steps or (150 if args.quick else 600)
    L = args.train_length or (32 if args.quick else 64)
    corpus = load_corpus("python-stdlib", max_bytes=args.max_bytes or (1_000_000 if args.quick else 4_000_000))
    runs = []
    for m in feats:
        for s in range(seeds):
            seed = args.seed + s
            cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, kernel="nprf", position=args.position, max_len=max(1024, L),
                           num_features=m, feature_seed=seed)
            r = train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                         device=args.device, desc=f"m={m:3d} seed {seed}")
            val = float("nan")
            if not r.diverged:
                total, count = eval_nll(r.model, corpus.validation, L, args.eval_tokens, args.batch_size, args.device)
                val = total / max(count, 1)
            runs.append({"features": m, "seed": seed, "diverged": r.diverged, "val_loss": val,
                         "final_train_loss": r.losses[-1], "seconds": round(r.seconds, 2)})
    summary = {}
    for m in feats:
        vals = [r["val_loss"] for r in runs if r["features"] == m and math.isfinite(r["val_loss"])]
        mu, sd = mean_std(vals) if vals else (float("nan"), float("nan"))
        summary[str(m)] = {"val_loss_mean": mu, "val_loss_std": sd, "runs": len(vals)}
    finite = {m: s["val_loss_mean"] for m, s in summary.items() if math.isfinite(s["val_loss_mean"])}
    best = min(finite, key=finite.get) if finite else None
    for m, s in summary.items():
        if best is None or m == best:
            s["diff_vs_best"], s["p_vs_best"] = (0.0 if m == best else None), None
            continue
        by = {r["seed"]: r["val_loss"] for r in runs if str(r["features"]) == m}
        bb = {r["seed"]: r["val_loss"] for r in runs if str(r["features"]) == best}
        common = sorted(set(by) & set(bb))
        t = paired_t_test([by[x] for x in common], [bb[x] for x in common])
        s["diff_vs_best"], s["p_vs_best"] = t["mean_diff"], t["p"]
    spread = (max(finite.values()) - min(finite.values())) if finite else None
    for m, s in summary.items():
        print(f"m={m:>3s}: val loss {s['val_loss_mean']:.4f} ± {s['val_loss_std']:.4f} nats/byte"
              + (f"  (+{s['diff_vs_best']:.4f} vs best m={best}, p={s['p_vs_best']:.3g})"
                 if s.get("p_vs_best") is not None else ""))
    result = {"experiment": "luo-fig3a", "position": args.position, "kernel": "nprf", "features": feats,
              "seeds": [args.seed + s for s in range(seeds)], "steps": steps, "train_length": L, "lr": args.lr,
              "batch_size": args.batch_size, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
              "best_features": None if best is None else int(best), "spread_of_means": spread,
              "summary": summary, "runs": runs}
    _plot(result, out_dir / "luo-fig3a.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    feats = result["features"]
    mu = [result["summary"][str(m)]["val_loss_mean"] for m in feats]
    sd = [result["summary"][str(m)]["val_loss_std"] for m in feats]
    ax.errorbar(feats, mu, yerr=sd, marker="o", capsize=3)
    for r in result["runs"]:
        ax.plot(r["features"], r["val_loss"], ".", color="gray", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks(feats, [str(m) for m in feats])
    ax.set_xlabel("feature dimension m")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"Luo Fig. 3(a): NPRF + {result['position']}, {len(result['seeds'])} seeds, "
                 f"{result['steps']} steps", fontsize=9)
    save(fig, path)
