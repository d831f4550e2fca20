"""benchmarks/prf_sweep.py, the PRF map kernels' launch choices for a GPU session: every
config's output equals the library's launch (here in the interpreter, at a toy length), and
a bad --configs is a one-line error."""
import json

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("triton")

from fastrpe.ops.linear import triton_chunked as tc


def _sweep():
    return load_benchmark("prf_sweep")


@pytest.mark.skipif(not tc.INTERPRETED, reason="the CPU run needs Triton's interpreter (TRITON_INTERPRET=1)")
def test_prf_sweep_configs_agree_with_the_library_launch(tmp_path, capsys):
    mod = _sweep()
    out = tmp_path / "sweep.json"
    assert mod.CONFIGS[0] == f"{mod.tp.BLOCK_ROWS}:{mod.tp.NUM_WARPS}:{mod.tp.PRECISION}"  # the library's launch
    assert mod.main(["--device", "cpu", "--lengths", "20", "--configs", "16:4:ieee,32:2:tf32x3", "--repeats", "1",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 and all("seconds" in r for r in rows)
    assert max(r["max_abs_diff"] for r in rows) < 1e-5
    assert "best" in capsys.readouterr().out
    assert mod.main(["--device", "cpu", "--warm", "--configs", "16:4:ieee", "--out", str(tmp_path / "no.json")]) == 0
    assert "1 configs compiled" in capsys.readouterr().out and not (tmp_path / "no.json").exists()


def test_prf_sweep_bad_config_is_one_line(capsys):
    assert _sweep().main(["--device", "cpu", "--configs", "64:4:fast"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "BR:num_warps:precision" in lines[0]
