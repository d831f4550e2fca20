"""fastrpe's `DecoderLM` as transformers `PreTrainedModel`s.

The models wrap one `fastrpe.nn.DecoderLM` (attribute `model`): the weights, the forward
pass and the decode states are fastrpe's own code. Without a cache the forward pass is
`DecoderLM.forward` (the fast full-sequence algorithms `backend` picks); with a cache
(`generate`, or `use_cache=True`) it is `DecoderLM.step`, and the cache is a
`FastRPECache` holding each layer's fastrpe decode state: a constant-size
`LinearState` / `BandState` / `SoEState` where the layer's `decoder()` picks one, else a
`KVCache`.

The cache's name: transformers 5.24 renamed the cache argument of `forward` / `generate` and the
output field that holds it from `past_key_values` to `cache` (`CACHE_NAME` is the installed
transformers' name). `FastRPEForCausalLM.forward` takes either keyword and returns the cache
under `CACHE_NAME`.

Padding: `attention_mask` may mark right padding (each row ones, then zeros) in a forward
pass without a cache (causal attention never lets a real token see the padding after it);
left padding, or padding while decoding with a cache, is refused with a `FastRPEError`.

Notation: B batch, L new tokens, V vocabulary, E width, C labels.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          GenerationMixin, PreTrainedModel)
from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                           SequenceClassifierOutputWithPast)

from .._validate import FastRPEError, check_tokens
from ..nn.block import init_weights
from ..nn.lm import DecoderLM
from .cache import FastRPECache
from .configuration import FastRPEConfig

#: The keyword `generate` passes the cache to `forward` under, and the output field that holds it:
#: "cache" from transformers 5.24, "past_key_values" before.
CACHE_NAME = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
              else "past_key_values")


def _hidden(lm: DecoderLM, tokens: Tensor) -> Tensor:
    """`tokens: [B, L]` -> final hidden states `[B, L, E]` (after the last LayerNorm), the
    modules of `DecoderLM.forward` in its order."""
    x = lm._embed(tokens, 0)  # (B, L, E)
    for blk in lm.blocks:
        x = blk(x)
    return lm.ln_f(x)


def _build_lm(config: FastRPEConfig) -> DecoderLM:
    """The wrapped `DecoderLM`. transformers' `from_pretrained` builds the model under a "meta"
    default device and then loads the weights; fastrpe's positional terms compute their initial
    values on the host, which meta tensors cannot, so that case builds on the CPU (the loaded
    weights replace these values). transformers passes `dtype=` as the default dtype while
    building; positional terms create float32 tensors explicitly, so the whole model is cast
    (`from_pretrained(..., dtype=d)` is then `from_pretrained(...).to(d)`)."""
    if torch.get_default_device().type == "meta":
        with torch.device("cpu"):
            lm = DecoderLM(config.to_lm_config())
    else:
        lm = DecoderLM(config.to_lm_config())
    return lm.to(torch.get_default_dtype())


def _check_inputs(where: str, input_ids, inputs_embeds, output_attentions, output_hidden_states, kwargs) -> None:
    if inputs_embeds is not None:
        raise FastRPEError(f"{where}: inputs_embeds is not supported; pass input_ids")
    if input_ids is None:
        raise FastRPEError(f"{where}: input_ids is required")
    if output_attentions:
        raise FastRPEError(f"{where}: output_attentions is not supported (kernelized backends never form the "
                           "attention weights)")
    if output_hidden_states:
        raise FastRPEError(f"{where}: output_hidden_states is not supported; FastRPEModel returns the last "
                           "hidden state")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in ("num_items_in_batch", "position_ids"))
    if unknown:
        raise FastRPEError(f"{where}: unexpected argument {unknown[0]!r}")
    if kwargs.get("position_ids") is not None:
        raise FastRPEError(f"{where}: position_ids is not supported (positions are relative: token i sits at i)")


def _check_mask(where: str, mask: Tensor | None, batch: int, length: int, cached: bool) -> Tensor | None:
    """Checks `attention_mask: [B, S]` (1 = token, 0 = padding) and returns it as bool, or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise FastRPEError(f"{where}: attention_mask must be [{batch}, {length}] (1 = token, 0 = padding), "
                           f"got {shape}")
    m = mask.bool()
    if cached:
        if not bool(m.all()):
            raise FastRPEError(f"{where}: attention_mask has padding; decoding with a cache needs unpadded rows "
                               "(batch prompts of one length, or generate them one at a time)")
    elif bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise FastRPEError(f"{where}: attention_mask: only right padding (ones, then zeros) is supported")
    return m


class FastRPEPreTrainedModel(PreTrainedModel):
    """Base class: config, weight tying, and no re-initialization (`DecoderLM` initializes
    itself, GPT-2 style, and positional terms keep their own initialization)."""

    config_class = FastRPEConfig
    config: FastRPEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the cache's name from transformers 5.24, before
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}
    # fastrpe's constant-size decode states cannot be rolled back (no assisted generation)
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value
        self.model.head.weight = value.weight


class FastRPEModel(FastRPEPreTrainedModel):
    """The body of `DecoderLM`: `input_ids: [B, L]` -> `last_hidden_state: [B, L, E]`."""

    def __init__(self, config: FastRPEConfig):
        super().__init__(config)
        self.model = _build_lm(config)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, *,
                inputs_embeds: Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs):
        _check_inputs("FastRPEModel", input_ids, inputs_embeds, output_attentions, output_hidden_states, kwargs)
        check_tokens(input_ids, self.config.vocab_size, "input_ids", "FastRPEModel")
        _check_mask("FastRPEModel", attention_mask, *input_ids.shape, cached=False)
        h = _hidden(self.model, input_ids)  # (B, L, E)
        if return_dict is False:
            return (h,)
        return BaseModelOutputWithPast(last_hidden_state=h)


class FastRPEForCausalLM(FastRPEPreTrainedModel, GenerationMixin):
    """`DecoderLM` as a transformers causal LM (`generate`, `Trainer`, `save_pretrained`).

    Example:
        >>> import torch, fastrpe.hf
        >>> from transformers import AutoModelForCausalLM
        >>> cfg = fastrpe.hf.FastRPEConfig(d_model=32, n_heads=2, kernel="nprf", position="alibi")
        >>> model = AutoModelForCausalLM.from_config(cfg).eval()
        >>> model.generate(torch.tensor([[72, 105]]), max_new_tokens=5, do_sample=False).shape
        torch.Size([1, 7])
    """

    def __init__(self, config: FastRPEConfig):
        super().__init__(config)
        self.model = _build_lm(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate must not make a DynamicCache: forward makes a FastRPECache on the first call
        return False

    def new_cache(self) -> FastRPECache:
        """An empty `FastRPECache` for this model (what `generate` uses when given none)."""
        return FastRPECache(self.config.n_layers)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: FastRPECache | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, *, past_key_values: FastRPECache | None = None,
                inputs_embeds: Tensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None, **kwargs):
        """Args:
            input_ids: `[B, L]` new tokens (after the cache's tokens, if any).
            attention_mask: `[B, S]`, S = cached + new tokens; see the module docstring for padding.
            cache: a `FastRPECache` (updated in place and returned).
            labels: `[B, L]` next-token targets as transformers shifts them (`labels[:, 1:]` are
                predicted from positions `:-1`); -100 is ignored.
            use_cache: decode with fastrpe's states (`DecoderLM.step`) and return the cache.
                Default: False, unless a cache is given (`generate` passes True).
            past_key_values: `cache` under its name before transformers 5.24 (what `generate`
                passes there); give one of the two.
        Returns:
            `CausalLMOutputWithPast(loss, logits [B, L, V], cache)`, the cache under `CACHE_NAME`.
        """
        where = "FastRPEForCausalLM"
        num_items = kwargs.pop("num_items_in_batch", None)
        _check_inputs(where, input_ids, inputs_embeds, output_attentions, output_hidden_states, kwargs)
        name = "cache"
        if past_key_values is not None:
            if cache is not None:
                raise FastRPEError(f"{where}: got both cache and past_key_values; pass the cache once "
                                   "(past_key_values is its name before transformers 5.24)")
            cache, name = past_key_values, "past_key_values"
        if cache is not None and not isinstance(cache, FastRPECache):
            raise FastRPEError(f"{where}: {name} must be a FastRPECache (model.new_cache()), got "
                               f"{type(cache).__name__}")
        check_tokens(input_ids, self.config.vocab_size, "input_ids", where)
        past = cache.get_seq_length() if cache is not None else 0
        cached = cache is not None or bool(use_cache)
        _check_mask(where, attention_mask, input_ids.shape[0], past + input_ids.shape[1], cached)
        if cached:
            if cache is None:
                cache = self.new_cache()
            logits, states = self.model.step(input_ids, cache.states if past else None)  # (B, L, V)
            cache.set_states(states)
        else:
            cache = None
            logits = self.model(input_ids)  # (B, L, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=num_items)
        if return_dict is False:
            out = (logits, cache) if cache is not None else (logits,)
            return ((loss,) + out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache})


class FastRPEForSequenceClassification(FastRPEPreTrainedModel):
    """`DecoderLM`'s body and a linear score head on the last token of each row (the last
    unpadded one: from `attention_mask`, else the last token before `pad_token_id`)."""

    def __init__(self, config: FastRPEConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = _build_lm(config)
        self.score = nn.Linear(config.d_model, config.num_labels, bias=False)
        init_weights(self.score)
        self.post_init()

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs):
        """`input_ids: [B, L]`, `labels: [B]` (class ids, or floats for regression / `[B, C]`
        multi-label) -> `SequenceClassifierOutputWithPast(loss, logits [B, C])`."""
        where = "FastRPEForSequenceClassification"
        kwargs.pop("num_items_in_batch", None)
        _check_inputs(where, input_ids, inputs_embeds, output_attentions, output_hidden_states, kwargs)
        check_tokens(input_ids, self.config.vocab_size, "input_ids", where)
        B, L = input_ids.shape
        if attention_mask is None and self.config.pad_token_id is not None:
            attention_mask = input_ids != self.config.pad_token_id
        m = _check_mask(where, attention_mask, B, L, cached=False)
        last = (m.sum(1) - 1).clamp(min=0) if m is not None else torch.full((B,), L - 1, device=input_ids.device)
        h = _hidden(self.model, input_ids)  # (B, L, E)
        logits = self.score(h[torch.arange(B, device=h.device), last])  # (B, C)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        if return_dict is False:
            return ((loss, logits) if loss is not None else (logits,))
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits)


def register() -> None:
    """Register "fastrpe" with transformers' Auto classes (done by `import fastrpe.hf`)."""
    AutoConfig.register(FastRPEConfig.model_type, FastRPEConfig, exist_ok=True)
    AutoModel.register(FastRPEConfig, FastRPEModel, exist_ok=True)
    AutoModelForCausalLM.register(FastRPEConfig, FastRPEForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(FastRPEConfig, FastRPEForSequenceClassification, exist_ok=True)
