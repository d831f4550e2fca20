"""Input checks shared by every public entry point.

Every error names the argument it is about, so that a user who passes a
wrong tensor sees which one at once.
"""
from __future__ import annotations

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
    if check_finite:
        # one host sync for all three (a GPU stalls at each bool()); names only on failure
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
