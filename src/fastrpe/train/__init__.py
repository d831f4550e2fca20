"""Training: a generic loop over any `nn.Module` and `loss_fn(model, batch)`, safetensors
checkpoints that resume exactly, and data parallelism through `torchrun`.

    from fastrpe.train import TrainConfig, train, seeded_batches
    cfg = TrainConfig(steps=1000, batch_size=32, lr=3e-4, out_dir="runs/x", ckpt_every=100, resume=True)
    train(model, loss_fn, seeded_batches(sample, cfg.batch_size, cfg.seed), cfg)

Needs the `train` extra (safetensors; tqdm for the progress bar): `pip install fastrpe[train]`.
"""
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    RngState,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig
from .distributed import DistInfo, cleanup, init_from_env, shard_batch
from .loop import (
    Callback,
    TrainResult,
    TrainState,
    as_batch_source,
    make_optimizer,
    param_groups,
    seeded_batches,
    step_seed,
    train,
)
from .schedule import Schedule, lr_at

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "DistInfo",
    "RngState",
    "Schedule",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "as_batch_source",
    "cleanup",
    "init_from_env",
    "load_checkpoint",
    "lr_at",
    "make_optimizer",
    "param_groups",
    "read_checkpoint",
    "save_checkpoint",
    "seeded_batches",
    "shard_batch",
    "step_seed",
    "train",
]
