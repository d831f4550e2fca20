"""`fastrpe SUBCOMMAND ...`: each subcommand lives in its own module and
registers itself with `add_parser(subparsers)` returning its handler."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module under fastrpe.cli (imported only when used, so `fastrpe --help` is fast)
SUBCOMMANDS = {
    "explain": "explain",
    "bench": "bench",
    "extrapolate": "extrapolate",
    "reproduce": "reproduce",
    "train": "train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrpe", description="Attention with relative positional encoding, fast on long sequences.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, mod in SUBCOMMANDS.items():
        module = importlib.import_module(f"fastrpe.cli.{mod}")
        p = module.add_parser(sub)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    from .._validate import FastRPEError
    from ..data._cache import MissingDataError

    try:
        return int(args._module.run(args) or 0)
    except (FastRPEError, MissingDataError) as e:  # the user's input or machine, not a bug: no traceback
        print(f"fastrpe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
