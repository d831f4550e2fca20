"""What the memos of values derived from a module's parameters key on (a frozen positional
term's SoE fit, `ops.linear.soe.soe_plan_for`; its log-coefficient table,
`backends._coefficients`; the SoE fit's verdict, `soe_terms`), and the store that keeps them.
None of it reads a tensor: no host synchronization."""
from __future__ import annotations

import weakref

import torch
from torch import nn


def parameter_state(module: nn.Module) -> tuple:
    """What identifies the values of a term's parameters and buffers without reading them:
    storage, version (in-place writes bump it), dtype and device of each. Keys the memos of
    what is derived from a frozen term (`soe_plan_for`, `backends._coefficients`)."""
    return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (*module.parameters(), *module.buffers()))


def takes_grad(module: nn.Module) -> bool:
    """Whether a call now would need gradients for any of the module's parameters (autograd
    on and one of them requires grad): what derives from it must then be built in the graph."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in module.parameters())


class OnOwner:
    """A store for `kept` that keeps each owner's entries on the owner itself, in its attribute
    `name` (an `nn.Module`'s `__dict__`), for memos read under torch.compile: Dynamo guards a
    read of one owner's entries on that owner alone, where it guards a module-level
    `weakref.WeakKeyDictionary` whole, so that another owner's entry added (a new positional
    term's first call) recompiled every graph that had read the memo, and one collected between
    a trace and its guards' build failed that build ("list index out of range"). The entries go
    with their owner."""

    def __init__(self, name: str):
        self.name = name

    def get(self, owner):
        return getattr(owner, self.name, None)

    def setdefault(self, owner, value: dict) -> dict:
        return owner.__dict__.setdefault(self.name, value)


class ByIdentity:
    """A store for `kept` whose owners are told apart by identity, for owners whose `==` is not
    identity (a tensor compares elementwise, a dataclass by fields, so neither can key a
    `weakref.WeakKeyDictionary`); an owner's entries go when it is collected."""

    def __init__(self):
        self._by_id: dict[int, dict] = {}

    def get(self, owner):
        return self._by_id.get(id(owner))

    def setdefault(self, owner, value: dict) -> dict:
        i = id(owner)
        if i not in self._by_id:
            self._by_id[i] = value
            weakref.finalize(owner, self._by_id.pop, i, None)
        return self._by_id[i]


def kept(store, owner, key, build, *, entries: int, keep=None):
    """`build()` for `owner` under `key`, kept in `store[owner]` (`store`: a
    `weakref.WeakKeyDictionary` of one dict per owner, or a `ByIdentity`; the oldest entry goes
    beyond `entries`; `keep(value)` False: returned, not kept)."""
    memo = store.get(owner)
    if memo is None:
        memo = store.setdefault(owner, {})
    if key in memo:
        return memo[key]
    value = build()
    if keep is None or keep(value):
        while len(memo) >= entries:
            memo.pop(next(iter(memo)))  # dicts keep insertion order: the oldest
        memo[key] = value
    return value
