"""benchmarks/fft_product_ab.py, the FFT product of this tree against another revision's: it
runs at toy sizes and finds both agreeing (HEAD's product.py against the tree's)."""
import json
import subprocess
from pathlib import Path

import pytest
from _benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_fft_product_ab_runs_and_agrees(tmp_path, capsys):
    head = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:src/fastrpe/ops/linear/fft/product.py"],
                          capture_output=True, check=False)
    if head.returncode != 0:
        pytest.skip("no git history here: the script compares with a revision")
    mod = load_benchmark("fft_product_ab")
    out = tmp_path / "ab.json"
    assert mod.main(["--base", "HEAD", "--length", "40", "--heads", "2", "--features", "3", "--value-dim", "4",
                     "--blocks", "1,3", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["block"] for r in res["rows"]] == [1, 3]
    for r in res["rows"]:
        assert r["base_s"] > 0 and r["this_s"] > 0
        # the same arithmetic in either layout, up to the round-off of the norm behind `err`
        assert all(v <= 1e-6 for v in r["max_abs_diff"].values()), r
    assert "block   1:" in capsys.readouterr().out


def test_fft_product_ab_times_the_toeplitz_product_too(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:src/fastrpe/ops/toeplitz/fft.py"],
                          capture_output=True, check=False)
    if head.returncode != 0:
        pytest.skip("no git history here: the script compares with a revision")
    out = tmp_path / "ab.json"
    assert load_benchmark("fft_product_ab").main(["--op", "toeplitz", "--base", "HEAD", "--length", "33", "--heads", "2",
                                                  "--value-dim", "3", "--repeats", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["max_abs_diff"]) == {"y", "g_v", "g_c"} and max(row["max_abs_diff"].values()) <= 1e-6, row
