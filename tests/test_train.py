"""fastrpe.train: config, schedule, safetensors checkpoints, exact resume after SIGKILL, torchrun."""
from __future__ import annotations

import json
import math
import os
import pickle
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("safetensors")

from _launch import run_job, torchrun

from fastrpe.train import (
    CheckpointError,
    CheckpointManager,
    Schedule,
    TrainConfig,
    load_checkpoint,
    make_optimizer,
    param_groups,
    read_checkpoint,
    save_checkpoint,
    seeded_batches,
    shard_batch,
    train,
)

TESTS_DIR = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------
# the toy task (also imported by the subprocess scripts below)
#
# Tokens follow x[t+1] = (3 x[t] + 1) mod V; a per-token model can learn it exactly.

V = 11


class TinyLM(nn.Module):
    """Embedding -> residual MLP (with dropout, so runs use the RNG) -> LayerNorm -> logits."""

    def __init__(self, vocab: int = V, dim: int = 16, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):  # tokens (B, L) -> logits (B, L, V)
        x = self.embed(tokens)
        x = x + self.drop(F.gelu(self.mix(x)))
        return self.head(self.norm(x))


def sample_tokens(g: torch.Generator, batch_size: int, length: int = 9):
    x0 = torch.randint(0, V, (batch_size, 1), generator=g)
    cols = [x0]
    for _ in range(length - 1):
        cols.append((3 * cols[-1] + 1) % V)
    return torch.cat(cols, dim=1)  # (B, L)


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    target = tokens[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return loss, {"acc": (logits.argmax(-1) == target).float().mean()}


def lm_batches(batch_size: int, seed: int):
    return seeded_batches(sample_tokens, batch_size, seed)


@pytest.fixture(autouse=True)
def one_thread():
    # tiny models: one intra-op thread is faster and immune to other processes' load
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _state(module_or_opt) -> dict:
    sd = module_or_opt.state_dict()
    if "state" in sd:  # optimizer
        return {f"{i}/{k}": v.clone() for i, st in sd["state"].items() for k, v in st.items()}
    return {k: v.clone() for k, v in sd.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------
# config


def test_config_json_round_trip():
    cfg = TrainConfig(steps=7, lr=1e-3, betas=(0.8, 0.99), schedule="linear", out_dir="x", precision="bf16")
    back = TrainConfig.from_json(cfg.to_json())
    assert back == cfg and isinstance(back.betas, tuple)
    assert TrainConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("d, field", [
    ({"lrr": 0.1}, "lrr"),
    ({"steps": -1}, "steps"),
    ({"steps": 2.5}, "steps"),
    ({"lr": float("nan")}, "lr"),
    ({"lr": 0}, "lr"),
    ({"schedule": "cos"}, "schedule"),
    ({"precision": "fp8"}, "precision"),
    ({"betas": [0.9]}, "betas"),
    ({"betas": [0.9, 1.0]}, "betas"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"batch_size": 10, "grad_accum_steps": 3}, "batch_size"),
    ({"resume": True}, "resume"),  # without out_dir
    ({"resume": "yes", "out_dir": "x"}, "resume"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_config_refuses_unknown_and_invalid_fields(d, field):
    with pytest.raises(ValueError, match=f"TrainConfig: .*'{field}'"):
        TrainConfig.from_dict(d)


def test_config_unknown_field_message():
    with pytest.raises(ValueError, match=r"^TrainConfig: unknown field 'lrr'"):
        TrainConfig.from_dict({"lrr": 1})
    with pytest.raises(ValueError, match=r"^TrainConfig: invalid value for 'steps': -1"):
        TrainConfig.from_dict({"steps": -1})
    with pytest.raises(ValueError, match="unknown field 'nope'"):
        TrainConfig().replace(nope=1)


# ----------------------------------------------------------------------------------------
# schedule


def test_schedule_key_steps():
    lr, W, S, m = 1.0, 10, 110, 0.1
    cos = Schedule(lr, S, W, "cosine", m)
    assert cos(0) == pytest.approx(lr / W)
    assert cos(4) == pytest.approx(lr * 5 / W)
    assert cos(W - 1) == pytest.approx(lr)
    assert cos(W) == pytest.approx(lr)  # decay starts at full lr
    assert cos(W + (S - W) // 2) == pytest.approx((lr + m * lr) / 2)  # cosine midpoint
    assert cos(S - 1) == pytest.approx(m * lr, abs=1e-3)
    assert cos(S) == cos(S + 50) == pytest.approx(m * lr)
    lin = Schedule(lr, S, W, "linear", m)
    assert lin(W + 25) == pytest.approx(lr - (lr - m * lr) * 0.25)
    assert lin(S) == pytest.approx(m * lr)
    const = Schedule(lr, S, W, "constant", m)
    assert const(0) == pytest.approx(lr / W) and const(W) == const(S + 5) == lr
    no_warmup = Schedule(lr, S, 0, "cosine", 0.0)
    assert no_warmup(0) == lr and no_warmup(S) == 0.0
    # pure in the step: any order of calls gives the same values
    fwd = [cos(s) for s in range(S + 2)]
    assert [cos(s) for s in reversed(range(S + 2))] == fwd[::-1]
    assert all(a <= b + 1e-12 for a, b in zip(fwd[W:], fwd[W - 1:]))  # non-increasing after warm-up


# ----------------------------------------------------------------------------------------
# training in process


def test_loss_decreases(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    cfg = TrainConfig(steps=60, batch_size=16, lr=2e-2, warmup_steps=5, log_every=10, out_dir=str(tmp_path),
                      progress=False)
    res = train(model, lm_loss, lm_batches(16, 0), cfg)
    losses = [r["loss"] for r in res.history if r["kind"] == "train"]
    assert len(losses) == 6
    assert losses[-1] < 0.25 * losses[0]
    assert res.history[-1]["acc"] > 0.9
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 and r["grad_norm"] > 0 for r in records)
    assert res.checkpoint == tmp_path / "checkpoints" / "step-00000060.safetensors"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == res.checkpoint.name
    assert TrainConfig.from_json((tmp_path / "config.json").read_text()) == cfg


def test_weight_decay_groups():
    from fastrpe.positions import KerpleLog

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), KerpleLog(2))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == len(list(model.parameters())) - 1


def test_eval_does_not_change_the_trajectory():
    def run(eval_fn):
        torch.manual_seed(1)
        model = TinyLM(dropout=0.3)
        cfg = TrainConfig(steps=8, batch_size=4, lr=1e-2, warmup_steps=2, eval_every=3, log_every=0, progress=False)
        res = train(model, lm_loss, lm_batches(4, 0), cfg, eval_fn=eval_fn)
        return _state(model), res

    def noisy_eval(model):  # uses the global RNG
        return {"noise": torch.rand(()) + model(torch.zeros(1, 3, dtype=torch.long)).mean()}

    a, res = run(noisy_eval)
    b, _ = run(None)
    assert _same(a, b)
    assert [r["step"] for r in res.history if r["kind"] == "eval"] == [3, 6, 8]


def test_grad_accumulation_matches_full_batch():
    def run(accum):
        torch.manual_seed(2)
        model = TinyLM(dropout=0.0)
        cfg = TrainConfig(steps=5, batch_size=8, grad_accum_steps=accum, lr=1e-2, warmup_steps=0, progress=False)
        train(model, lm_loss, lm_batches(8, 3), cfg)
        return _state(model)

    a, b = run(1), run(4)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_bf16_autocast_on_cpu_and_fp16_refused():
    torch.manual_seed(0)
    model = TinyLM()
    res = train(model, lm_loss, lm_batches(4, 0), TrainConfig(steps=3, batch_size=4, precision="bf16", progress=False))
    assert math.isfinite(res.final_loss)
    with pytest.raises(ValueError, match="'fp16' needs a CUDA device"):
        train(model, lm_loss, lm_batches(4, 0), TrainConfig(steps=3, batch_size=4, precision="fp16", progress=False))


def test_batch_sources_and_errors(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    data = [sample_tokens(torch.Generator().manual_seed(i), 4) for i in range(3)]
    for source in (data, iter(data * 3), lm_batches(4, 0)):  # sequence, iterator, function
        assert train(model, lm_loss, source, TrainConfig(steps=5, batch_size=4, progress=False)).step == 5
    with pytest.raises(ValueError, match="ran out after 3 batches"):
        train(model, lm_loss, iter(data), TrainConfig(steps=5, batch_size=4, progress=False))
    with pytest.raises(ValueError, match="has 4 rows, config.batch_size is 8"):
        train(model, lm_loss, data, TrainConfig(steps=1, batch_size=8, progress=False))
    with pytest.raises(TypeError, match="scalar tensor"):
        train(model, lambda m, b: m(b), data, TrainConfig(steps=1, batch_size=4, progress=False))
    # a fresh run does not silently mix with another run's checkpoints
    cfg = TrainConfig(steps=2, batch_size=4, out_dir=str(tmp_path), progress=False)
    train(model, lm_loss, data, cfg)
    with pytest.raises(ValueError, match="already holds checkpoints; set resume=True"):
        train(model, lm_loss, data, cfg)


def test_shard_batch():
    x = torch.arange(12).reshape(6, 2)
    batch = {"x": x, "pair": (x, torch.tensor(3.0)), "name": "n"}
    s = shard_batch(batch, 1, 3)
    assert torch.equal(s["x"], x[2:4]) and torch.equal(s["pair"][0], x[2:4])
    assert s["pair"][1].item() == 3.0 and s["name"] == "n"
    with pytest.raises(ValueError, match="not divisible into 4"):
        shard_batch(x, 0, 4)


# ----------------------------------------------------------------------------------------
# checkpoints


def _trained(tmp_path, steps=3):
    torch.manual_seed(0)
    model = TinyLM()
    opt = make_optimizer(model, TrainConfig(lr=1e-2))
    for step in range(steps):
        opt.zero_grad()
        lm_loss(model, lm_batches(4, 0)(step))[0].backward()
        opt.step()
    path = save_checkpoint(tmp_path / "ck.safetensors", model, opt, step=steps, config=TrainConfig(), extra={"a": 1})
    return model, opt, path


def _fresh():
    torch.manual_seed(123)
    model = TinyLM()
    opt = make_optimizer(model, TrainConfig(lr=1e-2))
    opt.zero_grad()
    lm_loss(model, lm_batches(4, 9)(0))[0].backward()
    opt.step()  # some optimizer state to protect, too
    return model, opt


def test_checkpoint_round_trip(tmp_path):
    model, opt, path = _trained(tmp_path)
    m2, o2 = _fresh()
    ck = load_checkpoint(path, m2, o2)
    assert ck.step == 3 and ck.extra == {"a": 1} and ck.config["lr"] == TrainConfig().lr
    assert _same(_state(model), _state(m2)) and _same(_state(opt), _state(o2))
    assert o2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    from safetensors import safe_open  # a plain safetensors file: any reader opens it

    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        meta = f.metadata()
    assert {"model/embed.weight", "optim/state/0/exp_avg", "rng/0/torch_cpu"} <= names
    envelope = json.loads(meta["fastrpe"])
    assert json.loads(envelope["meta"])["step"] == 3 and len(envelope["sha256"]) == 64


def test_checkpoint_restores_rng(tmp_path):
    model, _, _ = _trained(tmp_path)
    import random

    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    save_checkpoint(tmp_path / "r.safetensors", model, step=0)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(6), random.seed(6), np.random.seed(6)
    load_checkpoint(tmp_path / "r.safetensors", model, restore_rng=True)
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]


def test_tied_weights(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    a, b = Tied(), Tied()
    save_checkpoint(tmp_path / "t.safetensors", a, step=0)
    load_checkpoint(tmp_path / "t.safetensors", b)
    assert torch.equal(a.embed.weight, b.embed.weight) and b.head.weight is b.embed.weight


def _expect_refused(path, match=None):
    model, opt = _fresh()
    before_m, before_o = _state(model), _state(opt)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, model, opt, restore_rng=True)
    assert _same(before_m, _state(model)) and _same(before_o, _state(opt)), "model or optimizer was modified"


@pytest.mark.parametrize("cut", ["half", "minus1", "header_only", "7bytes", "empty"])
def test_truncated_checkpoint_refused(tmp_path, cut):
    _, _, path = _trained(tmp_path)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    keep = {"half": len(data) // 2, "minus1": len(data) - 1, "header_only": 8 + n, "7bytes": 7, "empty": 0}[cut]
    path.write_bytes(data[:keep])
    _expect_refused(path, "truncated")


def test_flipped_byte_refused(tmp_path):
    _, _, path = _trained(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x01  # in the tensor payload
    path.write_bytes(bytes(data))
    _expect_refused(path, "checksum mismatch")


def test_every_flipped_byte_refused(tmp_path):
    """A bit flip anywhere (length prefix, header JSON, metadata, payload) is caught."""
    model = TinyLM(dim=4)
    path = save_checkpoint(tmp_path / "s.safetensors", model, step=1, rng=False)
    good = path.read_bytes()
    n = int.from_bytes(good[:8], "little")
    from fastrpe.train.checkpoint import decode_checkpoint

    positions = sorted(set(range(0, 8 + n, 3)) | set(range(8)) | set(range(8 + n, len(good), 17)))
    for pos in positions:
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[pos] ^= bit
            with pytest.raises(CheckpointError):
                decode_checkpoint(bytes(bad))
    m2 = TinyLM(dim=4)
    load_checkpoint(path, m2)  # the untouched file loads


def test_mismatched_model_refused(tmp_path):
    _, _, path = _trained(tmp_path)
    other = TinyLM(dim=8)
    before = _state(other)
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(path, other)
    assert _same(before, _state(other))
    extra = nn.Sequential(TinyLM())
    with pytest.raises(CheckpointError, match="model keys do not match"):
        load_checkpoint(path, extra)
    model, _ = _fresh()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="optimizer is AdamW in the checkpoint, SGD here"):
        load_checkpoint(path, model, sgd)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("kind", ["torch.save", "pickle-4", "pickle-0"])
def test_pickle_masquerading_as_checkpoint_refused(tmp_path, monkeypatch, kind):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.safetensors"
    payload = {"weights": _Exploit(str(marker))}
    if kind == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=int(kind[-1])))

    def forbidden(*a, **k):
        raise AssertionError("a checkpoint loader unpickled something")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, forbidden)
    _expect_refused(path)
    assert not marker.exists()


def test_checkpoint_manager_keeps_last_and_points_to_latest(tmp_path):
    model = TinyLM(dim=4)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None
    for step in (1, 2, 3, 4):
        mgr.save(step, model)
    assert [s for s, _ in mgr.checkpoints()] == [3, 4]
    assert mgr.latest().name == "step-00000004.safetensors"
    (tmp_path / "latest").write_text("../../etc/passwd\n")
    with pytest.raises(CheckpointError, match="does not name a checkpoint"):
        mgr.latest()
    (tmp_path / "latest").unlink()
    assert mgr.latest().name == "step-00000004.safetensors"  # highest step without a pointer
    assert not list(tmp_path.glob("*.tmp"))


# ----------------------------------------------------------------------------------------
# subprocess runs: SIGKILL + resume, torchrun

SCRIPT = r"""
import json, os, signal, sys
sys.path.insert(0, {tests_dir!r})
import torch
torch.set_num_threads(1)
from test_train import TinyLM, lm_loss, lm_batches
import fastrpe.train.checkpoint as ckmod
from fastrpe.train import Callback, TrainConfig, cleanup, init_from_env, train

args = json.loads(sys.argv[1])
info = init_from_env()
torch.manual_seed(0)
model = TinyLM(dropout=args["dropout"])
cfg = TrainConfig.from_dict(args["config"])
kill = args.get("kill")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(Callback):
    def on_checkpoint(self, state, path):
        if kill == ["after_checkpoint", state.step]:
            die()

    def on_step_end(self, state):
        if kill == ["after_step", state.step]:
            die()


if kill and kill[0] == "in_checkpoint_write":
    real_replace = os.replace

    def replace(src, dst):  # die after the temp file is written, before it is renamed
        if str(dst).endswith("step-%08d.safetensors" % kill[1]):
            die()
        real_replace(src, dst)

    ckmod.os.replace = replace

train(model, lm_loss, lm_batches(cfg.batch_size, cfg.seed), cfg, callbacks=[Killer()])
cleanup()
"""


def _script(tmp_path) -> Path:
    path = tmp_path / "run_train.py"
    path.write_text(SCRIPT.format(tests_dir=str(TESTS_DIR)))
    return path


def _train_subprocess(tmp_path, out_dir, config, kill=None, dropout=0.1, nproc=None):
    args = json.dumps({"config": {**config, "out_dir": str(out_dir)}, "kill": kill, "dropout": dropout})
    script = str(_script(tmp_path))
    if nproc is None:
        return run_job([sys.executable, script, args], tmp_path, timeout=120)
    return torchrun([script, args], nproc, tmp_path, out_dir, timeout=120)


RESUME_CFG = {"steps": 12, "batch_size": 8, "lr": 1e-2, "warmup_steps": 3, "ckpt_every": 4, "keep_last": 2,
              "log_every": 1, "progress": False, "resume": True, "seed": 7}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = _train_subprocess(tmp, tmp / "run", RESUME_CFG)
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


def _final(run_dir: Path):
    return read_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())


def _losses(run_dir: Path):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.parametrize("kill", [["after_checkpoint", 4], ["after_step", 10], ["in_checkpoint_write", 8]],
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_sigkill_then_resume_gives_identical_weights(tmp_path, uninterrupted, kill):
    run = tmp_path / "run"
    proc = _train_subprocess(tmp_path, run, RESUME_CFG, kill=kill)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpt = CheckpointManager(run / "checkpoints").latest()
    expected_ckpt = {"after_checkpoint": 4, "after_step": 8, "in_checkpoint_write": 4}[kill[0]]
    assert read_checkpoint(ckpt).step == expected_ckpt
    assert max(s for s, _ in _losses(run)) == kill[1]  # records beyond the checkpoint, dropped on resume

    proc = _train_subprocess(tmp_path, run, RESUME_CFG)  # resume=True in RESUME_CFG
    assert proc.returncode == 0, proc.stderr
    a, b = _final(uninterrupted), _final(run)
    assert a.step == b.step == RESUME_CFG["steps"]
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:  # model, optimizer state and RNG: bitwise equal
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert _losses(run) == _losses(uninterrupted)  # metrics.jsonl has no duplicated or lost steps
    assert not list((run / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path):
    """2 ranks x 2 micro-batches of 2 rows == 1 process with the global batch of 8."""
    cfg = {"steps": 6, "batch_size": 8, "lr": 1e-2, "warmup_steps": 2, "log_every": 2, "progress": False,
           "seed": 3, "ckpt_every": 3}
    two = _train_subprocess(tmp_path, tmp_path / "two", {**cfg, "grad_accum_steps": 2}, dropout=0.0, nproc=2)
    assert two.returncode == 0, two.stdout + two.stderr
    torch.manual_seed(0)  # as the script does
    model = TinyLM(dropout=0.0)
    one = train(model, lm_loss, lm_batches(8, cfg["seed"]), TrainConfig.from_dict(cfg))
    ckpt = _final(tmp_path / "two")
    ref, got = model.state_dict(), ckpt.model_state()
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert len(ckpt.meta["rng"]) == 2 and ckpt.extra["world_size"] == 2  # one RNG state per rank
    # only rank 0 wrote: one record per logged step
    losses = _losses(tmp_path / "two")
    assert [s for s, _ in losses] == [2, 4, 6]
    ref_losses = [r["loss"] for r in one.history if r["kind"] == "train"]
    assert [lb for _, lb in losses] == pytest.approx(ref_losses, abs=1e-5)


# ----------------------------------------------------------------------------------------
# the checkpoint directory: fallback, permissions, the file as safetensors writes it


def _flip(path: Path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_latest_falls_back_past_a_corrupt_newest_checkpoint(tmp_path):
    model = TinyLM(dim=4)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        mgr.save(step, model)
    _flip(mgr.path_for(3))
    with pytest.warns(UserWarning, match=r"step-00000003.*checksum mismatch.*falling back .* step-00000002"):
        assert mgr.latest() == mgr.path_for(2)
    mgr.path_for(2).write_bytes(mgr.path_for(2).read_bytes()[:50])  # truncated too: back to step 1
    with pytest.warns(UserWarning):
        assert mgr.latest_checkpoint().step == 1
    _flip(mgr.path_for(1))
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="step-00000003.*checksum mismatch"):
        mgr.latest()  # none verifies: the newest one's error, never a silent fresh start
    # a pointer to a file that is gone: the previous checkpoint, with a warning
    mgr2 = CheckpointManager(tmp_path / "b")
    for step in (1, 2):
        mgr2.save(step, model)
    mgr2.path_for(2).unlink()
    with pytest.warns(UserWarning, match="names step-00000002.safetensors, which does not exist; falling back"):
        assert mgr2.latest() == mgr2.path_for(1)


def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path):
    cfg = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup_steps=1, ckpt_every=1, keep_last=4, out_dir=str(tmp_path),
                      progress=False, seed=1)
    torch.manual_seed(0)
    train(TinyLM(), lm_loss, lm_batches(4, 1), cfg)
    _flip(tmp_path / "checkpoints" / "step-00000004.safetensors")
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="falling back to the previous checkpoint step-00000003"):
        res = train(TinyLM(), lm_loss, lm_batches(4, 1), cfg.replace(resume=True))
    assert res.resumed_from == 3 and res.step == 4


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_files_get_the_mode_the_umask_gives(tmp_path, umask):
    """atomic_write's temporary files are 0600 (mkstemp); what it leaves is 0666 minus the umask,
    like every other file the run writes."""
    old = os.umask(umask)
    try:
        cfg = TrainConfig(steps=2, batch_size=4, lr=1e-2, warmup_steps=1, ckpt_every=1, out_dir=str(tmp_path),
                          progress=False)
        train(TinyLM(), lm_loss, lm_batches(4, 0), cfg)
        from fastrpe._io import atomic_write

        atomic_write(tmp_path / "plain.txt", b"x")
    finally:
        os.umask(old)
    files = [tmp_path / "config.json", tmp_path / "metrics.jsonl", tmp_path / "plain.txt",
             tmp_path / "checkpoints" / "latest", *(tmp_path / "checkpoints").glob("step-*.safetensors")]
    assert len(files) == 6
    for f in files:
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, (f.name, oct(f.stat().st_mode))


def test_checkpoint_is_exactly_what_safetensors_writes(tmp_path):
    """Metadata goes through safetensors' own `metadata=`: re-serializing the file's tensors and
    metadata with the library gives the same bytes (no hand-edited header)."""
    from safetensors import safe_open
    from safetensors.torch import load, save

    model, opt = _fresh()
    path = save_checkpoint(tmp_path / "c.safetensors", model, opt, step=3)
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata()
    assert set(md) == {"fastrpe"}
    assert json.loads(md["fastrpe"])["format"] == "fastrpe.train.checkpoint/2"
    data = path.read_bytes()
    assert save(load(data), metadata=md) == data
    assert read_checkpoint(path).step == 3


def test_version_1_checkpoints_still_load(tmp_path):
    """Files of format 1 (digest over the raw payload, written by rewriting the header) verify and load."""
    import hashlib
    import struct

    from safetensors.torch import save

    model = TinyLM(dim=4)
    tensors = {"model/" + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    codes = {torch.float32: "F32", torch.int64: "I64"}
    meta = {"step": 5, "format": "fastrpe.train.checkpoint/1", "optimizer": None, "rng": [],
            "tensors": {k: [codes[t.dtype], list(t.shape)] for k, t in sorted(tensors.items())}}
    meta_json = json.dumps(meta, sort_keys=True)
    raw = save(tensors, metadata={"format": "fastrpe.train.checkpoint/1", "meta": meta_json})
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["sha256"] = hashlib.sha256(meta_json.encode() + raw[8 + n:]).hexdigest()
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path = tmp_path / "v1.safetensors"
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    m2 = TinyLM(dim=4)
    assert load_checkpoint(path, m2).step == 5
    assert _same(_state(model), _state(m2))
    _flip(path, 3)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint(path)
