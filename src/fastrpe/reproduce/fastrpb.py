"""FastRPB (Zubkov & Gavrilov, 2022), Tables 1–2: accuracy without and with FastRPB, ListOps and images.

Paper: "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks" (Maksim
Zubkov, Daniil Gavrilov; ICLR 2022 submission, arXiv:2202.11364, 2022).

The paper's claim, as its abstract states it: linear Transformers do worse than softmax
attention on long-sequence tasks; FastRPB, an additive relative positional term
`Y = Attention(Q, K, V) + W·V` with a learned Toeplitz `W` (1D) or `W = w(Δrow) + w(Δcol)`
on an image grid (2D), multiplied by FFT in O(N log N), is independent of the attention
kernel and adds positional information to softmax attention and every linear variant
alike; and the SIKF feature map `φ(x) = exp(x)` (kernel "exp" here) reaches higher
accuracy than other linear kernels at no cost in speed. Its Tables 1–2 (ListOps from Long
Range Arena, and image classification) compare the kernels without and with FastRPB. The
tables' numbers were not found in the sources available when this was written (only the
abstract and summaries of it), so no paper numbers are quoted; what is tested is the
direction: *adding FastRPB raises validation accuracy, for every kernel, on both tasks*
(and, secondarily, whether exp/SIKF is the best of the linear kernels).

Setting. For each task × kernel (softmax, elu+1, exp = SIKF, dpfp, prf = Performer
FAVOR+ with 64 iid features) × {without, with FastRPB}, a small classifier is trained
from scratch; the two models of a pair are built from the same seed, the "with" model
gets the "without" model's weights copied in (so they differ *only* by the FastRPB
parameters, which start at 0: at step 0 both compute the same function) and they see the
same batches in the same order. No dropout, so the pair's runs differ only through the
FastRPB term. Reported: validation accuracy and loss after the last step, mean ± std over
`--seeds` (each seed changes initialization and batch order; the data sets stay fixed).

* listops: `EncoderClassifier` (bidirectional, mean-pooled) on the embedded LRA ListOps
  generator with LRA's tree settings but lengths `L/4 .. L` tokens (`--listops-length L`),
  FastRPB1D in every layer (`max_len = L`).
* images: `VisionTransformer` on pixels (`--patch-size 1`: one token per pixel, as in
  LRA's Image task and the authors' released 2D code, which treats an image as its
  H·W(·C) pixels; mean pooling, no class token), FastRPB2D in every layer (this library's
  FastRPB2D learns separate row and column vectors; the authors' code shares one).
  scikit-learn's 8×8 `digits` (64 tokens, its fixed 20% test split as validation) by
  default; MNIST / Fashion-MNIST (784 tokens) when installed.

Positions. By default (`--base-position none`) neither model has any other positional
term, so the "without" model is permutation-invariant (a bag of tokens / of pixels) and
any gain is FastRPB's positional information alone. `--base-position absolute` gives both
models absolute sinusoidal encodings (1D for ListOps, 2D for images) and asks whether
FastRPB still helps on top of them.
"""
from __future__ import annotations

from .._validate import FastRPEError

import math
import time

import torch
from torch import nn

KERNELS = ("softmax", "elu", "exp", "dpfp", "prf")
TASKS = ("listops", "images")
KERNEL_LABELS = {"softmax": "softmax", "elu": "elu+1", "exp": "exp (SIKF)", "dpfp": "DPFP", "prf": "Performer"}
BASE_POSITIONS = {"none": {"listops": "none", "images": "none"},
                  "absolute": {"listops": "sinusoidal", "images": "sinusoidal2d"}}


def add_arguments(p) -> None:
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of: " + ", ".join(TASKS))
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help="comma-separated kernel names of fastrpe.kernels.get_kernel (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 3000, quick 300)")
    p.add_argument("--seeds", type=int, default=None, help="runs per configuration (default 3, quick 1)")
    p.add_argument("--listops-length", type=int, default=None,
                   help="longest ListOps sequence; samples have L/4..L tokens (default 512, quick 64)")
    p.add_argument("--listops-train", type=int, default=None,
                   help="ListOps training samples (default 20000, quick 3000)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="validation samples per task (default: ListOps 2000 / quick 500; images: the whole test split)")
    p.add_argument("--image-dataset", default="digits", help="digits (scikit-learn), mnist or fashion-mnist")
    p.add_argument("--patch-size", type=int, default=1, help="ViT patch side in pixels (1: pixel-level)")
    p.add_argument("--base-position", default="none", choices=tuple(BASE_POSITIONS),
                   help="other positional term of both models: none (isolates FastRPB) or absolute sinusoidal")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--d-model", type=int, default=None, help="model width (default 64, quick 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads during the runs (default 1: these models are too small to gain from "
                        "more, and a second thread makes them several times slower when other jobs share the cores; "
                        "0 keeps PyTorch's setting)")


# ---------------------------------------------------------------------------------------
# data: each task gives a seeded batch sampler and fixed validation batches


def _listops_data(length: int, n_train: int, n_eval: int, seed: int, batch_size: int):
    from ..data.listops import ListOpsDataset, collate

    kw = {"min_length": max(10, length // 4), "max_length": length}
    train = ListOpsDataset("train", num_samples=n_train, seed=seed, **kw)
    val = ListOpsDataset("validation", num_samples=n_eval, seed=seed, **kw)

    def sample(g: torch.Generator):
        idx = torch.randint(0, len(train), (batch_size,), generator=g).tolist()
        b = collate([train[i] for i in idx])
        return b.tokens, b.labels

    val_batches = []
    for i in range(0, len(val), batch_size):
        b = collate([val[j] for j in range(i, min(len(val), i + batch_size))])
        val_batches.append((b.tokens, b.labels))
    return sample, val_batches, {"min_length": kw["min_length"], "max_length": length, "train": n_train,
                                 "validation": n_eval}


def _image_data(name: str, n_eval: int | None, batch_size: int):
    from ..data._cache import MissingDataError
    from ..data.images import load_images

    try:
        train, test = load_images(name, "train"), load_images(name, "test")
    except MissingDataError as e:
        raise FastRPEError(f"fastrpb: {e}") from None
    except ValueError as e:
        raise FastRPEError(f"fastrpb: --image-dataset: {e}") from None
    x_val, y_val = test.images[:n_eval], test.labels[:n_eval]

    def sample(g: torch.Generator):
        idx = torch.randint(0, len(train), (batch_size,), generator=g)
        return train.images[idx], train.labels[idx]

    val_batches = [(x_val[i:i + 256], y_val[i:i + 256]) for i in range(0, x_val.shape[0], 256)]
    _, C, H, W = train.images.shape
    return sample, val_batches, {"name": name, "image_size": [H, W], "channels": C, "train": len(train),
                                 "validation": int(x_val.shape[0]), "num_classes": train.num_classes}


# ---------------------------------------------------------------------------------------
# models


def make_model(task: str, kernel: str, fastrpb: bool, *, d_model: int, layers: int, heads: int, base_position: str,
               listops_length: int = 128, image_size=(8, 8), channels: int = 1, num_classes: int = 10,
               patch_size: int = 1) -> nn.Module:
    """The classifier of `task` ("listops" or "images") with `kernel`, with or without FastRPB."""
    pos = BASE_POSITIONS[base_position][task]
    if task == "listops":
        from ..data.listops import NUM_CLASSES, VOCAB_SIZE
        from ..nn import EncoderClassifier, EncoderConfig

        return EncoderClassifier(EncoderConfig(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, d_model=d_model,
                                               n_layers=layers, n_heads=heads, kernel=kernel, position=pos,
                                               fastrpb=fastrpb, max_len=listops_length))
    if task == "images":
        from ..nn.vit import ViTConfig, VisionTransformer

        return VisionTransformer(ViTConfig(image_size=tuple(image_size), patch_size=patch_size, channels=channels,
                                           num_classes=num_classes, d_model=d_model, n_layers=layers, n_heads=heads,
                                           kernel=kernel, position=pos, fastrpb2d=fastrpb, cls_token=False))
    raise ValueError(f"fastrpb: unknown task {task!r}; known: {', '.join(TASKS)}")


def build_pair(task: str, kernel: str, seed: int, **model_kw) -> tuple[nn.Module, nn.Module]:
    """`(without, with_fastrpb)`: the "with" model holds the "without" model's weights for
    every shared parameter and buffer, plus its FastRPB parameters (initialized to 0), so the
    two compute the same function at step 0 and differ only by the FastRPB term."""
    torch.manual_seed(seed)
    without = make_model(task, kernel, False, **model_kw)
    torch.manual_seed(seed)
    with_rpb = make_model(task, kernel, True, **model_kw)
    missing, unexpected = with_rpb.load_state_dict(without.state_dict(), strict=False)
    extra = set(fastrpb_parameter_names(with_rpb))
    if unexpected or set(missing) != extra:
        raise RuntimeError(f"fastrpb: the pair differs by more than FastRPB: missing {missing}, "
                           f"unexpected {unexpected}")
    return without, with_rpb


def fastrpb_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that belong to FastRPB terms (`FastRPB1D`, `FastRPB2D`)."""
    from ..positions.fastrpb import FastRPB1D
    from ..positions.grid import FastRPB2D

    names = []
    for mname, m in model.named_modules():
        if isinstance(m, (FastRPB1D, FastRPB2D)):
            names += [f"{mname}.{p}" for p, _ in m.named_parameters()]
    return names


# ---------------------------------------------------------------------------------------
# training and evaluation


def _evaluate(model: nn.Module, batches, device) -> tuple[float, float]:
    was = model.training
    model.eval()
    loss, correct, total = 0.0, 0, 0
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            logits = model(x).float()
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
            total += y.numel()
    model.train(was)
    return loss / max(total, 1), correct / max(total, 1)


def train_classifier(model: nn.Module, sample, val_batches, *, steps: int, lr: float, weight_decay: float, seed: int,
                     device) -> dict:
    """AdamW (positional parameters not decayed), one-cycle schedule, clipping at 1; batch
    `s` is `sample(g)` with `g` seeded by `seed`, so equal seeds give equal batch streams."""
    from ..train.loop import param_groups

    model = model.to(device).train()
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    losses, diverged = [], False
    t0 = time.time()
    for _ in range(steps):
        x, y = sample(g)
        logits = model(x.to(device))
        loss = nn.functional.cross_entropy(logits.float(), y.to(device))
        value = loss.item()
        losses.append(value)
        if not math.isfinite(value):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    seconds = time.time() - t0
    val_loss, val_acc = _evaluate(model, val_batches, device)
    return {"val_acc": val_acc, "val_loss": val_loss if math.isfinite(val_loss) else None, "diverged": diverged,
            "steps_run": len(losses), "final_train_loss": losses[-1] if losses and math.isfinite(losses[-1]) else None,
            "seconds": round(seconds, 2), "curve": _subsample(losses)}


def _subsample(xs: list[float], n: int = 100) -> list[list[float]]:
    step = max(1, math.ceil(len(xs) / n))
    keep = list(range(0, len(xs), step)) + ([len(xs) - 1] if xs and (len(xs) - 1) % step else [])
    return [[i, xs[i]] for i in keep if math.isfinite(xs[i])]


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, ((sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else None)


# ---------------------------------------------------------------------------------------


def _csv(value: str, known: tuple[str, ...] | None, what: str) -> list[str]:
    items = [s.strip() for s in value.split(",") if s.strip()]
    if not items:
        raise FastRPEError(f"fastrpb: --{what} is empty")
    if known is not None and (bad := [s for s in items if s not in known]):
        raise FastRPEError(f"fastrpb: unknown {what} {bad}; known: {', '.join(known)}")
    return items


def run(args, out_dir) -> dict:
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, out_dir)
    finally:
        torch.set_num_threads(threads)


def _run(args, out_dir) -> dict:
    from ..kernels import get_kernel

    tasks = _csv(args.tasks, TASKS, "tasks")
    kernels = _csv(args.kernels, None, "kernels")
    d_model = args.d_model or (32 if args.quick else 64)
    for k in kernels:
        try:
            get_kernel(k, head_dim=d_model // args.heads)
        except ValueError as e:
            raise FastRPEError(f"fastrpb: --kernels: {e}") from None
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (300 if args.quick else 3000)
    L = args.listops_length or (64 if args.quick else 512)
    n_train = args.listops_train or (3000 if args.quick else 20_000)
    n_eval_listops = args.eval_samples or (500 if args.quick else 2000)
    if min(seeds, steps, L - 10, n_train, n_eval_listops, args.batch_size, d_model, args.layers, args.heads) < 1:
        raise FastRPEError("fastrpb: --seeds, --steps, --listops-train, --eval-samples, --batch-size, --d-model, "
                         "--layers, --heads must be positive and --listops-length at least 11")
    common = {"d_model": d_model, "layers": args.layers, "heads": args.heads, "base_position": args.base_position}

    data, task_info = {}, {}
    if "listops" in tasks:
        sample, val, info = _listops_data(L, n_train, n_eval_listops, args.seed, args.batch_size)
        data["listops"] = (sample, val, {"listops_length": L})
        task_info["listops"] = info
    if "images" in tasks:
        sample, val, info = _image_data(args.image_dataset, args.eval_samples, args.batch_size)
        data["images"] = (sample, val, {"image_size": info["image_size"], "channels": info["channels"],
                                        "num_classes": info["num_classes"], "patch_size": args.patch_size})
        task_info["images"] = {**info, "patch_size": args.patch_size}

    runs = []
    for task in tasks:
        sample, val, kw = data[task]
        for kernel in kernels:
            for s in range(seeds):
                seed = args.seed + s
                pair = build_pair(task, kernel, seed, **common, **kw)
                for fastrpb, model in zip((False, True), pair):
                    r = train_classifier(model, sample, val, steps=steps, lr=args.lr, weight_decay=args.weight_decay,
                                         seed=seed, device=args.device)
                    n_params = sum(p.numel() for p in model.parameters())
                    loss = "diverged" if r["val_loss"] is None else f"loss {r['val_loss']:.3f}"
                    print(f"{task:>7s} {kernel:>7s} {'with' if fastrpb else 'without':>7s} FastRPB, seed {seed}: "
                          f"val acc {100 * r['val_acc']:5.1f}%, {loss} ({r['seconds']:.1f} s)", flush=True)
                    runs.append({"task": task, "kernel": kernel, "fastrpb": fastrpb, "seed": seed,
                                 "parameters": n_params, **r})
                del pair

    summary = []
    for task in tasks:
        for kernel in kernels:
            cell = {(r["fastrpb"], r["seed"]): r for r in runs if r["task"] == task and r["kernel"] == kernel}
            row = {"task": task, "kernel": kernel, "seeds": seeds}
            for fastrpb, key in ((False, "without"), (True, "with")):
                rs = [r for (f, _), r in cell.items() if f == fastrpb]
                row[f"acc_{key}"], row[f"acc_{key}_std"] = _mean_std([r["val_acc"] for r in rs])
                row[f"loss_{key}"], row[f"loss_{key}_std"] = _mean_std(
                    [r["val_loss"] for r in rs if r["val_loss"] is not None])
                row[f"diverged_{key}"] = sum(r["diverged"] for r in rs)
            diffs = [cell[(True, args.seed + s)]["val_acc"] - cell[(False, args.seed + s)]["val_acc"]
                     for s in range(seeds)]
            row["acc_diff"], row["acc_diff_std"] = _mean_std(diffs)
            row["with_better"] = sum(d > 0 for d in diffs)
            summary.append(row)

    _print_table(summary, seeds)
    result = {"experiment": "fastrpb",
              "paper": "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks "
                       "(Zubkov & Gavrilov, ICLR 2022 submission, arXiv:2202.11364)",
              "claim": "adding FastRPB raises validation accuracy of every attention kernel on ListOps and images",
              "tasks": tasks, "kernels": kernels, "seeds": seeds, "steps": steps, "batch_size": args.batch_size,
              "lr": args.lr, "weight_decay": args.weight_decay, "d_model": d_model, "layers": args.layers,
              "heads": args.heads, "base_position": args.base_position, "device": str(args.device),
              "threads": torch.get_num_threads(),
              "data": task_info, "summary": summary, "runs": runs}
    _plot(result, out_dir / "fastrpb.png")
    return result


def _fmt(mean, std, pct: bool = True, signed: bool = False) -> str:
    if mean is None:
        return "—"
    f = (lambda v: f"{100 * v:{'+' if signed else ''}.1f}") if pct else (lambda v: f"{v:.3f}")
    return f(mean) + (f" ± {100 * std if pct else std:.1f}" if std is not None else "")


def _print_table(summary: list[dict], seeds: int) -> None:
    print(f"\nvalidation accuracy (%), {'mean ± std over ' + str(seeds) + ' seeds' if seeds > 1 else 'one seed'}")
    head = ("task", "kernel", "without FastRPB", "with FastRPB", "difference", "with better")
    rows = [(r["task"], KERNEL_LABELS.get(r["kernel"], r["kernel"]), _fmt(r["acc_without"], r["acc_without_std"]),
             _fmt(r["acc_with"], r["acc_with_std"]), _fmt(r["acc_diff"], r["acc_diff_std"], signed=True),
             f"{r['with_better']}/{r['seeds']}") for r in summary]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |")


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    tasks, kernels = result["tasks"], result["kernels"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(1.3 * len(kernels) + 2.5, 3.6) if len(tasks) == 1
                             else (len(tasks) * (1.1 * len(kernels) + 1.5), 3.6), squeeze=False)
    width = 0.38
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in result["summary"] if r["task"] == task]
        xs = range(len(rows))
        for off, key, label, color in ((-width / 2, "without", "without FastRPB", "#9aa5b1"),
                                       (width / 2, "with", "with FastRPB", "#d9534f")):
            means = [100 * (r[f"acc_{key}"] or 0.0) for r in rows]
            errs = [100 * (r[f"acc_{key}_std"] or 0.0) for r in rows]
            ax.bar([x + off for x in xs], means, width, yerr=errs if result["seeds"] > 1 else None, capsize=3,
                   label=label, color=color)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([KERNEL_LABELS.get(r["kernel"], r["kernel"]) for r in rows], fontsize=8)
        name = (f"ListOps, {result['data']['listops']['min_length']}..{result['data']['listops']['max_length']} tokens"
                if task == "listops" else
                f"{result['data']['images']['name']} ({'×'.join(map(str, result['data']['images']['image_size']))}, "
                f"patch {result['data']['images']['patch_size']})")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("validation accuracy (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=7, loc="upper left")
    sd = f"mean ± std over {result['seeds']} seeds" if result["seeds"] > 1 else "one seed"
    fig.suptitle(f"FastRPB on/off per kernel: {result['steps']} steps, width {result['d_model']}, "
                 f"{result['layers']} layers, base position {result['base_position']}; {sd}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
