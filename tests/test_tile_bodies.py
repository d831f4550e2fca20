"""benchmarks/tile_bodies.py: triton_tiled's loop iterations compiled for sm_90, an interior
tile pair's (read without masks) against an edge one's, each with its weights by exponentials
and from the call's table (`triton_tiled.exp_table`). In a process of its own (this one
interprets the kernels: `_compiled.benchmark_json`), for the key-tile gradient kernel, whose
iterations the masks cost most (Triton 3.6.0 and 3.9.0 alike: in the forward and dq kernels
3.9.0 gives both bodies about the same length)."""
import pytest
from _compiled import benchmark_json

pytest.importorskip("triton")


def test_an_interior_iteration_is_shorter_than_an_edge_one(tmp_path):
    got = benchmark_json("tile_bodies", ["--kernels", "_tiled_bwd_dkv", "--modes", "0"], tmp_path)
    rows = got["rows"]
    # bf16 features (0): the float32 features' modes (tf32x3 2, bf16x3 3) compile longer, and
    # the suite is near its 15-minute budget (the benchmark itself runs them all)
    assert [r["MODE"] for r in rows] == [0]
    for r in rows:
        n = {v: r[v]["loop_sass"] for v in ("edge-exp", "interior-exp", "edge-table", "interior-table")}
        # the masks of a 64x64 tile and their compares are gone from an interior iteration, and
        # an exponential per pair from an iteration that reads the table
        assert 0 < n["interior-exp"] < n["edge-exp"] and 0 < n["interior-table"] < n["edge-table"], r
        assert n["interior-table"] < n["interior-exp"] and n["edge-table"] < n["edge-exp"], r
        # the shipped loop holds every body, and the kernel fits the registers it has
        shipped = r["shipped"]
        assert shipped["loop_sass"] > max(n.values()), r
        assert 0 < shipped["registers"] <= 255 and shipped["shared_bytes"] > 0, r
    assert got["meta"]["triton"] and got["meta"]["config"]["num_warps"] == 4
