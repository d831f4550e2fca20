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

Modules: `data` (samplers and validation batches), `models` (the classifier pairs),
`training` (one run through `fastrpe.train`), `stats` (mean ± std, paired differences),
`table`, `plot`; this module holds the command's options and the experiment's loop.
"""
from __future__ import annotations

import torch

from ..._validate import FastRPEError
from .data import image_data, listops_data
from .models import BASE_POSITIONS, KERNELS, TASKS, build_pair, fastrpb_parameter_names, make_model
from .plot import plot
from .stats import summarize
from .table import KERNEL_LABELS, format_table
from .training import train_classifier

__all__ = ["BASE_POSITIONS", "KERNELS", "KERNEL_LABELS", "TASKS", "add_arguments", "build_pair",
           "fastrpb_parameter_names", "make_model", "run", "train_classifier"]


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
    print("\n" + format_table(summary, seeds))
    result = {"experiment": "fastrpb",
              "paper": "FastRPB: a Scalable Relative Positional Encoding for Long Sequence Tasks "
                       "(Zubkov & Gavrilov, ICLR 2022 submission, arXiv:2202.11364)",
              "claim": "adding FastRPB raises validation accuracy of every attention kernel on ListOps and images",
              "tasks": tasks, "kernels": kernels, "seeds": seeds, "steps": steps, "batch_size": args.batch_size,
              "lr": args.lr, "weight_decay": args.weight_decay, "d_model": d_model, "layers": args.layers,
              "heads": args.heads, "base_position": args.base_position, "device": str(args.device),
              "threads": torch.get_num_threads(),
              "data": task_info, "summary": summary, "runs": runs}
    plot(result, out_dir / "fastrpb.png")
    return result
