"""`fastrpe reproduce NAME`: the seed papers' claims at small scale (JSON + PNG)."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch


def add_parser(sub) -> argparse.ArgumentParser:
    from ..reproduce import EXPERIMENTS

    p = sub.add_parser("reproduce", help="reproduce a seed paper's claim at small scale")
    exp = p.add_subparsers(dest="experiment", metavar="NAME", required=True)
    for name, mod in EXPERIMENTS.items():
        module = importlib.import_module(mod)
        e = exp.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0],
                           description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        e.add_argument("--quick", action="store_true", help="a setting that runs on 2 CPU cores in a few minutes")
        e.add_argument("--seed", type=int, default=0)
        e.add_argument("--out", default=None, help="output directory (default runs/reproduce/NAME)")
        module.add_arguments(e)
        e.set_defaults(_experiment=module)
    return p


def finite_or_null(obj):
    """`obj` with every NaN or infinite float replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def run(args) -> int:
    out = Path(args.out or f"runs/reproduce/{args.experiment}")
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    result = args._experiment.run(args, out)
    result["seconds"] = round(time.time() - t, 1)
    result["command"] = "fastrpe " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("fastrpe") else None
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}"
    # standard JSON: a number that could not be computed (a diverged run's loss) is null
    (out / f"{args.experiment}.json").write_text(json.dumps(finite_or_null(result), indent=1, allow_nan=False))
    print(f"wrote {out / (args.experiment + '.json')}")
    return 0
