"""Benchmarks: a registry of problems × competitors, timed side by side in one process."""
from .registry import COMPETITORS, SUITES, Problem, competitor_names  # noqa: F401
from .runner import run_suite  # noqa: F401
