"""Luo et al. (NeurIPS 2021) §3.3: training stability of PRF, PRF + RPE and NPRF + RPE.

The paper reports that kernelized attention with positive random features (PRF) and a
relative positional encoding is unstable to train — runs diverge or stall — because
unnormalized queries and keys give random-feature estimates of huge variance, and that
l2-normalizing q and k first (NPRF) makes it train as reliably as softmax.

Setting: the small causal byte-level LM of `fastrpe extrapolate` trained from scratch on
the embedded Python-stdlib corpus with each configuration over several seeds (the same
seed gives the same initialization and batches for every configuration). A run
*diverged* if its loss became non-finite; it *stalled* if its final validation loss is
not below the unigram cross-entropy of the validation text (it learned no more than byte
frequencies); otherwise it is ok.
"""
from __future__ import annotations

import math

import torch

from .._validate import FastRPEError
from .lm import add_model_arguments, eval_nll, train_lm

CONFIGS = {  # label: (kernel, position)
    "PRF": ("prf", "none"),
    "PRF + RPE": ("prf", "kerple_log"),
    "NPRF + RPE": ("nprf", "kerple_log"),
    "softmax + RPE": ("softmax", "kerple_log"),
}


def add_arguments(p) -> None:
    p.add_argument("--seeds", type=int, default=None, help="runs per configuration (default 5, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 1500, quick 300)")
    p.add_argument("--train-length", type=int, default=64)
    add_model_arguments(p)
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 8e6, quick 1e6)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))


def unigram_nll(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of `val` under `train`'s add-one token frequencies."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[val].mean())


def _subsample(xs: list[float], n: int = 200) -> list[list[float]]:
    step = max(1, math.ceil(len(xs) / n))
    return [[i, xs[i]] for i in range(0, len(xs), step)] + ([[len(xs) - 1, xs[-1]]] if (len(xs) - 1) % step else [])


def run(args, out_dir) -> dict:
    from ..data.text import load_corpus
    from ..nn import LMConfig

    seeds = args.seeds or (3 if args.quick else 5)
    steps = args.steps or (300 if args.quick else 1500)
    max_bytes = args.max_bytes or (1_000_000 if args.quick else 8_000_000)
    labels = [c for c in args.configs.split(",") if c]
    unknown = [c for c in labels if c not in CONFIGS]
    if unknown:
        raise FastRPEError(f"stability: unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    corpus = load_corpus("python-stdlib", max_bytes=max_bytes)
    L = args.train_length
    floor = unigram_nll(corpus.train, corpus.validation, corpus.vocab_size)
    runs = []
    for label in labels:
        kernel, position = CONFIGS[label]
        for s in range(seeds):
            seed = args.seed + s
            cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers,
                           n_heads=args.heads, kernel=kernel, position=position, max_len=max(4096, L))
            r = train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr,
                         seed=seed, device=args.device, desc=f"{label:>13s} seed {seed}")
            val = float("nan")
            if not r.diverged:
                total, count = eval_nll(r.model, corpus.validation, L, args.eval_tokens, args.batch_size, args.device)
                val = total / max(count, 1)
            status = "diverged" if r.diverged or not math.isfinite(val) else ("stalled" if val >= floor else "ok")
            runs.append({"config": label, "kernel": kernel, "position": position, "seed": seed, "status": status,
                         "steps_run": len(r.losses), "final_train_loss": r.losses[-1], "val_loss": val,
                         "seconds": round(r.seconds, 2), "curve": _subsample(r.losses)})
    summary = {}
    for label in labels:
        rs = [r for r in runs if r["config"] == label]
        ok = [r["val_loss"] for r in rs if r["status"] == "ok"]
        mean = sum(ok) / len(ok) if ok else float("nan")
        std = (sum((x - mean) ** 2 for x in ok) / max(1, len(ok) - 1)) ** 0.5 if len(ok) > 1 else 0.0
        summary[label] = {"runs": len(rs), "diverged": sum(r["status"] == "diverged" for r in rs),
                          "stalled": sum(r["status"] == "stalled" for r in rs), "ok": len(ok),
                          "val_loss_mean": mean, "val_loss_std": std}
    for label, s in summary.items():
        print(f"{label:>13s}: {s['ok']}/{s['runs']} ok, {s['diverged']} diverged, {s['stalled']} stalled; "
              f"val loss {s['val_loss_mean']:.3f} ± {s['val_loss_std']:.3f} nats/byte")
    result = {"experiment": "stability", "train_length": L, "steps": steps, "seeds": seeds, "lr": args.lr,
              "batch_size": args.batch_size, "d_model": args.d_model, "layers": args.layers, "heads": args.heads,
              "unigram_val_loss": floor, "summary": summary, "runs": runs}
    _plot(result, labels, out_dir / "stability.png")
    return result


def _plot(result: dict, labels: list[str], path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(labels), figsize=(3.6 * len(labels), 3.4), squeeze=False, sharey=True)
    for ax, label in zip(axes[0], labels):
        for r in result["runs"]:
            if r["config"] == label:
                xs, ys = zip(*r["curve"])
                style = {"ok": "-", "stalled": "--", "diverged": ":"}[r["status"]]
                ax.plot(xs, ys, style, lw=1, label=f"seed {r['seed']} ({r['status']})")
        ax.axhline(result["unigram_val_loss"], color="gray", lw=0.8, ls=":")
        s = result["summary"][label]
        ax.set_title(f"{label}: {s['ok']}/{s['runs']} ok", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("train loss (nats/byte); dotted: unigram")
    save(fig, path)
