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


def _pass_rows(times: dict, L: int = 65536) -> list[dict]:
    """Rows for configs timed `times[config] = (forward, backward)` seconds per launch."""
    return [{"L": L, "config": c, "map": m, "pass": w, "seconds": t[w == "bwd"], "max_abs_diff": 0.0,
             "ref_max_abs": 1.0} for c, t in times.items() for m in ("query", "key") for w in ("fwd", "bwd")]


def test_choose_takes_each_pass_fastest_and_the_library_pair(tmp_path, capsys):
    """Each pass has its own pick ("FWD/BWD" where they differ, as triton_prf parses it), the
    library's own pair is what is compared against, and a pair no faster than it stays."""
    mod = _sweep()
    lib = "64:4:tf32x3"
    times = {lib: (1.0, 2.0), "64:4:bf16x3": (0.5, 1.9), "16:4:bf16x3": (0.9, 1.0)}
    assert mod.choose(_pass_rows(times), 65536)[0] == "64:4:bf16x3/16:4:bf16x3"
    assert mod.tp.parse_launches("64:4:bf16x3/16:4:bf16x3")[1] == (16, 4, "bf16x3", 1)
    # one config fastest both ways: no "/"
    assert mod.choose(_pass_rows({lib: (1.0, 2.0), "64:4:bf16x3": (0.5, 1.0)}), 65536)[0] == "64:4:bf16x3"
    # the library runs 16:4:bf16x3 backward already: the pick adds the forward's
    assert mod.choose(_pass_rows(times), 65536, (lib, "16:4:bf16x3"))[0] == "64:4:bf16x3/16:4:bf16x3"
    # ... and the library already runs the fastest pair: nothing
    assert mod.choose(_pass_rows(times), 65536, ("64:4:bf16x3", "16:4:bf16x3"))[0] is None
    # a backward that disagrees with the library's is not taken, the forward still is
    rows = _pass_rows(times)
    for r in rows:
        if r["config"] == "16:4:bf16x3" and r["pass"] == "bwd":
            r["max_abs_diff"] = 0.5
    assert mod.choose(rows, 65536)[0] == "64:4:bf16x3"
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"library": ["64:4:bf16x3", "16:4:bf16x3"], "rows": _pass_rows(times)}))
    assert mod.main(["--choose", str(f)]) == 0 and capsys.readouterr().out.strip() == ""


def test_the_query_maps_backward_is_fed_an_attention_like_gradient():
    """What normalized attention gives a query map: each row of dφ orthogonal to its φ (the
    output does not change when a row of φ(q) is scaled), so the stabilizer's share is
    round-off and a near tie at the row's maximum cannot move dx."""
    import torch

    g = torch.Generator().manual_seed(0)
    phi, dphi = torch.rand(3, 40, 8, generator=g) + 0.1, torch.randn(3, 40, 8, generator=g)
    out = _sweep().attention_like_query_grad(dphi, phi)
    assert (out * phi).sum(-1).abs().max() < 1e-5 * (dphi * phi).sum(-1).abs().max()
    # nothing else moves: the part orthogonal to φ is dφ's own
    assert torch.allclose(out - dphi, phi * ((out - dphi) / phi)[..., :1], atol=1e-6)


@pytest.mark.parametrize("family", ["alibi", "kerple_log"])
def test_attention_gives_a_query_map_a_gradient_orthogonal_to_its_features(family):
    """The premise of `attention_like_query_grad`: normalized kernelized attention (float64,
    NPRF, the dense backend) hands its query map a dφ with `Σ_f dφ·φ = 0` in every row, to
    round-off (the output does not change when a row of φ(q) is scaled)."""
    import torch

    import fastrpe as fr
    from fastrpe import kernels, positions

    B, H, L, D = 1, 2, 50, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    kern = kernels.get_kernel("nprf", head_dim=D, num_features=8).double()
    seen = {}
    forward = kern.forward

    def features(x, is_query=True):
        phi = forward(x, is_query)
        if is_query and phi.requires_grad:
            phi.retain_grad()
            seen["phi"] = phi
        return phi

    kern.forward = features
    q.requires_grad_(True)
    pos = positions.make(family, H, causal=True, max_len=L).double()
    out = fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend="dense")
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    phi = seen["phi"]
    along = (phi.grad * phi).sum(-1).abs()
    assert along.max() < 1e-13 * (phi.grad.abs() * phi.abs()).sum(-1).max()
