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


#: FASTRPE_TESTS_DONE=<file> (benchmarks/gpu_run.sh): a resumable run. Each finished test's id
#: is appended to the file; a session started with the same file leaves out the tests already
#: in it; and a test whose failure broke the CUDA context (an illegal memory access: every
#: later CUDA call of the process fails with the same error) stops the session after it, with
#: a STOPPED_FOR_CONTEXT line, so that the script starts a new process for the rest. On the
#: H100 of 2026-11-27 the third test of 57 faulted, and the 54 after it failed with its error,
#: saying nothing of their own kernels. Each test's start is a RUNNING line: a process that dies
#: in a test (no teardown recorded) leaves it last, and the script counts that test as done.
TESTS_DONE = "FASTRPE_TESTS_DONE"
STOPPED_FOR_CONTEXT = "# stopped: the CUDA context broke in "
RUNNING = "# running "


def tests_done(path: str) -> set[str]:
    """The test ids a resumable run's file lists as finished (its comment lines left out)."""
    try:
        with open(path) as f:
            return {line.strip() for line in f if line.strip() and not line.startswith("#")}
    except FileNotFoundError:
        return set()


def cuda_context_broken() -> bool:
    """Whether this process's CUDA context is unusable (`fastrpe.bench.runner.context_lost`, the
    bench's own check); False where the process never started one."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    from fastrpe.bench.runner import context_lost

    return context_lost(torch.device("cuda", torch.cuda.current_device()))


def pytest_runtest_logreport(report):
    """FASTRPE_INSTAFAIL=1 (benchmarks/gpu_run.sh): each failure's message as it happens, so a
    run killed at a device call's time limit still says what failed and why. FASTRPE_TESTS_DONE:
    each test's id once its teardown is over."""
    if report.failed and os.environ.get("FASTRPE_INSTAFAIL"):
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n")
    done = os.environ.get(TESTS_DONE)
    if done and report.when == "teardown":
        with open(done, "a") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logstart(nodeid, location):
    """FASTRPE_TESTS_DONE: the test about to run, as a RUNNING line."""
    done = os.environ.get(TESTS_DONE)
    if done:
        with open(done, "a") as f:
            f.write(RUNNING + nodeid + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """FASTRPE_TESTS_DONE: after a failed phase that broke the CUDA context, stop the session
    once this test is over (its teardown still runs and is recorded) and say so in the file."""
    done = os.environ.get(TESTS_DONE)
    if done and call.excinfo is not None and not item.session.shouldstop and cuda_context_broken():
        item.session.shouldstop = f"the CUDA context broke in {item.nodeid}: the rest in a new process"
        with open(done, "a") as f:
            f.write(STOPPED_FOR_CONTEXT + item.nodeid + "\n")


def pytest_collection_modifyitems(config, items):
    done = os.environ.get(TESTS_DONE)
    if done:
        finished = tests_done(done)
        keep = [item for item in items if item.nodeid not in finished]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid in finished])
            items[:] = keep
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
