"""`fastrpe bench`: competitors side by side on a suite of problems; JSON + log-log plot."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def add_parser(sub) -> argparse.ArgumentParser:
    from ..bench import SUITES, competitor_names

    p = sub.add_parser("bench", help="time fastrpe against FlexAttention/SDPA on a suite of problems")
    p.add_argument("--suite", default="quick", choices=sorted(SUITES))
    p.add_argument("--competitors", default=",".join(competitor_names()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--out", default="runs/bench")
    from ..bench.gpu import add_arguments

    add_arguments(p)  # --suite gpu: issue 12's GPU comparison (fastrpe.bench.gpu)
    return p


def run(args) -> int:
    from dataclasses import replace

    if args.suite == "gpu":
        from ..bench.gpu import run_cli

        return run_cli(args)

    from .._validate import FastRPEError, check_device
    from ..bench import SUITES, competitor_names, run_suite
    from ..bench.runner import plot, ratios

    check_device(args.device, "--device")
    if args.repeats < 1:
        raise FastRPEError(f"--repeats: must be >= 1, got {args.repeats}")
    chosen = [c for c in args.competitors.split(",") if c]
    unknown = [c for c in chosen if c not in competitor_names()]
    if unknown or not chosen:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "none given"
        raise FastRPEError(f"--competitors: {what}; known: {', '.join(competitor_names())}")

    problems = SUITES[args.suite]
    if args.forward_only:
        problems = [replace(p, backward=False) for p in problems]
    res = run_suite(problems, chosen, device=args.device, dtype=args.dtype,
                    repeats=args.repeats)
    res["ratios"] = ratios(res)
    res["command"] = "fastrpe bench " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                 if k not in ("_module", "command"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}.json").write_text(json.dumps(res, indent=2))
    png = plot(res, out / f"{args.suite}.png")
    print(f"wrote {out / (args.suite + '.json')}" + (f" and {png}" if png else ""))
    return 0
