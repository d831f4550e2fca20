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

#: each Triton backend with a family it runs (the low-precision checks: interpreted, and on a GPU)
TRITON_CASES = (("triton_chunked", "alibi"), ("triton_soe", "kerple_log"), ("triton_band", "t5"),
                ("triton_tiled", "learned"))


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


def features_and_values(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, *, dtype=torch.float64,
                        device=None, seed: int = 0, state: bool = False,
                        requires_grad: bool = True) -> tuple[Tensor, ...]:
    """Random inputs for the kernelized ops, which take feature maps rather than `q, k`.

    Feature maps (PRF, elu+1, ...) are non-negative, so `phi_q` and `phi_k` are uniform on
    [0, 1) where `qkv` would draw signed values; `v` is standard normal. Everything is drawn in
    float64 from one generator seeded with `seed`, then cast, so a test in float32 or bf16 and
    its float64 reference (`t.detach().double()`) see the same numbers.

    Args:
        B, H, Lq, Lk, F, Dv: batch, heads, query and key lengths, features, value width.
        dtype, device: of every returned tensor.
        seed: the generator's seed.
        state: also return an initial state `[B, H, F, Dv+1]` (the keys before position 0,
            `Σ_j φk_j ⊗ [v_j, 1]`), non-negative, drawn after `v`.
        requires_grad: make every returned tensor a leaf that requires grad (unlike `qkv`,
            on by default: these inputs are for gradient checks).

    Returns:
        `(phi_q [B, H, Lq, F], phi_k [B, H, Lk, F], v [B, H, Lk, Dv])`, and `initial_state
        [B, H, F, Dv+1]` after them if `state`.
    """
    g = torch.Generator().manual_seed(seed)
    out = [torch.rand(B, H, Lq, F, generator=g, dtype=torch.float64),
           torch.rand(B, H, Lk, F, generator=g, dtype=torch.float64),
           torch.randn(B, H, Lk, Dv, generator=g, dtype=torch.float64)]
    if state:
        out.append(torch.rand(B, H, F, Dv + 1, generator=g, dtype=torch.float64))
    return tuple(t.to(device, dtype).requires_grad_(requires_grad) for t in out)


def weighted_grads(outs, leaves, seed: int = 1) -> tuple[Tensor | None, ...]:
    """Gradients of `Σ_o <o, W_o>` (taken in float64) with respect to `leaves`.

    The weights `W_o` are standard normal, drawn on the CPU in float64 from a generator seeded
    with `seed`, one per output in order: two calls with outputs of the same shapes (a fast op
    and its reference, on any device, in any dtype) weight them identically, so their
    gradients should agree. A random weighting, unlike `.sum()`, lets no error cancel.

    Args:
        outs: the tensors to weight, in the same order on both sides of a comparison.
        leaves: tensors to differentiate by; a `None` entry (an absent optional input) is
            passed over and gets `None` back, so the result lines up with `leaves`. Every other
            leaf must require grad and be used by `outs`: autograd raises otherwise.

    Returns:
        One gradient per entry of `leaves`, in its dtype.
    """
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)
    grads = iter(torch.autograd.grad(loss, [t for t in leaves if t is not None]))
    return tuple(None if t is None else next(grads) for t in leaves)


def quotient_reference(num: Tensor, den: Tensor) -> Tensor:
    """Luo et al. 2021 Eq. 10's output from its sums: `num_i / den_i` (`num: [B, H, Lq, Dv]`,
    `den: [B, H, Lq]`), 0 for a row with no weight (`den_i = 0`), differentiable. Written
    from the formula for the tests of the ops that divide themselves (`divide=`), sharing
    nothing with their `safe_divide`."""
    empty = den == 0
    return torch.where(empty[..., None], torch.zeros_like(num), num / torch.where(empty, torch.ones_like(den), den)[..., None])
