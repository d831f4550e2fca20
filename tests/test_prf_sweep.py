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
    assert "adopt:" in capsys.readouterr().out
    assert mod.main(["--device", "cpu", "--warm", "--configs", "16:4:ieee", "--out", str(tmp_path / "no.json")]) == 0
    assert "1 configs compiled" in capsys.readouterr().out and not (tmp_path / "no.json").exists()


def test_prf_sweep_bad_config_is_one_line(capsys):
    assert _sweep().main(["--device", "cpu", "--configs", "64:4:fast"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "BR:num_warps:precision" in lines[0]


def _rows(times: dict, diff: float = 0.0, L: int = 65536) -> list[dict]:
    """The sweep's rows for configs timed `times[config]` seconds per launch (four launches)."""
    return [{"L": L, "config": c, "map": m, "pass": w, "seconds": t, "max_abs_diff": diff if i else 0.0,
             "ref_max_abs": 1.0}
            for i, (c, t) in enumerate(times.items()) for m in ("query", "key") for w in ("fwd", "bwd")]


def test_choose_adopts_a_clearly_faster_config_that_agrees(tmp_path, capsys):
    mod = _sweep()
    lib = "64:4:ieee"
    assert mod.choose(_rows({lib: 1.0, "128:8:ieee": 0.5, "32:4:ieee": 0.7}), 65536)[0] == "128:8:ieee"
    # within the noise of the library's own: kept
    assert mod.choose(_rows({lib: 1.0, "128:8:ieee": 0.97}), 65536)[0] is None
    # faster but its results differ from the library's launch beyond the tolerance: not adopted
    assert mod.choose(_rows({lib: 1.0, "64:4:tf32x3": 0.3}, diff=1e-2), 65536)[0] is None
    # a config with a failed launch (no time) is never adopted
    rows = _rows({lib: 1.0, "16:4:ieee": 0.2})
    del rows[-1]["seconds"]
    assert mod.choose(rows, 65536)[0] is None
    # nor one whose result could not be compared (timed, then an error)
    rows = _rows({lib: 1.0, "16:4:ieee": 0.2})
    del rows[-1]["max_abs_diff"]
    rows[-1]["error"] = "RuntimeError: ..."
    assert mod.choose(rows, 65536)[0] is None
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"rows": _rows({lib: 1.0, "128:8:ieee": 0.5})}))
    assert mod.main(["--choose", str(f)]) == 0 and capsys.readouterr().out.strip() == "128:8:ieee"
    f.write_text(json.dumps({"rows": _rows({lib: 1.0})}))
    assert mod.main(["--choose", str(f)]) == 0 and capsys.readouterr().out.strip() == ""
