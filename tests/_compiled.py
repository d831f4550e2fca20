"""The environment of a Python process in which Triton compiles its kernels for a GPU target:
this test process interprets them (conftest.py sets TRITON_INTERPRET=1, and `triton.jit`
reads it when it decorates), so the tests that compile (for sm_90, without a GPU) run a
process of their own."""
from __future__ import annotations

import os


def compiled_env(**extra: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET, with `extra` set (a test's own
    TRITON_CACHE_DIR, say)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env
