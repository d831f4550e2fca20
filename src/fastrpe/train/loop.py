"""The training loop: AdamW, warm-up + decay schedule, clipping, mixed precision, metrics,
checkpoints, exact resumption and data parallelism.

    from fastrpe.train import TrainConfig, train, seeded_batches

    def sample(g: torch.Generator, batch_size: int):            # one global batch from a generator
        return torch.randint(0, 256, (batch_size, 65), generator=g)

    def loss_fn(model, tokens):                                 # -> loss, or (loss, {"name": value})
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    cfg = TrainConfig(steps=1000, batch_size=32, lr=3e-4, out_dir="runs/lm", ckpt_every=200, resume=True)
    result = train(model, loss_fn, seeded_batches(sample, cfg.batch_size, seed=cfg.seed), cfg)

Exact resumption. Step `s` uses `batches(s)` and the learning rate `Schedule(s)`; both depend on
`s` only, so a checkpoint needs to hold just the step, the weights, the optimizer state and
the RNG states (for dropout) to continue bit for bit. A run killed at any point and resumed
(`resume=True`) ends with the weights of an uninterrupted run. Evaluation runs with the RNG
state saved and restored around it, so it never changes the training trajectory either.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed as D
from .._io import atomic_write
from .checkpoint import CheckpointManager, RngState, load_checkpoint
from .config import BOOKKEEPING_FIELDS, TrainConfig
from .redraw import redraw_random_features
from .schedule import Schedule

log = logging.getLogger("fastrpe.train")

LossFn = Callable[[nn.Module, Any], "Tensor | tuple[Tensor, dict[str, Any]]"]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


# ----------------------------------------------------------------------------------------
# batches as a function of the step


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for step `step` of a run seeded with `seed` (distinct for distinct pairs)."""
    digest = hashlib.sha256(f"fastrpe:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_batches(sample: Callable[[torch.Generator, int], Any], batch_size: int, seed: int = 0) -> Callable[[int], Any]:
    """`batches(step) = sample(generator, batch_size)`, the generator seeded by `(seed, step)`.

    This is the batch source that makes resumption exact and free: batch `s` is recomputed
    from `s`, with nothing to fast-forward and no sampler state to checkpoint.
    """

    def batches(step: int):
        return sample(torch.Generator().manual_seed(step_seed(seed, step)), batch_size)

    batches.batch_size = batch_size  # type: ignore[attr-defined]
    return batches


class _IterableSource:
    """Step-indexed view of an iterable: re-iterated at exhaustion, fast-forwarded on resume.

    Resumption is exact only when iterating again yields the same batches in the same order.
    """

    def __init__(self, iterable: Iterable[Any]):
        self.iterable = iterable
        self.it: Iterator[Any] | None = None
        self.pos = 0

    def _next(self):
        if self.it is None:
            self.it = iter(self.iterable)
        try:
            return next(self.it)
        except StopIteration:
            if iter(self.iterable) is self.it:
                raise ValueError(f"train_batches: the iterator ran out after {self.pos} batches; pass a "
                                 "re-iterable (a list, a DataLoader) or a function step -> batch") from None
            self.it = iter(self.iterable)
            try:
                return next(self.it)
            except StopIteration:
                raise ValueError("train_batches: the iterable is empty") from None

    def __call__(self, step: int):
        if step < self.pos:
            self.it, self.pos = None, 0
        while self.pos < step:  # fast-forward (only on resume)
            self._next()
            self.pos += 1
        batch = self._next()
        self.pos += 1
        return batch


def as_batch_source(train_batches) -> Callable[[int], Any]:
    """`step -> batch` from a function (used as is), a sequence (`seq[step % len]`) or an iterable."""
    if callable(train_batches) and not isinstance(train_batches, nn.Module):
        return train_batches
    if isinstance(train_batches, Tensor):
        raise TypeError("train_batches: pass a function step -> batch, a sequence or an iterable of batches, "
                        "not a single tensor")
    if hasattr(train_batches, "__getitem__") and hasattr(train_batches, "__len__"):
        n = len(train_batches)
        if n == 0:
            raise ValueError("train_batches: the sequence is empty")
        return lambda step: train_batches[step % n]
    if hasattr(train_batches, "__iter__"):
        return _IterableSource(train_batches)
    raise TypeError(f"train_batches: expected a function step -> batch, a sequence or an iterable, "
                    f"got {type(train_batches).__name__}")


def _first_tensor(batch: Any) -> Tensor | None:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            t = _first_tensor(b)
            if t is not None:
                return t
    return None


def _count(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of a batch: the first tensor's rows, and the first integer tensor's size."""
    leaves: list[Tensor] = []

    def walk(b):
        if isinstance(b, Tensor):
            leaves.append(b)
        elif isinstance(b, dict):
            for v in b.values():
                walk(v)
        elif isinstance(b, (list, tuple)):
            for v in b:
                walk(v)

    walk(batch)
    samples = leaves[0].shape[0] if leaves and leaves[0].dim() else 1
    tokens = next((t.numel() for t in leaves if not t.is_floating_point() and t.dtype != torch.bool), None)
    return samples, tokens


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(b, device) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return type(batch)((k, _to_device(v, device)) for k, v in batch.items())
    return batch


# ----------------------------------------------------------------------------------------
# optimizer


def _is_positional(module: nn.Module) -> bool:
    return type(module).__module__.startswith("fastrpe.positions")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: matrices decay; biases, norm gains, other vectors/scalars and the
    parameters of `fastrpe.positions` modules (RPE tables, KERPLE/ALiBi slopes) do not.

    Tied parameters appear once.
    """
    positional: set[int] = set()
    for m in model.modules():
        if _is_positional(m):
            positional.update(id(p) for p in m.parameters())
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or id(p) in positional else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups(model, cfg.weight_decay)` with `cfg`'s betas and eps."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


# ----------------------------------------------------------------------------------------
# callbacks and results


class Callback:
    """Hooks called on every rank; override the ones you need. A plain function passed as a
    callback is called as `on_step_end(state)`."""

    def on_step_end(self, state: TrainState) -> None: ...

    def on_log(self, state: TrainState, record: dict[str, Any]) -> None: ...

    def on_eval(self, state: TrainState, metrics: dict[str, Any]) -> None: ...

    def on_checkpoint(self, state: TrainState, path: Path) -> None: ...

    def on_train_end(self, state: TrainState) -> None: ...


class _FunctionCallback(Callback):
    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, state):
        self.fn(state)


@dataclass
class TrainState:
    """What callbacks see. `step` counts completed optimizer steps."""

    step: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    rank: int = 0
    world_size: int = 1
    lr: float = 0.0
    out_dir: Path | None = None


@dataclass
class TrainResult:
    """`step` reached; the records logged by this call (`kind` "train" or "eval"); the last
    checkpoint written; the last train loss and eval metrics; the step resumed from (or None)."""

    step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None
    final_loss: float | None = None
    eval: dict[str, Any] | None = None
    resumed_from: int | None = None


# ----------------------------------------------------------------------------------------
# helpers


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def _call_loss(loss_fn: LossFn | None, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Any]]:
    out = model(batch) if loss_fn is None else loss_fn(model, batch)
    metrics: dict[str, Any] = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError("loss_fn must return a loss tensor or (loss, metrics dict)")
        out, metrics = out
    elif isinstance(out, dict):
        metrics = {k: v for k, v in out.items() if k != "loss"}
        out = out.get("loss")
    if not isinstance(out, Tensor) or out.numel() != 1:
        what = type(out).__name__ if not isinstance(out, Tensor) else f"a tensor of shape {tuple(out.shape)}"
        raise TypeError(f"the loss must be a scalar tensor, got {what}")
    return out.reshape(()), metrics


def _gather_rng() -> list[RngState] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere)."""
    s = RngState.capture()
    if D.current().world_size == 1:
        return [s]
    cpu = D.gather_tensors(s.torch_cpu)
    cuda = [D.gather_tensors(c) for c in s.cuda]
    js = D.gather_json({"python": s.python, "numpy": s.numpy})
    if cpu is None:
        return None
    return [RngState(cpu[r], [c[r] for c in cuda], js[r]["python"], js[r]["numpy"]) for r in range(len(cpu))]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), python `random` and numpy with `seed`."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _progress_bar(cfg: TrainConfig, enabled: bool, start: int):
    show = cfg.progress if cfg.progress is not None else sys.stderr.isatty()
    if not (enabled and show):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warnings.warn("progress bar requested but tqdm is not installed (pip install fastrpe[train])", stacklevel=3)
        return None
    return tqdm(total=cfg.steps, initial=start, desc="train", file=sys.stderr, dynamic_ncols=True, leave=True)


def _scalar(v: Any) -> float:
    return float(v.detach().float().mean().item()) if isinstance(v, Tensor) else float(v)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (written by a run that was killed before its next checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write(path, "".join(x + "\n" for x in keep).encode())


def _warn_config_change(saved: dict | None, cfg: TrainConfig, where: str) -> None:
    if not saved:
        return
    now = cfg.to_dict()
    defaults = TrainConfig().to_dict()  # a field newer than the checkpoint had its default then
    changed = [k for k in now if k not in BOOKKEEPING_FIELDS and saved.get(k, defaults[k]) != now[k]]
    if changed:
        warnings.warn(f"resuming from {where} with changed config field(s) {', '.join(changed)}: "
                      "the run will not match an uninterrupted one", stacklevel=3)


# ----------------------------------------------------------------------------------------
# the loop


def train(model: nn.Module, loss_fn: LossFn | None, train_batches: Any, config: TrainConfig, *,
          eval_fn: Callable[[nn.Module], dict[str, Any]] | None = None,
          callbacks: Sequence[Callback | Callable[[TrainState], None]] = (),
          optimizer: torch.optim.Optimizer | None = None) -> TrainResult:
    """Train `model` for `config.steps` optimizer steps.

    Args:
        model: any `nn.Module`, already on its device. In a `torchrun` job (after
            `init_from_env()`), each rank holds a replica; rank 0's initial weights are
            broadcast, and gradients are averaged over ranks every step.
        loss_fn: `loss_fn(model, batch) -> loss` or `-> (loss, {"name": value})`, with `loss`
            a scalar tensor averaged over the batch; None calls `model(batch)`, which must
            return the same. Metrics are averaged over steps (and ranks) and logged.
        train_batches: the global batches. Best a function `step -> batch` (see
            `seeded_batches`), deterministic in the step; also a sequence (`seq[step % len]`)
            or an iterable (re-iterated when exhausted, fast-forwarded on resume). A batch is
            a tensor or a tuple/list/dict of them with the batch in dimension 0; each rank
            takes its rows (`shard_batch`), then splits them into `grad_accum_steps` micro-batches.
            With context parallelism (`init_from_env(context_parallel=N)`) the N ranks of a group
            take the same rows; the model (built with the group) splits the sequences, and its
            loss must be the group's loss with this rank's share of the gradient (as
            `DecoderLM.loss` with a group is): gradients are summed over the group.
        config: a `TrainConfig`.
        eval_fn: `eval_fn(model) -> {"name": value}`, run every `config.eval_every` steps and at
            the end, on every rank, in eval mode under `torch.no_grad()`; logged by rank 0.
        callbacks: `Callback` objects, or functions called with the `TrainState` after each step.
        optimizer: overrides the default AdamW (`make_optimizer`). The schedule sets each
            group's lr to `schedule(step) * group.get("lr_scale", 1)`.

    Returns:
        A `TrainResult`. Files (rank 0, when `config.out_dir` is set): `config.json`,
        `metrics.jsonl` (one JSON record per line), `checkpoints/step-XXXXXXXX.safetensors`
        and `checkpoints/latest`.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = config
    info = D.current()
    rank, world = info.rank, info.world_size
    # rows of the batch are split over the DP replicas; the ranks of one context-parallel
    # group share their rows (the model splits the sequences)
    replica, replicas = info.dp_rank, info.dp_size
    main = rank == 0
    if info.context_parallel > 1 and not any(getattr(m, "group", None) is info.cp_group for m in model.modules()):
        # each CP rank would compute the whole rows' gradient, and the CP sum multiply it by N
        raise ValueError(f"train: the job is context-parallel ({info.context_parallel} ranks per sequence) but no "
                         "layer of the model has this rank's CP group; build it with group=info.cp_group")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("train: the model has no trainable parameters")
    device = params[0].device
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError(f"TrainConfig: precision 'fp16' needs a CUDA device (the model is on {device}); "
                         "use 'bf16' or 'fp32'")
    per_rank = cfg.batch_size // replicas if cfg.batch_size else 0
    if cfg.batch_size and (cfg.batch_size % replicas or per_rank % cfg.grad_accum_steps):
        raise ValueError(f"TrainConfig: batch_size {cfg.batch_size} must split evenly into {replicas} "
                         f"data-parallel rank(s) x {cfg.grad_accum_steps} micro-batch(es)")

    source = as_batch_source(train_batches)
    schedule = Schedule.from_config(cfg)
    opt = optimizer if optimizer is not None else make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.precision == "fp16")
    cbs = [c if isinstance(c, Callback) else _FunctionCallback(c) for c in callbacks]

    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
    manager = CheckpointManager(out_dir / CHECKPOINT_DIR, cfg.keep_last) if out_dir is not None else None
    metrics_path = out_dir / METRICS_FILE if out_dir is not None else None

    # ---- start: resume or seed ----
    start, resumed_from = 0, None
    # the newest checkpoint that verifies (a damaged newest one is skipped with a warning)
    ckpt = manager.latest_checkpoint() if (cfg.resume and manager is not None) else None
    if ckpt is not None:
        latest = ckpt.path
        _warn_config_change(ckpt.config, cfg, str(latest))
        load_checkpoint(ckpt, model, opt, scaler=scaler, restore_rng=True, rank=rank)
        start = resumed_from = ckpt.step
        log.info("resumed from %s (step %d)", latest, start)
    else:
        if manager is not None and not cfg.resume and manager.checkpoints():
            raise ValueError(f"train: {manager.directory} already holds checkpoints; set resume=True to continue "
                             "that run, or use another out_dir")
        seed_everything(cfg.seed + rank)
        D.broadcast_parameters(model)
    D.barrier()  # every rank has read the checkpoint before rank 0 may write (and prune) any
    if main and out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / CONFIG_FILE, (cfg.to_json() + "\n").encode())
        if resumed_from is not None:
            _truncate_metrics(metrics_path, start)
        elif metrics_path.exists():  # records of an earlier attempt that never checkpointed
            metrics_path.unlink()
    stack = contextlib.ExitStack()
    metrics_file = stack.enter_context(metrics_path.open("a")) if (main and metrics_path is not None) else None
    bar = _progress_bar(cfg, main, start)
    if bar is not None:
        stack.callback(bar.close)

    state = TrainState(start, model, opt, cfg, rank, world, schedule(start) if start < cfg.steps else 0.0, out_dir)
    result = TrainResult(step=start, resumed_from=resumed_from)

    def emit(record: dict[str, Any]) -> None:
        result.history.append(record)
        if metrics_file is not None:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    def evaluate(step: int) -> None:
        rng = RngState.capture()  # evaluation must not move the training RNG
        model.eval()
        try:
            with torch.no_grad(), _autocast(cfg.precision, device):
                metrics = eval_fn(model)
        finally:
            model.train()
            rng.restore()
        metrics = {k: _scalar(v) for k, v in (metrics or {}).items()}
        result.eval = metrics
        if main:
            emit({"kind": "eval", "step": step, **metrics})
        for c in cbs:
            c.on_eval(state, metrics)

    def checkpoint(step: int) -> None:
        rngs = _gather_rng()
        path = manager.path_for(step)
        if main:
            path = manager.save(step, model, opt, config=cfg, schedule=schedule, data={"step": step},
                                scaler=scaler, rng=rngs, extra={"world_size": world, "context_parallel": info.context_parallel})
        D.barrier()
        result.checkpoint = path
        for c in cbs:
            c.on_checkpoint(state, path)

    # interval accumulators (tensors: no device sync until a record is written)
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    acc_loss = torch.zeros((), device=device, dtype=acc_dtype)
    acc_norm = torch.zeros((), device=device, dtype=acc_dtype)
    acc_metrics: dict[str, Any] = {}
    n_acc = samples = 0
    tokens: int | None = 0
    t0 = time.perf_counter()
    t_start = t0

    model.train()
    try:
        for step in range(start, cfg.steps):
            lr = schedule(step)
            for group in opt.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            state.lr = lr

            batch = source(step)
            if cfg.batch_size:
                first = _first_tensor(batch)
                if first is not None and first.dim() and first.shape[0] != cfg.batch_size:
                    raise ValueError(f"train: batch {step} has {first.shape[0]} rows, config.batch_size is "
                                     f"{cfg.batch_size}")
            local = D.shard_batch(batch, replica, replicas)
            n_s, n_t = _count(local)
            samples += n_s
            tokens = None if (tokens is None or n_t is None) else tokens + n_t

            opt.zero_grad(set_to_none=True)
            for i in range(cfg.grad_accum_steps):
                micro = _to_device(D.shard_batch(local, i, cfg.grad_accum_steps), device)
                with _autocast(cfg.precision, device):
                    loss, metrics = _call_loss(loss_fn, model, micro)
                scaler.scale(loss.float() / cfg.grad_accum_steps).backward()
                acc_loss += loss.detach().to(acc_dtype) / cfg.grad_accum_steps
                for k, v in metrics.items():
                    v = v.detach().to(acc_dtype).mean() if isinstance(v, Tensor) else float(v)
                    acc_metrics[k] = acc_metrics.get(k, 0.0) + v / cfg.grad_accum_steps
            D.allreduce_gradients(params, replicas)
            scaler.unscale_(opt)
            if cfg.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            acc_norm += norm.detach().to(acc_dtype)
            scaler.step(opt)
            scaler.update()
            n_acc += 1

            done = step + 1
            state.step = result.step = done
            if cfg.feature_redraw_interval and done % cfg.feature_redraw_interval == 0:
                redraw_random_features(model, cfg.seed, done)  # before this step's checkpoint saves them
            if bar is not None:
                bar.update(1)
            last = done == cfg.steps

            if (cfg.log_every and done % cfg.log_every == 0) or last:
                keys = sorted(acc_metrics)
                vec = torch.stack([acc_loss, acc_norm] + [torch.as_tensor(acc_metrics[k], dtype=acc_dtype,
                                                                          device=device) for k in keys])
                vec = D.all_reduce_mean(vec / n_acc).tolist()
                dt = time.perf_counter() - t0
                record = {"kind": "train", "step": done, "loss": vec[0], "lr": lr, "grad_norm": vec[1]}
                record.update(zip(keys, vec[2:]))
                # the ranks of a CP group count the same rows and windows once each
                record["samples_per_s"] = D.all_reduce_sum(samples) / info.context_parallel / dt
                if tokens is not None:
                    record["tokens_per_s"] = D.all_reduce_sum(tokens) / info.context_parallel / dt
                record["elapsed_s"] = time.perf_counter() - t_start
                if not math.isfinite(record["loss"]):
                    raise FloatingPointError(f"train: loss is {record['loss']} at step {done}")
                result.final_loss = record["loss"]
                if main:
                    emit(record)
                if bar is not None:
                    post = {"loss": f"{record['loss']:.4g}", "lr": f"{lr:.2e}"}
                    if "tokens_per_s" in record:
                        post["tok/s"] = f"{record['tokens_per_s']:.3g}"
                    else:
                        post["samples/s"] = f"{record['samples_per_s']:.3g}"
                    bar.set_postfix(post, refresh=False)
                for c in cbs:
                    c.on_log(state, record)
                acc_loss.zero_()
                acc_norm.zero_()
                acc_metrics, n_acc, samples, tokens = {}, 0, 0, 0
                t0 = time.perf_counter()

            if eval_fn is not None and cfg.eval_every and (done % cfg.eval_every == 0 or last):
                evaluate(done)
            if manager is not None and ((cfg.ckpt_every and done % cfg.ckpt_every == 0) or (last and cfg.save_final)):
                checkpoint(done)
            for c in cbs:
                c.on_step_end(state)
        for c in cbs:
            c.on_train_end(state)
    finally:
        stack.close()
    return result
