"""benchmarks/fft_causal_ab.py runs both causal FFT paths and says how far apart they are."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fft_causal_ab_times_both_paths_and_they_agree(tmp_path):
    out = tmp_path / "ab.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fft_causal_ab.py"), "--length", "300", "--heads", "1",
                    "--features", "4", "--value-dim", "3", "--repeats", "1", "--leaf", "16", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    res = json.loads(out.read_text())
    assert [r["blocked"] for r in res["rows"]] == ["always", "never"]
    assert all(r["total_s"] > 0 and r["gib_moved"] > 0 and r["launches"] > 0 for r in res["rows"])
    assert res["meta"]["problem"]["chunk"] == 16  # 19 chunks: the blocked product ran
    assert res["difference"]["num_max_abs_over_max"] < 1e-5 and res["difference"]["den_max_rel"] < 1e-5
