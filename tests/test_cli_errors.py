"""Every `fastrpe` subcommand, given bad arguments, prints one line on stderr and exits 2.

The battery runs in-process through `fastrpe.cli.main.main(argv)` (fast); a few cases run
as real subprocesses to check what a shell sees (exit status, no traceback).
See docs/ERRORS.md, "The command line".
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from fastrpe.cli.main import main

NO_CUDA = not torch.cuda.is_available()
# tiny, fast settings for the options a case does not test (small corpus, short windows)
TRAIN = ["--steps", "2", "--seq-len", "8", "--batch-size", "2", "--max-bytes", "60000", "--eval-samples", "2",
         "--no-progress"]
EXTRAP = ["--steps", "2", "--train-length", "8", "--eval-tokens", "16", "--max-bytes", "60000", "--d-model", "8",
          "--heads", "2", "--layers", "1", "--no-progress", "--positions", "none", "--kernels", "softmax",
          "--factors", "1"]


def _one_line(capsys, rc, *fragments):
    """rc 2, exactly one non-empty stderr line `fastrpe ...: error: ...` naming `fragments`, no traceback."""
    out = capsys.readouterr()
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert rc == 2, (rc, out.err)
    assert len(lines) == 1, out.err
    assert lines[0].startswith("fastrpe") and ": error: " in lines[0], lines[0]
    assert "Traceback" not in out.err + out.out
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


# (argv, fragments the one line must contain); `{out}` is replaced by a fresh directory
BATTERY = [
    # top level
    (["nope"], ["invalid choice"]),
    (["--nope"], ["unrecognized"]),
    # train: option values
    (["train", "--steps", "-1"], ["--steps", "-1"]),
    (["train", "--steps", "0"], ["--steps"]),
    (["train", "--steps", "abc"], ["--steps", "invalid int"]),
    (["train", "--lr", "-1"], ["--lr"]),
    (["train", "--lr", "nan"], ["--lr"]),
    (["train", "--lr", "inf"], ["--lr"]),
    (["train", "--lr", "0"], ["--lr"]),
    (["train", "--ckpt-every", "-5"], ["--ckpt-every"]),
    (["train", "--eval-every", "-1"], ["--eval-every"]),
    (["train", "--warmup-steps", "-3"], ["--warmup-steps"]),
    (["train", "--seq-len", "1"], ["--seq-len"]),
    (["train", "--batch-size", "0"], ["--batch-size"]),
    (["train", "--weight-decay", "-0.1"], ["--weight-decay"]),
    (["train", "--grad-clip", "nan"], ["--grad-clip"]),
    (["train", "--num-samples", "0"], ["--num-samples"]),
    (["train", "--max-bytes", "0"], ["--max-bytes"]),
    (["train", "--patch-size", "0"], ["--patch-size"]),
    (["train", "--seed", "-1"], ["--seed"]),
    (["train", "--task", "nope"], ["--task", "invalid choice"]),
    (["train", "--size", "huge"], ["--size"]),
    (["train", "--precision", "fp8"], ["--precision"]),
    (["train", "--nope"], ["unrecognized"]),
    (["train", "--device", "tpu"], ["--device"]),
    (["train", "--device", "nonsense"], ["--device"]),
    (["train", "--device", "cuda:99"], ["--device"]),
    pytest.param(["train", "--device", "cuda"], ["--device", "no CUDA"],
                 marks=pytest.mark.skipif(not NO_CUDA, reason="has a GPU")),
    pytest.param(["train", "--precision", "fp16"], ["--precision", "fp16"],
                 marks=pytest.mark.skipif(not NO_CUDA, reason="has a GPU")),
    # train: options that only the task can refuse (build_task)
    (["train", "--position", "nope"], ["position", "nope"]),
    (["train", "--kernel", "nope"], ["kernel", "nope"]),
    (["train", "--backend", "nope"], ["backend", "nope"]),
    (["train", "--task", "images", "--position", "kerple_log"], ["images task takes"]),
    # explain
    (["explain", "--length", "-5"], ["--length", "-5"]),
    (["explain", "--length", "0"], ["--length"]),
    (["explain", "--dim", "0"], ["--dim"]),
    (["explain", "--heads", "0"], ["--heads"]),
    (["explain", "--key-length", "-1"], ["--key-length"]),
    (["explain", "--length", "x"], ["--length", "invalid int"]),
    (["explain", "--kernel", "nope"], ["kernel", "nope"]),
    (["explain", "--position", "nope"], ["position", "nope"]),
    (["explain", "--dtype", "int8"], ["--dtype"]),
    (["explain", "--device", "tpu"], ["--device"]),
    pytest.param(["explain", "--device", "cuda"], ["--device"], marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    # bench
    (["bench", "--repeats", "0"], ["--repeats"]),
    (["bench", "--repeats", "-2"], ["--repeats"]),
    (["bench", "--suite", "nope"], ["--suite"]),
    (["bench", "--competitors", "nope"], ["--competitors", "nope"]),
    (["bench", "--competitors", ","], ["--competitors"]),
    (["bench", "--dtype", "int8"], ["--dtype"]),
    (["bench", "--device", "tpu"], ["--device"]),
    pytest.param(["bench", "--device", "cuda"], ["--device"], marks=pytest.mark.skipif(not NO_CUDA, reason="GPU")),
    # reproduce
    (["reproduce"], ["NAME"]),
    (["reproduce", "nope"], ["invalid choice"]),
    (["reproduce", "approx", "--seed", "x"], ["--seed"]),
    (["reproduce", "approx", "--nope"], ["unrecognized"]),
    # extrapolate (the main job; its options are checked before any training)
    (["extrapolate", "--positions", "nope"], ["nope"]),
    (["extrapolate", "--kernels", "nope"], ["nope"]),
    (["extrapolate", "--corpus", "nope"], ["nope"]),
    (["extrapolate", "--factors", "a,b"], ["--factors"]),
    (["extrapolate", "--factors", "0"], ["--factors"]),
    (["extrapolate", "--steps", "0"], ["--steps"]),
    (["extrapolate", "--max-bytes", "100"], ["--max-bytes"]),
    (["extrapolate", "--train-length", "0"], ["--train-length"]),
    (["extrapolate", "--steps", "x"], ["--steps"]),
    # convert (refused before the softmax model is trained)
    (["convert", "--kernel", "nope"], ["--kernel", "nope"]),
    (["convert", "--position", "nope"], ["--position", "nope"]),
    (["convert", "--arch", "opt"], ["--arch", "opt"]),
    (["convert", "--finetune-steps", "0"], ["--finetune-steps"]),
]


def _case(c):
    """Each battery entry as a pytest.param whose id is the command line."""
    values, marks = (c.values, c.marks) if hasattr(c, "values") else (c, ())
    return pytest.param(*values, marks=marks, id=" ".join(values[0]))


def _argv(argv, tmp_path):
    cmd = argv[0] if argv else ""
    extra = {"train": TRAIN, "extrapolate": EXTRAP}.get(cmd, [])
    out = ["--out", str(tmp_path / "out")] if cmd in ("train", "extrapolate", "bench") else []
    # the case's own options come last, so they override the defaults above
    return [*argv[:1], *extra, *out, *argv[1:]] if argv and not argv[0].startswith("-") else list(argv)


@pytest.mark.parametrize("argv,fragments", [_case(c) for c in BATTERY])
def test_bad_argument_is_one_line_and_exit_2(argv, fragments, tmp_path, capsys):
    rc = main(_argv(argv, tmp_path))
    _one_line(capsys, rc, *fragments)
    assert not list(tmp_path.glob("out/checkpoints/*")), "a refused run wrote checkpoints"


# ----------------------------------------------------------------------------------------
# train: files and directories


def _train(tmp_path, *extra, out=None):
    return main(["train", *TRAIN, "--out", str(out or tmp_path / "run"), *extra])


def test_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    _one_line(capsys, _train(tmp_path, out=f), "--out", "not a directory")


def test_out_holding_checkpoints_needs_resume(tmp_path, capsys):
    assert _train(tmp_path, "--ckpt-every", "1") == 0
    capsys.readouterr()
    _one_line(capsys, _train(tmp_path, "--ckpt-every", "1"), "already holds checkpoints", "--resume")


def test_resume_with_another_position_or_seq_len_is_refused_even_before_the_first_checkpoint(
        tmp_path, capsys, monkeypatch):
    """task.json is written at the start: an interrupted run (no checkpoint yet) cannot be
    continued with another task."""
    import fastrpe.train.loop as loop

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.CheckpointManager, "save", interrupted)
    rc = _train(tmp_path, "--ckpt-every", "1")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and err == ["fastrpe train: interrupted"]
    assert (tmp_path / "run" / "task.json").is_file() and not list((tmp_path / "run").glob("checkpoints/step-*"))
    monkeypatch.undo()
    _one_line(capsys, _train(tmp_path, "--resume", "--position", "alibi"), "--resume", "position")
    _one_line(capsys, _train(tmp_path, "--resume", "--seq-len", "12"), "--resume", "seq_len")


def test_resume_of_a_truncated_checkpoint(tmp_path, capsys):
    """The only checkpoint is truncated: one line. With an older good one: it resumes from that,
    with a warning naming the bad file."""
    run = tmp_path / "run"
    assert _train(tmp_path, "--ckpt-every", "1") == 0
    ckpts = sorted((run / "checkpoints").glob("step-*.safetensors"))
    assert [c.name for c in ckpts] == ["step-00000001.safetensors", "step-00000002.safetensors"]
    newest = ckpts[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    capsys.readouterr()
    with pytest.warns(UserWarning, match="step-00000002.*falling back to the previous checkpoint step-00000001"):
        assert _train(tmp_path, "--ckpt-every", "1", "--resume", "--steps", "3") == 0
    assert "resumed from step 1" in capsys.readouterr().out

    single = tmp_path / "single"
    assert _train(tmp_path, "--ckpt-every", "2", out=single) == 0
    (ck,) = (single / "checkpoints").glob("step-*.safetensors")
    ck.write_bytes(ck.read_bytes()[:-1])
    capsys.readouterr()
    _one_line(capsys, _train(tmp_path, "--resume", "--steps", "3", out=single), "CheckpointError", "truncated")


@pytest.mark.parametrize("code,fragment", [(errno.ENOSPC, "No space left"), (errno.EROFS, "read-only")])
def test_full_or_read_only_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch, code,
                                                                         fragment):
    real = os.replace

    def failing(src, dst):  # the disk fills (or turns read-only) when checkpoint 2 is written
        if str(dst).endswith("step-00000002.safetensors"):
            raise OSError(code, os.strerror(code), str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    line = _one_line(capsys, _train(tmp_path, "--ckpt-every", "1"), fragment, "step-00000002")
    assert "--out" in line  # what to do
    monkeypatch.undo()
    from fastrpe.train import CheckpointManager, read_checkpoint

    ckdir = tmp_path / "run" / "checkpoints"
    assert read_checkpoint(CheckpointManager(ckdir).latest()).step == 1  # the last good one, verified
    assert not list(ckdir.glob(".*.tmp"))  # no partial file left behind


def test_read_only_out_directory(tmp_path, capsys, monkeypatch):
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "run"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    _one_line(capsys, _train(tmp_path), "Permission denied", "--out")


# ----------------------------------------------------------------------------------------
# what main() does with other exceptions


def _patched_run(monkeypatch, exc):
    import fastrpe.cli.explain as ex

    def run(args):
        raise exc

    monkeypatch.setattr(ex, "run", run)


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    _patched_run(monkeypatch, KeyboardInterrupt())
    assert main(["explain"]) == 130
    out = capsys.readouterr()
    assert out.err == "fastrpe explain: interrupted\n"


def test_a_bug_is_one_line_exit_1_and_a_traceback_with_fastrpe_debug(capsys, monkeypatch):
    _patched_run(monkeypatch, ZeroDivisionError("division by zero"))
    monkeypatch.delenv("FASTRPE_DEBUG", raising=False)
    assert main(["explain"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "internal error: ZeroDivisionError: division by zero" in err[0]
    assert "FASTRPE_DEBUG=1" in err[0]
    monkeypatch.setenv("FASTRPE_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["explain"])


def test_multi_line_messages_are_cut_to_one(capsys, monkeypatch):
    from fastrpe import FastRPEError

    _patched_run(monkeypatch, FastRPEError("backend: no backend supports this call:\n| a | b |\n| c | d |"))
    _one_line(capsys, main(["explain"]), "no backend supports this call", "+2 more lines")


# ----------------------------------------------------------------------------------------
# real processes: what a shell sees


def test_subprocesses_exit_2_with_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("FASTRPE_DEBUG", None)
    cases = [["train", "--steps", "-1", "--out", str(tmp_path / "a")], ["bench", "--repeats", "0"]]
    procs = [subprocess.Popen([sys.executable, "-m", "fastrpe.cli.main", *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for c in cases]
    for c, p in zip(cases, procs):
        out, err = p.communicate(timeout=120)
        lines = [x for x in err.splitlines() if x.strip()]
        assert p.returncode == 2, (c, err)
        assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, (c, err)


def test_subprocess_debug_shows_the_traceback(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", FASTRPE_DEBUG="1")
    p = subprocess.run([sys.executable, "-m", "fastrpe.cli.main", "explain", "--length", "-5"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and "FastRPEError: --length" in p.stderr


def test_battery_covers_every_subcommand():
    from fastrpe.cli.main import SUBCOMMANDS

    covered = {(c.values[0] if hasattr(c, "values") else c)[0][0] for c in BATTERY}
    assert set(SUBCOMMANDS) <= covered, set(SUBCOMMANDS) - covered

