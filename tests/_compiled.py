"""The environment of a Python process in which Triton compiles its kernels for a GPU target:
this test process interprets them (conftest.py sets TRITON_INTERPRET=1, and `triton.jit`
reads it when it decorates), so the tests that compile (for sm_90, without a GPU) run a
process of their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compiled_env(**extra: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET, with `extra` set (a test's own
    TRITON_CACHE_DIR, say)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def compile_run(cmd: list[str], timeout: int, **env: str) -> str:
    """stdout of `cmd` in a process that compiles (`compiled_env(**env)`); the test is skipped
    where this triton has no ptxas, and fails with the process's stderr where it fails."""
    res = subprocess.run(cmd, env=compiled_env(**env), capture_output=True, text=True, timeout=timeout, check=False)
    if "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def benchmark_json(script: str, args: list[str], tmp_path: Path, timeout: int = 120) -> dict:
    """The JSON that `benchmarks/<script>.py <args> --out ...` writes, run by `compile_run` with a
    Triton cache of the test's own."""
    out = tmp_path / f"{script}.json"
    compile_run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args, "--out", str(out)], timeout,
                TRITON_CACHE_DIR=str(tmp_path / "cache"))
    return json.loads(out.read_text())
