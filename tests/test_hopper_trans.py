"""benchmarks/hopper_trans.py: each kernel compiled for sm_90, its shared memory, spills and
16-bit stores of a transposed product. In a process of its own (this one interprets the
kernels: `_compiled.compiled_env`), for one small kernel and the tiled key-tile one."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _compiled import compiled_env

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_hopper_trans_writes_a_row_per_case_and_warps(tmp_path):
    out = tmp_path / "ht.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hopper_trans.py"), "--kernels",
                          "_tiled_bwd_dkv", "--warps", "4", "--out", str(out)], capture_output=True, text=True,
                         env=compiled_env(TRITON_CACHE_DIR=str(tmp_path / "cache")), timeout=120, check=False)
    if "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(out.read_text())
    rows = got["rows"]
    # tf32x3 and bf16x3 (triton_tiled runs float32 features only), key-major in both: no 16-bit
    # store of a transposed product, and ptxas' counts read
    assert sorted(r["MODE"] for r in rows) == [2, 3]
    assert all(r["kernel"] == "_tiled_bwd_dkv_kernel" and r["num_warps"] == 4 for r in rows)
    assert all(r["hopper_trans_stores"] == 0 and 0 < r["registers"] <= 255 and r["shared_bytes"] > 0 for r in rows)
    assert got["meta"]["target"].startswith("sm_90") and got["meta"]["triton"]
