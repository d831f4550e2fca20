"""Test helpers: the one per-dtype tolerance table and input factories.

Low precision is judged against float64 (STYLE.md §9): the fast path's error
against a float64 reference must be within `LOWP_FACTOR` of the naive path's
error in the same dtype (plus a small absolute floor).
"""
from __future__ import annotations

import torch
from torch import Tensor

#: (atol, rtol) for comparing two implementations run in the same dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-8, 1e-7),
    torch.float32: (2e-5, 2e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}

#: fast-vs-float64 error may be this many times the naive-vs-float64 error.
LOWP_FACTOR = 4.0


def tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype | None = None, msg: str = "") -> None:
    """`torch.testing.assert_close` with the table's tolerance for `dtype` (default: `expected.dtype`)."""
    d = dtype or expected.dtype
    torch.testing.assert_close(actual.to(expected.dtype), expected, **tol(d), msg=msg or None)


def assert_lowp_close(fast: Tensor, naive: Tensor, ref64: Tensor, msg: str = "") -> None:
    """Fast low-precision result vs float64 reference, relative to the naive path's own error."""
    ref = ref64.double()
    err_fast = (fast.double() - ref).abs().max().item()
    err_naive = (naive.double() - ref).abs().max().item()
    floor = 1e-6 * max(1.0, ref.abs().max().item())
    assert err_fast <= LOWP_FACTOR * err_naive + floor, (
        f"{msg} fast error {err_fast:.3g} > {LOWP_FACTOR} x naive error {err_naive:.3g} (+{floor:.1g})"
    )


def qkv(B: int, H: int, Lq: int, Lk: int, D: int, Dv: int | None = None, *, dtype=torch.float64,
        seed: int = 0, requires_grad: bool = False, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Random `q: [B, H, Lq, D]`, `k: [B, H, Lk, D]`, `v: [B, H, Lk, Dv]` from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = (torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(B, H, Lk, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))  # type: ignore[return-value]
