"""Small causal-LM runs shared by `fastrpe extrapolate` and the reproductions.

`train_lm` trains a `DecoderLM` on random windows of a token stream (AdamW, one-cycle
schedule, clipping) and returns the model with its loss curve; `eval_ppl` scores
non-overlapping windows (KERPLE's protocol). Both are deterministic given the seed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class LMRun:
    """What `train_lm` returns: the trained model, the loss at every step, wall time, and
    whether training stopped early because the loss became non-finite."""

    model: torch.nn.Module
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    diverged: bool = False


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


def random_windows(stream: Tensor, length: int, batch_size: int, g: torch.Generator) -> Tensor:
    """`[batch_size, length + 1]` windows of `stream` at uniform random starts."""
    if stream.numel() < length + 2:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length + 1}")
    idx = torch.randint(0, stream.numel() - length - 1, (batch_size,), generator=g)
    return torch.stack([stream[i:i + length + 1] for i in idx.tolist()])


def train_lm(cfg, stream: Tensor, *, length: int, steps: int, batch_size: int, lr: float, seed: int = 0,
             device: str | torch.device = "cpu", weight_decay: float = 0.01, grad_clip: float = 1.0,
             desc: str = "", progress: bool = True, stop_on_nonfinite: bool = True, setup=None) -> LMRun:
    """Train `DecoderLM(cfg)` for `steps` steps on windows of `length + 1` tokens.

    The same `seed` gives the same initialization and the same batches for every config,
    so runs that differ only in their attention are paired. `setup(model)`, if given, may
    change the model in place before the optimizer is built.
    """
    from ..nn import DecoderLM
    from ..train.progress import progress as bar_of

    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    if setup is not None:
        setup(model)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    run = LMRun(model)
    t0 = time.time()
    bar = bar_of(range(steps), desc=desc, disable=not progress)
    for step in bar:
        batch = random_windows(stream, length, batch_size, g).to(device)
        loss = model.loss(batch)
        value = loss.item()
        run.losses.append(value)
        if not math.isfinite(value):
            run.diverged = True
            if stop_on_nonfinite:
                break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        if hasattr(bar, "set_postfix") and step % 10 == 0:
            bar.set_postfix(loss=f"{value:.3f}")
    run.seconds = time.time() - t0
    return run


def eval_nll(model, stream: Tensor, length: int, max_tokens: int, batch: int, device) -> tuple[float, int]:
    """Summed next-token negative log-likelihood and token count over non-overlapping
    windows of `length` tokens (each window predicts its own tokens 1..length)."""
    from ..data.text import eval_windows

    wins = eval_windows(stream, length, max_tokens=max_tokens)  # (N, length + 1)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, wins.shape[0], batch):
            w = wins[i:i + batch].to(device)
            total += model.loss(w, reduction="sum").item()
            count += w[:, 1:].numel()
    model.train(was_training)
    return total, count


def eval_ppl(model, stream: Tensor, length: int, max_tokens: int, batch: int, device) -> float:
    """Perplexity over non-overlapping windows of `length` tokens."""
    total, count = eval_nll(model, stream, length, max_tokens, batch, device)
    return math.exp(total / max(count, 1))
