"""The evaluation loops of the training stack, shared by `fastrpe train`, `fastrpe extrapolate`
and the reproductions: language-model negative log-likelihood on non-overlapping windows
(KERPLE's protocol) and classification loss/accuracy on fixed batches.

Both put the model in eval mode under `torch.no_grad()` and restore its mode afterwards, so
they can be called from inside `train(..., eval_fn=...)` or on a finished model.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn


def _to(batch, device):
    return tuple(t.to(device) for t in batch) if isinstance(batch, (tuple, list)) else batch.to(device)


def lm_nll(model: nn.Module, stream: Tensor, length: int, max_tokens: int | None, batch_size: int,
           device: str | torch.device) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and the number of tokens predicted, over
    the non-overlapping windows of `length` tokens of `stream` (`data.text.eval_windows`: every
    token predicted once), in batches of `batch_size` windows. `model.loss(w, reduction="sum")`
    scores a batch `[B, length + 1]`."""
    from ..data.text import eval_windows

    wins = eval_windows(stream, length, max_tokens=max_tokens)  # (N, length + 1)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for w in wins.split(max(1, batch_size)):
                w = w.to(device)
                total += model.loss(w, reduction="sum").item()
                count += w[:, 1:].numel()
    finally:
        model.train(was_training)
    return total, count


def lm_metrics(model: nn.Module, stream: Tensor, length: int, max_tokens: int | None, batch_size: int,
               device: str | torch.device) -> dict[str, float]:
    """`{"val_loss": mean NLL per token, "val_ppl": its exponential}` (see `lm_nll`)."""
    total, count = lm_nll(model, stream, length, max_tokens, batch_size, device)
    loss = total / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}


def classification_metrics(model: nn.Module, batches: Iterable[Any], device: str | torch.device,
                           forward: Callable[[nn.Module, Any], tuple[Tensor, Tensor]] | None = None
                           ) -> dict[str, float]:
    """`{"val_loss", "val_acc"}` of a classifier over fixed batches: summed cross-entropy and
    correct predictions divided by the number of labels. A batch is `(inputs, labels)`;
    `forward(model, batch) -> (logits, labels)` overrides the default `(model(inputs), labels)`."""
    forward = forward or (lambda m, b: (m(b[0]), b[1]))
    was_training = model.training
    model.eval()
    loss, correct, total = 0.0, 0, 0
    try:
        with torch.no_grad():
            for batch in batches:
                logits, y = forward(model, _to(batch, device))
                logits = logits.float()
                loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
                total += y.numel()
    finally:
        model.train(was_training)
    return {"val_loss": loss / max(total, 1), "val_acc": correct / max(total, 1)}
