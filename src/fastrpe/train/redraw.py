"""Redrawing random feature projections during training (Performer's `feature_redraw_interval`,
Choromanski et al., "Rethinking Attention with Performers", 2021).

Every `N` optimizer steps each random feature map of the model (PRF, ORF, sphere-PRF, TRF:
modules with a `redraw(seed)` method and a projection buffer) draws a new projection. The
seed depends only on the run's seed, the map's name in the model and the step, so a run
resumed from a checkpoint redraws exactly as the uninterrupted run (the current projection
is a buffer, saved in every checkpoint), and every rank of a data-parallel run draws the same.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn


def random_feature_maps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(name, module)` of every random feature map in `model` (modules with `redraw`)."""
    from ..kernels import FeatureMap

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, FeatureMap) and callable(getattr(m, "redraw", None))]


def redraw_seed(run_seed: int, name: str, step: int) -> int:
    """The 63-bit seed of map `name`'s projection drawn after optimizer step `step`."""
    digest = hashlib.sha256(f"fastrpe-redraw:{run_seed}:{name}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def redraw_random_features(model: nn.Module, run_seed: int, step: int) -> int:
    """Redraw every random feature map of `model` for `step`; returns how many were redrawn."""
    maps = random_feature_maps(model)
    for name, m in maps:
        m.redraw(redraw_seed(run_seed, name, step))
    return len(maps)
