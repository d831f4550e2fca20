import os
import sys

import pytest
import torch

# Two cores on CI: keep intra-op threads from oversubscribing.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run under Triton's interpreter. It must be switched on
# before anything imports triton (torch.compile's tests do, through inductor): `@triton.jit`
# reads it when it decorates, so a later switch leaves the kernels uncallable on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report):
    """FASTRPE_INSTAFAIL=1 (benchmarks/gpu_run.sh): each failure's message as it happens, so a
    run killed at a device call's time limit still says what failed and why."""
    if report.failed and os.environ.get("FASTRPE_INSTAFAIL"):
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ran(monkeypatch):
    """The names of the backends that ran (under compile: that the traced graph calls)."""
    from fastrpe.dispatch import BACKENDS

    names: list[str] = []
    for name, b in BACKENDS.items():
        def run(q, k, v, p, kpm, _name=name, _run=b.run):
            names.append(_name)
            return _run(q, k, v, p, kpm)
        monkeypatch.setattr(b, "run", run)
    return names


@pytest.fixture
def count_calls(monkeypatch):
    """`count_calls(module, name)`: a list that grows by one at each call of `module.name`
    (the function still runs; undone after the test)."""
    def install(module, name: str) -> list:
        calls, real = [], getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
        return calls
    return install


@pytest.fixture
def blocked_scan(monkeypatch):
    """The Triton kernels' chunk-state passes in blocks (`triton_chunked.STATE_SCAN =
    "blocked"`) from 2 chunks on: the default threshold, 16 chunks, needs inputs longer than
    the interpreter runs quickly."""
    from fastrpe.ops.linear import triton_chunked as tc

    monkeypatch.setattr(tc, "STATE_SCAN", "blocked")
    monkeypatch.setattr(tc, "BLOCKED_MIN_CHUNKS", 2)
