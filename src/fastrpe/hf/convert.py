"""Converting a pretrained Hugging Face transformer's attention to fastrpe attention, in place.

    import fastrpe.hf
    fastrpe.hf.convert(model, kernel="nprf", position="kerple_log", keep_position_encoding=False)

`convert` keeps every projection and weight of the model and changes only how attention is
computed: each attention module gets a `fastrpe` submodule (`FastRPEAttention`: the content
kernel, with its random features as buffers, and the positional term, with its parameters),
so both are in `state_dict`, trainable and moved by `.to()`; the model's attention
implementation becomes "fastrpe", a function registered in transformers'
`AttentionInterface` that reads them from the module and calls `fastrpe.attention`.
This is Luo et al. 2021's conversion (Figure 2: a trained softmax Transformer whose attention
is replaced by (N)PRF), read as a user's workflow.

Supported architectures (`SUPPORTED`): Llama, Mistral, Qwen2 and GPT-NeoX (rotary) and GPT-2
(learned absolute positions), causal decoder self-attention. Everything else is refused.

What the converted attention computes, per architecture (notation: B batch, H query heads,
Hkv key/value heads, L length, D head width):

* The model's own q/k/v projections, its rotary embedding (when kept) and its KV cache are
  untouched; fastrpe sees `q: [B, H, Lq, D]`, `k, v: [B, Hkv, Lk, D]` as the model's own
  attention would, with the model's score scale (`scaling`).
* Grouped-query attention (Hkv < H: Llama, Mistral, Qwen2): each key/value head is repeated
  for its `H / Hkv` query heads, as the models' eager attention does.
* Masks: a causal mask plus key padding is what fastrpe attention takes. The registered mask
  function hands the attention the 2D padding mask (`[B, Lk]`, True = a real token) or None,
  never an `L×L` matrix; a prepared 4D mask passed by the user is read back into key padding
  and checked. Any other pattern (packed sequences, a sliding window that reaches back less
  than the sequence: Mistral's `sliding_window`, Qwen2's `use_sliding_window`) raises
  `FastRPEError`: fastrpe does not silently attend where the model would not.
  Relative positional terms see key indices, so a left-padded batch gives its real tokens the
  same offsets as the unpadded sequence.
* `keep_position_encoding=False` removes the model's own positional encoding:
  Llama, Mistral, Qwen2, GPT-NeoX: the model's rotary module is wrapped so that it returns
  `cos = 1, sin = 0`, which makes `apply_rotary_pos_emb` the identity (exactly);
  GPT-2: the learned absolute table `wpe` is zeroed and frozen (`requires_grad=False`).
* Attention-probability dropout has no counterpart in kernelized attention: `convert` sets
  it to 0 (with a warning when it was not 0); the attention function refuses a nonzero rate.

Saving: `save_pretrained` writes every weight, the fastrpe ones included, and records the
arguments in `config.fastrpe_conversion`; load with `load_converted(path)` (a plain
`from_pretrained` would rebuild the original softmax attention and drop the fastrpe weights).

The identity check (`tests/test_hf_convert.py`): with `kernel="softmax"`, `position=None`
and the model's encoding kept, the converted model's logits equal the original's.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .._validate import FastRPEError

#: the name of the attention (and mask) implementation registered with transformers
ATTN_IMPLEMENTATION = "fastrpe"


@dataclass(frozen=True)
class _Arch:
    attention: tuple[str, ...]  # class names of the self-attention modules
    encoding: str  # "rotary" (base_model.rotary_emb) or "absolute" (base_model.wpe)


#: `config.model_type` -> how the architecture is converted
ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch(("LlamaAttention",), "rotary"),
    "mistral": _Arch(("MistralAttention",), "rotary"),
    "qwen2": _Arch(("Qwen2Attention",), "rotary"),
    "gpt_neox": _Arch(("GPTNeoXAttention",), "rotary"),
    "gpt2": _Arch(("GPT2Attention",), "absolute"),
}
SUPPORTED = tuple(ARCHITECTURES)


class FastRPEAttention(nn.Module):
    """What one converted attention module attends with: `kernel` (`fastrpe.kernels`: "softmax"
    or a feature map, a submodule with its random projections as buffers), `position` (a
    `fastrpe.positions` term or None, a submodule with its parameters) and the `backend`
    (`fastrpe.attention`'s, "auto" by default). Attached to the model's attention module as
    `module.fastrpe` by `convert`."""

    def __init__(self, kernel, position: nn.Module | None, backend: str = "auto"):
        super().__init__()
        self.kernel = kernel  # a FeatureMap registers as a submodule; Softmax is a plain attribute
        self.position = position
        self.backend = backend

    def extra_repr(self) -> str:
        k = self.kernel if not isinstance(self.kernel, nn.Module) else type(self.kernel).__name__
        return f"kernel={k}, backend={self.backend!r}"


class _NoRotary(nn.Module):
    """Wraps a model's rotary module so that it returns `cos = 1, sin = 0` of the shapes it
    would return: `q·cos + rotate_half(q)·sin = q` exactly, i.e. no rotary encoding."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x, position_ids=None, *args, **kwargs):
        cos, sin = self.rotary(x, position_ids, *args, **kwargs)
        return torch.ones_like(cos), torch.zeros_like(sin)


# ----------------------------------------------------------------------------------------
# the attention and mask functions registered with transformers


def _key_padding_from_4d(mask: Tensor, B: int, Lq: int, Lk: int) -> Tensor | None:
    """A user's prepared 4D mask (`[B or 1, 1 or H, Lq, Lk]`, bool True = attend, or additive
    float 0 / -inf) as key padding `[B, Lk]` (True = padding); raises when it is not
    "causal (bottom-right) and key padding"."""
    if mask.dim() != 4 or mask.shape[-2:] != (Lq, Lk):
        raise FastRPEError(f"attention_mask: expected [B, 1, {Lq}, {Lk}], got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask
    else:  # additive: 0 attends, a large negative number (-1e4 .. -inf) blocks; anything else is a bias
        allowed = mask == 0
        if not bool((allowed | (mask <= -1e4)).all()):
            raise FastRPEError("attention_mask: an additive 4D mask must hold 0 (attend) or a large negative number "
                               "(blocked); other values are a bias, which fastrpe attention does not take")
    allowed = allowed.all(dim=1).expand(B, Lq, Lk)  # [B, Lq, Lk]
    kpm = ~allowed[:, -1, :]  # the last query sees every key it may (causal, bottom-right aligned)
    i = torch.arange(Lq, device=mask.device)[:, None] + (Lk - Lq)
    causal = torch.arange(Lk, device=mask.device)[None, :] <= i
    want = causal[None] & ~kpm[:, None, :]
    rows = want.any(-1)  # a query with no admissible key may be masked in any way
    if not bool((allowed == want)[rows].all()):
        raise FastRPEError("attention_mask: fastrpe attention takes a causal mask with key padding only; "
                           "this 4D mask is another pattern (packed sequences, a window, a custom mask)")
    return kpm if bool(kpm.any()) else None


def _mask_function(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: Tensor | None = None, device="cpu", use_vmap: bool = False, **kwargs):
    """transformers' mask interface for "fastrpe": the 2D padding mask `[B, kv_length]` (True =
    a real token) or None, instead of a 4D matrix. A mask pattern other than causal (a
    sliding window that reaches back less than the keys, packed sequences) raises."""
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    local_size, plain = kwargs.get("local_size"), kwargs.get("allow_is_causal_skip", False)
    if mask_function is not causal_mask_function and local_size is not None and plain:
        # transformers' plain sliding-window causal mask (no overlay, which would have turned `plain`
        # off): the same as causal unless the oldest key is `local_size` or more behind the last query
        if int(kv_offset) <= int(q_offset) + q_length - 1 - int(local_size):
            raise FastRPEError(f"attention_mask: fastrpe attention is causal with key padding only; the model's "
                               f"sliding window ({local_size}) is shorter than this call's keys reach back")
    elif mask_function is not causal_mask_function:
        # another pattern: exact only if it is causal on this call's positions (checked on the full matrix)
        common = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, attention_mask=None, allow_is_causal_skip=False, device=device)
        got = sdpa_mask(mask_function=mask_function, use_vmap=use_vmap, **common)
        want = sdpa_mask(mask_function=causal_mask_function, **common)
        if not torch.equal(got.expand_as(want), want):
            raise FastRPEError("attention_mask: fastrpe attention is causal with key padding only; this model asks "
                               "for another pattern here (a sliding window shorter than the sequence, or packed "
                               "sequences)")
    pad = prepare_padding_mask(attention_mask, kv_length, kv_offset) if attention_mask is not None else None
    if pad is None:
        return None
    pad = pad.to(device=device, dtype=torch.bool)
    if pad.shape != (batch_size, kv_length):
        raise FastRPEError(f"attention_mask: expected a [{batch_size}, {kv_length}] padding mask, "
                           f"got {tuple(pad.shape)}")
    return None if bool(pad.all()) else pad


def _attention_function(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                        scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention interface for "fastrpe": `query: [B, H, Lq, D]`,
    `key, value: [B, Hkv, Lk, D]` -> (`[B, Lq, H, D]`, None)."""
    from ..api import attention

    spec = getattr(module, "fastrpe", None)
    if not isinstance(spec, FastRPEAttention):
        raise FastRPEError(f"{type(module).__name__} has no fastrpe attention: convert the model with "
                           "fastrpe.hf.convert(model, ...) rather than setting attn_implementation='fastrpe'")
    if dropout:
        raise FastRPEError(f"dropout: fastrpe attention has no attention-probability dropout (got {dropout}); "
                           "set the model's attention dropout to 0")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise FastRPEError("fastrpe.hf.convert supports causal self-attention only")
    B, H, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if Hkv != H:  # grouped-query attention: key/value head g serves query heads g*G .. g*G+G-1
        key = key.repeat_interleave(H // Hkv, dim=1)
        value = value.repeat_interleave(H // Hkv, dim=1)
    if attention_mask is None:
        kpm = None
    elif attention_mask.dim() == 2:  # from _mask_function: True = a real token
        kpm = ~attention_mask
    else:
        kpm = _key_padding_from_4d(attention_mask, B, Lq, Lk)
    out = attention(query, key, value, kernel=spec.kernel, position=spec.position, causal=True,
                    key_padding_mask=kpm, scale=scaling, backend=spec.backend)  # [B, H, Lq, D]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the "fastrpe" attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_function)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask_function)


# ----------------------------------------------------------------------------------------
# convert


def _layer_kernel(kernel, layer: int, head_dim: int, num_heads: int, num_features: int | None, seed: int,
                  scaling: float):
    from ..kernels import PRF, Kernel, get_kernel
    from ..nn.block import layer_seed

    if callable(kernel) and not isinstance(kernel, (str, Kernel)):
        k = kernel(layer, head_dim, num_heads)
    elif isinstance(kernel, str):
        try:
            k = get_kernel(kernel, head_dim=head_dim, num_features=num_features, seed=layer_seed(seed, "hf", layer),
                           num_heads=num_heads)
        except ValueError as e:
            raise FastRPEError(str(e)) from None
        if isinstance(k, PRF) and not k.normalize:
            # estimate exp(scaling·q·k), the model's own softmax kernel (GPT-2 may scale by 1/layer too)
            k.input_scale = math.sqrt(scaling)
    else:
        raise FastRPEError("kernel: expected a name ('softmax', 'nprf', 'elu', ...) or a function "
                           f"(layer, head_dim, num_heads) -> fastrpe kernel, got {type(kernel).__name__}")
    if not isinstance(k, Kernel):
        raise FastRPEError(f"kernel: the function returned {type(k).__name__}, not a fastrpe kernel")
    return k


def _layer_position(position, layer: int, num_heads: int, max_len: int):
    from .. import positions as P

    if position is None or position == "none":
        return None
    if isinstance(position, str):
        try:
            return P.make(position, num_heads, causal=True, max_len=max_len)
        except ValueError as e:
            raise FastRPEError(str(e)) from None
    if callable(position) and not isinstance(position, nn.Module):
        term = position(layer, num_heads)
        if term is not None and not isinstance(term, (P.Position, P.AdditiveTerm)):
            raise FastRPEError(f"position: the function returned {type(term).__name__}, not a fastrpe positional term")
        return term
    raise FastRPEError("position: expected a name ('kerple_log', 'alibi', ...), None, or a function "
                       f"(layer, num_heads) -> fastrpe positional term, got {type(position).__name__}")


def _heads(module: nn.Module, config) -> tuple[int, int, float]:
    """(query heads, head width, score scale) of one attention module."""
    H = config.num_attention_heads
    D = getattr(module, "head_dim", None) or getattr(module, "head_size", None) or config.hidden_size // H
    scaling = getattr(module, "scaling", None) or D ** -0.5
    return H, D, float(scaling)


def _zero_dropout(module: nn.Module, config, model_type: str) -> float:
    """Set the attention-probability dropout of `module` to 0; returns what it was."""
    if model_type == "gpt2":
        was = float(module.attn_dropout.p)
        module.attn_dropout.p = 0.0
        config.attn_pdrop = 0.0
    else:
        was = float(getattr(module, "attention_dropout", 0.0) or 0.0)
        module.attention_dropout = 0.0
        config.attention_dropout = 0.0
    return was


def convert(model: nn.Module, kernel="nprf", position="kerple_log", *, keep_position_encoding: bool = True,
            num_features: int | None = None, seed: int = 0, backend: str = "auto",
            max_len: int | None = None) -> nn.Module:
    """Swap the attention of a pretrained transformers model for fastrpe attention, in place.

    Args:
        model: a Llama, Mistral, Qwen2, GPT-NeoX or GPT-2 model from transformers (any head:
            `...ForCausalLM`, the bare model, ...), with its pretrained weights.
        kernel: content kernel: a `fastrpe.kernels` name ("softmax", "nprf" (Luo et al.'s
            normalized PRF), "prf", "elu", ...), or a function `(layer, head_dim, num_heads) ->
            kernel`. Each layer draws its own random features (an independent projection per
            head) from `seed`. An unnormalized "prf" estimates the model's own softmax kernel
            `exp(scaling·q·k)`.
        position: a `fastrpe.positions` name ("kerple_log", "alibi", "t5", ...), None, or a
            function `(layer, num_heads) -> term`; a fresh term per layer, trainable.
        keep_position_encoding: keep the model's rotary / absolute position encoding (True), or
            remove it (False: rotary becomes the identity, GPT-2's `wpe` is zeroed and frozen).
        num_features: random features per head of a random feature map (default 64).
        seed: seed of the random features.
        backend: `fastrpe.attention`'s backend ("auto" chooses per call).
        max_len: longest sequence a table-based positional term must cover (default: the
            model's `max_position_embeddings`).

    Returns:
        `model`, converted: its config's attention implementation is "fastrpe" and
        `config.fastrpe_conversion` records the arguments.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise FastRPEError(f"model: fastrpe.hf.convert supports {', '.join(SUPPORTED)}; "
                           f"got model_type {model_type!r} ({type(model).__name__})")
    if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        raise FastRPEError("model: already converted to fastrpe attention")
    if model_type == "gpt2" and getattr(config, "add_cross_attention", False):
        raise FastRPEError("model: GPT-2 with cross-attention is not supported (decoder self-attention only)")
    if not isinstance(keep_position_encoding, bool):
        raise FastRPEError(f"keep_position_encoding must be True or False, got {keep_position_encoding!r}")
    if not isinstance(backend, str):
        raise FastRPEError(f"backend must be a name, got {type(backend).__name__}")
    arch = ARCHITECTURES[model_type]
    layers = [m for m in model.modules() if type(m).__name__ in arch.attention]
    if not layers:
        raise FastRPEError(f"model: found no {'/'.join(arch.attention)} module to convert")
    if max_len is None:
        max_len = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 4096))

    register()
    dropped = []
    for i, module in enumerate(layers):
        layer = getattr(module, "layer_idx", None)
        layer = i if layer is None else int(layer)
        H, D, scaling = _heads(module, config)
        ref = next(module.parameters())
        k = _layer_kernel(kernel, layer, D, H, num_features, seed, scaling)
        p = _layer_position(position, layer, H, max_len)
        spec = FastRPEAttention(k, p, backend)
        spec.to(device=ref.device)
        if p is not None:  # positional parameters follow the model's dtype; random features stay as drawn
            p.to(dtype=ref.dtype)
        module.fastrpe = spec
        was = _zero_dropout(module, config, model_type)
        if was:
            dropped.append(was)
    if dropped:
        warnings.warn(f"fastrpe.hf.convert: attention dropout {max(dropped)} set to 0 (kernelized attention has no "
                      "attention-probability dropout)", stacklevel=2)

    if not keep_position_encoding:
        base = model.base_model
        if arch.encoding == "rotary":
            if not isinstance(base.rotary_emb, _NoRotary):
                base.rotary_emb = _NoRotary(base.rotary_emb)
        else:
            with torch.no_grad():
                base.wpe.weight.zero_()
            base.wpe.weight.requires_grad_(False)

    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    config.fastrpe_conversion = {
        "kernel": kernel if isinstance(kernel, str) else "custom",
        "position": position if (position is None or isinstance(position, str)) else "custom",
        "keep_position_encoding": keep_position_encoding, "num_features": num_features, "seed": seed,
        "backend": backend,
    }
    return model


def load_converted(path, model_class=None, **kwargs) -> nn.Module:
    """Load a model that was converted and saved with `save_pretrained`.

    A plain `from_pretrained` builds the original architecture with its own attention and
    drops the fastrpe weights (positional parameters, random features). This builds it, applies
    `convert` again with the arguments recorded in `config.fastrpe_conversion`, and loads the
    fastrpe tensors from the checkpoint's safetensors files.

    Args:
        path: the directory written by `save_pretrained`.
        model_class: the transformers class to load with (default `AutoModelForCausalLM`).
        **kwargs: passed to `from_pretrained` (e.g. `torch_dtype`).
    """
    from pathlib import Path

    from safetensors.torch import load_file

    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    model = model_class.from_pretrained(path, **kwargs)
    recorded = getattr(model.config, "fastrpe_conversion", None)
    if not isinstance(recorded, dict):
        raise FastRPEError(f"path: {path} holds no converted model (its config has no fastrpe_conversion)")
    if "custom" in (recorded.get("kernel"), recorded.get("position")):
        raise FastRPEError(f"path: {path} was converted with a custom kernel or position function; convert the "
                           "loaded model with the same function and load its state dict yourself")
    args = {k: recorded[k] for k in ("kernel", "position", "keep_position_encoding", "num_features", "seed", "backend")
            if k in recorded}
    convert(model, **args)
    want = {k for k in model.state_dict() if ".fastrpe." in k}
    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(f)).items() if k in want})
    missing = sorted(want - set(tensors))
    if missing:
        raise FastRPEError(f"path: {path} lacks the fastrpe tensors {', '.join(missing[:3])}"
                           + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""))
    model.load_state_dict(tensors, strict=False)
    return model
