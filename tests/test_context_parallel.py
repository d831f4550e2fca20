"""Context-parallel models and training (issue 17 parts 3-4): `DecoderLM(cfg, group=...)` across
4 CPU processes (gloo) against one process, and `fastrpe train --context-parallel N` under
torchrun against the 1-process run.

The layer checks run in one launch of 4 processes (start-up is the slow part); each process
runs this file as a script (`python tests/test_context_parallel.py RANK WORLD INIT OUT CASES`)
and rank 0 writes every check's largest error over the ranks. The reference is the same
model (same weights, float64) without a group, on the whole batch, in every process: nothing
but the weights is shared with the path under test.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from _launch import torchrun

from fastrpe import FastRPEError
from fastrpe.nn import DecoderLM, LMConfig, MultiheadAttention

WORLD = 4
TOL = 1e-10  # float64
UNEVEN = (5, 17, 1, 40)  # forward() slices of a 63-token sequence, one of length 1


# ------------------------------------------------------------------------------------------
# the checks, run on every rank


def _model(kernel: str, position: str, backend: str = "auto") -> DecoderLM:
    torch.manual_seed(0)  # the same weights (and random features) on every rank
    cfg = LMConfig(vocab_size=37, d_model=24, n_layers=2, n_heads=3, kernel=kernel, position=position,
                   num_features=12 if kernel != "softmax" else None, backend=backend)
    m = DecoderLM(cfg).double()
    with torch.no_grad():  # positional parameters away from their initial values
        for name, p in m.named_parameters():
            if "positions" in name:
                p.add_(0.2 * torch.randn(p.shape, dtype=p.dtype))
    return m


def _grads(m) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in m.named_parameters()}


def _compare(case: dict, rank: int, world: int) -> float:
    """Largest error of the loss, this rank's logits and the parameter gradients (summed over
    the CP group and averaged over DP, as `fastrpe.train` does) against one process."""
    from fastrpe.train import distributed as D

    cp = case["cp"]
    cp_group, _ = D.make_groups(cp)
    dp_rank, dp_size, cp_rank = rank // cp, world // cp, rank % cp
    g = torch.Generator().manual_seed(5)
    B, L = 4, 63
    tokens = torch.randint(0, 37, (B, L + 1), generator=g)

    ref = _model(case["kernel"], case["position"], case.get("backend", "auto"))
    ref_loss = ref.loss(tokens)
    ref_loss.backward()
    ref_logits = ref(tokens[:, :-1]).detach()
    want = _grads(ref)

    m = _model(case["kernel"], case["position"], case.get("backend", "auto"))
    m.group = cp_group
    rows = slice(dp_rank * (B // dp_size), (dp_rank + 1) * (B // dp_size))
    loss = m.loss(tokens[rows])  # every CP rank passes the same whole windows of its DP rows
    loss.backward()
    D.allreduce_gradients([p for p in m.parameters()], replicas=dp_size)
    got = _grads(m)
    # the DP replica's loss is the mean over its rows: average over DP for the global one
    loss_all = D.all_reduce_mean(loss.detach())
    errs = [(loss_all - ref_loss.detach()).abs()]
    errs += [(got[n] - want[n]).abs().max() for n in want]
    # forward on uneven slices: this rank's logits, and gradients through a fixed cotangent
    with torch.no_grad():
        m.zero_grad(set_to_none=True)
    lengths = UNEVEN if cp == 4 else (20, 43)
    off, n = sum(lengths[:cp_rank]), lengths[cp_rank]
    logits = m(tokens[rows, off:off + n])
    errs.append((logits - ref_logits[rows, off:off + n]).abs().max())
    return float(torch.stack([e.detach() for e in errs]).max())


def _mha(case: dict, rank: int, world: int) -> float:
    """`MultiheadAttention` on uneven slices with a key padding mask: output, input gradient
    and parameter gradients (summed over the group) against the layer without a group."""
    import copy

    import torch.distributed as dist

    import fastrpe as fr

    group = dist.new_group(list(range(world)))
    H, E = 3, 24
    torch.manual_seed(1)
    kernel = "softmax" if case["kernel"] == "softmax" else fr.kernels.get_kernel(case["kernel"], head_dim=E // H,
                                                                                 num_features=12, seed=2)
    pos = {"t5": lambda: fr.positions.T5Bias(H, num_buckets=8, max_distance=20, bidirectional=not case["causal"]),
           "kerple_log": lambda: fr.positions.KerpleLog(H)}[case["position"]]()
    ref = MultiheadAttention(E, H, kernel, pos, causal=case["causal"]).double()
    mine = copy.deepcopy(ref)
    mine.group = group
    g = torch.Generator().manual_seed(4)
    L = sum(UNEVEN)
    x = torch.randn(2, L, E, generator=g, dtype=torch.float64)
    mask = torch.rand(2, L, generator=g) < 0.3
    mask[:, 0] = False
    go = torch.randn(2, L, E, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr, key_padding_mask=mask)
    (out_ref * go).sum().backward()
    off, n = sum(UNEVEN[:rank]), UNEVEN[rank]
    sl = slice(off, off + n)
    xl = x[:, sl].clone().requires_grad_()
    out = mine(xl, key_padding_mask=mask[:, sl])
    (out * go[:, sl]).sum().backward()
    errs = [(out - out_ref[:, sl]).abs().max(), (xl.grad - xr.grad[:, sl]).abs().max()]
    for (name, a), b in zip(mine.named_parameters(), ref.parameters()):
        ga = a.grad.clone() if a.grad is not None else torch.zeros_like(a)
        dist.all_reduce(ga, group=group)
        errs.append((ga - (b.grad if b.grad is not None else torch.zeros_like(b))).abs().max())
    return float(torch.stack([e.detach() for e in errs]).max())


def _refusals(case: dict, rank: int, world: int) -> float:
    """What a context-parallel layer refuses, on every rank, with one line."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    mha = MultiheadAttention(8, 2, causal=True, group=group).double()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    m = _model("softmax", "alibi")
    m.group = group
    calls = [lambda: mha(x, x, x), lambda: mha(x, q_offset=2), lambda: mha.step(x),
             lambda: m.loss(torch.zeros(2, 9, dtype=torch.long), reduction="none"),
             lambda: m.loss(torch.zeros(2, 3, dtype=torch.long)),  # 2 targets, 4 ranks
             lambda: m.step(torch.zeros(1, 2, dtype=torch.long))]
    bad = 0
    for call in calls:
        try:
            call()
            bad += 1
        except FastRPEError as e:
            bad += "\n" in str(e)
    # a context-parallel job whose model is not on the CP group is refused before any step
    from fastrpe.train import TrainConfig, train
    from fastrpe.train import distributed as D

    D.make_groups(2)
    try:
        train(_model("softmax", "alibi"), lambda mdl, b: mdl.loss(b), [torch.zeros(2, 9, dtype=torch.long)],
              TrainConfig(steps=1, batch_size=2, warmup_steps=0))
        bad += 1
    except ValueError as e:
        bad += "no layer of the model has this rank's CP group" not in str(e)
    return float(bad)


def _cases() -> dict[str, dict]:
    cases = {}
    for kernel, position in (("softmax", "alibi"), ("nprf", "kerple_log"), ("softmax", "rotary"),
                             ("elu", "sinusoidal")):
        for cp in (2, 4):
            cases[f"{kernel}-{position}-cp{cp}"] = dict(fn="compare", kernel=kernel, position=position, cp=cp)
    # the state-passing paths: chunked (geometric decay) and band (finite support), forced as on one process
    for position, backend in (("alibi", "chunked"), ("t5", "band")):
        cases[f"nprf-{position}-{backend}-cp4"] = dict(fn="compare", kernel="nprf", position=position, cp=4,
                                                      backend=backend)
    for kernel, position, causal in (("softmax", "t5", False), ("nprf", "kerple_log", True)):
        cases[f"mha-{kernel}-{position}-mask-{'causal' if causal else 'full'}"] = dict(
            fn="mha", kernel=kernel, position=position, causal=causal)
    cases["refusals"] = dict(fn="refusals")
    return cases


_FNS = {"compare": _compare, "mha": _mha, "refusals": _refusals}


def _worker(rank: int, world: int, init: str, out: str, names: list[str]) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    cases, results, tbs = _cases(), {}, {}
    for name in names:
        try:
            err = _FNS[cases[name]["fn"]](cases[name], rank, world)
        except Exception:  # a failure is a result: report it, do not hang the others
            err, tbs[f"{name}@{rank}"] = float("inf"), traceback.format_exc()
        e = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        results[name] = float(e)
    every = [None] * world
    dist.all_gather_object(every, tbs)
    if rank == 0:
        results["_tracebacks"] = {k: v for t in every for k, v in t.items()}
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp: Path, names: list[str]) -> dict:
    init, out = tmp / "init", tmp / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(WORLD), str(init), str(out), ",".join(names)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(WORLD)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for pp in procs:
                pp.kill()
            raise AssertionError("the 4 processes did not finish in 240 s")
    assert out.is_file(), "\n".join(logs)[-4000:]  # the results, written before the teardown
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("cp"), list(_cases()))


def _tb(results, name) -> str:
    return "\n".join(v for k, v in results["_tracebacks"].items() if k.startswith(name + "@"))


@pytest.mark.parametrize("name", [n for n, c in _cases().items() if c["fn"] == "compare"])
def test_decoder_lm_matches_one_process(results, name):
    """Loss, logits (uneven slices 5, 17, 1, 40 / 20, 43) and every parameter gradient within
    1e-10 in float64; cp2 is 2 DP x 2 CP (rows split over DP, gradients summed over CP).
    Paths taken: softmax -> ring; NPRF + KERPLE log -> gather; elu (no term), NPRF + ALiBi
    (chunked), NPRF + T5 (band) -> linear."""
    assert results[name] <= TOL, f"{name}: max error {results[name]}\n" + _tb(results, name)


@pytest.mark.parametrize("name", [n for n, c in _cases().items() if c["fn"] == "mha"])
def test_attention_layer_with_padding_matches_one_process(results, name):
    """`MultiheadAttention(group=...)` on slices 5, 17, 1, 40 with a key padding mask: output,
    input and parameter gradients within 1e-10 (float64)."""
    assert results[name] <= TOL, f"{name}: max error {results[name]}\n" + _tb(results, name)


def test_context_parallel_refusals(results):
    assert results["refusals"] == 0.0, _tb(results, "refusals") or "a call was not refused in one line"


# ------------------------------------------------------------------------------------------
# single process


def test_group_must_be_a_process_group():
    with pytest.raises(FastRPEError, match="group"):
        MultiheadAttention(8, 2, group=object())
    with pytest.raises(FastRPEError, match="group"):
        DecoderLM(LMConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2), group="ranks")


def test_without_group_nothing_changes():
    torch.manual_seed(0)
    m = DecoderLM(LMConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2)).double()
    tokens = torch.randint(0, 11, (2, 10))
    a = m.loss(tokens)
    m.group = None
    assert torch.equal(a, m.loss(tokens)) and m.group is None


# ------------------------------------------------------------------------------------------
# `fastrpe train --context-parallel N` under torchrun


TRAIN = ["train", "--task", "lm", "--seq-len", "31", "--max-bytes", "60000", "--batch-size", "4", "--steps", "6",
         "--lr", "3e-3", "--warmup-steps", "1", "--ckpt-every", "3", "--log-every", "1", "--eval-samples", "4", "--no-progress",
         "--kernel", "softmax", "--position", "alibi", "--seed", "3"]


def _records(out: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _torchrun(tmp: Path, nproc: int, args: list[str], out: Path):
    return torchrun(["-m", "fastrpe.cli.main", *args, "--out", str(out)], nproc, tmp, out, timeout=180)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from fastrpe.cli.main import main

    out = tmp_path_factory.mktemp("one") / "run"
    assert main([*TRAIN, "--out", str(out)]) == 0
    return out


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    from fastrpe.train import read_checkpoint

    return read_checkpoint(sorted((out / "checkpoints").glob("step-*.safetensors"))[-1]).model_state()


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp2")
    proc = _torchrun(tmp, 2, [*TRAIN, "--context-parallel", "2"], tmp / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "run"


# The CLI trains in float32; the runs differ only in the order of sums (loss and gradient
# all-reduces, attention split over ranks). Measured (4 ranks vs 1, 6 steps): losses within
# 2.4e-7 (one float32 ulp at 5.0 is 4.8e-7), grad norms within 1e-6, weights within 1e-5 of
# their norm. LOSS_TOL is 10 ulps; a wrong weighting of the ranks' losses or gradients (a
# missing CP sum, a DP sum instead of a mean) moves the step-2 loss by > 1e-2.
LOSS_TOL, REL_TOL = 5e-6, 1e-4
# Softmax is invariant to a bias added to every key (it shifts a row's scores by one
# constant), so the key-projection biases have an exact gradient of 0: Adam turns the
# float32 noise of either run into steps of its own, and their values are not compared.
NOISE_ONLY = ".attn.k_proj.bias"


def _assert_same_run(out: Path, ref: Path) -> None:
    a_all = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    b_all = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in b_all] == [(r["kind"], r["step"]) for r in a_all]  # rank 0 alone logs
    assert [r["step"] for r in a_all if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(a_all, b_all):
        for key in ("loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=LOSS_TOL), (key, a, b)
        if "grad_norm" in a:
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=REL_TOL), (a, b)
    want, have = _final_state(ref), _final_state(out)
    assert want.keys() == have.keys()
    for k in want:
        if not k.endswith(NOISE_ONLY):
            rel = float((have[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30))
            assert rel <= REL_TOL, f"{k}: relative difference {rel:.2e}"
    names = sorted(p.name for p in (out / "checkpoints").glob("step-*.safetensors"))
    assert names == ["step-00000003.safetensors", "step-00000006.safetensors"]
    assert not list((out / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_train_context_parallel_2_matches_one_process(cp2_run, one_process):
    """2 ranks = 1 DP x 2 CP: the loss curve, the evaluation and the final weights of the
    1-process run; the checkpoints written once."""
    _assert_same_run(cp2_run, one_process)


@pytest.mark.slow
def test_train_dp2_cp2_matches_one_process(tmp_path, one_process):
    """4 ranks = 2 DP x 2 CP: rows split over DP, sequences over CP; the 1-process run."""
    proc = _torchrun(tmp_path, 4, [*TRAIN, "--context-parallel", "2"], tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 data-parallel x 2 context-parallel" in proc.stdout
    _assert_same_run(tmp_path / "run", one_process)


@pytest.mark.slow
def test_train_context_parallel_resumes(tmp_path, cp2_run):
    """Drop the last checkpoint of the 2-rank run, --resume from step 3: the same weights, bit for bit."""
    from fastrpe.train import read_checkpoint

    out = tmp_path / "run"
    shutil.copytree(cp2_run, out)
    last = out / "checkpoints" / "step-00000006.safetensors"
    before = read_checkpoint(last).model_state()
    last.unlink()
    (out / "checkpoints" / "latest").unlink(missing_ok=True)
    proc = _torchrun(tmp_path, 2, [*TRAIN, "--context-parallel", "2", "--resume"], out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from step 3" in proc.stdout
    after = read_checkpoint(last).model_state()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_checkpoint_whose_header_length_starts_with_0x80_loads(tmp_path):
    """A safetensors length prefix whose first byte is 0x80 (a header of 128 + 256k bytes, hit
    by a context-parallel run's checkpoint) is not a pickle: it loads."""
    from fastrpe.train import read_checkpoint, save_checkpoint

    model = torch.nn.Linear(2, 2)
    for pad in range(512):
        path = save_checkpoint(tmp_path / "c.safetensors", model, step=1, rng=False, extra={"pad": "x" * pad})
        if path.read_bytes()[:1] == b"\x80":
            break
    else:
        pytest.fail("no header length with a first byte 0x80 in 512 tries")
    assert read_checkpoint(path).step == 1


def test_train_context_parallel_refusals(tmp_path, capsys):
    from fastrpe.cli.main import main

    for extra, fragment in ((["--context-parallel", "0"], "--context-parallel"),
                            (["--context-parallel", "2"], "do not divide the 1 process"),
                            (["--context-parallel", "2", "--task", "images"], "lm task only"),
                            (["--context-parallel", "40"], "--seq-len")):
        capsys.readouterr()
        assert main([*TRAIN, *extra, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5].split(","))
