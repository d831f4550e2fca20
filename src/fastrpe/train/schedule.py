"""Learning-rate schedules: linear warm-up, then cosine / linear / constant decay.

A schedule is a pure function of the step, so a resumed run needs nothing but the step
to continue with exactly the learning rates of an uninterrupted one (no scheduler state
to save, unlike `torch.optim.lr_scheduler`).

With `W = warmup_steps`, `S = steps`, `lr_min = lr * min_lr_ratio`, step `s` (0-based) uses:

    s < W          lr * (s + 1) / W                       (reaches lr at s = W - 1)
    W <= s < S     cosine:   lr_min + (lr - lr_min) * (1 + cos(pi * p)) / 2
                   linear:   lr - (lr - lr_min) * p
                   constant: lr
                   with p = (s - W) / (S - W) in [0, 1)
    s >= S         lr_min (constant: lr)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import SCHEDULES


@dataclass(frozen=True)
class Schedule:
    """`Schedule(lr, steps, warmup_steps, kind, min_lr_ratio)(step) -> learning rate`."""

    lr: float
    steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"Schedule: kind must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.steps < 0 or self.warmup_steps < 0:
            raise ValueError("Schedule: steps and warmup_steps must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"Schedule: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @classmethod
    def from_config(cls, cfg) -> Schedule:
        return cls(lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps, kind=cfg.schedule,
                   min_lr_ratio=cfg.min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"Schedule: step must be >= 0, got {step}")
        W, S = self.warmup_steps, self.steps
        if step < W:
            return self.lr * (step + 1) / W
        if self.kind == "constant":
            return self.lr
        lr_min = self.lr * self.min_lr_ratio
        if step >= S:
            return lr_min
        p = (step - W) / (S - W)
        if self.kind == "cosine":
            return lr_min + (self.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * p))
        return self.lr - (self.lr - lr_min) * p

    def to_dict(self) -> dict:
        return {"lr": self.lr, "steps": self.steps, "warmup_steps": self.warmup_steps, "kind": self.kind,
                "min_lr_ratio": self.min_lr_ratio}


def lr_at(step: int, cfg) -> float:
    """The learning rate of step `step` under `TrainConfig` `cfg`."""
    return Schedule.from_config(cfg)(step)
