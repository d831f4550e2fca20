"""`fastrpe reproduce luo-fig1a|luo-fig3a|scaleformer-fig4|scaleformer-fig6|kerple-table4|
kerple-table5|fastrpb-table3` on tiny settings: each runs through the CLI, writes standard
JSON (no NaN/Infinity constants) with the fields RESULTS.md quotes, and a plot."""
import json
import math

import pytest

from fastrpe.cli.main import main
from fastrpe.reproduce import EXPERIMENTS

NEW = ("luo-fig1a", "luo-fig3a", "scaleformer-fig4", "scaleformer-fig6", "kerple-table4", "kerple-table5",
       "fastrpb-table3")
TINY_LM = ["--batch-size", "4", "--d-model", "16", "--layers", "1", "--heads", "2"]


def _run(tmp_path, name, *argv):
    assert main(["reproduce", name, *argv, "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / f"{name}.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert res["experiment"] == name
    assert (tmp_path / f"{name}.png").exists()
    return res


def test_registered():
    assert set(NEW) <= set(EXPERIMENTS)


def test_luo_fig1a_tiny(tmp_path):
    res = _run(tmp_path, "luo-fig1a", "--lengths", "64,128", "--features", "4,8", "--repeats", "1", "--dim", "16")
    names = {r["competitor"] for r in res["rows"]}
    assert names == {"softmax (standard)", "softmax + RPE (dense)", "NPRF + RPE fft, m=4", "NPRF + RPE fft, m=8"}
    assert len(res["rows"]) == 8 and all(r["seconds"] > 0 for r in res["rows"])
    assert set(res["slopes"]) == names and all(math.isfinite(s) for s in res["slopes"].values())
    assert res["heads"] == 1 and res["threads"] == 1


def test_scaleformer_fig4_tiny_agrees(tmp_path):
    """The naive and the linear Shaw term give the same numerator at every length (checked in
    the run), and both modes and both algorithms get a slope."""
    res = _run(tmp_path, "scaleformer-fig4", "--lengths", "33,64", "--dim", "8", "--k", "3", "--repeats", "1")
    assert len(res["rows"]) == 2 * 2 * 2
    for r in res["rows"]:
        if r["algorithm"] == "linear":
            assert r["rel_err_vs_naive"] < 1e-5
        else:
            assert r["rel_err_vs_naive"] is None
    assert set(res["slopes"]) == {"masked | naive", "masked | linear", "bidirectional | naive",
                                  "bidirectional | linear"}


def test_scaleformer_fig6_tiny_records_choice(tmp_path):
    from fastrpe.dispatch import BACKENDS

    res = _run(tmp_path, "scaleformer-fig6", "--lengths", "16,32", "--heads", "2", "--dim", "8", "--k", "2",
               "--repeats", "1")
    assert len(res["rows"]) == 6
    for r in res["rows"]:
        assert r["auto_chose"] in BACKENDS and r["fastest_backend"] in r["forced_seconds"]
        assert r["forced_seconds"][r["auto_chose"]] == r["seconds"] and r["auto_over_fastest"] >= 1.0
        if r["competitor"] == "vanilla softmax":
            assert r["auto_chose"] in ("sdpa", "dense", "flex")
    assert set(res["faster_than_softmax_from"]) == {"elu + Shaw (auto)", "elu, no RPE (auto)"}


def test_luo_fig3a_tiny(tmp_path):
    res = _run(tmp_path, "luo-fig3a", "--features", "4,8", "--steps", "3", "--seeds", "2", "--train-length", "8",
               "--max-bytes", "100000", "--eval-tokens", "128", *TINY_LM)
    assert len(res["runs"]) == 4 and {r["seed"] for r in res["runs"]} == {0, 1}
    assert set(res["summary"]) == {"4", "8"} and res["best_features"] in (4, 8)
    for s in res["summary"].values():
        assert s["runs"] == 2 and s["val_loss_mean"] > 0
    best = str(res["best_features"])
    assert res["summary"][best]["diff_vs_best"] == 0.0
    other = "4" if best == "8" else "8"
    assert res["summary"][other]["diff_vs_best"] >= 0


def test_luo_fig3a_refuses_other_position(tmp_path, capsys):
    assert main(["reproduce", "luo-fig3a", "--position", "t5", "--steps", "1", "--out", str(tmp_path)]) == 2
    assert "--position" in capsys.readouterr().err


def test_kerple_table4_tiny(tmp_path):
    res = _run(tmp_path, "kerple-table4", "--positions", "kerple_log,alibi,rotary", "--steps", "3", "--skip", "1",
               "--rounds", "2", "--train-length", "16", *TINY_LM)
    rows = {r["position"]: r for r in res["rows"]}
    assert set(rows) == {"kerple_log", "alibi", "rotary"}
    assert rows["kerple_log"]["ratio_to_log"] == 1.0
    for r in rows.values():
        assert r["sec_per_step"] > 0 and r["steps_timed"] == 2 * 2 and r["auto_backend"]
    assert rows["alibi"]["paper_ratio_to_log"] == pytest.approx(0.302 / 0.307)


def test_kerple_table5_tiny_paired(tmp_path):
    res = _run(tmp_path, "kerple-table5", "--steps", "3", "--seeds", "2", "--train-length", "8", "--factors", "1,2",
               "--max-bytes", "100000", "--eval-tokens", "128", *TINY_LM)
    assert res["lengths"] == [8, 16] and len(res["runs"]) == 3 * 2
    assert set(res["table"]) == {"kerple_log", "kerple_log3", "kerple_bias_weight"}
    for pos, by_len in res["table"].items():
        for cell in by_len.values():
            assert cell["seeds"] == 2 and cell["ppl_mean"] > 1
            if pos != "kerple_log":
                assert cell["pairs"] == 2 and 0 <= cell["wins_vs_log"] <= 2
                assert cell["p_vs_log"] is None or 0 <= cell["p_vs_log"] <= 1


def test_fastrpb_table3_tiny(tmp_path):
    res = _run(tmp_path, "fastrpb-table3", "--lengths", "16", "--kernels", "SIKF,softmax", "--steps", "3",
               "--skip", "1", "--batch-size", "2", *TINY_LM[2:])
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["sec_per_step"] > 0 and r["peak_bytes"] > 0 and r["auto_backend"]
    # the FastRPB model holds strictly more parameters and state than the one without
    for r in res["ratios"]:
        assert r["memory_ratio"] > 1.0
    assert {r["kernel"] for r in res["ratios"]} == {"SIKF", "softmax"}


def test_fastrpb_table3_refuses_unknown_kernel(tmp_path, capsys):
    assert main(["reproduce", "fastrpb-table3", "--kernels", "SIKF,nope", "--out", str(tmp_path)]) == 2
    assert "unknown kernel" in capsys.readouterr().err
