"""`fastrpe reproduce extrapolation` (KERPLE Table 3 at small scale) and its paired t-test."""
import importlib.util
import json
import math
import random

import pytest

from fastrpe.cli.main import main
from fastrpe.reproduce.extrapolation import betainc, paired_t_test, summarize, t_two_sided_p


def _finite_numbers(obj):
    """Every number in a JSON value (None allowed elsewhere) is finite."""
    if isinstance(obj, dict):
        return all(_finite_numbers(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_finite_numbers(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def test_reproduce_extrapolation_tiny(tmp_path):
    rc = main(["reproduce", "extrapolation", "--train-length", "8", "--steps", "3", "--seeds", "2",
               "--positions", "kerple_log,alibi", "--d-model", "16", "--layers", "1", "--heads", "2",
               "--batch-size", "4", "--max-bytes", "100000", "--eval-tokens", "256", "--out", str(tmp_path)])
    assert rc == 0
    text = (tmp_path / "extrapolation.json").read_text()
    res = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert res["experiment"] == "extrapolation" and res["kernels"] == ["softmax"]
    assert res["lengths"] == [8, 16, 32, 64, 128] and res["seeds"] == [0, 1]
    assert _finite_numbers(res)
    assert len(res["runs"]) == 4
    for r in res["runs"]:
        assert not r["diverged"]
        assert set(r["ppl"]) == {str(n) for n in res["lengths"]}
        assert all(isinstance(v, float) and v > 1 for v in r["ppl"].values())
        assert all(abs(math.log(r["ppl"][k]) - r["nll"][k]) < 1e-9 for k in r["ppl"])
    # paired design: every configuration is trained with the same seeds
    assert sorted((r["position"], r["seed"]) for r in res["runs"]) == [("alibi", 0), ("alibi", 1),
                                                                      ("kerple_log", 0), ("kerple_log", 1)]
    for n in res["lengths"]:
        s = res["summary"]["softmax"][str(n)]
        assert s["best"] in ("kerple_log", "alibi")
        other = "alibi" if s["best"] == "kerple_log" else "kerple_log"
        assert s["configs"][s["best"]]["p_vs_best"] is None
        assert 0.0 <= s["configs"][other]["p_vs_best"] <= 1.0
        assert s["configs"][s["best"]]["log_ppl_mean"] <= s["configs"][other]["log_ppl_mean"]
        assert isinstance(s["configs"][other]["best_significantly_better"], bool)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "extrapolation.png").stat().st_size > 0


@pytest.mark.parametrize("t, df, p", [
    pytest.param(2.776445, 4, 0.05, id="t2.776-df4"),
    pytest.param(12.7062, 1, 0.05, id="t12.706-df1"),
    pytest.param(4.302653, 2, 0.05, id="t4.303-df2"),
    pytest.param(2.228139, 10, 0.05, id="t2.228-df10"),
    pytest.param(3.169273, 10, 0.01, id="t3.169-df10-p0.01"),
    pytest.param(1.959964, 1e7, 0.05, id="t1.96-df1e7-normal"),
    pytest.param(0.0, 3, 1.0, id="t0"),
    pytest.param(math.inf, 3, 0.0, id="tinf"),
])
def test_t_two_sided_p_known_values(t, df, p):
    assert t_two_sided_p(t, df) == pytest.approx(p, abs=2e-6)
    assert t_two_sided_p(-t, df) == pytest.approx(p, abs=2e-6)  # two-sided: symmetric in t


@pytest.mark.parametrize("t", [0.05, 0.3, 1.0, 2.5, 7.0, 40.0, 1e3])
def test_t_two_sided_p_closed_forms(t):
    # df = 1 is Cauchy: p = 1 - (2/pi)·atan|t|; df = 2: p = 1 - |t| / sqrt(2 + t²)
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-10, abs=1e-14)
    assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10, abs=1e-14)


def test_betainc_identities():
    rng = random.Random(0)
    for _ in range(200):
        a, b, x = rng.uniform(0.1, 30), rng.uniform(0.1, 30), rng.random()
        assert betainc(a, b, x) == pytest.approx(1 - betainc(b, a, 1 - x), abs=1e-12)
        assert betainc(1.0, b, x) == pytest.approx(1 - (1 - x) ** b, abs=1e-12)  # I_x(1, b)
        assert betainc(a, 1.0, x) == pytest.approx(x ** a, abs=1e-12)  # I_x(a, 1)
    assert betainc(2.0, 3.0, 0.0) == 0.0 and betainc(2.0, 3.0, 1.0) == 1.0


def test_t_two_sided_p_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for t in (0.1, 0.9, 2.0, 3.3, 8.0, 25.0):
        for df in (1, 2, 3, 4, 7, 19, 60, 500):
            assert t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-8, abs=1e-300)


def test_paired_t_test_identical_and_shifted():
    rng = random.Random(1)
    x = [rng.gauss(2.0, 0.5) for _ in range(5)]
    same = paired_t_test(x, list(x))
    assert same["p"] == pytest.approx(1.0) and same["t"] == 0.0 and same["df"] == 4
    # a large common shift with little pair-to-pair noise: the pairing removes the between-seed spread
    y = [v + 0.3 + rng.gauss(0.0, 0.01) for v in x]
    shifted = paired_t_test(x, y)
    assert shifted["p"] < 1e-4 and shifted["t"] < 0 and shifted["mean_diff"] == pytest.approx(-0.3, abs=0.02)
    # by hand: d = (-1, -2, -3): mean -2, sd 1, t = -2·sqrt(3)
    hand = paired_t_test([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert hand["t"] == pytest.approx(-2 * math.sqrt(3))
    assert hand["p"] == pytest.approx(t_two_sided_p(2 * math.sqrt(3), 2))
    # a constant nonzero difference is certain; one pair is untestable
    assert paired_t_test([1.0, 2.0], [2.0, 3.0])["p"] == 0.0
    assert paired_t_test([1.0], [2.0])["p"] is None


def test_summarize_marks_significance_only_when_best_is_lower():
    lengths = [4]
    runs = []
    for seed, base in enumerate([2.0, 2.4, 1.8, 2.2]):  # wide between-seed spread
        runs.append({"kernel": "softmax", "position": "good", "seed": seed, "nll": {"4": base}})
        runs.append({"kernel": "softmax", "position": "bad", "seed": seed, "nll": {"4": base + 0.2 + 0.001 * seed}})
        noisy = base + (0.3 if seed % 2 else -0.25)
        runs.append({"kernel": "softmax", "position": "noisy", "seed": seed, "nll": {"4": noisy}})
    s = summarize(runs, ["softmax"], ["good", "bad", "noisy"], lengths, alpha=0.05)["softmax"]["4"]
    assert s["best"] == "good"
    assert s["configs"]["bad"]["best_significantly_better"] and s["configs"]["bad"]["p_vs_best"] < 1e-4
    assert not s["configs"]["noisy"]["best_significantly_better"] and s["configs"]["noisy"]["p_vs_best"] > 0.05
    assert s["configs"]["good"]["ppl_mean"] == pytest.approx(sum(math.exp(v) for v in [2.0, 2.4, 1.8, 2.2]) / 4)
