"""Small causal-LM runs shared by `fastrpe extrapolate` and the reproductions, through the one
training stack (`fastrpe.train.train`).

`train_lm` builds a `DecoderLM` from a seed and trains it on random windows of a token
stream (`data.text.random_windows`, batch `s` drawn from a generator seeded by `(seed, s)`)
with `train_config`'s hyper-parameters: AdamW, linear warm-up over the first 10 % of the
steps then cosine decay to 0, clipping at 1. Given an `out_dir` it checkpoints and resumes
exactly. `eval_nll` scores non-overlapping windows (KERPLE's protocol). Both are
deterministic given the seed.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..train.loop import Callback


@dataclass
class LMRun:
    """What `train_lm` returns: the trained model, the training loss at every step, wall time,
    whether training stopped early because the loss became non-finite, and the step the run
    resumed from (None for a fresh run)."""

    model: torch.nn.Module
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    diverged: bool = False
    resumed_from: int | None = None


def add_model_arguments(p) -> None:
    """The small causal LM's options, shared by `fastrpe extrapolate` and the LM reproductions
    (the same defaults, so their runs are comparable): batch, learning rate, width, depth,
    heads and device."""
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


class StepBar(Callback):
    """A `fastrpe.train` callback that shows a progress bar over `total` steps (tqdm when
    installed, else nothing), with the last train loss. One bar can follow several runs
    (`start_run`, `end_run`); a resumed run moves it past the steps it had finished."""

    def __init__(self, total: int, desc: str = ""):
        from ..train.progress import progress

        self.bar = progress(None, desc=desc, total=total)
        self.last = 0

    def _sync(self, step: int) -> None:
        if self.bar is not None and step > self.last:  # a resumed run jumps over its finished steps
            self.bar.update(step - self.last)
        self.last = max(self.last, step)

    def start_run(self, desc: str | None = None) -> None:
        """The next steps belong to another run (counted from its own step 0)."""
        self.last = 0
        if self.bar is not None and desc is not None:
            self.bar.set_description(desc, refresh=False)

    def end_run(self, steps: int) -> None:
        """The current run has reached `steps` (also when it had nothing left to train)."""
        self._sync(steps)

    def on_step_end(self, state) -> None:
        self._sync(state.step)

    def on_log(self, state, record) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_config(*, steps: int, batch_size: int, lr: float, seed: int = 0, weight_decay: float = 0.01,
                 grad_clip: float = 1.0, out_dir: str | Path | None = None, ckpt_every: int = 0,
                 progress: bool = False):
    """The `TrainConfig` of every reproduction's run (the small LMs and FastRPB's classifiers):
    AdamW (betas 0.9, 0.999 — the mean of the one-cycle schedule's beta1 these runs used
    before; decay `weight_decay` on matrices only), warm-up over 10 % of the steps to `lr`,
    cosine decay to 0, clipping at `grad_clip`, a record every step. With `out_dir`: checkpoints every `ckpt_every` steps and
    at the end, and resumption from the newest one."""
    from ..train import TrainConfig

    return TrainConfig(steps=steps, batch_size=batch_size, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999),
                       warmup_steps=max(1, round(0.1 * steps)), schedule="cosine", min_lr_ratio=0.0,
                       grad_clip=grad_clip, seed=seed, log_every=1, ckpt_every=ckpt_every if out_dir else 0,
                       keep_last=1, save_final=out_dir is not None,
                       out_dir=None if out_dir is None else str(out_dir), resume=out_dir is not None,
                       progress=progress)


def _logged_losses(out_dir: Path) -> list[float]:
    """Train losses recorded in `out_dir/metrics.jsonl` (one per step with `log_every=1`)."""
    from ..train.loop import METRICS_FILE

    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        return []
    losses = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train":
            losses.append(rec["loss"])
    return losses


def train_lm(cfg, stream: Tensor, *, length: int, steps: int, batch_size: int, lr: float, seed: int = 0,
             device: str | torch.device = "cpu", weight_decay: float = 0.01, grad_clip: float = 1.0,
             desc: str = "", progress: bool = True, setup=None, out_dir: str | Path | None = None,
             ckpt_every: int = 0, callbacks: Sequence = ()) -> LMRun:
    """Train `DecoderLM(cfg)` for `steps` steps on windows of `length + 1` tokens through
    `fastrpe.train.train` (hyper-parameters: `train_config`).

    The same `seed` gives the same initialization and the same batches for every config,
    so runs that differ only in their attention are paired. `setup(model)`, if given, may
    change the model in place before the optimizer is built. With `out_dir` the run
    checkpoints there and a second call continues from the newest checkpoint (bit for bit).
    A non-finite loss stops training (`diverged`). `callbacks` go to `train`; `progress`
    shows a bar labelled `desc` (`StepBar`).
    """
    from ..data.text import random_windows
    from ..nn import DecoderLM
    from ..train import seeded_batches, train

    if stream.numel() < length + 2:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length + 1}")
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    if setup is not None:
        setup(model)
    model = model.to(device)
    config = train_config(steps=steps, batch_size=batch_size, lr=lr, seed=seed, weight_decay=weight_decay,
                          grad_clip=grad_clip, out_dir=out_dir, ckpt_every=ckpt_every)  # the bar is StepBar
    batches = seeded_batches(lambda g, bs: random_windows(stream, length, bs, g), batch_size, seed)
    run = LMRun(model)

    class _Losses(Callback):
        def on_log(self, state, record):
            run.losses.append(record["loss"])

    bar = StepBar(steps, desc) if progress else None
    t0 = time.time()
    try:
        result = train(model, lambda m, b: m.loss(b.to(device)), batches, config,
                       callbacks=[_Losses(), *([bar] if bar is not None else []), *callbacks])
        run.resumed_from = result.resumed_from
    except FloatingPointError:  # the loop refuses a non-finite loss: the run diverged
        run.diverged = True
        run.losses.append(float("nan"))
    finally:
        if bar is not None:
            bar.close()
    run.seconds = time.time() - t0
    if out_dir is not None and not run.diverged:
        run.losses = _logged_losses(Path(out_dir))  # the whole curve, across resumptions
    return run


def eval_nll(model, stream: Tensor, length: int, max_tokens: int, batch: int, device) -> tuple[float, int]:
    """Summed next-token negative log-likelihood and token count over non-overlapping
    windows of `length` tokens (`fastrpe.train.evaluation.lm_nll`)."""
    from ..train.evaluation import lm_nll

    return lm_nll(model, stream, length, max_tokens, batch, device)


def eval_ppl(model, stream: Tensor, length: int, max_tokens: int, batch: int, device) -> float:
    """Perplexity over non-overlapping windows of `length` tokens."""
    total, count = eval_nll(model, stream, length, max_tokens, batch, device)
    return math.exp(total / max(count, 1))
