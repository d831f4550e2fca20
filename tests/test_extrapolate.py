"""`fastrpe extrapolate`: argument errors are one line (exit 2); finished rows survive an
interruption and a rerun completes the rest with the numbers of an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fastrpe.reproduce.lm as lm
from fastrpe.cli.main import main

TINY = ["--positions", "none,alibi", "--kernels", "softmax", "--factors", "1,2", "--train-length", "16",
        "--eval-tokens", "64", "--max-bytes", "200000", "--d-model", "16", "--heads", "2", "--layers", "1",
        "--batch-size", "4", "--no-progress"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FASTRPE_CACHE", str(tmp_path_factory.getbasetemp() / "fastrpe-cache"))


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastrpe extrapolate: error:"), err
    assert "Traceback" not in err[0]
    return err[0]


BAD = {
    "positions-nope": (["--positions", "nope"], "--positions"),
    "positions-empty": (["--positions", ","], "--positions"),
    "positions-twice": (["--positions", "alibi,alibi"], "--positions"),
    "kernels-nope": (["--kernels", "nope"], "--kernels"),
    "corpus-nope": (["--corpus", "nope"], "--corpus"),
    "factors-letters": (["--factors", "a,b"], "--factors"),
    "factors-zero": (["--factors", "0"], "--factors"),
    "factors-negative": (["--factors", "1,-2"], "--factors"),
    "steps-zero": (["--steps", "0"], "--steps"),
    "steps-text": (["--steps", "abc"], "--steps"),
    "max-bytes-100": (["--max-bytes", "100"], "--max-bytes"),
    "train-length-1": (["--train-length", "1"], "--train-length"),
    "batch-size-0": (["--batch-size", "0"], "--batch-size"),
    "eval-tokens-0": (["--eval-tokens", "0"], "--eval-tokens"),
    "lr-negative": (["--lr", "-1"], "--lr"),
    "lr-nan": (["--lr", "nan"], "--lr"),
    "heads-not-dividing": (["--d-model", "15"], "--d-model"),
    "ckpt-every-negative": (["--ckpt-every", "-5"], "--ckpt-every"),
    "seed-negative": (["--seed", "-1"], "--seed"),
    "device-nope": (["--device", "nope"], "--device"),
}


@pytest.mark.parametrize("bad,names", list(BAD.values()), ids=list(BAD))
def test_bad_arguments_one_line_exit_2(tmp_path, capsys, bad, names):
    assert main(["extrapolate", *bad, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0] and names in err[0], err
    assert not (tmp_path / "out" / "rows").exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    assert main(["extrapolate", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device" in _one_error_line(capsys)


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["extrapolate", *TINY, "--steps", "2", "--out", str(tmp_path / "f")]) == 2
    assert "not a directory" in _one_error_line(capsys)


def test_changed_settings_are_refused_and_fresh_discards(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["extrapolate", *TINY, "--steps", "2", "--out", out]) == 0
    capsys.readouterr()
    assert main(["extrapolate", *TINY, "--steps", "3", "--out", out]) == 2
    line = _one_error_line(capsys)
    assert "steps 2 -> 3" in line and "--fresh" in line
    assert main(["extrapolate", *TINY, "--steps", "3", "--fresh", "--out", out]) == 0
    res = json.loads((Path(out) / "results.json").read_text())
    assert res["settings"]["steps"] == 3 and not res["partial"] and len(res["results"]) == 2


def _rows(out: Path) -> dict:
    return {(r["kernel"], r["position"]): r for r in json.loads((out / "results.json").read_text())["results"]}


def test_interrupted_run_keeps_finished_rows_and_a_rerun_completes_them(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of the second model's training: the first row is on disk, the
    second model's checkpoint too; the rerun trains only the rest, and every number equals an
    uninterrupted run's."""
    args = [*TINY, "--steps", "12", "--ckpt-every", "4"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["extrapolate", *args, "--out", str(ref)]) == 0

    real, calls = lm.train_lm, []

    def interrupting(*a, callbacks=(), **kw):  # Ctrl-C at step 6 of the second model
        calls.append(kw["out_dir"])

        def stop(state):
            if len(calls) == 2 and state.step == 6:
                raise KeyboardInterrupt

        return real(*a, callbacks=[*callbacks, stop], **kw)

    monkeypatch.setattr(lm, "train_lm", interrupting)
    capsys.readouterr()
    assert main(["extrapolate", *args, "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and "1 of 2 rows" in err[0], err
    first = out / "rows" / "softmax-none.json"
    assert first.is_file() and not (out / "rows" / "softmax-alibi.json").exists()
    assert (out / "train" / "softmax-alibi" / "checkpoints" / "step-00000004.safetensors").is_file()
    kept = first.read_bytes()

    calls.clear()
    assert main(["extrapolate", *args, "--out", str(out)]) == 0
    assert [Path(c).name for c in calls] == ["softmax-alibi"]  # the finished row was not redone
    assert first.read_bytes() == kept
    got, want = _rows(out), _rows(ref)
    assert got[("softmax", "alibi")]["resumed_from_step"] == 4
    for key in want:
        assert got[key]["ppl"] == want[key]["ppl"], key
        assert got[key]["final_train_loss"] == want[key]["final_train_loss"], key


def test_sigint_stops_with_one_line_and_keeps_the_finished_row(tmp_path):
    """The real signal, to a real process, once its first row file exists."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fastrpe.cli.main", "extrapolate", *TINY, "--positions", "none,alibi,t5",
           "--steps", "200", "--out", str(out)]
    # a shell's background job inherits SIGINT ignored (and Python then keeps ignoring it): restore it
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120  # start-up is slow on a loaded machine
        while not any((out / "rows").glob("*.json")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=25)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "Traceback" not in err, err
    rows = sorted(p.name for p in (out / "rows").glob("*.json"))
    assert "softmax-none.json" in rows and len(rows) < 3
