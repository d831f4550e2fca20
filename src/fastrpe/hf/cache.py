"""`FastRPECache`: transformers' `Cache` interface over fastrpe's decode states.

Each layer holds what `fastrpe.nn.MultiheadAttention.step` returned for that layer: a
constant-size `LinearState` / `BandState` / `SoEState` where the layer's `decoder()` picks
one, else a `KVCache` (see `fastrpe.ops.linear.state`). transformers' `generate` only reads
the length (`get_seq_length`) and reorders the batch (`reorder_cache` for beam search,
`batch_select_indices`, `batch_repeat_interleave`); the model writes the states.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._validate import FastRPEError
from ..ops.linear.state import BandState, KVCache, LinearState, SoEState

State = KVCache | LinearState | BandState | SoEState


def _batch_size(state: State) -> int:
    return (state.k if isinstance(state, KVCache) else state.S).shape[0]


class FastRPECacheLayer(CacheLayerMixin):
    """One layer's fastrpe decode state (`state`, None before the first call)."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: State | None = None

    def __repr__(self) -> str:
        kind = "empty" if self.state is None else type(self.state).__name__
        return f"FastRPECacheLayer({kind}, length={self.get_seq_length()})"

    def lazy_initialization(self, key_states, value_states) -> None:
        raise FastRPEError("FastRPECache: fastrpe layers keep their own decode states; there are no keys/values to "
                           "initialize")

    def update(self, key_states, value_states, *args, **kwargs):
        raise FastRPEError("FastRPECache: update(keys, values) is not supported; fastrpe layers store their decode "
                           "state in FastRPECacheLayer.state")

    def get_seq_length(self) -> int:
        return 0 if self.state is None else self.state.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):  # the states are small or are a plain KV cache: nothing to move
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state = None

    def _select(self, index: torch.Tensor) -> None:
        if self.state is not None:
            idx = index.to(device=(self.state.k if isinstance(self.state, KVCache) else self.state.S).device)
            self.state = self.state.select(idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b of the new batch is row `beam_idx[b]` of the old one."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self._select(torch.arange(_batch_size(self.state)).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers' convention: a negative count).
        Only a `KVCache` can forget tokens; a constant-size state cannot (`crop(0)` is a no-op)."""
        if tokens_to_remove == 0 or self.state is None:
            return
        if tokens_to_remove > 0:
            raise FastRPEError(f"FastRPECache.crop: tokens_to_remove must be <= 0 (tokens to drop, negated), "
                               f"got {tokens_to_remove}")
        if not isinstance(self.state, KVCache):
            raise FastRPEError(f"FastRPECache.crop: a constant-size {type(self.state).__name__} cannot forget tokens "
                               "(only a KVCache can)")
        n = -tokens_to_remove
        if n >= self.state.length:
            self.state = None
        else:
            self.state = KVCache(self.state.k[:, :, :-n], self.state.v[:, :, :-n])


class FastRPECache(Cache):
    """transformers `Cache` holding one fastrpe decode state per layer.

    `FastRPECache(n_layers)`; `states` lists the per-layer states (None before the first call),
    `nbytes()` is their total size in bytes."""

    def __init__(self, num_layers: int):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise FastRPEError(f"FastRPECache: num_layers must be a positive int, got {num_layers!r}")
        super().__init__(layers=[FastRPECacheLayer() for _ in range(num_layers)])

    @property
    def states(self) -> list[State | None]:
        return [layer.state for layer in self.layers]

    def set_states(self, states: list[State]) -> None:
        if len(states) != len(self.layers):
            raise FastRPEError(f"FastRPECache.set_states: got {len(states)} states for {len(self.layers)} layers")
        for layer, s in zip(self.layers, states):
            layer.state = s

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.states if s is not None)

    @property
    def batch_size(self) -> int:
        sizes = {_batch_size(s) for s in self.states if s is not None}
        return sizes.pop() if len(sizes) == 1 else -1
