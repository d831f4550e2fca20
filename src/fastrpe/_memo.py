"""What the memos of values derived from a module's parameters key on (a frozen positional
term's SoE fit, `ops.linear.soe.soe_plan_for`; its log-coefficient table,
`backends._coefficients`). Neither reads a tensor: no host synchronization."""
from __future__ import annotations

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
