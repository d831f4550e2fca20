"""`fastrpe train`: train a model on an embedded task, with checkpoints, --resume and torchrun.

Examples:
    fastrpe train --task lm --kernel nprf --position kerple_log --steps 500 --out runs/lm
    fastrpe train --task images --kernel elu --fastrpb --steps 300 --out runs/digits   # ViT, 2D positions
    fastrpe train --task lm --steps 500 --out runs/lm --resume          # continue after a stop
    torchrun --nproc_per_node 2 -m fastrpe.cli.main train --task lm --out runs/lm2   # data parallel
    torchrun --nproc_per_node 4 -m fastrpe.cli.main train --task lm --context-parallel 2 --out runs/cp
        # 2 ranks per sequence (each computes half of every window) x 2 data-parallel replicas

Writes `config.json`, `task.json`, `metrics.jsonl` and `checkpoints/` (safetensors) under
--out, and prints the final evaluation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    from ..train.tasks import SIZES, TASKS

    p = sub.add_parser("train", help="train a model on an embedded task (checkpoints, --resume, torchrun)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="lm", choices=sorted(TASKS))
    p.add_argument("--size", default="tiny", choices=list(SIZES), help="model size (width, layers, heads): "
                   + ", ".join(f"{k}={v}" for k, v in SIZES.items()))
    p.add_argument("--kernel", default="softmax", help="content kernel: softmax, nprf, elu, exp, dpfp, prf, ...")
    p.add_argument("--position", default=None,
                   help="lm/listops/seq2seq: none, sinusoidal, rotary, shaw or a positions family (kerple_log, alibi, "
                   "geometric, t5, ...; default kerple_log); images: none, learned_abs, sinusoidal2d, table2d (default)")
    p.add_argument("--backend", default="auto", help="attention backend (see `fastrpe explain`)")
    p.add_argument("--fastrpb", action="store_true", help="add FastRPB (listops: 1D, images: 2D)")
    p.add_argument("--dataset", default=None, help="lm: python-stdlib | shakespeare; seq2seq: copy | reverse | sort | "
                   "shift; images: digits | mnist | fashion-mnist")
    p.add_argument("--patch-size", type=int, default=None, help="images: patch side (default 2 for 8×8, else 4)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (all processes)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--eval-every", type=int, default=0, help="0: evaluate at the end only")
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10, help="steps between records in metrics.jsonl")
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="lm: corpus bytes to read")
    p.add_argument("--num-samples", type=int, default=4000, help="listops/seq2seq: training examples")
    p.add_argument("--eval-samples", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-redraw-interval", type=int, default=0, metavar="N",
                   help="redraw every random feature map's projection every N steps (Performer); 0: never")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="lm: split every sequence over N ranks of the torchrun job (attention across them, "
                   "fastrpe.distributed); the remaining factor of the world is data parallel. Default 1")
    p.add_argument("--device", default=None, help="default: cuda if available (the local rank's GPU under torchrun)")
    p.add_argument("--out", default="runs/train")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true")
    return p


def _check_args(args) -> None:
    """Refuse, naming the option, what cannot run: before any data is read or model built."""
    import math

    from .._validate import FastRPEError

    def need(ok: bool, option: str, why: str) -> None:
        if not ok:
            raise FastRPEError(f"{option}: {why}, got {getattr(args, option[2:].replace('-', '_'))!r}")

    for opt in ("--steps", "--seq-len", "--batch-size", "--num-samples", "--eval-samples", "--max-bytes",
                "--log-every"):
        need(getattr(args, opt[2:].replace("-", "_")) >= 1, opt, "must be >= 1")
    need(args.seq_len >= 2, "--seq-len", "must be >= 2 (an input and a target)")
    for opt in ("--warmup-steps", "--eval-every", "--ckpt-every"):
        need(getattr(args, opt[2:].replace("-", "_")) >= 0, opt, "must be >= 0 (0: off)")
    need(math.isfinite(args.lr) and args.lr > 0, "--lr", "must be a finite number > 0")
    for opt in ("--weight-decay", "--grad-clip"):
        v = getattr(args, opt[2:].replace("-", "_"))
        need(math.isfinite(v) and v >= 0, opt, "must be a finite number >= 0")
    need(args.patch_size is None or args.patch_size >= 1, "--patch-size", "must be >= 1")
    need(0 <= args.seed < 2**63, "--seed", "must be in [0, 2**63)")
    need(args.context_parallel >= 1, "--context-parallel", "must be >= 1")
    need(args.context_parallel == 1 or args.task == "lm", "--context-parallel",
         f"splits sequences of the lm task only (--task {args.task})")
    need(args.seq_len >= args.context_parallel, "--context-parallel",
         f"must be <= --seq-len ({args.seq_len}): every rank takes at least one position")


def _check_out(out: Path, resume: bool) -> None:
    """`--out` must be a directory we can write; one holding checkpoints needs --resume."""
    from .._validate import FastRPEError
    from ..train.checkpoint import CheckpointManager
    from ..train.loop import CHECKPOINT_DIR

    if out.exists() and not out.is_dir():
        raise FastRPEError(f"--out: {out} exists and is not a directory")
    if not resume and CheckpointManager(out / CHECKPOINT_DIR).checkpoints():
        raise FastRPEError(f"--out: {out} already holds checkpoints of a run; add --resume to continue it, "
                           "or choose another --out")


def _check_task(saved: Path, task_json: str) -> None:
    """`--resume` continues the run recorded in `task.json` only with the same task options."""
    from .._validate import FastRPEError

    ignore = ("device", "eval_samples", "description")  # do not change the training trajectory
    try:
        before = json.loads(saved.read_text())
    except json.JSONDecodeError as e:
        raise FastRPEError(f"--resume: {saved} is not valid JSON ({e}); it records the run's task") from None
    if not isinstance(before, dict):
        raise FastRPEError(f"--resume: {saved} does not hold the run's task options")
    before = {k: v for k, v in before.items() if k not in ignore}
    now = {k: v for k, v in json.loads(task_json).items() if k not in ignore}
    if before != now:
        diff = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in now if before.get(k) != now.get(k))
        raise FastRPEError(f"--resume: the task differs from the run in {saved.parent} ({diff}); "
                           "use another --out")


def run(args) -> int:
    import torch

    from .._validate import FastRPEError, check_device
    from ..train import TrainConfig, init_from_env, train
    from ..train.checkpoint import atomic_write
    from ..train.distributed import cleanup
    from ..train.loop import seed_everything
    from ..train.tasks import TaskOptions, build_task, with_defaults

    _check_args(args)
    if args.device is not None:
        check_device(args.device, "--device")
    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.precision == "fp16" and dev.type != "cuda":
        raise FastRPEError("--precision: fp16 needs a CUDA device (loss scaling); use bf16 or fp32 on the CPU")
    out = Path(args.out)
    _check_out(out, args.resume)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip, precision=args.precision,
                      seed=args.seed, eval_every=args.eval_every or args.steps, ckpt_every=args.ckpt_every, out_dir=args.out,
                      resume=args.resume, progress=False if args.no_progress else None, log_every=args.log_every,
                      feature_redraw_interval=args.feature_redraw_interval)

    from ..train.distributed import _env_int

    world = _env_int("WORLD_SIZE", 1)
    if world % args.context_parallel:
        raise FastRPEError(f"--context-parallel: {args.context_parallel} ranks per sequence do not divide the {world} "
                           "process(es) of this job (torchrun --nproc_per_node)")
    info = init_from_env(device=args.device, context_parallel=args.context_parallel)
    if args.batch_size % info.dp_size:
        raise FastRPEError(f"--batch-size: {args.batch_size} rows do not split into {info.dp_size} data-parallel "
                           f"replica(s) ({info.world_size} processes / --context-parallel {info.context_parallel})")
    device = str(info.device)
    opts = with_defaults(TaskOptions(task=args.task, size=args.size, kernel=args.kernel, position=args.position,
                       backend=args.backend, seq_len=args.seq_len, batch_size=args.batch_size, dataset=args.dataset,
                       max_bytes=args.max_bytes, num_samples=args.num_samples, eval_samples=args.eval_samples,
                       fastrpb=args.fastrpb, patch_size=args.patch_size, seed=args.seed, device=device))
    task_json = json.dumps(dataclasses.asdict(opts), indent=2)
    saved = out / "task.json"
    if args.resume and saved.is_file():  # before anything is built: a changed task is refused at once
        _check_task(saved, task_json)
    # seeded before the model is built, so a seed fixes the initial weights (and a run killed
    # before its first checkpoint restarts from the same ones); every rank builds the same model
    seed_everything(args.seed)
    task = build_task(opts)  # an option that does not fit the task raises ValueError naming it
    model = task.model.to(device)
    if info.context_parallel > 1:
        model.group = info.cp_group  # a DecoderLM: each rank computes its slice of every window
    if info.rank == 0:
        # written at the start, so that --resume of an interrupted run is checked against it
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(saved, (json.dumps(json.loads(task_json) | {"description": task.description}, indent=2)
                             + "\n").encode())
        n_params = sum(p.numel() for p in model.parameters())
        layout = (f" ({info.dp_size} data-parallel x {info.context_parallel} context-parallel)"
                  if info.context_parallel > 1 else "")
        print(f"{task.description}; {n_params / 1e6:.2f}M parameters; {info.world_size} process(es){layout} on {device}")
    result = train(model, task.loss_fn, task.batches, cfg, eval_fn=task.eval_fn)
    if info.rank == 0:
        msg = f"step {result.step}: train loss {result.final_loss:.4f}" if result.final_loss is not None else \
            f"step {result.step}"
        if result.eval:
            msg += "; " + ", ".join(f"{k} {v:.4f}" for k, v in result.eval.items() if isinstance(v, (int, float)))
        if result.resumed_from is not None:
            msg += f" (resumed from step {result.resumed_from})"
        print(msg)
        print(f"wrote {out / 'metrics.jsonl'} and {out / 'checkpoints'}")
    cleanup()
    return 0
