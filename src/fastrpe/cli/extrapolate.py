"""`fastrpe extrapolate`: the main job.

Trains a small causal LM on the embedded corpus at length L for several positional
terms, with softmax and with NPRF kernelized attention, then evaluates perplexity at
L, 2L, 4L, 8L, 16L on non-overlapping validation windows (KERPLE's protocol). Prints
a table and writes JSON and a plot.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from ..reproduce.lm import add_model_arguments

DEFAULT_POSITIONS = ["none", "sinusoidal", "alibi", "t5", "kerple_power", "kerple_log"]
DEFAULT_KERNELS = ["softmax", "nprf"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("extrapolate", help="train small LMs at length L and measure perplexity up to 16L",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", default=",".join(DEFAULT_POSITIONS), help="comma-separated position names")
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS), help="comma-separated kernels")
    p.add_argument("--corpus", default="python-stdlib", help="embedded corpus (see fastrpe.data)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus bytes to read (train + validation)")
    p.add_argument("--train-length", "-L", type=int, default=64)
    p.add_argument("--factors", default="1,2,4,8,16", help="evaluation lengths as multiples of L")
    p.add_argument("--steps", type=int, default=800)
    add_model_arguments(p)
    p.add_argument("--eval-tokens", type=int, default=16384, help="validation tokens scored at each length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/extrapolate", help="directory for results.json and plot.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args) -> int:
    from ..data.text import load_corpus
    from ..nn import LMConfig
    from ..reproduce.lm import eval_ppl, train_lm

    torch.manual_seed(args.seed)
    positions = [s for s in args.positions.split(",") if s]
    kernels = [s for s in args.kernels.split(",") if s]
    factors = [int(f) for f in args.factors.split(",")]
    L = args.train_length
    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    train_stream, val_stream = corpus.train, corpus.validation
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t_all = time.time()
    for kernel in kernels:
        for position in positions:
            cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                           kernel=kernel, position=position, max_len=L * max(factors))
            run = train_lm(cfg, train_stream, length=L, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           seed=args.seed, device=args.device, desc=f"{kernel:>7s} {position:<13s}",
                           progress=not args.no_progress)
            ppl = {f * L: eval_ppl(run.model, val_stream, f * L, args.eval_tokens, max(1, args.batch_size // f),
                                   args.device) for f in factors}
            train_s, last = run.seconds, run.losses[-1]
            results.append({"kernel": kernel, "position": position, "train_seconds": round(train_s, 2),
                            "final_train_loss": last, "ppl": {str(k): v for k, v in ppl.items()}})
    table = format_table(results, L, factors)
    print(table)
    meta = {
        "command": "fastrpe extrapolate " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                     if k not in ("_module", "command")),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, torch {torch.__version__}, device {args.device}",
        "corpus": args.corpus, "train_length": L, "factors": factors, "seconds": round(time.time() - t_all, 1),
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(meta, indent=2))
    (out / "table.md").write_text(table + "\n")
    plot_path = plot(results, L, factors, out / "plot.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {plot_path}" if plot_path else " (no plot: pip install matplotlib)"))
    return 0


def format_table(results: list[dict], L: int, factors: list[int]) -> str:
    head = "| kernel | position | " + " | ".join(f"ppl@{f * L}" for f in factors) + " |"
    sep = "|---|---|" + "---|" * len(factors)
    rows = [f"| {r['kernel']} | {r['position']} | " + " | ".join(f"{r['ppl'][str(f * L)]:.2f}" for f in factors) + " |"
            for r in results]
    return "\n".join([head, sep, *rows])


def plot(results: list[dict], L: int, factors: list[int], path: Path):
    from ..plotting import pyplot

    plt = pyplot()
    if plt is None:
        return None
    kernels = sorted({r["kernel"] for r in results})
    fig, axes = plt.subplots(1, len(kernels), figsize=(5.5 * len(kernels), 4), squeeze=False, sharey=True)
    for ax, kern in zip(axes[0], kernels):
        for r in results:
            if r["kernel"] == kern:
                xs = [f * L for f in factors]
                ax.plot(xs, [r["ppl"][str(x)] for x in xs], marker="o", label=r["position"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axvline(L, color="gray", ls=":", lw=1)
        ax.set_title(f"{kern}: trained at L={L}")
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel("perplexity (bytes)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
