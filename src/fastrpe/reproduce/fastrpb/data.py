"""FastRPB reproduction: each task's seeded batch sampler and fixed validation batches."""
from __future__ import annotations

import torch

from ..._validate import FastRPEError


def listops_data(length: int, n_train: int, n_eval: int, seed: int, batch_size: int):
    """`(sample, val_batches, info)` for ListOps with `length/4 .. length` tokens;
    `sample(g, batch_size) -> (tokens, labels)` draws uniformly from the training set."""
    from ...data.listops import ListOpsDataset, collate

    kw = {"min_length": max(10, length // 4), "max_length": length}
    train = ListOpsDataset("train", num_samples=n_train, seed=seed, **kw)
    val = ListOpsDataset("validation", num_samples=n_eval, seed=seed, **kw)

    # padded once: drawing a batch is then an index, not a Python collate per step
    whole = collate([train[i] for i in range(len(train))])

    def sample(g: torch.Generator, bs: int):
        idx = torch.randint(0, len(train), (bs,), generator=g)
        return whole.tokens[idx, :int(whole.lengths[idx].max())], whole.labels[idx]

    val_batches = []
    for i in range(0, len(val), batch_size):
        b = collate([val[j] for j in range(i, min(len(val), i + batch_size))])
        val_batches.append((b.tokens, b.labels))
    return sample, val_batches, {"min_length": kw["min_length"], "max_length": length, "train": n_train,
                                 "validation": n_eval}


def image_data(name: str, n_eval: int | None):
    """`(sample, val_batches, info)` for an embedded image set; the first `n_eval` test images
    (all when None) are the validation set."""
    from ...data._cache import MissingDataError
    from ...data.images import load_images

    try:
        train, test = load_images(name, "train"), load_images(name, "test")
    except MissingDataError as e:
        raise FastRPEError(f"fastrpb: {e}") from None
    except ValueError as e:
        raise FastRPEError(f"fastrpb: --image-dataset: {e}") from None
    x_val, y_val = test.images[:n_eval], test.labels[:n_eval]

    def sample(g: torch.Generator, bs: int):
        idx = torch.randint(0, len(train), (bs,), generator=g)
        return train.images[idx], train.labels[idx]

    val_batches = [(x_val[i:i + 256], y_val[i:i + 256]) for i in range(0, x_val.shape[0], 256)]
    _, C, H, W = train.images.shape
    return sample, val_batches, {"name": name, "image_size": [H, W], "channels": C, "train": len(train),
                                 "validation": int(x_val.shape[0]), "num_classes": train.num_classes}
