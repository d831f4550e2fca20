"""`FastRPEConfig`: a transformers `PreTrainedConfig` holding a `fastrpe.nn.LMConfig`.

The fields are `LMConfig`'s, with the same names and defaults (content kernel, positional
term, backend, sizes); transformers' standard names (`hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `max_position_embeddings`) are aliases of `d_model`, `n_layers`,
`n_heads`, `max_len`. The positional term's learned parameters live in the weights.
"""
from __future__ import annotations

import dataclasses

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .._validate import FastRPEError
from ..nn.lm import LMConfig

#: `LMConfig` field names, in the order `to_lm_config` passes them
LM_FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))


@strict
class FastRPEConfig(PreTrainedConfig):
    """Configuration of `FastRPEForCausalLM` / `FastRPEForSequenceClassification`.

    Args (besides transformers' common ones, e.g. `num_labels`, `pad_token_id`):
        vocab_size, d_model, n_layers, n_heads, ff_mult, dropout: sizes, as `LMConfig`.
        kernel: "softmax" or a feature-map name ("nprf", "elu", "prf", ...).
        position: "none", "sinusoidal", "rotary", "shaw" or a `fastrpe.positions` name
            ("kerple_log", "alibi", "t5", ...).
        backend: the `fastrpe.attention` backend ("auto" by default).
        max_len: longest sequence a position table is sized for.
        num_features, feature_seed: random feature maps (see `LMConfig`).
        use_cache: whether `generate` keeps fastrpe decode states (default True).

    Invalid values raise `FastRPEError` naming the field, when the config is made.
    """

    model_type = "fastrpe"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the cache's name from transformers 5.24, before
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_len",
    }

    vocab_size: int = 259
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ff_mult: int = 4
    dropout: float | int = 0.0
    kernel: str = "softmax"
    position: str = "kerple_log"
    backend: str = "auto"
    max_len: int = 4096
    num_features: int | None = None
    feature_seed: int = 0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if not self.tie_word_embeddings:
            raise FastRPEError("FastRPEConfig: field 'tie_word_embeddings' must be True (DecoderLM ties its head)")
        self.to_lm_config()  # checked when made, not at the first forward

    def to_lm_config(self) -> LMConfig:
        """The `fastrpe.nn.LMConfig` of the wrapped `DecoderLM`."""
        try:
            return LMConfig(**{name: getattr(self, name) for name in LM_FIELDS})
        except (TypeError, ValueError) as e:  # FastRPEError included: one message, this class's name
            raise FastRPEError(f"FastRPEConfig: {str(e).removeprefix('LMConfig: ')}") from None

    @classmethod
    def from_lm_config(cls, lm: LMConfig, **kwargs) -> FastRPEConfig:
        """The config of a `DecoderLM` built from `lm` (extra `kwargs`: transformers' fields)."""
        return cls(**lm.to_dict(), **kwargs)
