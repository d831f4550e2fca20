"""fastrpe: attention with relative positional encoding, fast on long sequences.

    import fastrpe as fr
    out = fr.attention(q, k, v, kernel="nprf", position=fr.positions.KerpleLog(8), causal=True)
    print(fr.explain(q, k, v, kernel="nprf", position=..., causal=True))
"""
from . import kernels, nn, positions  # noqa: F401
from ._validate import FastRPEError  # noqa: F401
from .api import attention, explain  # noqa: F401
from .dispatch import BACKENDS, register_backend, set_auto_policy  # noqa: F401

__version__ = "0.1.0"
__all__ = ["attention", "explain", "kernels", "positions", "nn", "FastRPEError", "BACKENDS", "set_auto_policy"]

