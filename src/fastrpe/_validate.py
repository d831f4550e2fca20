"""Input checks shared by every public entry point.

Every error names the argument it is about, so that a user who passes a
wrong tensor sees which one at once.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


class FastRPEError(ValueError):
    """Raised for invalid input to a fastrpe function."""


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, check_finite: bool = True) -> None:
    """Check `q: [B, H, Lq, D]`, `k: [B, H, Lk, D]`, `v: [B, H, Lk, Dv]`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise FastRPEError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise FastRPEError(
                f"{name} must have 4 dimensions [B, H, L, D] (SDPA layout), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise FastRPEError(f"{name} must be a floating point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise FastRPEError(f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise FastRPEError(
            f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    B, H, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise FastRPEError(f"batch sizes differ: q={B}, k={k.shape[0]}, v={v.shape[0]}")
    if k.shape[1] != H or v.shape[1] != H:
        raise FastRPEError(f"head counts differ: q={H}, k={k.shape[1]}, v={v.shape[1]}")
    if k.shape[3] != D:
        raise FastRPEError(f"k's last dimension ({k.shape[3]}) must equal q's ({D})")
    if v.shape[2] != k.shape[2]:
        raise FastRPEError(f"v's length ({v.shape[2]}) must equal k's ({k.shape[2]})")
    if Lq == 0:
        raise FastRPEError("q is an empty sequence (Lq = 0)")
    if k.shape[2] == 0:
        raise FastRPEError("k and v are empty sequences (Lk = 0)")
    if D == 0 or v.shape[3] == 0:
        raise FastRPEError(f"head dimension must be positive, got D={D}, Dv={v.shape[3]}")
    if check_finite and q.device.type == "cpu" and not torch.compiler.is_compiling():
        # value check, eager CPU only: under torch.compile a host read of tensor values breaks the
        # graph, and on a GPU it would drain the stream on every call (no host sync in the hot
        # path: there a non-finite input shows as a NaN output); names only on failure
        ok = torch.stack([torch.isfinite(t).all() for t in (q, k, v)])
        if not bool(ok.all()):
            name = next(n for n, good in zip("qkv", ok.tolist()) if not good)
            raise FastRPEError(f"{name} contains non-finite values (inf or NaN)")


def resolve_q_offset(Lq: int, Lk: int, causal: bool, q_offset: int | None) -> int:
    """Position of the first query (keys sit at `0..Lk-1`).

    Default 0, except causal with `Lq < Lk` (decoding with a cache), where the
    queries are bottom-right aligned: `q_offset = Lk - Lq`.
    """
    if q_offset is None:
        return Lk - Lq if (causal and Lq < Lk) else 0
    if isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise FastRPEError(f"q_offset must be an int or None, got {q_offset!r}")
    if q_offset < 0:
        raise FastRPEError(f"q_offset must be >= 0, got {q_offset}")
    return q_offset


def check_key_padding_mask(mask: Tensor | None, B: int, Lk: int, device: torch.device) -> Tensor | None:
    """`key_padding_mask: [B, Lk]` bool, True marks a padding key (ignored), as in nn.MultiheadAttention."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise FastRPEError(f"key_padding_mask must be a bool tensor [B, Lk], got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise FastRPEError(f"key_padding_mask must have dtype torch.bool (True = padding), got {mask.dtype}")
    if tuple(mask.shape) != (B, Lk):
        raise FastRPEError(f"key_padding_mask must have shape [B, Lk] = {(B, Lk)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise FastRPEError(f"key_padding_mask is on {mask.device}, q/k/v on {device}")
    return mask


def check_scale(scale) -> None:
    """`scale`: None or a finite positive number (inf made every softmax row NaN)."""
    if scale is None:
        return
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
    if not ok:
        raise FastRPEError(f"scale must be a positive finite number or None, got {scale!r}")


def check_backend_name(backend, where: str = "backend") -> None:
    """`backend`: "auto" or a registered backend name (checked at construction, not at the first call)."""
    from . import backends as _backends  # noqa: F401  (registers the built-in backends)
    from .dispatch import BACKENDS

    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise FastRPEError(f"{where}: unknown backend {backend!r}; known: {', '.join(['auto', *BACKENDS])}")


def check_features(x, name: str, width: int, where: str, *, dims: tuple[int, ...] = (3,),
                   layout: str = "[B, L, E]") -> None:
    """A layer input: a floating tensor of rank in `dims` whose last dimension is `width`."""
    if not isinstance(x, Tensor):
        raise FastRPEError(f"{where}: {name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() not in dims:
        raise FastRPEError(f"{where}: {name} must have {' or '.join(map(str, dims))} dimensions {layout}, "
                           f"got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise FastRPEError(f"{where}: {name} must be a floating point tensor, got dtype {x.dtype} "
                           "(token ids go through an embedding first)")
    if x.shape[-1] != width:
        raise FastRPEError(f"{where}: {name}'s last dimension must be {width}, got shape {tuple(x.shape)}")


def check_same_dtype(x, param: Tensor, name: str, where: str) -> None:
    """An input must have the dtype of the layer's weights (mixed dtypes fail inside a matmul), except
    under autocast, which casts for the matmul itself."""
    if x.dtype == param.dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise FastRPEError(f"{where}: {name} has dtype {x.dtype} but the layer's weights are {param.dtype}; "
                       f"convert one of them (e.g. layer.to({x.dtype}))")


def check_tokens(tokens, vocab_size: int, name: str, where: str, *, dims: tuple[int, ...] = (2,)) -> None:
    """Token ids: an integer tensor `[B, L]` with every id in `0 .. vocab_size-1`."""
    if not isinstance(tokens, Tensor):
        raise FastRPEError(f"{where}: {name} must be an integer torch.Tensor [B, L], got {type(tokens).__name__}")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise FastRPEError(f"{where}: {name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dim() not in dims:
        raise FastRPEError(f"{where}: {name} must have {' or '.join(map(str, dims))} dimensions [B, L], "
                           f"got shape {tuple(tokens.shape)}")
    # value check, eager only: a host read breaks a compiled graph (an id out of range still fails in the embedding)
    if tokens.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(tokens)  # one pass, two host reads
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise FastRPEError(f"{where}: {name} holds id {bad}, outside the vocabulary 0..{vocab_size - 1}")


def check_device(device, where: str = "device") -> torch.device:
    """A device string/object that exists on this machine (cuda needs a GPU; cuda:N needs N GPUs)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise FastRPEError(f"{where}: {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise FastRPEError(f"{where}: {device!r} asked for, but no CUDA GPU is available here; use cpu")
        if dev.index is not None and dev.index >= n:
            raise FastRPEError(f"{where}: {device!r} asked for, but only {n} CUDA GPU(s) exist")
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise FastRPEError(f"{where}: {device!r} asked for, but MPS is not available here; use cpu")
    elif dev.type != "cpu":
        raise FastRPEError(f"{where}: device type {dev.type!r} is not supported (use cpu, cuda or cuda:N)")
    return dev


_ZERO_ROWS_WARNED: set[str] = set()


def _caller_outside_fastrpe() -> dict:
    """`warnings.warn` arguments that attribute a warning to the first frame outside fastrpe
    (the user's call), however deep inside the package it is raised."""
    import os
    import sys

    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # level 1 = the function calling warnings.warn
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return {"stacklevel": level}


def warn_underflowed_rows(kernel, phi_q: Tensor, phi_k: Tensor) -> None:
    """Warn once per process (per feature map) when some query has zero content weight on
    every key: `φ(q_i)·Σ_j φ(k_j) = 0`. With unnormalized `exp` or `prf` this happens at huge
    q/k norms (~1e3: the features underflow), and by the documented rule those rows return 0
    — silently, unless said here. Normalized maps (`nexp`, `nprf`) cannot underflow; other
    maps are not checked. `phi_q: [B, H, Lq, F]`, `phi_k: [B, H, Lk, F]` (non-negative)."""
    name = getattr(kernel, "name", None)
    if torch.compiler.is_compiling():  # reads values on the host (a graph break): eager only
        return
    if name not in ("exp", "prf") or getattr(kernel, "normalize", True) or name in _ZERO_ROWS_WARNED:
        return
    if phi_q.numel() == 0 or phi_k.numel() == 0:
        return
    with torch.no_grad():
        content = (phi_q * phi_k.sum(-2, keepdim=True)).sum(-1)  # (B, H, Lq): Σ_j φ(q_i)·φ(k_j)
        if not bool((content == 0).any()):
            return
    _ZERO_ROWS_WARNED.add(name)
    import warnings

    warnings.warn(f"kernel {name!r}: some queries have zero weight on every key (the features underflow at large "
                  f"q/k norms, ~1e3) and return 0, as documented; normalize q/k with kernel='n{name}' or scale "
                  "the inputs down (warned once)", RuntimeWarning, **_caller_outside_fastrpe())
