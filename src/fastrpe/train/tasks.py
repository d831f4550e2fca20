"""Tasks for `fastrpe train`: each builds a model, a loss, a step-indexed batch source and an
evaluation from the embedded data sets.

A task is `build(opts) -> Task`. Batches are functions of the step (seeded per step), so a
resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .evaluation import classification_metrics
from .loop import seeded_batches

#: model sizes: width, layers, heads
SIZES = {"tiny": (64, 2, 4), "small": (128, 4, 4), "base": (256, 6, 8)}


@dataclass
class TaskOptions:
    """What the command line chooses (see `fastrpe train --help`)."""

    task: str = "lm"
    size: str = "tiny"
    kernel: str = "softmax"
    position: str | None = None  # default per task: kerple_log (sequences), table2d (images)
    backend: str = "auto"
    seq_len: int = 128
    batch_size: int = 16
    dataset: str | None = None  # default per task
    max_bytes: int = 2_000_000
    num_samples: int = 4000
    eval_samples: int = 500
    fastrpb: bool = False
    patch_size: int | None = None  # images: default 2 for 8×8 digits, 4 for 28×28 MNIST
    seed: int = 0
    device: str = "cpu"


@dataclass
class Task:
    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], Any]
    batches: Callable[[int], Any]
    eval_fn: Callable[[nn.Module], dict[str, float]]
    description: str


def _dims(o: TaskOptions) -> tuple[int, int, int]:
    if o.size not in SIZES:
        raise ValueError(f"size: unknown {o.size!r}; known: {', '.join(SIZES)}")
    return SIZES[o.size]


def _to(batch, device):
    return tuple(t.to(device) for t in batch) if isinstance(batch, tuple) else batch.to(device)


def lm_task(o: TaskOptions) -> Task:
    from ..data.text import eval_windows, load_corpus, random_windows
    from .evaluation import lm_metrics
    from ..nn import DecoderLM, LMConfig

    d, n, h = _dims(o)
    corpus = load_corpus(o.dataset or "python-stdlib", max_bytes=o.max_bytes)
    train, val = corpus.train, corpus.validation
    if train.numel() < o.seq_len + 2:
        raise ValueError(f"seq_len {o.seq_len} is longer than the training text ({train.numel()} tokens)")
    model = DecoderLM(LMConfig(vocab_size=corpus.vocab_size, d_model=d, n_layers=n, n_heads=h, kernel=o.kernel,
                               position=o.position, backend=o.backend, max_len=max(4096, o.seq_len),
                               feature_seed=o.seed))

    def sample(g: torch.Generator, bs: int):
        return random_windows(train, o.seq_len, bs, g)

    eval_windows(val, o.seq_len)  # a validation text too short is an error now, not at the first evaluation

    def evaluate(m) -> dict[str, float]:
        return lm_metrics(m, val, o.seq_len, o.eval_samples * o.seq_len, o.batch_size, o.device)

    return Task(model, lambda m, b: m.loss(b.to(o.device)), seeded_batches(sample, o.batch_size, o.seed), evaluate,
                f"causal LM on {corpus.name} (byte tokens), windows of {o.seq_len}")


def _classification_loss(device):
    """Loss of a classifier on `(inputs, labels)` batches, with its accuracy as a metric."""

    def loss_fn(m, batch):
        x, y = _to(batch, device)
        logits = m(x)
        return nn.functional.cross_entropy(logits.float(), y), {"acc": (logits.argmax(-1) == y).float().mean()}

    return loss_fn


def _classifier_eval(val_batches, device):
    """Evaluation of a classifier on fixed `(inputs, labels)` batches."""
    return lambda m: classification_metrics(m, val_batches, device)


def listops_task(o: TaskOptions) -> Task:
    from ..data.listops import VOCAB, ListOpsDataset, collate
    from ..nn import EncoderClassifier, EncoderConfig

    d, n, h = _dims(o)
    lo = max(10, o.seq_len // 4)
    kw = {"min_length": lo, "max_length": o.seq_len}
    train = ListOpsDataset("train", num_samples=o.num_samples, seed=o.seed, **kw)
    val = ListOpsDataset("validation", num_samples=o.eval_samples, seed=o.seed, **kw)
    model = EncoderClassifier(EncoderConfig(vocab_size=len(VOCAB), num_classes=10, d_model=d, n_layers=n, n_heads=h,
                                            kernel=o.kernel, position=o.position, fastrpb=o.fastrpb,
                                            backend=o.backend, max_len=max(4096, o.seq_len), feature_seed=o.seed))

    def sample(g: torch.Generator, bs: int):
        idx = torch.randint(0, len(train), (bs,), generator=g).tolist()
        b = collate([train[i] for i in idx])
        return b.tokens, b.labels

    val_batches = [(b.tokens, b.labels) for b in (collate([val[j] for j in range(i, min(len(val), i + o.batch_size))])
                                                  for i in range(0, len(val), o.batch_size))]
    return Task(model, _classification_loss(o.device), seeded_batches(sample, o.batch_size, o.seed),
                _classifier_eval(val_batches, o.device),
                f"ListOps classification, {lo}..{o.seq_len} tokens")


def seq2seq_task(o: TaskOptions) -> Task:
    from ..data.seq2seq import Seq2SeqDataset, collate
    from ..nn import Seq2Seq, Seq2SeqConfig

    d, n, h = _dims(o)
    name = o.dataset or "reverse"
    kw = {"min_len": max(2, o.seq_len // 4), "max_len": o.seq_len}
    train = Seq2SeqDataset(name, num_samples=o.num_samples, seed=o.seed, split="train", **kw)
    val = Seq2SeqDataset(name, num_samples=o.eval_samples, seed=o.seed, split="validation", **kw)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=train.vocab_size, d_model=d, n_enc_layers=n, n_dec_layers=n, n_heads=h,
                                  kernel=o.kernel, position=o.position, cross_position=o.position, backend=o.backend,
                                  max_len=max(1024, 2 * o.seq_len + 4), feature_seed=o.seed))

    def sample(g: torch.Generator, bs: int):
        idx = torch.randint(0, len(train), (bs,), generator=g).tolist()
        b = collate([train[i] for i in idx])
        return b.src, b.tgt

    def evaluate(m) -> dict[str, float]:
        loss = exact = count = 0
        for i in range(0, len(val), o.batch_size):
            b = collate([val[j] for j in range(i, min(len(val), i + o.batch_size))])
            src, tgt = b.src.to(o.device), b.tgt.to(o.device)
            loss += m.loss(src, tgt).item() * src.shape[0]
            out = m.generate(src, tgt.shape[1] + 2)
            for row, ref in zip(out, tgt):
                ref = ref[ref != m.cfg.pad_id]
                exact += int(row.shape[0] >= ref.shape[0] and torch.equal(row[:ref.shape[0]], ref))
            count += src.shape[0]
        return {"val_loss": loss / max(count, 1), "val_exact_match": exact / max(count, 1)}

    return Task(model, lambda m, b: m.loss(*_to(b, o.device)), seeded_batches(sample, o.batch_size, o.seed), evaluate,
                f"sequence-to-sequence '{name}', {kw['min_len']}..{o.seq_len} symbols")


def images_task(o: TaskOptions) -> Task:
    from ..data.images import load_images
    from ..nn import ViTConfig, VisionTransformer
    from ..nn.vit import VIT_POSITIONS

    d, n, h = _dims(o)
    name = o.dataset or "digits"
    position = o.position
    if position not in VIT_POSITIONS:
        raise ValueError(f"position: the images task takes {', '.join(VIT_POSITIONS)}, got {position!r}")
    train, test = load_images(name, "train"), load_images(name, "test")
    C, H, W = train.images.shape[1:]
    patch = o.patch_size or (2 if max(H, W) <= 16 else 4)
    model = VisionTransformer(ViTConfig(image_size=(H, W), patch_size=patch, channels=C, num_classes=train.num_classes,
                                        d_model=d, n_layers=n, n_heads=h, kernel=o.kernel, position=position,
                                        fastrpb2d=o.fastrpb, backend=o.backend))

    def sample(g: torch.Generator, bs: int):
        idx = torch.randint(0, len(train), (bs,), generator=g)
        return train.images[idx], train.labels[idx]

    m_eval = min(len(test), o.eval_samples)
    val_batches = [(test.images[i:min(m_eval, i + o.batch_size)], test.labels[i:min(m_eval, i + o.batch_size)])
                   for i in range(0, m_eval, o.batch_size)]
    grid = model.grid
    return Task(model, _classification_loss(o.device), seeded_batches(sample, o.batch_size, o.seed),
                _classifier_eval(val_batches, o.device),
                f"image classification on {name} ({H}×{W}, {patch}×{patch} patches: a {grid[0]}×{grid[1]} grid), "
                f"ViT with {position}" + (" + FastRPB 2D" if o.fastrpb else ""))


TASKS: dict[str, Callable[[TaskOptions], Task]] = {
    "lm": lm_task,
    "listops": listops_task,
    "seq2seq": seq2seq_task,
    "images": images_task,
}


#: the positional term a task uses when none is given
DEFAULT_POSITION = {"images": "table2d"}


def with_defaults(o: TaskOptions) -> TaskOptions:
    """`o` with its per-task defaults filled in (what `task.json` records)."""
    if o.position is None:
        o = dataclasses.replace(o, position=DEFAULT_POSITION.get(o.task, "kerple_log"))
    return o


def build_task(o: TaskOptions) -> Task:
    o = with_defaults(o)
    if o.task not in TASKS:
        raise ValueError(f"task: unknown {o.task!r}; known: {', '.join(TASKS)}")
    if o.seq_len < 2 or o.batch_size < 1:
        raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {o.seq_len}, {o.batch_size}")
    return TASKS[o.task](o)
