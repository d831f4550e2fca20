"""benchmarks/hopper_trans.py: each kernel compiled for sm_90, its shared memory, spills and
16-bit stores of a transposed product. In a process of its own (this one interprets the
kernels: `_compiled.benchmark_json`), for one small kernel and the tiled key-tile one."""
import pytest
from _compiled import benchmark_json

pytest.importorskip("triton")


def test_hopper_trans_writes_a_row_per_case_and_warps(tmp_path):
    got = benchmark_json("hopper_trans", ["--kernels", "_tiled_bwd_dkv", "--warps", "4"], tmp_path)
    rows = got["rows"]
    # tf32x3 and bf16x3 (triton_tiled runs float32 features only), key-major in both: no 16-bit
    # store of a transposed product, and ptxas' counts read
    assert sorted(r["MODE"] for r in rows) == [2, 3]
    assert all(r["kernel"] == "_tiled_bwd_dkv_kernel" and r["num_warps"] == 4 for r in rows)
    assert all(r["hopper_trans_stores"] == 0 and 0 < r["registers"] <= 255 and r["shared_bytes"] > 0 for r in rows)
    assert got["meta"]["target"].startswith("sm_90") and got["meta"]["triton"]
