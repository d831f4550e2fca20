"""Exact softmax attention with a positional term by passing key/value blocks around a ring."""
from __future__ import annotations


def ring_reasons(p) -> list[str]:
    return ["the softmax ring is not implemented yet"]
