"""Luo et al. (NeurIPS 2021) Figure 2: converting trained softmax models to random features.

The paper trains softmax Transformers with and without normalized queries/keys and with
and without RPE, replaces softmax by its positive-random-feature estimate (PRF) without
any fine-tuning, and reports how far the metric drops as a function of the number of
features m: models trained with normalized q/k (and RPE) convert with a small drop, the
usual unnormalized softmax models do not.

Setting: the small causal byte-level LM of `fastrpe extrapolate`, four variants trained
with the same seed and batches — softmax or normalized softmax, without a positional term
or with KERPLE-log. "Normalized" is Luo et al.'s §3.2: attention sees unit vectors, so its
content logits are `q̂·k̂ ∈ [−1, 1]` (temperature 1, fixed) and only the RPE can make a row
sharp. There is no learned scale: the paper's footnote 5 points out that a learned
rescaling of the normalized q and k (as in RFA) does not control their norms and so
defeats the normalization (an earlier version here learned one, started at ±8 logits).
`--temperature` fixes another logit range, for comparison; it is never learned.
PRF with input scale `D^-1/4` estimates `exp(q·k/√D)` — exactly the softmax kernel of the
same inputs — so the swap keeps every weight and changes only the kernel. Metric:
validation loss (nats/byte) on held-out files, averaged over `--draws` random-feature
draws, whose seeds come from a generator of their own (never the model's stream).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .lm import add_model_arguments, eval_nll, train_lm

VARIANTS = {  # label: (normalized q/k, position)
    "softmax": (False, "none"),
    "softmax + RPE": (False, "kerple_log"),
    "normalized": (True, "none"),
    "normalized + RPE": (True, "kerple_log"),
}


def add_arguments(p) -> None:
    p.add_argument("--features", default=None, help="m values (default 8,...,1024; quick 8,...,256)")
    p.add_argument("--draws", type=int, default=None, help="random-feature draws per m (default 5, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 1500, quick 400)")
    p.add_argument("--train-length", type=int, default=64)
    add_model_arguments(p)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="fixed (never learned) logit range of the normalized models; Luo et al.: 1")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 8e6, quick 1e6)")
    p.add_argument("--eval-tokens", type=int, default=8192)


def _attention_layers(model: nn.Module):
    from ..nn import MultiheadAttention

    return [m for m in model.modules() if isinstance(m, MultiheadAttention)]


def normalize_qk(model: nn.Module, temperature: float = 1.0) -> None:
    """Make every attention layer of `model` see `a·q̂`, `a·k̂` with a fixed `a`, in place:
    softmax's logits `D^-1/2·a²·q̂·k̂` are then `temperature·q̂·k̂` (Luo et al. §3.2 at 1)."""
    for layer in _attention_layers(model):
        a = math.sqrt(temperature * math.sqrt(layer.head_dim))  # a² = temperature·√D
        inner = layer._attend

        def attend(q, k, v, q_offset, kpm, _inner=inner, _a=a):
            return _inner(F.normalize(q, dim=-1) * _a, F.normalize(k, dim=-1) * _a, v, q_offset, kpm)

        layer._attend = attend


def set_kernel(model: nn.Module, kernel) -> None:
    """Swap the content kernel of every attention layer (weights untouched)."""
    from ..kernels import get_kernel

    for layer in _attention_layers(model):
        layer._modules.pop("kernel", None)  # a FeatureMap is a submodule, Softmax is not
        layer.kernel = get_kernel(kernel, head_dim=layer.head_dim)


def run(args, out_dir) -> dict:
    from ..data.text import load_corpus
    from ..kernels import PRF
    from ..nn import LMConfig

    feats = [int(m) for m in (args.features or ("8,16,32,64,128,256" if args.quick else
                                                "8,16,32,64,128,256,512,1024")).split(",")]
    draws = args.draws or (3 if args.quick else 5)
    steps = args.steps or (400 if args.quick else 1500)
    max_bytes = args.max_bytes or (1_000_000 if args.quick else 8_000_000)
    corpus = load_corpus("python-stdlib", max_bytes=max_bytes)
    L = args.train_length

    def val_loss(model) -> float:
        total, count = eval_nll(model, corpus.validation, L, args.eval_tokens, args.batch_size, args.device)
        return total / max(count, 1)

    from .approx import feature_seeds

    seeds = feature_seeds(args.seed, draws)
    rows = []
    for label, (normalized, position) in VARIANTS.items():
        cfg = LMConfig(vocab_size=corpus.vocab_size, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       kernel="softmax", position=position, max_len=max(4096, L))
        # train_lm builds the model; normalization must be in place before training
        run = train_lm(cfg, corpus.train, length=L, steps=steps, batch_size=args.batch_size, lr=args.lr,
                       seed=args.seed, device=args.device, desc=f"{label:>16s}",
                       setup=(lambda m: normalize_qk(m, args.temperature)) if normalized else None)
        model = run.model
        base = val_loss(model)
        D = model.blocks[0].attn.head_dim
        per_m = []
        for m in feats:
            losses = []
            for t in range(draws):
                set_kernel(model, PRF(D, m, seed=seeds[t], input_scale=D ** -0.25).to(args.device))
                losses.append(val_loss(model))
            finite = [x for x in losses if math.isfinite(x)]
            per_m.append({"features": m, "val_loss": sum(finite) / len(finite) if finite else float("nan"),
                          "val_loss_all": losses, "non_finite": len(losses) - len(finite)})
        set_kernel(model, "softmax")
        rows.append({"model": label, "normalized": normalized, "position": position, "softmax_val_loss": base,
                     "final_train_loss": run.losses[-1], "prf": per_m})
        print(f"{label:>16s}: softmax {base:.3f}; PRF " +
              ", ".join(f"m={r['features']}: {r['val_loss']:.3f}" for r in per_m))
    result = {"experiment": "conversion", "train_length": L, "steps": steps, "draws": draws,
              "temperature": args.temperature, "features": feats, "rows": rows}
    _plot(result, out_dir / "conversion.png")
    return result


def _plot(result: dict, path) -> None:
    from ..plotting import pyplot, save

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(result["rows"]):
        color = f"C{i}"
        xs = [p["features"] for p in r["prf"]]
        ax.plot(xs, [p["val_loss"] for p in r["prf"]], marker="o", color=color, label=f"{r['model']} → PRF")
        ax.axhline(r["softmax_val_loss"], color=color, ls="--", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("random features m (no fine-tuning)")
    ax.set_ylabel("validation loss (nats/byte); dashed: softmax")
    ax.set_title("softmax models converted to PRF", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)
