"""The GPU test runs' resumption (`conftest.py`, FASTRPE_TESTS_DONE; `benchmarks/gpu_run.sh`):
a test that breaks the CUDA context stops its process after it, and the next process runs
only the tests not finished yet. On CPU a test stands in for the fault by making the
conftest's check report a broken context."""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import conftest
from _benchmarks import BENCHMARKS

TESTS = '''
import sys


def test_a():
    pass


def test_b():
    sys.modules["conftest"].cuda_context_broken = lambda: True  # as an illegal memory access leaves it
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_c():
    pass
'''


def _pytest(where: Path, done: Path | None) -> subprocess.CompletedProcess:
    """pytest on `where`'s test_k.py, resumable through `done` (None: not resumable)."""
    env = {k: v for k, v in os.environ.items() if k != conftest.TESTS_DONE}
    if done is not None:
        env[conftest.TESTS_DONE] = str(done)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_k.py"], cwd=where,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_broken_cuda_context_stops_the_run_and_the_next_one_runs_the_rest(tmp_path):
    (tmp_path / "conftest.py").write_text(Path(conftest.__file__).read_text())
    (tmp_path / "test_k.py").write_text(TESTS)
    done = tmp_path / "done.txt"

    first = _pytest(tmp_path, done)
    assert "1 failed, 1 passed" in first.stdout, first.stdout + first.stderr
    assert "test_c" not in first.stdout  # not run: it would have failed with test_b's error
    lines = done.read_text().splitlines()
    assert lines == [conftest.RUNNING + "test_k.py::test_a", "test_k.py::test_a",
                     conftest.RUNNING + "test_k.py::test_b", conftest.STOPPED_FOR_CONTEXT + "test_k.py::test_b",
                     "test_k.py::test_b"]
    assert conftest.tests_done(str(done)) == {"test_k.py::test_a", "test_k.py::test_b"}

    second = _pytest(tmp_path, done)
    assert "1 passed, 2 deselected" in second.stdout, second.stdout + second.stderr
    assert done.read_text().splitlines()[-1] == "test_k.py::test_c"
    assert not done.read_text().splitlines()[-1].startswith("#")  # finished: nothing left to resume


def test_without_the_file_nothing_is_recorded_and_a_failure_does_not_stop_the_run(tmp_path):
    (tmp_path / "conftest.py").write_text(Path(conftest.__file__).read_text())
    (tmp_path / "test_k.py").write_text(TESTS)
    r = _pytest(tmp_path, None)
    assert "1 failed, 2 passed" in r.stdout, r.stdout + r.stderr
    assert not any(p.name == "done.txt" for p in tmp_path.iterdir())


def _gpu_tests_function() -> str:
    """`gpu_tests` as benchmarks/gpu_run.sh defines it (the function's lines alone)."""
    lines = (BENCHMARKS / "gpu_run.sh").read_text().splitlines()
    start = lines.index("gpu_tests() {")
    end = lines.index("}", start)
    return "\n".join(lines[start:end + 1])


def _gpu_tests(where: Path, tests: str, budget: int) -> tuple[subprocess.CompletedProcess, str]:
    """`gpu_tests` (the script's function) on `tests` as `where`/test_k.py, within `budget`
    seconds: the bash run and the log it wrote."""
    (where / "conftest.py").write_text(Path(conftest.__file__).read_text())
    (where / "test_k.py").write_text(tests)
    script = (f"{_gpu_tests_function()}\n"
              f"gpu_tests {budget} {where}/log.txt {where}/all.xml -q -p no:cacheprovider test_k.py; echo rc=$?\n")
    env = {**os.environ, "BENCH_DIR": str(BENCHMARKS), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop(conftest.TESTS_DONE, None)
    r = subprocess.run(["bash", "-c", script], cwd=where, env=env, capture_output=True, text=True,
                       timeout=budget + 140, check=False)
    return r, (where / "log.txt").read_text()


#: TESTS, then a test whose process dies in it (no teardown, no report) and one after it
CRASH = TESTS + '''

def test_d():
    import os
    os._exit(3)


def test_e():
    pass
'''


def test_gpu_run_sh_runs_the_tests_again_after_a_broken_context(tmp_path):
    """The script's loop on TESTS and a process that dies in a test: three processes (after
    test_b's fault, after test_d's death), every test run once, one junit XML of the processes
    that wrote one, the last process's status."""
    r, log = _gpu_tests(tmp_path, CRASH, budget=100)
    assert "process 2 runs the rest" in log and "the process died in test_k.py::test_d; process 3" in log, log
    assert "1 passed, 4 deselected" in log, log + r.stderr  # the third: test_e alone
    assert r.stdout.strip().endswith("rc=0"), r.stdout  # the third process passed
    root = ET.parse(tmp_path / "all.xml").getroot()
    # (the second process died before writing its XML: test_c's pass is in the log only)
    assert [s.get("name") for s in root.iter("testsuite")] == ["pytest (process 1 of the run)",
                                                                "pytest (process 3 of the run)"]
    assert (root.get("tests"), root.get("failures")) == ("3", "1")
    assert sorted(c.get("name") for c in root.iter("testcase")) == ["test_a", "test_b", "test_e"]


def test_the_sixteen_bit_modes_that_failed_are_left_out_of_the_bench(tmp_path):
    """`gpu_tests_xml.py --faulty-rows`: the bench's patterns of the 16-bit modes whose float64
    test failed or errored (gpu_run.sh adds them to --skip), none for passes or other tests."""
    from _benchmarks import load_benchmark

    xml = tmp_path / "t.xml"
    name = "test_sixteen_bit_products_match_float64_at_4096"
    xml.write_text(f"""<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.test_gpu" name="{name}[triton_soe-bf16x3]"><failure message="x"/></testcase>
<testcase classname="tests.test_gpu" name="{name}[triton_tiled-bf16x3]"><error message="CUDA error"/></testcase>
<testcase classname="tests.test_gpu" name="{name}[triton_tiled-bf16-features]"/>
<testcase classname="tests.test_gpu" name="{name}[triton_chunked-bf16x3]"><skipped message="s"/></testcase>
<testcase classname="tests.test_gpu" name="{name}[triton_band-tf32x3]"><failure message="x"/></testcase>
<testcase classname="tests.test_gpu" name="test_backend_matches_float64_reference_at_4096_bf16[x]"><failure/></testcase>
</testsuite></testsuites>""")
    mod = load_benchmark("gpu_tests_xml")
    # (bf16x3 is the default products of 16-bit calls: `auto` runs it too; tf32x3 names no rows alone)
    assert mod.faulty_rows(xml) == ["fastrpe-auto*", "fastrpe-triton_soe+bf16x3*", "fastrpe-triton_tiled+bf16x3*"]
    assert mod.faulty_rows(tmp_path / "absent.xml") == []
    from fastrpe.bench import gpu

    assert gpu.matches("fastrpe-triton_tiled+bf16x3+cudagraphs", mod.faulty_rows(xml))
    assert not gpu.matches("fastrpe-triton_tiled+bf16-features", mod.faulty_rows(xml))


#: a test that outlasts the budget
SLOW = """
import time


def test_a():
    pass


def test_slow():
    time.sleep(60)


def test_after():
    pass
"""


def test_gpu_run_sh_says_the_budget_stopped_the_tests_not_that_the_process_died(tmp_path):
    """The budget's interrupt (timeout's SIGINT; its exit status 124) leaves a test running in
    the list: that is the budget's stop, said as such, and no process starts after it (the
    sixth H100 session's log said "the process died" there)."""
    r, log = _gpu_tests(tmp_path, SLOW, budget=16)
    assert "GPU tests: the budget stopped them in test_k.py::test_slow" in log, log + r.stderr
    assert "died" not in log and "process 2" not in log, log
