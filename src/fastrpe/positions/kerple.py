"""KERPLE positional biases (Chi et al., "KERPLE: Kernelized Relative Positional
Embedding for Length Extrapolation", NeurIPS 2022).

Each head's bias is a shift-invariant conditionally positive definite kernel of the
distance `|r|` (Corollary 1 and §5.3 of the paper); softmax absorbs the constant that
would make it positive definite. The paper writes the kernels of `|m - n|`; they depend
on the distance only, so the sign convention of `r` does not matter here.

Constrained parameters are stored unconstrained (`raw_*`) and mapped, never clamped in
the forward pass, so no optimizer step can leave the valid set:

* `x > 0`:        `x = EPS + softplus(raw)`
* `0 < p <= 2`:   `p = EPS + (2 - EPS)·sigmoid(raw)`

`EPS = 1e-2` is the floor at which the official code clamps every parameter; it also
keeps `x > 0` strict in float32, where `softplus` and `sigmoid` underflow to 0. A learned
`p` is below 2 in exact arithmetic (float32 rounding can give exactly 2, still valid);
initial values must be below 2 (pass 1.999 for an almost-Gaussian kernel).

Initialization (`init=`): "mean" (default) starts every head at the mean of the official
code's uniform draws; "random" draws each head's parameters as the official code does
(`ParallelKerpleLog` / `ParallelKerplePower` in github.com/chijames/KERPLE): `2·U(0, 1)`
for the coefficient outside the log and for the exponents, `U(0, 1)` for the others,
from `generator` (or `torch.Generator().manual_seed(seed)`; default the global
generator) so that a run can be reproduced. The official code clamps draws below `EPS` up
to `EPS` at the first forward pass; here they start at `EPS + 1e-4` (`EPS` itself is the
map's unreachable floor). An explicit value (a number or a per-head sequence/tensor, e.g.
`KerpleLog(H, r1=1.5)`) overrides the init for that parameter; values at or below EPS are
refused.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Position, compute_dtype

#: floor of every positive parameter and of every exponent (the official clamp value).
EPS = 1e-2


def _inv_positive(x: float) -> float:
    """Inverse of `EPS + softplus(raw)`."""
    if not x > EPS:
        raise ValueError(f"KERPLE coefficients must be > {EPS}, got {x}")
    y = x - EPS
    return y + math.log(-math.expm1(-y))


def _inv_exponent(p: float) -> float:
    """Inverse of `EPS + (2 - EPS)·sigmoid(raw)`."""
    if not EPS < p < 2:
        raise ValueError(f"KERPLE exponents must be in ({EPS}, 2), got {p}")
    s = (p - EPS) / (2 - EPS)
    return math.log(s / (1 - s))


# the maps compute in at least float32 (`compute_dtype`): a bf16 module rounds its raw
# parameters, never the values derived from them

def _positive(raw: Tensor) -> Tensor:
    return EPS + F.softplus(raw.to(compute_dtype(raw)))


def _exponent(raw: Tensor) -> Tensor:
    return EPS + (2 - EPS) * torch.sigmoid(raw.to(compute_dtype(raw)))


INITS = ("mean", "random")
#: where a random draw below the floor starts (the official code clamps it to the floor)
_DRAW_FLOOR = EPS + 1e-4


class _Init:
    """Initial values per parameter: the given value, the official draw's mean, or a draw."""

    def __init__(self, H: int, init: str, generator: torch.Generator | None, seed: int | None):
        if init not in INITS:
            raise ValueError(f"init: expected one of {', '.join(INITS)}, got {init!r}")
        if generator is not None and seed is not None:
            raise ValueError("pass either generator or seed, not both")
        self.H, self.init = H, init
        self.gen = torch.Generator().manual_seed(int(seed)) if seed is not None else generator

    def __call__(self, value, scale: float):
        """`value` if given, else `scale·U(0, 1)` per head ("random") or its mean `scale/2`."""
        if value is not None:
            return value
        if self.init == "mean":
            return scale / 2
        draw = torch.rand(self.H, generator=self.gen, dtype=torch.float64) * scale
        return draw.clamp_min(_DRAW_FLOOR)


def _per_head(value, H: int, inverse) -> Tensor:
    """`[H]` raw values whose mapped values are `value` (a number or H numbers)."""
    v = torch.as_tensor(value, dtype=torch.float64).detach().flatten()
    if v.numel() == 1:
        v = v.expand(H)
    if v.numel() != H:
        raise ValueError(f"expected 1 or {H} initial values, got {v.numel()}")
    return torch.tensor([inverse(float(x)) for x in v], dtype=torch.float32)


def abs_pow(r: Tensor, p: Tensor) -> Tensor:
    """`|r|^p` for integer offsets `r`, 0 at `r = 0`, with finite gradients there.

    `d|r|^p/dp = |r|^p·log|r|` is `0·(-inf)` at `r = 0` and `d|r|^p/dr` is infinite for
    `p < 1`; computing `exp(p·log|r|)` only where `r ≠ 0` keeps both finite.
    """
    a = r.abs().to(compute_dtype(p))
    nonzero = a > 0
    safe = torch.where(nonzero, a, torch.ones_like(a))
    return torch.where(nonzero, torch.exp(p * torch.log(safe)), torch.zeros_like(a))


def _refresh_p_is_one(module: "KerplePower", incompatible_keys) -> None:
    """After `load_state_dict`: the loaded `fixed_p` decides whether the term is geometric."""
    module._p_is_one = bool((module.fixed_p == 1).all())


class KerplePower(Position):
    """KERPLE power variant: `b_h(r) = -r1_h·|r|^p_h`, `r1 > 0`, `0 < p <= 2`.

    From "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation"
    (Chi et al., NeurIPS 2022), §4 "(power)" (the paper's `r2` is `p` here). With
    `p = 1` it is ALiBi with a learned slope.

    Args:
        num_heads: H.
        r1: initial coefficient(s), a number or `[H]` (official init: `U(0, 1)`, mean 0.5).
        p: initial exponent(s), a number or `[H]` (official init: `U(0, 2)`, mean 1).
        learn_p: False keeps p fixed (a buffer; then `0 < p <= 2` and p = 2 is allowed).
            With p = 1 the kernelized form is the geometric decay `exp(-r1)^|r|` that
            the linear-time `chunked` backend runs. A fixed p defaults to 1 under either init.
        init: "mean" or "random" (the official per-head draws; see the module docstring).
        generator, seed: the source of the "random" draws (default: the global generator).

    Parameters: `raw_r1: [H]`, `raw_p: [H]` (when learned); properties `r1`, `p`.
    """

    def __init__(self, num_heads: int, r1=None, p=None, learn_p: bool = True, *, init: str = "mean",
                 generator: torch.Generator | None = None, seed: int | None = None):
        super().__init__(num_heads)
        pick = _Init(num_heads, init, generator, seed)
        # the official code draws the exponent first, then the coefficient
        p = pick(p, 2.0) if learn_p else (1.0 if p is None else p)
        self.raw_r1 = nn.Parameter(_per_head(pick(r1, 1.0), num_heads, _inv_positive))
        self.learn_p = learn_p
        if learn_p:
            self.raw_p = nn.Parameter(_per_head(p, num_heads, _inv_exponent))
        else:
            fixed = torch.as_tensor(p, dtype=torch.float32).detach().flatten()
            if fixed.numel() not in (1, num_heads):
                raise ValueError(f"expected 1 or {num_heads} initial values, got {fixed.numel()}")
            fixed = fixed.expand(num_heads).clone()
            if not bool(((fixed > 0) & (fixed <= 2)).all()):
                raise ValueError(f"p must be in (0, 2], got {p}")
            self.register_buffer("fixed_p", fixed)
            self.register_load_state_dict_post_hook(_refresh_p_is_one)
        self._p_is_one = not learn_p and bool((self.fixed_p == 1).all())

    @property
    def r1(self) -> Tensor:
        return _positive(self.raw_r1)

    @property
    def p(self) -> Tensor:
        return _exponent(self.raw_p) if self.learn_p else self.fixed_p

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * abs_pow(r, self.p[h].to(compute_dtype(self.raw_r1)))

    def geometric_decay(self) -> Tensor | None:
        if self.learn_p:
            return None
        # whether p = 1 picks an algorithm, so it is read on the host, but only when the buffer
        # is new or was written in place since the last read (its storage and version say so
        # without reading it): reading it on every call synchronized a CUDA stream every call.
        # Under torch.compile the last eager read (or construction, or load_state_dict) holds,
        # as a host read would break the graph.
        if not torch.compiler.is_compiling():
            key = (self.fixed_p.data_ptr(), self.fixed_p._version, self.fixed_p.device)
            if key != getattr(self, "_p_read", None):
                self._p_is_one, self._p_read = bool((self.fixed_p == 1).all()), key
        return torch.exp(-self.r1) if self._p_is_one else None

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, learn_p={self.learn_p}"


class KerpleLog(Position):
    """KERPLE logarithmic variant: `b_h(r) = -r1_h·log(1 + r2_h·|r|)`, `r1, r2 > 0`.

    From "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation"
    (Chi et al., NeurIPS 2022), §4 "(logarithmic)", the paper's best variant. In
    kernelized attention `c(r) = (1 + r2·|r|)^(-r1)`, a power-law decay.

    Args:
        num_heads: H.
        r1: initial coefficient(s) outside the log, a number or `[H]`
            (official init: `U(0, 2)`, mean 1).
        r2: initial scale(s) inside the log, a number or `[H]` (official init: `U(0, 1)`, mean 0.5).
        init: "mean" or "random" (the official per-head draws; see the module docstring).
        generator, seed: the source of the "random" draws (default: the global generator).

    Parameters: `raw_r1: [H]`, `raw_r2: [H]`; properties `r1`, `r2`.
    """

    def __init__(self, num_heads: int, r1=None, r2=None, *, init: str = "mean",
                 generator: torch.Generator | None = None, seed: int | None = None):
        super().__init__(num_heads)
        pick = _Init(num_heads, init, generator, seed)
        r1, r2 = pick(r1, 2.0), pick(r2, 1.0)  # the official order: outside, then inside the log
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_positive))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_positive))

    @property
    def r1(self) -> Tensor:
        return _positive(self.raw_r1)

    @property
    def r2(self) -> Tensor:
        return _positive(self.raw_r2)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * torch.log1p(self.r2[h] * r.abs().to(compute_dtype(self.raw_r1)))


class KerpleLog3(Position):
    """KERPLE 3-parameter logarithmic variant: `b_h(r) = -r1_h·log(1 + r2_h·|r|^p_h)`,
    `r1, r2 > 0`, `0 < p <= 2`.

    From "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation"
    (Chi et al., NeurIPS 2022), §5.3 "(3-para-log)" and Figure 1 (the paper's `r3` is
    `p` here); p = 1 is `KerpleLog`. The official code has no implementation of it; the
    defaults start it at `KerpleLog`'s defaults.

    Args:
        num_heads: H.
        r1: initial coefficient(s) outside the log, a number or `[H]`.
        r2: initial scale(s) inside the log, a number or `[H]`.
        p: initial exponent(s), a number or `[H]`.
        init: "mean" or "random": r1, r2 drawn as `KerpleLog`'s, p as `KerplePower`'s exponent
            (`U(0, 2)`; the official code has no 3-parameter variant to follow).
        generator, seed: the source of the "random" draws (default: the global generator).

    Parameters: `raw_r1, raw_r2, raw_p: [H]`; properties `r1`, `r2`, `p`.
    """

    def __init__(self, num_heads: int, r1=None, r2=None, p=None, *, init: str = "mean",
                 generator: torch.Generator | None = None, seed: int | None = None):
        super().__init__(num_heads)
        pick = _Init(num_heads, init, generator, seed)
        r1, r2, p = pick(r1, 2.0), pick(r2, 1.0), pick(p, 2.0)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_positive))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_positive))
        self.raw_p = nn.Parameter(_per_head(p, num_heads, _inv_exponent))

    r1 = KerpleLog.r1
    r2 = KerpleLog.r2

    @property
    def p(self) -> Tensor:
        return _exponent(self.raw_p)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * torch.log1p(self.r2[h] * abs_pow(r, self.p[h]))


class KerpleBiasWeight(Position):
    """KERPLE "bias + weight" variant (softmax only): the logit is weighted by a kernel
    and a power bias is added,
    `score_ij = w_h(r)·scale·q_i·k_j + b_h(r)`, `b_h(r) = -r1_h·|r|^r2_h`,
    `w_h(r) = exp(-r3_h·|r|^r4_h)`, `r1, r3 > 0`, `0 < r2, r4 <= 2`.

    From "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation"
    (Chi et al., NeurIPS 2022), §5.3 "(bias+wht)"; official code: `ParallelKerplePower`
    with both a bias and a weight kernel (`x*wei + bias`, bias and weight added to the
    already-scaled logits, as here). The paper names are kept: `r2`, `r4` are exponents.

    The weight rescales each logit by its offset, which is not a Toeplitz reweighting of
    `φ(q)·φ(k)`: kernelized backends cannot express it and refuse it.

    Args:
        num_heads: H.
        r1: initial bias coefficient(s) (official init `U(0, 1)`, mean 0.5).
        r2: initial bias exponent(s) (official init `U(0, 2)`, mean 1).
        r3: initial weight coefficient(s) (official init `U(0, 1)`, mean 0.5).
        r4: initial weight exponent(s) (official init `U(0, 2)`, mean 1).
        Each a number or `[H]`.
        init: "mean" or "random" (the official per-head draws; see the module docstring).
        generator, seed: the source of the "random" draws (default: the global generator).

    Parameters: `raw_r1, raw_r2, raw_r3, raw_r4: [H]`; properties `r1 .. r4`.
    """

    softmax_only = True
    kernelized_refusal = ("KerpleBiasWeight multiplies the softmax logits by a positional weight "
                          "exp(-r3·|r|^r4); kernelized attention has no logits to weigh")

    def __init__(self, num_heads: int, r1=None, r2=None, r3=None, r4=None, *, init: str = "mean",
                 generator: torch.Generator | None = None, seed: int | None = None):
        super().__init__(num_heads)
        pick = _Init(num_heads, init, generator, seed)
        # the official order: bias exponent, bias coefficient, weight exponent, weight coefficient
        r2 = pick(r2, 2.0)
        r1 = pick(r1, 1.0)
        r4 = pick(r4, 2.0)
        r3 = pick(r3, 1.0)
        self.raw_r1 = nn.Parameter(_per_head(r1, num_heads, _inv_positive))
        self.raw_r2 = nn.Parameter(_per_head(r2, num_heads, _inv_exponent))
        self.raw_r3 = nn.Parameter(_per_head(r3, num_heads, _inv_positive))
        self.raw_r4 = nn.Parameter(_per_head(r4, num_heads, _inv_exponent))

    @property
    def r1(self) -> Tensor:
        return _positive(self.raw_r1)

    @property
    def r2(self) -> Tensor:
        return _exponent(self.raw_r2)

    @property
    def r3(self) -> Tensor:
        return _positive(self.raw_r3)

    @property
    def r4(self) -> Tensor:
        return _exponent(self.raw_r4)

    def bias(self, h: Tensor, r: Tensor) -> Tensor:
        return -self.r1[h] * abs_pow(r, self.r2[h])

    def weight(self, h: Tensor, r: Tensor) -> Tensor:
        """Multiplier `w_h(r) = exp(-r3·|r|^r4)` of the (scaled) logit at offset r."""
        return torch.exp(-self.r3[h] * abs_pow(r, self.r4[h]))
