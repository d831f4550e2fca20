"""benchmarks/fft_blocked_traffic.py counts the causal FFT path's bytes and checks the chunk
model against them: at toy sizes, that it runs and its parts say what they should."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fft_blocked_traffic_counts_the_lag_matrices_and_the_levels(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fft_blocked_traffic.py"), "--levels", "256,512",
                    "--model", "1024:1:32768", "--features", "4", "--value-dim", "3", "--matrix-chunk", "16",
                    "--out", str(out)], check=True, capture_output=True, text=True)
    res = json.loads(out.read_text())
    assert len(res["level"]["per_level"]) == 1 and res["level"]["per_level"][0] > 0
    m = res["matrix"]
    assert 0 < m["kept"]["passes_per_block"] < m["sliced"]["passes_per_block"]  # a slice at a time builds again
    rows = res["model"]["rows"]
    assert rows[0]["chunks"] is None and len(rows) >= 2
    assert all(r["levels_counted"] > 0 and r["launches"] > 0 for r in rows)
    best = min(rows, key=lambda r: r["levels_estimated"])
    assert res["model"]["picked_chunks"] == best["chunks"]
    assert {(r["budget"], r["H"], r["L"]) for r in res["plan"]} == {(b, h, L) for b in ("cpu", "H100 80GB", "H200")
                                                              for h in (1, 8) for L in (65536, 262144, 1048576)}
