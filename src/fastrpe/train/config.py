"""`TrainConfig`: every knob of `fastrpe.train.train`, with JSON round trip and strict validation."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")

# Fields that do not change the trajectory of the weights: they may differ between a run
# and its resumption without a warning.
BOOKKEEPING_FIELDS = frozenset(
    {"steps", "log_every", "eval_every", "ckpt_every", "keep_last", "out_dir", "resume", "progress", "save_final"}
)


@dataclass
class TrainConfig:
    """Training hyper-parameters and bookkeeping.

    Steps are optimizer updates; step `s` (0-based) uses learning rate `Schedule(...)(s)`
    and the batch `batches(s)`. Intervals (`log_every`, `eval_every`, `ckpt_every`) count
    completed steps; 0 turns the periodic action off.

    Args:
        steps: number of optimizer updates.
        batch_size: global batch size (all ranks and micro-batches together). When > 0 the
            loop checks that each batch has this many rows; 0 skips the check.
        grad_accum_steps: micro-batches per step (each rank splits its shard this many ways).
        lr: peak learning rate.
        weight_decay: AdamW decoupled weight decay (not applied to biases, norms and
            positional parameters; see `param_groups`).
        betas, eps: AdamW.
        warmup_steps: linear warm-up from `lr / warmup_steps` to `lr`.
        schedule: "cosine", "linear" or "constant" decay after warm-up.
        min_lr_ratio: the decay ends at `lr * min_lr_ratio`.
        grad_clip: clip the global gradient norm to this (0: no clipping).
        precision: "fp32"; "bf16" (autocast, CUDA or CPU); "fp16" (autocast + loss scaling, CUDA only).
        seed: seeds torch, `random` and numpy at the start of a fresh run (rank r uses seed + r).
        log_every: steps between records in `metrics.jsonl` (and progress bar updates).
        eval_every: steps between calls of `eval_fn`; it also runs after the last step when > 0.
        ckpt_every: steps between checkpoints.
        keep_last: how many periodic checkpoints to keep (>= 1).
        save_final: write a checkpoint after the last step (needs `out_dir`).
        out_dir: directory for `metrics.jsonl`, `config.json` and `checkpoints/`; None writes nothing.
        resume: continue from the newest checkpoint in `out_dir` when there is one.
        progress: show a tqdm bar: True, False, or None (only when stderr is a terminal).
        feature_redraw_interval: every this many steps, each random feature map of the model
            draws a new projection (Performer's `feature_redraw_interval`), from a seed that
            depends on `seed`, the map's name and the step (see `fastrpe.train.redraw`);
            0 (default) never redraws.
    """

    steps: int = 1000
    batch_size: int = 32
    grad_accum_steps: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    ckpt_every: int = 0
    keep_last: int = 3
    save_final: bool = True
    out_dir: str | None = None
    resume: bool = False
    progress: bool | None = None
    feature_redraw_interval: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        self.validate()

    # ---- validation -----------------------------------------------------------------
    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""

        def bad(name: str, why: str):
            return ValueError(f"TrainConfig: invalid value for {name!r}: {getattr(self, name)!r} ({why})")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in ("steps", "batch_size", "warmup_steps", "seed", "log_every", "eval_every", "ckpt_every",
                     "feature_redraw_interval"):
            v = getattr(self, name)
            if not is_int(v):
                raise bad(name, "must be an int")
            if v < 0:
                raise bad(name, "must be >= 0")
        for name in ("grad_accum_steps", "keep_last"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise bad(name, "must be an int >= 1")
        for name in ("lr", "weight_decay", "eps", "min_lr_ratio", "grad_clip"):
            v = getattr(self, name)
            if not is_num(v):
                raise bad(name, "must be a finite number")
            if v < 0:
                raise bad(name, "must be >= 0")
        if self.lr == 0:
            raise bad("lr", "must be > 0")
        if self.min_lr_ratio > 1:
            raise bad("min_lr_ratio", "must be in [0, 1]")
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2
                or not all(is_num(b) and 0 <= b < 1 for b in self.betas)):
            raise bad("betas", "must be two numbers in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"one of {', '.join(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"one of {', '.join(PRECISIONS)}")
        for name in ("save_final", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise bad("progress", "must be true, false or null")
        if isinstance(self.out_dir, os.PathLike):
            self.out_dir = os.fspath(self.out_dir)
        if self.out_dir is not None and not isinstance(self.out_dir, str):
            raise bad("out_dir", "must be a string path or null")
        if self.resume and self.out_dir is None:
            raise bad("resume", "resume=True needs out_dir")
        if self.batch_size and self.batch_size % self.grad_accum_steps:
            raise bad("batch_size", f"must be a multiple of grad_accum_steps ({self.grad_accum_steps})")

    # ---- (de)serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Build from a dict; unknown fields and invalid values raise `ValueError` naming the field."""
        if not isinstance(d, dict):
            raise TypeError(f"TrainConfig: expected a dict, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise ValueError(f"TrainConfig: unknown field {key!r} (known: {', '.join(names)})")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> TrainConfig:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"TrainConfig: not valid JSON: {e}") from None
        return cls.from_dict(d)

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with some fields changed (unknown names raise like `from_dict`)."""
        d = self.to_dict()
        for key in changes:
            if key not in d:
                raise ValueError(f"TrainConfig: unknown field {key!r}")
        d.update(changes)
        return type(self).from_dict(d)
