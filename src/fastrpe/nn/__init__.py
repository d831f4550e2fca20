"""Layers and models built on `fastrpe.attention`."""
from .attention import MultiheadAttention  # noqa: F401
