"""benchmarks/<name>.py as a module, for the tests of the benchmark scripts (they are scripts
beside the package, not part of it): a fresh module at each call."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, *, register: bool = False):
    """The module of `benchmarks/<name>.py`; `register`: also in `sys.modules` under `name`
    (a dataclass there looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
