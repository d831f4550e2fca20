"""`fastrpe SUBCOMMAND ...`: each subcommand lives in its own module and
registers itself with `add_parser(subparsers)` returning its handler.

Errors (docs/ERRORS.md): a mistake in the arguments, a refused call, a bad or unreadable
file, a full or read-only disk, a missing optional data set — anything the user can fix —
prints one line `fastrpe COMMAND: error: ...` on stderr and exits with status 2, as
argparse does for an unknown option. Ctrl-C prints `fastrpe COMMAND: interrupted` and exits
with 130 (128 + SIGINT, the shell's convention). Anything else is a bug in fastrpe: one line
`fastrpe COMMAND: internal error: ...` and status 1. `FASTRPE_DEBUG=1` re-raises every
exception with its full traceback instead.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

# subcommand name -> module under fastrpe.cli (imported only when used, so `fastrpe --help` is fast)
SUBCOMMANDS = {
    "explain": "explain",
    "bench": "bench",
    "extrapolate": "extrapolate",
    "reproduce": "reproduce",
    "train": "train",
    "convert": "convert",
}

#: exit status for a user error (argparse's own), Ctrl-C (128 + SIGINT), and a bug
EXIT_USER, EXIT_INTERRUPTED, EXIT_BUG = 2, 130, 1


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (`prog: error: ...; see prog --help`)
    instead of the usage block followed by the error."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(EXIT_USER, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="fastrpe",
                            description="Attention with relative positional encoding, fast on long sequences.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subparsers inherit _OneLineParser
    for name, mod in SUBCOMMANDS.items():
        module = importlib.import_module(f"fastrpe.cli.{mod}")
        p = module.add_parser(sub)
        p.set_defaults(_module=module)
    return parser


def _one_line(msg: str) -> str:
    """The message on one line: its first line, with a pointer when it had more."""
    lines = [x for x in str(msg).strip().splitlines() if x.strip()]
    if not lines:
        return "(no message)"
    return lines[0] if len(lines) == 1 else f"{lines[0]} (+{len(lines) - 1} more lines; FASTRPE_DEBUG=1 shows them)"


def _os_message(e: OSError) -> str:
    """`OSError` as a sentence naming the file and, for the usual cases, what to do."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e)
    hint = {errno.ENOSPC: "free some space or choose another --out",
            errno.EROFS: "the file system is read-only; choose another --out",
            errno.EACCES: "no permission; choose another --out",
            errno.EDQUOT: "disk quota exceeded; free some space or choose another --out",
            errno.ENOTDIR: "a path component is a file, not a directory",
            errno.EEXIST: "it exists and is not a directory"}.get(e.errno)
    return f"{where}{what}" + (f" ({hint})" if hint else "")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the input or the machine", not "a bug in fastrpe"."""
    import torch

    from .._validate import FastRPEError
    from ..data._cache import MissingDataError

    types: list[type[BaseException]] = [FastRPEError, MissingDataError, ValueError, OSError]
    try:
        from ..train.checkpoint import CheckpointError
        types.append(CheckpointError)
    except ImportError:  # the train extra (safetensors) is not installed
        pass
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None:
        types.append(oom)
    return tuple(types)


def report(command: str, e: BaseException) -> int:
    """Print one line about `e` on stderr and return the exit status (see the module docstring)."""
    name = f"fastrpe {command}" if command else "fastrpe"
    if isinstance(e, KeyboardInterrupt):
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(e, user_errors()):
        msg = _os_message(e) if isinstance(e, OSError) else str(e)
        if type(e).__name__ == "CheckpointError":
            msg = f"CheckpointError: {msg}"
        print(f"{name}: error: {_one_line(msg)}", file=sys.stderr)
        return EXIT_USER
    print(f"{name}: internal error: {type(e).__name__}: {_one_line(str(e))} (a bug in fastrpe: rerun with "
          "FASTRPE_DEBUG=1 for the traceback and report it)", file=sys.stderr)
    return EXIT_BUG


def debug() -> bool:
    return os.environ.get("FASTRPE_DEBUG", "").strip() not in ("", "0", "false", "no")


def main(argv: list[str] | None = None) -> int:
    """Run `fastrpe` with `argv` (default `sys.argv[1:]`); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, already printed on one line)
        return e.code if isinstance(e.code, int) else EXIT_USER
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        return int(args._module.run(args) or 0)
    except SystemExit as e:  # a handler that exits with a message
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        if debug():
            raise
        print(_one_line(str(e.code)), file=sys.stderr)
        return EXIT_USER
    except BaseException as e:  # noqa: BLE001 - every exception becomes one line (module docstring)
        if debug():
            raise
        return report(args.command, e)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
