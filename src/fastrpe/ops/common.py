"""Small helpers shared by the ops.

Notation: B batch, H heads, Lq queries, Lk keys, F features, Dv value width,
R = Lq + Lk - 1 offsets.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

# index arithmetic lives in a leaf module shared with `fastrpe.positions` (no import cycle)
from .._index import (CLS_TO_CLS, CLS_TO_PATCH, PATCH_TO_CLS, check_grid, grid_offset_index,  # noqa: F401
                      materialize_grid, offsets, toeplitz_index)
from .._validate import FastRPEError


#: CUDA's limit on a grid's second and third dimensions; the Triton kernels put B·H on the second
MAX_GRID_YZ = 65535

#: the settings of a switch between a path for CUDA devices and its portable sibling
#: (`kernels.TRITON_FEATURES`, `nn.attention.FUSED_STEP`, `fft.causal.SEGMENT_BLOCKS`)
DEVICE_ROUTES = ("cuda", "always", "never")


def route_setting(module, name: str, route: str):
    """A context manager: the switch `module.name` set to `route` (a `DEVICE_ROUTES` value,
    checked first) inside the block, restored after it (`fft.blocked.use_kernel`,
    `fft.causal.use_local`, `fft.triton_rowsum.use_row_sums`)."""
    device_route(route, f"{module.__name__}.{name}", torch.device("cpu"))  # (checks the value)
    return _setting_block(module, name, route)


@contextlib.contextmanager
def _setting_block(module, name: str, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def device_route(setting: str, name: str, device: torch.device) -> bool:
    """Whether a switch set to `setting` (`DEVICE_ROUTES`; `name` is the switch, for the error)
    takes a call on `device`: "cuda" on CUDA devices, "always" everywhere, "never" nowhere."""
    if setting not in DEVICE_ROUTES:
        raise FastRPEError(f"{name}: 'cuda', 'always' or 'never', got {setting!r}")
    return setting == "always" or (setting == "cuda" and device.type == "cuda")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (no event query, no pinned
    allocation, no host read may happen then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class LaterReads:
    """Small device tensors copied to pinned host memory without waiting, each with what it is
    about, and read at a later call once its copy has landed (an event query, never a wait: a
    read would drain the stream). How a verdict that needs a value from the GPU is taken in a
    hot path (the FFT path's NaN rows, the sum-of-exponentials fit in training). Nothing is
    queued or queried while a CUDA graph is captured (a query there invalidates the capture),
    and no more than `limit` wait."""

    def __init__(self, limit: int = 64):
        self.pending: list = []  # (event, host copy, info), oldest first
        self.limit = limit

    def accepting(self) -> bool:
        """Whether `add` may be called now (asked first, so that no flag is computed for nothing)."""
        return not capturing() and len(self.pending) <= self.limit

    def add(self, t: Tensor, info=None) -> None:
        """Queue `t` (when `accepting()`)."""
        self.pending.append((*self._copy(t), info))

    def landed(self):
        """`(host copy, info)` of each entry whose copy has landed, oldest first, taken off."""
        while self.pending and not capturing() and self.pending[0][0].query():
            _, copy, info = self.pending.pop(0)
            yield copy, info

    def clear(self) -> None:
        self.pending.clear()

    @staticmethod
    def _copy(t: Tensor) -> tuple:
        """`(event, copy)`: `t` copied to pinned memory on its device's current stream."""
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))  # there, whichever device is current
        return event, copy


def causal_offset_mask(Lq: int, Lk: int, q_offset: int, device=None) -> Tensor:
    """`[R]` bool over offsets `r = -(Lq-1+q_offset) .. Lk-1-q_offset`: True where `r <= 0` (kept by causal)."""
    r = torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, device=device)
    return r <= 0


def finite_max(x: Tensor, dim: int = -1) -> Tensor:
    """Detached max over `dim` (kept), with 0 where every entry is `-inf`: the shift taken
    out before `exp` so that nothing overflows and an all-`-inf` row gives zeros, not NaN."""
    m = x.detach().amax(dim=dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def underflow_threshold(dtype: torch.dtype) -> float:
    """`tiny / eps` of `dtype` (1e-31 in float32, 2e-292 in float64): a row whose total
    weight is below it counts as empty. Above it, `1/den` (the gradient of `num/den`) stays
    below `eps/tiny` and cannot overflow; below it, the weights themselves approach the
    subnormal range and the forward value has lost its precision anyway."""
    fi = torch.finfo(dtype)
    return fi.tiny / fi.eps


def safe_inverse(den: Tensor) -> Tensor:
    """`1/den`, 0 where `|den|` is below `underflow_threshold` (an empty row)."""
    zero = den.abs() < underflow_threshold(den.dtype)
    return torch.where(zero, torch.zeros_like(den), 1 / torch.where(zero, torch.ones_like(den), den))


class _SafeDivide(torch.autograd.Function):
    """`num·inv[..., None]`, `inv = safe_inverse(den)`. Autograd's own `num / den` and masking
    held three `[B, H, Lq, Dv]` temporaries in forward and five in backward; this holds the
    output and, in backward, `dnum` (`Σ g·num` is a batched dot, no temporary): at a million
    tokens each is 2 GiB (B·H = 8, Dv = 64, float32). The backward is made of differentiable
    ops on the saved inputs, so second derivatives still work."""

    @staticmethod
    def forward(ctx, num: Tensor, den: Tensor) -> Tensor:
        ctx.save_for_backward(num, den)
        return num * safe_inverse(den).unsqueeze(-1)

    @staticmethod
    def backward(ctx, g: Tensor):
        num, den = ctx.saved_tensors
        inv = safe_inverse(den)
        dnum = g * inv.unsqueeze(-1) if ctx.needs_input_grad[0] else None
        # d(num/den)/d(den) = -num/den²; empty rows have inv = 0 and so a zero gradient
        dden = -torch.einsum("...d,...d->...", g, num) * inv * inv if ctx.needs_input_grad[1] else None
        return dnum, dden


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """`num: [B, H, Lq, Dv]` / `den: [B, H, Lq]`; rows with no weight (`|den|` below
    `underflow_threshold`, exactly 0 included) give 0 and a zero gradient."""
    return _SafeDivide.apply(num, den)


# The division inside a kernel's autograd function (the Triton backends, `divide=`): the
# function returns `out = num/den` and keeps neither num (saved by `_SafeDivide`) nor, in
# backward, `dnum = dout/den`: its kernels read dout as it comes and scale each row by `inv`
# (`triton_chunked.quotient_backward`).


def quotient(num: Tensor, den: Tensor, dtype: torch.dtype) -> Tensor:
    """`num/den` as `safe_divide` computes it (empty rows 0), in `dtype`. `num` is scaled in
    place: it must be a buffer the caller owns and no longer needs."""
    return num.mul_(safe_inverse(den).unsqueeze(-1)).to(dtype)
