"""`fastrpe convert`: convert a trained softmax transformer to kernelized attention with a
relative positional term, fine-tune it briefly, and report the loss before conversion, right
after and after fine-tuning (Luo et al. 2021, Figure 2, as a user's workflow; needs the
`hf` extra).

No pretrained weights can be downloaded, so the softmax model is a tiny transformers model
(Llama by default) trained here on the embedded corpus, saved with `save_pretrained` and
loaded back with `from_pretrained`; `fastrpe.hf.convert` then swaps its attention.

Examples:
    fastrpe convert --quick                                   # ~1-2 minutes on 2 CPU cores
    fastrpe convert --kernel nprf --position kerple_log --out runs/convert
    fastrpe convert --quick --kernel softmax --position alibi --keep-position-encoding

Writes results.json (losses in nats/byte, the fine-tuning curve, timings) and convert.png
under --out, next to the saved softmax model and each training's metrics.jsonl.
"""
from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="convert a trained softmax transformer to fastrpe attention, fine-tune, report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model and few steps (about 1-2 minutes on 2 cores)")
    p.add_argument("--pretrained", default=None, metavar="DIR",
                   help="start from this softmax model (a save_pretrained directory) instead of training one")
    p.add_argument("--arch", default="llama", help="transformers architecture to train and convert: llama, mistral, "
                   "qwen2, gpt_neox, gpt2")
    p.add_argument("--kernel", default="nprf", help="kernel after conversion: nprf (default), prf, softmax, elu, ...")
    p.add_argument("--position", default="kerple_log",
                   help="fastrpe positional term after conversion: kerple_log (default), alibi, t5, ..., or none")
    p.add_argument("--keep-position-encoding", action="store_true",
                   help="keep the model's own rotary / absolute encoding (default: removed)")
    p.add_argument("--num-features", type=int, default=None, help="random features per head (default 64)")
    p.add_argument("--pretrain-steps", type=int, default=None, help="softmax training steps (default 1500, quick 200)")
    p.add_argument("--finetune-steps", type=int, default=None, help="fine-tuning steps (default 500, quick 80)")
    p.add_argument("--finetune-lr", type=float, default=None, help="fine-tuning learning rate (default 1e-3)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the control run (the softmax model trained for the same extra steps)")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes (default 8e6, quick 1e6)")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="validation tokens of each reported loss (default 65536, quick 16384)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/convert", help="output directory (default runs/convert)")
    p.add_argument("--no-progress", action="store_true")
    return p


def options_from_args(args):
    """`RecipeOptions` from the command line (the --quick preset, then the options given)."""
    from .._validate import FastRPEError
    from ..hf.recipe import RecipeOptions

    changes = {"arch": args.arch, "kernel": args.kernel,
               "position": None if args.position in (None, "none") else args.position,
               "keep_position_encoding": bool(args.keep_position_encoding), "num_features": args.num_features,
               "control": not args.no_control, "seed": args.seed, "pretrained": args.pretrained}
    for name in ("pretrain_steps", "finetune_steps", "finetune_lr", "max_bytes", "eval_tokens"):
        v = getattr(args, name)
        if v is not None:
            changes[name] = v
    o = RecipeOptions.quick(**changes) if args.quick else RecipeOptions(**changes)
    try:
        o.validate()
    except FastRPEError as e:  # name the option as it is spelt on the command line
        name, _, rest = str(e).partition(":")
        if name.isidentifier():
            raise FastRPEError(f"--{name.replace('_', '-')}:{rest}") from None
        raise
    return o


def run(args) -> int:
    from pathlib import Path

    from .._validate import FastRPEError

    o = options_from_args(args)
    try:
        import transformers  # noqa: F401  (the hf extra)
    except ImportError:
        raise FastRPEError("fastrpe convert needs Hugging Face transformers: pip install fastrpe[hf]") from None
    from ..hf.recipe import convert_recipe

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FastRPEError(f"--out: {out} exists and is not a directory")
    res = convert_recipe(out, o, progress=False if args.no_progress else None)
    v = res["val_loss"]
    print(f"validation loss (nats/byte): softmax {v['softmax']:.4f}, right after conversion {v['converted']:.4f} "
          f"({v['converted'] - v['softmax']:+.4f}), after {o.finetune_steps} fine-tuning steps {v['finetuned']:.4f} "
          f"({v['finetuned'] - v['softmax']:+.4f})"
          + (f"; softmax control after the same steps {v['softmax_control']:.4f}" if v["softmax_control"] is not None
             else ""))
    print(f"wrote {out / 'results.json'}" + (f" and {out / 'convert.png'}" if (out / "convert.png").exists() else ""))
    return 0
