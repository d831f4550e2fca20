"""Positional terms, one module per family. See `base.py` for the conventions.

`make(name, num_heads, causal=..., max_len=...)` builds a term from its name (the CLI and
the model configs use these names): see `NAMES`; keyword arguments go to the term, e.g.
`make("geometric", 8, gamma=0.999, learnable=True)` or `make("kerple_log", 8, init="random", seed=0)`.
The model configs also take "shaw" (`ShawRelative`, whose width follows the layer's kernel:
see `fastrpe.nn.block.position_term`) and "none", "sinusoidal", "rotary".
"""
from __future__ import annotations

from .alibi import ALiBi, alibi_slopes  # noqa: F401
from .base import AdditiveTerm, Position, offsets, toeplitz_index  # noqa: F401
from .fastrpb import FastRPB1D  # noqa: F401
from .geometric import GeometricDecay, retnet_gammas  # noqa: F401
from .grid import FastRPB2D, GridPosition, Table2D  # noqa: F401
from .kerple import KerpleBiasWeight, KerpleLog, KerpleLog3, KerplePower  # noqa: F401
from .learned import LearnedTable  # noqa: F401
from .shaw import ShawRelative  # noqa: F401
from .t5 import T5Bias, t5_bucket  # noqa: F401


def _t5(H, causal, max_len, **kw):
    return T5Bias(H, bidirectional=not causal, **kw)


def _learned(H, causal, max_len, **kw):
    kw.setdefault("max_distance", min(max_len, 512))
    return LearnedTable(H, **kw)


_FACTORIES = {
    "learned": _learned,
    "t5": _t5,
    "alibi": lambda H, causal, max_len, **kw: ALiBi(H, **kw),
    "geometric": lambda H, causal, max_len, **kw: GeometricDecay(H, **kw),
    "kerple_power": lambda H, causal, max_len, **kw: KerplePower(H, **kw),
    "kerple_power_p1": lambda H, causal, max_len, **kw: KerplePower(H, learn_p=False, p=1.0, **kw),
    "kerple_log": lambda H, causal, max_len, **kw: KerpleLog(H, **kw),
    "kerple_log3": lambda H, causal, max_len, **kw: KerpleLog3(H, **kw),
    "kerple_bias_weight": lambda H, causal, max_len, **kw: KerpleBiasWeight(H, **kw),
}

NAMES = tuple(_FACTORIES)


def make(name: str, num_heads: int, *, causal: bool = False, max_len: int = 1024, **kwargs):
    """A positional term from its name (`NAMES`), with `num_heads` heads."""
    if name not in _FACTORIES:
        raise ValueError(f"position: unknown name {name!r}; known: {', '.join(NAMES)}")
    return _FACTORIES[name](num_heads, causal, max_len, **kwargs)
