"""fastrpe models as Hugging Face transformers models (extra `[hf]`).

    import fastrpe.hf  # registers "fastrpe" with AutoConfig / AutoModelForCausalLM / ...
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(fastrpe.hf.FastRPEConfig(kernel="nprf", position="alibi"))

`import fastrpe` never imports transformers; only this module does.
"""
from .._validate import FastRPEError

try:
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - exercised only without the extra
    raise FastRPEError("fastrpe.hf needs Hugging Face transformers: pip install fastrpe[hf]") from None

from .cache import FastRPECache, FastRPECacheLayer  # noqa: E402,F401
from .configuration import FastRPEConfig  # noqa: E402,F401
from .modeling import (  # noqa: E402,F401
    CACHE_NAME, FastRPEForCausalLM, FastRPEForSequenceClassification, FastRPEModel, FastRPEPreTrainedModel, register)

register()

from .convert import convert  # noqa: E402,F401  (converting a pretrained transformers model)

__all__ = ["FastRPEConfig", "FastRPEModel", "FastRPEForCausalLM", "FastRPEForSequenceClassification",
           "FastRPEPreTrainedModel", "FastRPECache", "FastRPECacheLayer", "CACHE_NAME"]
