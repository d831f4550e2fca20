"""FastRPB reproduction: the classifiers, built in pairs that differ only by the FastRPB term."""
from __future__ import annotations

import torch
from torch import nn

#: the kernels of the paper's tables here; `DEFAULT_KERNELS` those run by default
KERNELS = ("softmax", "exp", "elu", "prf", "dpfp", "relu")
DEFAULT_KERNELS = ("softmax", "exp", "elu", "prf")
TASKS = ("listops", "images")
#: `--base-position`: the positional term both models of a pair share. "learned" is the
#: paper's setting ("All models also used trainable Absolute Positional Encodings", §4).
BASE_POSITIONS = {"learned": {"listops": "learned_abs", "images": "learned_abs"},
                  "none": {"listops": "none", "images": "none"},
                  "sinusoidal": {"listops": "sinusoidal", "images": "sinusoidal2d"}}


def make_model(task: str, kernel: str, fastrpb: bool, *, d_model: int, layers: int, heads: int, base_position: str,
               listops_length: int = 128, image_size=(8, 8), channels: int = 1, num_classes: int = 10,
               patch_size: int = 1) -> nn.Module:
    """The classifier of `task` ("listops" or "images") with `kernel`, with or without FastRPB."""
    pos = BASE_POSITIONS[base_position][task]
    if task == "listops":
        from ...data.listops import NUM_CLASSES, VOCAB_SIZE
        from ...nn import EncoderClassifier, EncoderConfig

        return EncoderClassifier(EncoderConfig(vocab_size=VOCAB_SIZE, num_classes=NUM_CLASSES, d_model=d_model,
                                               n_layers=layers, n_heads=heads, kernel=kernel, position=pos,
                                               fastrpb=fastrpb, max_len=listops_length))
    if task == "images":
        from ...nn.vit import ViTConfig, VisionTransformer

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
    from ...positions.fastrpb import FastRPB1D
    from ...positions.grid import FastRPB2D

    names = []
    for mname, m in model.named_modules():
        if isinstance(m, (FastRPB1D, FastRPB2D)):
            names += [f"{mname}.{p}" for p, _ in m.named_parameters()]
    return names
