"""FastRPB (Zubkov & Gavrilov, 2022), Tables 1–2: accuracy without and with FastRPB, ListOps and images.

Paper: "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks" (Maksim
Zubkov, Daniil Gavrilov; ICLR 2022 submission, arXiv:2202.11364, 2022).

FastRPB adds a learned relative term to any attention, `Y = Attention(Q, K, V) + W·V`, with
a Toeplitz `W` (1D) or `W = w(Δrow) + w(Δcol)` on an image grid (2D), multiplied by FFT.
The paper's Tables 1–2 compare each kernel without and with it; all its models "also used
trainable Absolute Positional Encodings" (§4). What the tables say (`paper.PAPER` holds
their numbers): on LRA ListOps FastRPB does not help (Table 1: "the best performance was
obtained by the model without any relative positional encoding"), on LRA CIFAR10 (a
single-layer model) it hurts by 3–10 points, on MNIST (8 layers) it helps by 0.6–2.7 F1
points for every kernel (Table 2).

Setting. For each task × kernel (default softmax, exp = SIKF, elu+1, prf = Performer
FAVOR+; dpfp and relu on request) × {without, with FastRPB}, a small classifier with a
trainable absolute position embedding is trained from scratch; the two models of a pair
are built from the same seed, the "with" model gets the "without" model's weights copied
in (so they differ *only* by the FastRPB parameters, which start at 0: at step 0 both
compute the same function) and they see the same batches in the same order. No dropout.
Reported: validation accuracy after the last step, mean ± std over `--seeds` (each seed
changes initialization and batch order; the data sets stay fixed), the paired difference
(with − without, same seed) with its per-seed signs, a paired two-sided t-test and its
95 % interval, and a verdict per paper table row (`paper.verdict`).

* listops: `EncoderClassifier` (bidirectional, mean-pooled) on the embedded LRA ListOps
  generator with LRA's tree settings but lengths `L/4 .. L` tokens (`--listops-length L`),
  FastRPB1D in every layer (`max_len = L`).
* images: `VisionTransformer` on pixels (`--patch-size 1`: one token per pixel, as in
  LRA's Image task and the authors' released 2D code; mean pooling, no class token),
  FastRPB2D in every layer (this library's FastRPB2D learns separate row and column
  vectors; the authors' code shares one). scikit-learn's 8×8 `digits` (64 tokens, its
  fixed 20% test split as validation) by default, standing in for both CIFAR10 and MNIST;
  MNIST / Fashion-MNIST (784 tokens) when installed.

Positions. `--base-position learned` (default, the paper's setting) gives both models a
trainable absolute embedding per position (per pixel for images); `none` leaves them
without (the "without" model is then a bag of tokens, and any gain is FastRPB's positional
information alone); `sinusoidal` gives both fixed absolute encodings (2D for images).

Modules: `data` (samplers and validation batches), `models` (the classifier pairs),
`training` (one run through `fastrpe.train`), `stats` (mean ± std, paired tests),
`paper` (the tables and the verdict rule), `table`, `plot`; this module holds the command's options and the experiment's loop.
"""
from __future__ import annotations

import torch

from ..._validate import FastRPEError
from .data import image_data, listops_data
from .models import BASE_POSITIONS, DEFAULT_KERNELS, KERNELS, TASKS, build_pair, fastrpb_parameter_names, make_model
from .plot import plot
from .paper import PAPER, compare
from .stats import pooled, summarize
from .table import KERNEL_LABELS, format_table, format_verdicts
from .training import train_classifier

__all__ = ["BASE_POSITIONS", "DEFAULT_KERNELS", "KERNELS", "PAPER", "KERNEL_LABELS", "TASKS", "add_arguments", "build_pair",
           "fastrpb_parameter_names", "make_model", "run", "train_classifier"]


def add_arguments(p) -> None:
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of: " + ", ".join(TASKS))
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                   help="comma-separated kernel names of fastrpe.kernels.get_kernel (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 250, quick 100)")
    p.add_argument("--seeds", type=int, default=None, help="runs per configuration (default 3, quick 1)")
    p.add_argument("--listops-length", type=int, default=None,
                   help="longest ListOps sequence; samples have L/4..L tokens (default 64, quick 32)")
    p.add_argument("--listops-train", type=int, default=None,
                   help="ListOps training samples (default 5000, quick 1000)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="validation samples per task (default: ListOps 500 / quick 200; images: the whole test split)")
    p.add_argument("--image-dataset", default="digits", help="digits (scikit-learn), mnist or fashion-mnist")
    p.add_argument("--patch-size", type=int, default=1, help="ViT patch side in pixels (1: pixel-level)")
    p.add_argument("--base-position", default="learned", choices=tuple(BASE_POSITIONS),
                   help="absolute positions of both models: learned (the paper's setting), none (isolates FastRPB) "
                        "or sinusoidal")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--d-model", type=int, default=None, help="model width (default 32, quick 16)")
    p.add_argument("--layers", type=int, default=1, help="layers (default 1, as LRA's CIFAR10 model)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.05, help="significance level of the paired t-test")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads during the runs (default 1: these models are too small to gain from "
                        "more, and a second thread makes them several times slower when other jobs share the cores; "
                        "0 keeps PyTorch's setting)")


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
    from ...kernels import get_kernel

    tasks = _csv(args.tasks, TASKS, "tasks")
    kernels = _csv(args.kernels, None, "kernels")
    d_model = args.d_model or (16 if args.quick else 32)
    for k in kernels:
        try:
            get_kernel(k, head_dim=d_model // args.heads)
        except ValueError as e:
            raise FastRPEError(f"fastrpb: --kernels: {e}") from None
    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or (100 if args.quick else 250)
    L = args.listops_length or (32 if args.quick else 64)
    n_train = args.listops_train or (1000 if args.quick else 5000)
    n_eval_listops = args.eval_samples or (200 if args.quick else 500)
    if min(seeds, steps, L - 10, n_train, n_eval_listops, args.batch_size, d_model, args.layers, args.heads) < 1:
        raise FastRPEError("fastrpb: --seeds, --steps, --listops-train, --eval-samples, --batch-size, --d-model, "
                           "--layers, --heads must be positive and --listops-length at least 11")
    if not 0 < args.alpha < 1:
        raise FastRPEError(f"fastrpb: --alpha must be in (0, 1), got {args.alpha}")
    common = {"d_model": d_model, "layers": args.layers, "heads": args.heads, "base_position": args.base_position}

    data, task_info = {}, {}
    if "listops" in tasks:
        sample, val, info = listops_data(L, n_train, n_eval_listops, args.seed, args.batch_size)
        data["listops"] = (sample, val, {"listops_length": L})
        task_info["listops"] = info
    if "images" in tasks:
        sample, val, info = image_data(args.image_dataset, args.eval_samples)
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
                    r = train_classifier(model, sample, val, steps=steps, batch_size=args.batch_size, lr=args.lr,
                                         weight_decay=args.weight_decay, seed=seed, device=args.device)
                    n_params = sum(p.numel() for p in model.parameters())
                    loss = "diverged" if r["val_loss"] is None else f"loss {r['val_loss']:.3f}"
                    print(f"{task:>7s} {kernel:>7s} {'with' if fastrpb else 'without':>7s} FastRPB, seed {seed}: "
                          f"val acc {100 * r['val_acc']:5.1f}%, {loss} ({r['seconds']:.1f} s)", flush=True)
                    runs.append({"task": task, "kernel": kernel, "fastrpb": fastrpb, "seed": seed,
                                 "parameters": n_params, **r})
                del pair

    summary = summarize(runs, tasks, kernels, [args.seed + s for s in range(seeds)])
    pooled_tests = pooled(summary)
    comparison = compare(summary, pooled_tests, args.alpha)
    print("\n" + format_table(summary, seeds))
    print("\n" + format_verdicts(comparison, summary, pooled_tests))
    result = {"experiment": "fastrpb",
              "paper": "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks "
                       "(Zubkov & Gavrilov, ICLR 2022 submission, arXiv:2202.11364)",
              "claim": "Table 1: FastRPB does not help on ListOps and hurts on CIFAR10; Table 2: it helps every "
                       "kernel on MNIST (all models with trainable absolute positions)",
              "paper_tables": {t: {"claim": c, "compared_with": task, "rows": rows} for t, (c, task, rows) in PAPER.items()},
              "tasks": tasks, "kernels": kernels, "seeds": seeds, "steps": steps, "batch_size": args.batch_size,
              "lr": args.lr, "weight_decay": args.weight_decay, "d_model": d_model, "layers": args.layers,
              "heads": args.heads, "base_position": args.base_position, "device": str(args.device),
              "threads": torch.get_num_threads(),
              "alpha": args.alpha, "data": task_info, "summary": summary, "pooled": pooled_tests,
              "comparison": comparison, "runs": runs}
    plot(result, out_dir / "fastrpb.png")
    return result
