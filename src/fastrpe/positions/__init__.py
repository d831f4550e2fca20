"""Positional terms. See `base.py` for the conventions."""
from .base import AdditiveTerm, Position, offsets, toeplitz_index  # noqa: F401
