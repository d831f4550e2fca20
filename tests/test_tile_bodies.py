"""benchmarks/tile_bodies.py: triton_tiled's loop iterations compiled for sm_90, an interior
tile pair's (read without masks) against an edge one's. In a process of its own (this one
interprets the kernels: `_compiled.compile_run`), for the key-tile gradient kernel, whose
iterations the masks cost most (Triton 3.6.0 and 3.9.0 alike: in the forward and dq kernels
3.9.0 gives both bodies about the same length)."""
import json
import sys
from pathlib import Path

import pytest
from _compiled import compile_run

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def test_an_interior_iteration_is_shorter_than_an_edge_one(tmp_path):
    out = tmp_path / "tb.json"
    compile_run([sys.executable, str(ROOT / "benchmarks" / "tile_bodies.py"), "--kernels", "_tiled_bwd_dkv",
                 "--modes", "0,3", "--out", str(out)], 120, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    got = json.loads(out.read_text())
    rows = got["rows"]
    # bf16 features (0) and float32 features by bf16x3 (3); tf32x3 (2) compiles longest
    assert sorted(r["MODE"] for r in rows) == [0, 3]
    for r in rows:
        edge, inner, shipped = r["edge"], r["interior"], r["shipped"]
        # the masks of a 64x64 tile and their compares are gone from an interior iteration
        assert 0 < inner["loop_sass"] < edge["loop_sass"], r
        # the shipped loop holds both bodies, and the kernel fits the registers it has
        assert shipped["loop_sass"] > max(edge["loop_sass"], inner["loop_sass"]), r
        assert 0 < shipped["registers"] <= 255 and shipped["shared_bytes"] > 0, r
    assert got["meta"]["triton"] and got["meta"]["config"]["num_warps"] == 4
