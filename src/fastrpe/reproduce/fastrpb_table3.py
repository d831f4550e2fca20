"""FastRPB (ICLR submission), Table 3: training time and peak memory with and without FastRPB.

The paper (LRA, one A100) reports that FastRPB adds little: e.g. ListOps with the SIKF
linear kernel trains in 0.24 h without it and 0.34 h with it, at 0.68 → 0.85 GB peak
memory; "architectures with FastRPB ... proved to have memory and computation consumption
comparable with the default architectures".

Setting: the ListOps classifier of `fastrpe reproduce fastrpb` (`EncoderClassifier`,
bidirectional, `backend="auto"`) with each kernel — SIKF (`exp`), ReLU, DPFP, Performer
(`prf`) and softmax — with and without the FastRPB term `W·V`, on random token sequences of
exactly L tokens (the time of a step does not depend on the tokens' values), trained through
`fastrpe.train` with the reproductions' configuration (`reproduce.lm.train_config`), one
thread (`torch.set_num_threads(1)`). sec/step: the median interval between consecutive
steps' ends after the first `--skip`; peak memory: the allocator's peak over a 2-step
training run (CPU tensor allocations from the profiler: `fastrpe.bench.memory`), parameters
and optimizer state included. The backend `auto` picked for the attention is recorded:
fastrpe has no non-causal `φ(K)ᵀV` backend, so bidirectional linear kernels run `dense` (or
`fft`), quadratic in L, unlike the paper's linear transformers. The ratio "with / without" is the comparison; the paper's
absolute hours and GB belong to a different model, data and device.
"""
from __future__ import annotations

import statistics

import torch

from .._validate import FastRPEError
from .kerple_table4 import _StepTimer
from .luo_fig1a import parse_ints, set_timing_threads

KERNELS = {"SIKF": "exp", "ReLU": "relu", "DPFP": "dpfp", "Performer": "prf", "softmax": "softmax"}
PAPER_LISTOPS = {  # Table 3, ListOps rows: (without, with FastRPB)
    "softmax": {"hours": (0.74, 0.85), "gb": (3.25, 3.49)},
    "DPFP": {"hours": (0.26, 0.36), "gb": (0.68, 0.85)},
    "SIKF": {"hours": (0.24, 0.34), "gb": (0.68, 0.85)},
    "ReLU": {"hours": (0.24, 0.34), "gb": (0.68, 0.85)},
    "Performer": {"hours": (0.38, 0.48), "gb": (0.67, 0.9)},
}


def add_arguments(p) -> None:
    p.add_argument("--lengths", default=None, help="default 256,1024,2048 (quick 128,512)")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ", ".join(KERNELS))
    p.add_argument("--steps", type=int, default=None, help="timed training steps per cell (default 8, quick 5)")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def _train(model, L: int, steps: int, batch_size: int, seed: int, callbacks=()) -> None:
    from ..data.listops import NUM_CLASSES, VOCAB_SIZE
    from ..train import seeded_batches, train
    from .lm import train_config

    def sample(g, bs):
        return (torch.randint(1, VOCAB_SIZE, (bs, L), generator=g), torch.randint(0, NUM_CLASSES, (bs,), generator=g))

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x).float(), y)

    config = train_config(steps=steps, batch_size=batch_size, lr=1e-3, seed=seed)
    train(model, loss_fn, seeded_batches(sample, batch_size, seed), config, callbacks=list(callbacks))


def auto_backend(model, L: int, batch_size: int) -> str | None:
    """The backend `auto` picks for the model's first attention layer (with gradients)."""
    import fastrpe as fr

    from ..nn import MultiheadAttention

    attn = next(m for m in model.modules() if isinstance(m, MultiheadAttention))
    D = attn.head_dim
    x = torch.zeros(1, 1, 1, 1).expand(batch_size, attn.num_heads, L, D).requires_grad_(True)
    return fr.explain(x, x, x, kernel=attn.kernel, position=attn.position).chosen


def run(args, out_dir) -> dict:
    from ..bench.memory import allocator_peak_bytes
    from ..bench.runner import device_name
    from .fastrpb.models import make_model

    lengths = parse_ints(args.lengths) if args.lengths else ([128, 512] if args.quick else [256, 1024, 2048])
    names = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise FastRPEError(f"fastrpb-table3: unknown kernel(s) {unknown}; known: {', '.join(KERNELS)}")
    steps = args.steps or (5 if args.quick else 8)
    if steps <= args.skip:
        raise FastRPEError(f"fastrpb-table3: --steps ({steps}) must exceed --skip ({args.skip})")
    kw = {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "base_position": "none"}
    prev = set_timing_threads(args.threads)
    rows = []
    try:
        for L in lengths:
            for name in names:
                for rpb in (False, True):
                    def build():
                        torch.manual_seed(args.seed)
                        return make_model("listops", KERNELS[name], rpb, listops_length=L, **kw)

                    timer = _StepTimer()
                    _train(build(), L, steps, args.batch_size, args.seed, [timer])
                    sec = statistics.median(timer.intervals[max(args.skip - 1, 0):])
                    peak, _ = allocator_peak_bytes(lambda: _train(build(), L, 2, args.batch_size, args.seed))
                    chosen = auto_backend(build(), L, args.batch_size)
                    rows.append({"kernel": name, "fastrpb": rpb, "L": L, "sec_per_step": sec, "peak_bytes": peak,
                                 "auto_backend": chosen})
                    print(f"L={L:5d} {name:9s} {'FastRPB' if rpb else 'none':7s} {sec * 1e3:8.1f} ms/step "
                          f"peak {peak / 2**20:7.1f} MiB  auto: {chosen}", flush=True)
    finally:
        torch.set_num_threads(prev)
    ratios = []
    for L in lengths:
        for name in names:
            a = next(r for r in rows if r["kernel"] == name and r["L"] == L and not r["fastrpb"])
            b = next(r for r in rows if r["kernel"] == name and r["L"] == L and r["fastrpb"])
            paper = PAPER_LISTOPS[name]
            ratios.append({"kernel": name, "L": L, "time_ratio": b["sec_per_step"] / a["sec_per_step"],
                           "memory_ratio": b["peak_bytes"] / a["peak_bytes"],
                           "paper_listops_time_ratio": paper["hours"][1] / paper["hours"][0],
                           "paper_listops_memory_ratio": paper["gb"][1] / paper["gb"][0]})
    for r in ratios:
        print(f"L={r['L']:5d} {r['kernel']:9s} FastRPB/none: time x{r['time_ratio']:.2f} "
              f"(paper x{r['paper_listops_time_ratio']:.2f}), memory x{r['memory_ratio']:.2f} "
              f"(paper x{r['paper_listops_memory_ratio']:.2f})")
    result = {"experiment": "fastrpb-table3", "device": device_name(torch.device("cpu")), "threads": args.threads,
              "task": "listops classifier, random tokens", "lengths": lengths, "kernels": names, "steps": steps,
              "skip": args.skip, "batch_size": args.batch_size, "d_model": args.d_model, "layers": args.layers,
              "heads": args.heads, "rows": rows, "ratios": ratios}
    _plot(result, out_dir / "fastrpb-table3.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names, lengths = result["kernels"], result["lengths"]
    width = 0.8 / len(lengths)
    for j, L in enumerate(lengths):
        rs = [next(r for r in result["ratios"] if r["kernel"] == n and r["L"] == L) for n in names]
        xs = [i + (j - (len(lengths) - 1) / 2) * width for i in range(len(names))]
        axes[0].bar(xs, [r["time_ratio"] for r in rs], width=width, label=f"L = {L}")
        axes[1].bar(xs, [r["memory_ratio"] for r in rs], width=width, label=f"L = {L}")
    paper = [next(r for r in result["ratios"] if r["kernel"] == n)["paper_listops_time_ratio"] for n in names]
    paper_m = [next(r for r in result["ratios"] if r["kernel"] == n)["paper_listops_memory_ratio"] for n in names]
    axes[0].plot(range(len(names)), paper, "k_", ms=20, mew=2, label="paper, ListOps")
    axes[1].plot(range(len(names)), paper_m, "k_", ms=20, mew=2, label="paper, ListOps")
    for ax, what in zip(axes, ("sec/step", "peak memory")):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel(f"{what}: with FastRPB / without")
        ax.legend(fontsize=7)
    fig.suptitle(f"FastRPB Table 3 on CPU, {result['threads']} thread: ListOps classifier, "
                 f"d = {result['d_model']}, {result['layers']} layers", fontsize=9)
    save(fig, path)
