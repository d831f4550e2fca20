"""`fastrpe convert` and `fastrpe.hf.recipe.convert_recipe` end to end, at toy sizes."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from fastrpe.cli.main import main  # noqa: E402
from fastrpe.hf.recipe import RecipeOptions, convert_recipe  # noqa: E402

TOY = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=32, batch_size=4, pretrain_steps=3,
           finetune_steps=2, warmup_steps=1, max_bytes=300_000, eval_tokens=512, eval_every=1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_recipe_end_to_end(tmp_path, arch):
    o = RecipeOptions(arch=arch, kernel="nprf", position="kerple_log", num_features=8, **TOY)
    res = convert_recipe(tmp_path, o, progress=False, log=lambda *_: None, plot=arch == "llama")
    v = res["val_loss"]
    for key in ("softmax", "converted", "finetuned", "softmax_control"):
        assert isinstance(v[key], float) and 0 < v[key] < 10, key
    # the saved and reloaded softmax model is the trained one
    assert v["softmax"] == pytest.approx(v["softmax_before_save"], abs=1e-6)
    assert abs(v["converted"] - v["softmax"]) > 1e-4, "the conversion must change the attention"
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["val_loss"] == pytest.approx(v)
    assert on_disk["finetune_curve"]["eval_step"] == [0, 1, 2]
    assert on_disk["finetune_curve"]["eval_loss"][0] == pytest.approx(v["converted"])
    assert on_disk["finetune_curve"]["eval_loss"][-1] == pytest.approx(v["finetuned"])
    assert (tmp_path / "softmax-model" / "config.json").is_file()
    assert (tmp_path / "finetune" / "metrics.jsonl").is_file() and (tmp_path / "control" / "metrics.jsonl").is_file()
    if arch == "llama" and pytest.importorskip("matplotlib"):
        assert (tmp_path / "convert.png").stat().st_size > 0


def test_recipe_softmax_identity_conversion_costs_nothing(tmp_path):
    """softmax, no term, the model's encoding kept: the loss right after `convert` is the loss before."""
    o = RecipeOptions(kernel="softmax", position=None, keep_position_encoding=True, control=False, **TOY)
    res = convert_recipe(tmp_path, o, progress=False, log=lambda *_: None, plot=False)
    assert res["val_loss"]["converted"] == pytest.approx(res["val_loss"]["softmax"], abs=1e-5)
    assert res["val_loss"]["softmax_control"] is None and res["control_curve"] is None
    # a user's own saved softmax model: no pretraining, the same starting loss
    again = RecipeOptions(pretrained=str(tmp_path / "softmax-model"), control=False, num_features=8,
                          **{k: v for k, v in TOY.items() if k != "hidden_size"})
    res2 = convert_recipe(tmp_path / "again", again, progress=False, log=lambda *_: None, plot=False)
    assert res2["val_loss"]["softmax"] == pytest.approx(res["val_loss"]["softmax"], abs=1e-9)
    assert res2["pretrain_final_train_loss"] is None and not (tmp_path / "again" / "pretrain").exists()
    assert abs(res2["val_loss"]["converted"] - res2["val_loss"]["softmax"]) > 1e-4  # nprf + kerple_log


def test_cli_convert_quick_runs_and_reports(tmp_path, capsys):
    rc = main(["convert", "--quick", "--pretrain-steps", "2", "--finetune-steps", "1", "--max-bytes", "300000",
               "--eval-tokens", "256", "--no-control", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "right after conversion" in out and "after 1 fine-tuning steps" in out
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["options"]["kernel"] == "nprf" and res["options"]["position"] == "kerple_log"
    assert res["options"]["keep_position_encoding"] is False


def test_cli_convert_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main(["convert", "--quick", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "not a directory" in err[0]


def test_cli_convert_pretrained_must_be_a_saved_model(tmp_path, capsys):
    rc = main(["convert", "--quick", "--max-bytes", "300000", "--pretrained", str(tmp_path / "nope"),
               "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pretrained" in err[0] and "save_pretrained" in err[0]
