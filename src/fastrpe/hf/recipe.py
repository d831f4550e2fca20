"""The conversion recipe behind `fastrpe convert`: Luo et al. 2021's Figure 2 read as a user's
workflow — take a trained softmax transformer, swap its attention for kernelized attention with
a relative positional term, fine-tune briefly, and see what the conversion cost.

No pretrained weights can be downloaded here, so the "pretrained" model is trained first: a
tiny transformers model (Llama by default) on the embedded byte-level corpus
(`fastrpe.data.text.load_corpus`), through the project's one training stack
(`fastrpe.train.train`), saved with `save_pretrained` and loaded back with `from_pretrained`
as a user's checkpoint would be. Then:

1. validation loss of the softmax model (nats/byte, every validation token predicted once:
   `fastrpe.data.text.eval_windows`);
2. `fastrpe.hf.convert(model, kernel, position, keep_position_encoding=...)`, loss right after;
3. fine-tuning for `finetune_steps` through `fastrpe.train.train`, loss after;
4. a control: the softmax model trained for the same extra steps with the same settings, so
   that the fine-tuned converted model is compared with a softmax model that had the same
   budget, not only with the one it started from.

Writes `results.json` and `convert.png` (the fine-tuning loss curve with the softmax and
converted-before-fine-tuning losses as reference lines) under `out_dir`.
"""
from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._validate import FastRPEError

#: `arch` -> (transformers config class name, its field names for (width, layers, heads, mlp, kv heads))
_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "gpt_neox": "GPTNeoXConfig",
    "gpt2": "GPT2Config",
}


@dataclass
class RecipeOptions:
    """Every knob of `convert_recipe`; `quick()` is the `--quick` preset (about 1–2 minutes on 2
    CPU cores)."""

    arch: str = "llama"
    pretrained: str | None = None  # a softmax model saved with save_pretrained: skip the pretraining
    kernel: str = "nprf"
    position: str | None = "kerple_log"
    keep_position_encoding: bool = False
    num_features: int | None = None  # random features per head (default: the kernel's, 64)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 128
    batch_size: int = 16
    pretrain_steps: int = 1500
    pretrain_lr: float = 3e-3
    finetune_steps: int = 500
    finetune_lr: float = 1e-3
    warmup_steps: int = 50
    control: bool = True
    max_bytes: int = 8_000_000
    eval_tokens: int = 65_536
    eval_every: int = 50
    corpus: str = "python-stdlib"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls, **changes) -> RecipeOptions:
        base = dict(hidden_size=64, num_layers=2, seq_len=64, pretrain_steps=200, finetune_steps=80, warmup_steps=20,
                    max_bytes=1_000_000, eval_tokens=16_384, eval_every=20)
        base.update(changes)
        return cls(**base)

    def validate(self) -> None:
        from .convert import SUPPORTED

        if self.arch not in SUPPORTED:
            raise FastRPEError(f"arch: supported are {', '.join(SUPPORTED)}; got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "seq_len", "batch_size",
                     "pretrain_steps", "finetune_steps", "max_bytes", "eval_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise FastRPEError(f"{name}: must be an int >= 1, got {v!r}")
        for name in ("warmup_steps", "eval_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise FastRPEError(f"{name}: must be an int >= 0, got {v!r}")
        for name in ("pretrain_lr", "finetune_lr"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise FastRPEError(f"{name}: must be a finite number > 0, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise FastRPEError(f"hidden_size: {self.hidden_size} is not a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise FastRPEError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads ({self.num_heads})")
        if self.seq_len < 2:
            raise FastRPEError(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.num_features is not None and (not isinstance(self.num_features, int) or self.num_features < 1):
            raise FastRPEError(f"num_features: must be an int >= 1, got {self.num_features!r}")
        # the kernel and the positional term are refused now, not after the pretraining
        from .. import positions as P
        from ..kernels import get_kernel

        try:
            get_kernel(self.kernel, head_dim=self.hidden_size // self.num_heads, num_features=self.num_features)
        except ValueError as e:
            raise FastRPEError(str(e)) from None
        if self.position is not None:
            try:
                P.make(self.position, self.num_heads, causal=True)
            except ValueError as e:
                raise FastRPEError(str(e)) from None


def tiny_config(o: RecipeOptions, vocab_size: int):
    """The transformers config of the model the recipe trains (attention: SDPA, no dropout)."""
    import transformers

    cls = getattr(transformers, _CONFIGS[o.arch])
    if o.arch == "gpt2":
        cfg = cls(vocab_size=vocab_size, n_embd=o.hidden_size, n_layer=o.num_layers, n_head=o.num_heads,
                  n_positions=max(1024, o.seq_len), attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                  bos_token_id=0, eos_token_id=0)
    else:
        kw = dict(vocab_size=vocab_size, hidden_size=o.hidden_size, num_hidden_layers=o.num_layers,
                  num_attention_heads=o.num_heads, intermediate_size=4 * o.hidden_size,
                  max_position_embeddings=max(1024, o.seq_len), bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if o.arch != "gpt_neox":
            kw["num_key_value_heads"] = o.num_kv_heads
        cfg = cls(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def lm_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of `windows: [B, L+1]` (the model predicts tokens 1..L)."""
    return model(input_ids=windows, labels=windows).loss


def validation_loss(model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token negative log-likelihood (nats per byte) over `windows: [N, L+1]`."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for w in windows.split(batch_size):
                logits = model(input_ids=w[:, :-1]).logits.float()
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(),
                                                           reduction="sum").item()
                count += w[:, 1:].numel()
    finally:
        model.train(was)
    return total / count


def _train(model, batches, o: RecipeOptions, steps: int, lr: float, out_dir: Path, eval_fn, progress):
    from ..train import TrainConfig, train

    cfg = TrainConfig(steps=steps, batch_size=o.batch_size, lr=lr, warmup_steps=min(o.warmup_steps, steps),
                      weight_decay=0.1, grad_clip=1.0, seed=o.seed, log_every=max(1, min(10, steps // 20)),
                      eval_every=o.eval_every if eval_fn is not None else 0, ckpt_every=0, save_final=False,
                      out_dir=str(out_dir), progress=progress)
    t0 = time.perf_counter()
    res = train(model, lm_loss, batches, cfg, eval_fn=eval_fn)
    return res, time.perf_counter() - t0


def _finite_or_null(x):
    """`x` with every non-finite float replaced by None (valid JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


def _curve(history, start: float) -> dict[str, list]:
    """The logged train losses, and the validation loss at step 0 (`start`) and each evaluation."""
    train_pts = [(r["step"], r["loss"]) for r in history if r.get("kind") == "train"]
    eval_pts = [(0, start)] + [(r["step"], r["val_loss"]) for r in history if r.get("kind") == "eval"]
    return {"train_step": [s for s, _ in train_pts], "train_loss": [v for _, v in train_pts],
            "eval_step": [s for s, _ in eval_pts], "eval_loss": [v for _, v in eval_pts]}


def convert_recipe(out_dir: str | Path, options: RecipeOptions | None = None, *, progress: bool | None = None,
                   log=print, plot: bool = True) -> dict[str, Any]:
    """Train a softmax model, save and reload it, convert it, fine-tune it; see the module docstring.

    Args:
        out_dir: where `softmax-model/` (save_pretrained), `pretrain/`, `finetune/`, `control/`
            (metrics.jsonl of each training), `results.json` and `convert.png` go.
        options: `RecipeOptions` (default: the full setting; `RecipeOptions.quick()` for --quick).
        progress: tqdm bars of the training loop (None: when stderr is a terminal).
        log: called with one line per stage.
        plot: draw `convert.png` (when matplotlib is installed).

    Returns:
        The results dict written to `results.json`: losses in nats/byte under
        `"val_loss"`: `softmax` (the loaded model), `converted` (right after `convert`),
        `finetuned`, and `softmax_control` (the softmax model after the same extra steps).
    """
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the one-line reports below say what happens; no weight-loading bars
    hf_logging.disable_progress_bar()
    try:
        return _convert_recipe(out_dir, options, progress, log, plot)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _convert_recipe(out_dir, options, progress, log, plot) -> dict[str, Any]:
    import transformers

    from ..data.text import eval_windows, load_corpus, random_windows
    from ..train import seeded_batches
    from .convert import convert

    o = options or RecipeOptions()
    o.validate()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FastRPEError(f"out_dir: {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    corpus = load_corpus(o.corpus, max_bytes=o.max_bytes)
    train_stream, val_stream = corpus.train, corpus.validation
    val = eval_windows(val_stream, o.seq_len, max_tokens=o.eval_tokens)
    batches = seeded_batches(lambda g, bs: random_windows(train_stream, o.seq_len, bs, g), o.batch_size, o.seed)
    ft_batches = seeded_batches(lambda g, bs: random_windows(train_stream, o.seq_len, bs, g), o.batch_size,
                                o.seed + 1)  # fine-tuning sees other windows than pretraining
    eval_bs = max(1, o.batch_size)

    def curve_eval(m):
        return {"val_loss": validation_loss(m, val, eval_bs)}

    # 1. the "pretrained" softmax model (trained here unless one is given)
    pre, pre_s, trained_loss = None, None, None
    if o.pretrained is None:
        torch.manual_seed(o.seed)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(o, corpus.vocab_size))
        n_params = sum(p.numel() for p in model.parameters())
        log(f"convert: pretraining a softmax {o.arch} ({n_params / 1e6:.2f} M parameters) for "
            f"{o.pretrain_steps} steps")
        pre, pre_s = _train(model, batches, o, o.pretrain_steps, o.pretrain_lr, out / "pretrain", None, progress)
        saved = out / "softmax-model"
        model.save_pretrained(saved)
        trained_loss = validation_loss(model, val, eval_bs)
        del model
    else:
        saved = Path(o.pretrained)
        if not (saved / "config.json").is_file():
            raise FastRPEError(f"pretrained: {saved} is not a directory written by save_pretrained (no config.json)")

    # 2. a user's workflow starts here: load, measure, convert, measure
    model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    arch = model.config.model_type
    n_params = sum(p.numel() for p in model.parameters())
    if model.get_input_embeddings().num_embeddings < corpus.vocab_size:
        raise FastRPEError(f"pretrained: the model's vocabulary ({model.get_input_embeddings().num_embeddings}) is "
                           f"smaller than the byte corpus' ({corpus.vocab_size})")
    loss_softmax = validation_loss(model, val, eval_bs)
    log(f"convert: softmax model loaded from {saved}: validation loss {loss_softmax:.4f} nats/byte")
    control = None
    if o.control:
        control = transformers.AutoModelForCausalLM.from_pretrained(saved)
    convert(model, kernel=o.kernel, position=o.position, keep_position_encoding=o.keep_position_encoding,
            num_features=o.num_features, seed=o.seed)
    loss_converted = validation_loss(model, val, eval_bs)
    log(f"convert: converted to {o.kernel} + {o.position or 'no positional term'} (model's own position encoding "
        f"{'kept' if o.keep_position_encoding else 'removed'}): {loss_converted:.4f} nats/byte before fine-tuning")

    # 3. fine-tune the converted model
    ft, ft_s = _train(model, ft_batches, o, o.finetune_steps, o.finetune_lr, out / "finetune", curve_eval, progress)
    loss_finetuned = ft.eval["val_loss"] if ft.eval else validation_loss(model, val, eval_bs)
    log(f"convert: after {o.finetune_steps} fine-tuning steps: {loss_finetuned:.4f} nats/byte")

    # 4. the control: softmax, the same extra steps
    loss_control, ctl_curve, ctl_s = None, None, None
    if control is not None:
        ctl, ctl_s = _train(control, ft_batches, o, o.finetune_steps, o.finetune_lr, out / "control", curve_eval,
                            progress)
        loss_control = ctl.eval["val_loss"] if ctl.eval else validation_loss(control, val, eval_bs)
        ctl_curve = _curve(ctl.history, loss_softmax)
        log(f"convert: control (softmax, the same {o.finetune_steps} steps): {loss_control:.4f} nats/byte")

    results = {
        "command": "fastrpe convert",
        "options": {k: v for k, v in asdict(o).items() if k != "extra"},
        "model": {"arch": arch, "parameters": n_params, "vocab_size": corpus.vocab_size,
                  "saved": str(saved), "corpus": corpus.name},
        "val_loss": {"softmax": loss_softmax, "converted": loss_converted, "finetuned": loss_finetuned,
                     "softmax_control": loss_control, "softmax_before_save": trained_loss},
        "val_tokens": int(val[:, 1:].numel()),
        "increase": {"converted": loss_converted - loss_softmax, "finetuned": loss_finetuned - loss_softmax,
                     "finetuned_vs_control": None if loss_control is None else loss_finetuned - loss_control},
        "finetune_curve": _curve(ft.history, loss_converted),
        "control_curve": ctl_curve,
        "pretrain_final_train_loss": None if pre is None else pre.final_loss,
        "seconds": {"pretrain": pre_s, "finetune": ft_s, "control": ctl_s,
                    "total": time.perf_counter() - t_start},
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "threads": torch.get_num_threads()},
    }
    (out / "results.json").write_text(json.dumps(_finite_or_null(results), indent=2, allow_nan=False) + "\n")
    if plot:
        plot_recipe(results, out / "convert.png")
    return results


def plot_recipe(results: dict[str, Any], path: str | Path) -> Path | None:
    """The fine-tuning curve (train loss per logged step, validation loss at the evaluations)
    with the softmax model's and the just-converted model's validation loss as lines; the
    control's curve when there is one. Returns None when matplotlib is absent."""
    from ..plotting import pyplot

    plt = pyplot()
    if plt is None:
        return None
    o, v, c = results["options"], results["val_loss"], results["finetune_curve"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(c["train_step"], c["train_loss"], color="C0", alpha=0.45, lw=1, label="converted: train loss")
    ax.plot(c["eval_step"], c["eval_loss"], "o-", color="C0", ms=3, label="converted: validation loss")
    cc = results.get("control_curve")
    if cc:
        ax.plot(cc["eval_step"], cc["eval_loss"], "s-", color="C2", ms=3, alpha=0.8,
                label="softmax, same extra steps (control)")
    ax.axhline(v["softmax"], color="k", ls="--", lw=1, label=f"softmax before conversion ({v['softmax']:.3f})")
    ax.axhline(v["converted"], color="C3", ls=":", lw=1.2,
               label=f"right after conversion ({v['converted']:.3f})")
    shown = c["eval_loss"] + [v["softmax"], v["converted"]] + ((cc or {}).get("eval_loss") or [])
    ax.set_ylim(min(shown + c["train_loss"]) - 0.05, max(shown) + 0.1)  # a first train loss may sit above
    ax.set_xlabel(f"fine-tuning step (validation: {results['val_tokens']:,} held-out bytes)")
    ax.set_ylabel("loss (nats/byte)")
    enc = "kept" if o["keep_position_encoding"] else "removed"
    ax.set_title(f"{results['model']['arch']} softmax → {o['kernel']} + {o['position'] or 'no positional term'} "
                 f"(own position encoding {enc})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
