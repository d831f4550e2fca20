"""`fastrpe extrapolate`: the main job.

Trains a small causal LM on the embedded corpus at length L for several positional
terms, with softmax and with NPRF kernelized attention, then evaluates perplexity at
L, 2L, 4L, 8L, 16L on non-overlapping validation windows (KERPLE's protocol). Prints
a table and writes JSON and a plot.

Every model trains through `fastrpe.train` (the stack `fastrpe train` uses). Nothing finished
is lost to an interruption: each row (kernel × position) is written to OUT/rows/ as soon as it
is evaluated, each model's training checkpoints to OUT/train/KERNEL-POSITION/ every
--ckpt-every steps, and a rerun of the same command skips finished rows and resumes the
half-trained one, ending with the numbers an uninterrupted run gives. OUT/settings.json
records the settings the rows belong to; a rerun with other settings is refused (--fresh
discards the old rows and checkpoints).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from .._io import atomic_write
from .._validate import FastRPEError
from ..reproduce.lm import StepBar, add_model_arguments

DEFAULT_POSITIONS = ["none", "sinusoidal", "alibi", "t5", "kerple_power", "kerple_log"]
DEFAULT_KERNELS = ["softmax", "nprf"]
SETTINGS_FILE = "settings.json"
ROWS_DIR = "rows"
TRAIN_DIR = "train"
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


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
    p.add_argument("--out", default="runs/extrapolate",
                   help="directory for results.json, table.md, plot.png, rows/ and train/ (checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=100,
                   help="checkpoint each model's training every this many steps (0: only at the end)")
    p.add_argument("--fresh", action="store_true",
                   help="discard the finished rows and checkpoints in --out instead of continuing them")
    p.add_argument("--no-progress", action="store_true")
    return p


# ---------------------------------------------------------------------------------------
# arguments


def _names(value: str, what: str) -> list[str]:
    items = [s.strip() for s in value.split(",") if s.strip()]
    if not items:
        raise FastRPEError(f"--{what}: expected a comma-separated list of names, got {value!r}")
    if len(set(items)) != len(items):
        raise FastRPEError(f"--{what}: a name appears twice in {value!r}")
    return items


def _factors(value: str) -> list[int]:
    try:
        factors = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise FastRPEError(f"--factors: expected comma-separated positive integers, got {value!r}") from None
    if not factors or min(factors) < 1:
        raise FastRPEError(f"--factors: expected comma-separated positive integers, got {value!r}")
    if len(set(factors)) != len(factors):
        raise FastRPEError(f"--factors: a factor appears twice in {value!r}")
    return factors


def _check_numbers(args) -> None:
    for name, low in (("steps", 1), ("train_length", 2), ("batch_size", 1), ("d_model", 1), ("layers", 1),
                      ("heads", 1), ("eval_tokens", 1), ("max_bytes", 1), ("ckpt_every", 0), ("seed", 0)):
        v = getattr(args, name)
        if v < low:
            raise FastRPEError(f"--{name.replace('_', '-')}: must be >= {low}, got {v}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise FastRPEError(f"--lr: must be a positive number, got {args.lr}")
    if args.d_model % args.heads:
        raise FastRPEError(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise FastRPEError(f"--device: not a device: {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastRPEError(f"--device {args.device}: no CUDA device is available")
    if device.type not in ("cpu", "cuda", "mps"):
        raise FastRPEError(f"--device: expected cpu, cuda or mps, got {args.device!r}")


def _model_config(args, vocab_size: int, kernel: str, position: str, max_len: int):
    from ..nn import LMConfig

    return LMConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                    kernel=kernel, position=position, max_len=max_len)


def _check_models(args, kernels: list[str], positions: list[str], max_len: int) -> None:
    """Build every configuration once (cheap), so that a bad name fails now, in one line."""
    from ..nn import DecoderLM

    def build(kernel, position):
        with torch.random.fork_rng(devices=[]):  # draws nothing from the caller's generator
            DecoderLM(_model_config(args, 259, kernel, position, max_len))

    from ..nn.block import ABSOLUTE, ROTARY
    from ..positions import NAMES

    known = ("none", *ABSOLUTE, *ROTARY, *NAMES)
    for position in positions:
        try:
            build("softmax", position)
        except (ValueError, TypeError, KeyError) as e:
            why = f"unknown name; known: {', '.join(known)}" if position not in known else str(e)
            raise FastRPEError(f"--positions: {position!r}: {why}") from None
    for kernel in kernels:
        try:
            build(kernel, "none")
        except (ValueError, TypeError, KeyError) as e:
            raise FastRPEError(f"--kernels: {kernel!r}: {e}") from None
    for kernel in kernels:
        for position in positions:
            try:
                build(kernel, position)
            except (ValueError, TypeError, KeyError) as e:
                raise FastRPEError(f"--kernels {kernel} with --positions {position}: {e}") from None


# ---------------------------------------------------------------------------------------
# what is on disk


def _settings(args, factors: list[int]) -> dict:
    """Everything a row's numbers depend on (not which rows are asked for)."""
    return {"corpus": args.corpus, "max_bytes": args.max_bytes, "train_length": args.train_length,
            "factors": factors, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "d_model": args.d_model, "layers": args.layers, "heads": args.heads, "eval_tokens": args.eval_tokens,
            "seed": args.seed, "device": str(torch.device(args.device))}


def _write_json(path: Path, obj) -> None:
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def _prepare(out: Path, settings: dict, fresh: bool) -> None:
    """Make `out` hold rows of `settings`: keep what matches, refuse what does not (or discard it)."""
    if out.exists() and not out.is_dir():
        raise FastRPEError(f"--out {out}: exists and is not a directory")
    old_state = [out / ROWS_DIR, out / TRAIN_DIR]
    if fresh:
        for d in old_state:
            if d.is_dir():
                shutil.rmtree(d)
        (out / SETTINGS_FILE).unlink(missing_ok=True)
    path = out / SETTINGS_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FastRPEError(f"--out {out}: {path.name} is not valid JSON; use --fresh to start over") from None
        changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in settings.items() if saved.get(k) != v]
        if changed:
            raise FastRPEError(f"--out {out} holds rows of other settings ({', '.join(changed)}); "
                               "use --fresh to discard them, or another --out")
    elif any(d.is_dir() and any(d.iterdir()) for d in old_state):
        raise FastRPEError(f"--out {out} holds rows or checkpoints without {SETTINGS_FILE}; "
                           "use --fresh to discard them, or another --out")
    (out / ROWS_DIR).mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        _write_json(path, settings)


def _row_name(kernel: str, position: str) -> str:
    return f"{kernel}-{position}"


def _read_row(path: Path, settings: dict) -> dict | None:
    """A finished row, or None if there is none (or only an unreadable one, redone)."""
    try:
        row = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if row.get("settings") == settings else None


# ---------------------------------------------------------------------------------------
# the job


def run(args) -> int:
    from ..data.text import load_corpus

    positions = _names(args.positions, "positions")
    kernels = _names(args.kernels, "kernels")
    factors = _factors(args.factors)
    _check_numbers(args)
    L = args.train_length
    lengths = [f * L for f in factors]
    _check_models(args, kernels, positions, max(lengths))
    try:
        corpus = load_corpus(args.corpus, max_bytes=args.max_bytes)
    except ValueError as e:
        raise FastRPEError(f"--corpus: {e}") from None
    train_stream, val_stream = corpus.train, corpus.validation
    if train_stream.numel() < L + 2:
        raise FastRPEError(f"--max-bytes {args.max_bytes}: the training text has {train_stream.numel()} tokens, "
                           f"too few for windows of {L + 1}")
    if val_stream.numel() < max(lengths) + 1:
        raise FastRPEError(f"--max-bytes {args.max_bytes}: the validation text has {val_stream.numel()} tokens, "
                           f"too few for one window of {max(lengths)} (the longest evaluation length)")

    out = Path(args.out)
    settings = _settings(args, factors)
    _prepare(out, settings, args.fresh)
    configs = [(k, p) for k in kernels for p in positions]
    rows: dict[tuple[str, str], dict] = {}
    for kernel, position in configs:
        row = _read_row(out / ROWS_DIR / f"{_row_name(kernel, position)}.json", settings)
        if row is not None:
            rows[(kernel, position)] = row
    todo = [c for c in configs if c not in rows]
    if rows:
        print(f"{len(rows)} of {len(configs)} rows already finished in {out / ROWS_DIR}; "
              f"{len(todo)} to go", flush=True)

    bar = StepBar(len(todo) * args.steps, "extrapolate") if (todo and not args.no_progress) else None
    t_all = time.time()
    try:
        for kernel, position in todo:
            row = rows[(kernel, position)] = _run_row(args, settings, corpus, kernel, position, lengths, out, bar)
            line = (f"{kernel} {position}: " + ", ".join(f"ppl@{n} {row['ppl'][str(n)]:.2f}" for n in lengths)
                    + f" ({row['train_seconds']:.0f} s training)")
            if bar is not None and bar.bar is not None:
                bar.bar.write(line)
            else:
                print(line, flush=True)
            _write_results(out, args, settings, configs, rows, time.time() - t_all, partial=True)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        done = sum(c in rows for c in configs)
        print(f"fastrpe extrapolate: interrupted; {done} of {len(configs)} rows finished and kept in "
              f"{out / ROWS_DIR}, training checkpointed in {out / TRAIN_DIR}: run the same command again to continue",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if bar is not None:
            bar.close()

    results = [rows[c] for c in configs]
    table = format_table(results, L, factors)
    print(table)
    _write_results(out, args, settings, configs, rows, time.time() - t_all, partial=False)
    atomic_write(out / "table.md", (table + "\n").encode())
    plot_path = plot(results, L, factors, out / "plot.png")
    print(f"\nwrote {out / 'results.json'}" + (f" and {plot_path}" if plot_path else " (no plot: pip install matplotlib)"))
    return 0


def _run_row(args, settings: dict, corpus, kernel: str, position: str, lengths: list[int], out: Path,
             bar: StepBar | None) -> dict:
    """Train (or resume) one configuration, evaluate it, and write its row file."""
    from ..reproduce.lm import eval_ppl, train_lm

    name = _row_name(kernel, position)
    cfg = _model_config(args, corpus.vocab_size, kernel, position, max(lengths))
    if bar is not None:
        bar.start_run(f"{kernel} {position}")
    r = train_lm(cfg, corpus.train, length=args.train_length, steps=args.steps, batch_size=args.batch_size,
                 lr=args.lr, seed=args.seed, device=args.device, progress=False, out_dir=out / TRAIN_DIR / name,
                 ckpt_every=args.ckpt_every, callbacks=[bar] if bar is not None else ())
    if r.diverged:
        raise FastRPEError(f"{kernel} {position}: the training loss became non-finite; try a smaller --lr")
    if bar is not None:
        bar.end_run(args.steps)
    f_of = {n: n // args.train_length for n in lengths}
    ppl = {str(n): eval_ppl(r.model, corpus.validation, n, args.eval_tokens, max(1, args.batch_size // f_of[n]),
                            args.device) for n in lengths}
    row = {"kernel": kernel, "position": position, "train_seconds": round(r.seconds, 2),
           "resumed_from_step": r.resumed_from, "final_train_loss": r.losses[-1] if r.losses else None,
           "ppl": ppl, "settings": settings}
    _write_json(out / ROWS_DIR / f"{name}.json", row)
    return row


def _write_results(out: Path, args, settings: dict, configs, rows: dict, seconds: float, partial: bool) -> None:
    meta = {
        "command": "fastrpe extrapolate " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                     if k not in ("_module", "command")),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
                   f"torch {torch.__version__}, device {args.device}",
        "corpus": args.corpus, "train_length": args.train_length, "factors": settings["factors"],
        "settings": settings, "seconds": round(seconds, 1), "partial": partial,
        "results": [{k: v for k, v in rows[c].items() if k != "settings"} for c in configs if c in rows],
    }
    _write_json(out / "results.json", meta)


def format_table(results: list[dict], L: int, factors: list[int]) -> str:
    head = "| kernel | position | " + " | ".join(f"ppl@{f * L}" for f in factors) + " |"
    sep = "|---|---|" + "---|" * len(factors)
    rows = [f"| {r['kernel']} | {r['position']} | " + " | ".join(f"{r['ppl'][str(f * L)]:.2f}" for f in factors) + " |"
            for r in results]
    return "\n".join([head, sep, *rows])


def plot(results: list[dict], L: int, factors: list[int], path: Path):
    from ..plotting import pyplot, save

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
    save(fig, path)
    return path
