"""`fastrpe train`: every task trains through fastrpe.train from the command line."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from fastrpe.cli.main import main


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("task,extra", [
    ("lm", ["--seq-len", "32", "--kernel", "nprf", "--position", "kerple_log", "--max-bytes", "300000"]),
    ("listops", ["--seq-len", "48", "--num-samples", "300", "--kernel", "elu", "--position", "none", "--fastrpb"]),
    ("seq2seq", ["--seq-len", "8", "--num-samples", "300", "--dataset", "copy"]),
    ("images", ["--kernel", "elu", "--fastrpb"]),
])
def test_each_task_trains_and_checkpoints(tmp_path, task, extra):
    out = tmp_path / task
    rc = main(["train", "--task", task, "--steps", "40", "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "5",
               "--ckpt-every", "20", "--eval-samples", "16", "--no-progress", "--out", str(out), *extra])
    assert rc == 0
    recs = _records(out)
    train = [r for r in recs if r["kind"] == "train"]
    assert train[-1]["step"] == 40 and train[-1]["loss"] < train[0]["loss"]  # it learns
    ev = [r for r in recs if r["kind"] == "eval"]
    assert ev and all(math.isfinite(v) for v in ev[-1].values() if isinstance(v, float))
    ckpts = sorted((out / "checkpoints").glob("step-*.safetensors"))
    assert [c.name for c in ckpts][-1] == "step-00000040.safetensors"
    assert load_file(ckpts[-1])  # a readable safetensors file
    assert json.loads((out / "task.json").read_text())["task"] == task


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastrpe train: error:"), err
    for f in fragments:
        assert f in err[0], err
    return err[0]


def test_resume_continues_and_refuses_a_different_task(tmp_path, capsys):
    common = ["train", "--task", "lm", "--seq-len", "16", "--max-bytes", "200000", "--batch-size", "4",
              "--eval-samples", "4", "--ckpt-every", "5", "--no-progress", "--out", str(tmp_path)]
    assert main([*common, "--steps", "10"]) == 0
    assert main([*common, "--steps", "15", "--resume"]) == 0
    steps = [r["step"] for r in _records(tmp_path) if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 15
    capsys.readouterr()
    assert main([*common, "--steps", "20", "--resume", "--kernel", "nprf"]) == 2
    _one_error_line(capsys, "--resume: the task differs", "kernel")
    assert main([*common, "--steps", "20"]) == 2
    _one_error_line(capsys, "already holds checkpoints", "--resume")


def test_unknown_choices_are_refused(tmp_path, capsys):
    assert main(["train", "--task", "nope", "--out", str(tmp_path)]) == 2
    _one_error_line(capsys, "--task", "invalid choice")
    assert main(["train", "--task", "lm", "--position", "nope", "--steps", "1", "--max-bytes", "100000",
                 "--out", str(tmp_path / "x")]) == 2
    _one_error_line(capsys, "position")


def test_images_task_records_its_default_position_and_refuses_1d_ones(tmp_path, capsys):
    out = tmp_path / "img"
    assert main(["train", "--task", "images", "--steps", "2", "--batch-size", "4", "--eval-samples", "8",
                 "--no-progress", "--out", str(out)]) == 0
    assert json.loads((out / "task.json").read_text())["position"] == "table2d"
    capsys.readouterr()
    assert main(["train", "--task", "images", "--position", "kerple_log", "--steps", "1",
                 "--out", str(tmp_path / "x")]) == 2
    _one_error_line(capsys, "images task takes")


def test_same_seed_gives_bit_identical_checkpoints_and_a_killed_run_restarts_from_the_same_init(
        tmp_path, monkeypatch, capsys):
    """The seed fixes the initial weights (seeded before the model is built): two runs write
    byte-identical checkpoints; a run interrupted before its first checkpoint and resumed ends
    with the same tensors; another seed gives other weights."""
    from safetensors.torch import load_file

    import fastrpe.train.loop as loop

    args = ["train", "--task", "lm", "--seq-len", "8", "--max-bytes", "60000", "--batch-size", "2",
            "--eval-samples", "2", "--steps", "2", "--ckpt-every", "2", "--no-progress", "--out", "run"]

    def run_in(d, *extra):
        d.mkdir()
        monkeypatch.chdir(d)  # the same relative --out: config.json and the checkpoint meta agree too
        return main([*args, *extra])

    assert run_in(tmp_path / "a", "--seed", "7") == 0
    assert run_in(tmp_path / "b", "--seed", "7") == 0
    ck = "run/checkpoints/step-00000002.safetensors"
    assert (tmp_path / "a" / ck).read_bytes() == (tmp_path / "b" / ck).read_bytes()

    real_save = loop.CheckpointManager.save

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.CheckpointManager, "save", killed)
    assert run_in(tmp_path / "c", "--seed", "7") == 130
    monkeypatch.setattr(loop.CheckpointManager, "save", real_save)
    assert main([*args, "--seed", "7", "--resume"]) == 0  # nothing to resume: starts over, from the same init
    a, c = load_file(tmp_path / "a" / ck), load_file(tmp_path / "c" / ck)
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)

    assert run_in(tmp_path / "d", "--seed", "8") == 0
    d = load_file(tmp_path / "d" / ck)
    assert not torch.equal(a["model/embed.weight"], d["model/embed.weight"])
