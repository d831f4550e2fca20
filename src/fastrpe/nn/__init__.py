"""Layers and models built on `fastrpe.attention`."""
from ..ops.linear.state import BandState, KVCache, LinearState, SoEState  # noqa: F401
from .attention import MultiheadAttention, rotary  # noqa: F401
from .encoder import EncoderClassifier, EncoderConfig  # noqa: F401
from .lm import DecoderLM, LMConfig  # noqa: F401
from .seq2seq import Seq2Seq, Seq2SeqConfig  # noqa: F401
from .vit import ViTConfig, VisionTransformer  # noqa: F401
