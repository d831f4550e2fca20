"""FastRPB reproduction: one classifier's run, through the one training stack (`fastrpe.train`)."""
from __future__ import annotations

import math
import time

from torch import nn

from ..lm import train_config
from .stats import subsample


def train_classifier(model: nn.Module, sample, val_batches, *, steps: int, batch_size: int, lr: float,
                     weight_decay: float, seed: int, device) -> dict:
    """Train `model` with `fastrpe.train.train` (hyper-parameters: `reproduce.lm.train_config`:
    AdamW, positional parameters not decayed, 10 % warm-up then cosine decay, clipping at 1),
    then evaluate it on `val_batches`. Batch `s` is `sample(g, batch_size)` with `g` seeded by
    `(seed, s)`, so equal seeds give equal batch streams. A non-finite loss stops training."""
    from ...train import Callback, seeded_batches, train
    from ...train.evaluation import classification_metrics

    model = model.to(device).train()
    losses: list[float] = []

    class _Losses(Callback):
        def on_log(self, state, record):
            losses.append(record["loss"])

    def loss_fn(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x.to(device)).float(), y.to(device))

    config = train_config(steps=steps, batch_size=batch_size, lr=lr, seed=seed, weight_decay=weight_decay)
    diverged = False
    t0 = time.time()
    try:
        train(model, loss_fn, seeded_batches(sample, batch_size, seed), config, callbacks=[_Losses()])
    except FloatingPointError:  # the loop refuses a non-finite loss
        diverged = True
        losses.append(float("nan"))
    seconds = time.time() - t0
    m = classification_metrics(model, val_batches, device)
    val_loss = m["val_loss"]
    return {"val_acc": m["val_acc"], "val_loss": val_loss if math.isfinite(val_loss) else None, "diverged": diverged,
            "steps_run": len(losses), "final_train_loss": losses[-1] if losses and math.isfinite(losses[-1]) else None,
            "seconds": round(seconds, 2), "curve": subsample(losses)}
