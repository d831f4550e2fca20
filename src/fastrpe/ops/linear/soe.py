"""Causal kernelized attention with any decaying positional term in linear time, by a
sum of exponentials: an exact band `|r| < W` plus `Σ_k a_k·γ_k^|r|` beyond.

`c(r) = exp(b(r) - max b)` for `r <= 0` is written as
`c(r) = Σ_k a_k γ_k^|r| + [|r| < W]·(c(r) - Σ_k a_k γ_k^|r|)`:
each exponential is one pass of the chunked (linear-time) geometric form, and the band
correction is exact and dense over W offsets. Only the far field `|r| >= W` is
approximated; `soe_fit_error` reports how well. The rates `γ_k` sit on a log-spaced grid of
time scales up to the term's reach (`live_distance`) and the weights `a_k` solve a
least-squares fit weighted as the rows' misplaced weight counts errors (`fit_soe`), so they
are differentiable functions of the positional parameters (refitted every call).

Notation: B batch, H heads, L length, F features, C = Dv + 1, K terms, W band width.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as Fn
from torch import Tensor

from ..._memo import OnOwner, kept, parameter_state, takes_grad
from ..common import LaterReads
from .state import SoEState

DEFAULT_WINDOW = 64
DEFAULT_TERMS = 16

# --- the fused Triton kernel's geometry (ops/linear/triton_soe.py), here because the
# dispatcher's cost model reads it without importing triton

#: bytes the chunk states of one launch of the fused Triton kernel may take
#: (`ops/linear/triton_soe.py`): the K·N states of all terms at once are 17 GB at L = 1M,
#: B·H = 8, K = 16 (float32 features, bf16 states), so the terms run in groups
STATE_BUDGET = 1 << 30


def terms_per_group(BH: int, N: int, BF: int, BDV: int, state_bytes: int, K: int, budget: int | None = None) -> int:
    """How many of the K terms one launch of the fused kernel takes: as many as fit their
    chunk states (`[B·H, ·, N, BF, BDV]` in the state dtype, `z` in float32) in `budget`
    bytes (default `STATE_BUDGET`), at least one."""
    per_term = BH * N * BF * (BDV * state_bytes + 4)
    return max(1, min(K, (STATE_BUDGET if budget is None else budget) // per_term))


#: the most near chunks a call uses: a wider band raises the chunk instead (`near_chunks`)
MAX_NEAR = 4


def near_chunks(window: int, chunk: int) -> tuple[int, int]:
    """`(T, NB)`: chunk length and near chunks for a band of `window` exact distances, with
    `W <= (NB-1)·T + 1` so the far field (distances past `(NB-1)·T`) is all fitted. T is
    `chunk` unless that would need more than `MAX_NEAR` chunks (then the smallest power of two
    that needs no more)."""
    W, T = max(int(window), 1), int(chunk)
    while 1 + max(1, -(-(W - 1) // T)) > MAX_NEAR:
        T *= 2
    return T, 1 + max(1, -(-(W - 1) // T))


#: coefficients this far below c(0) = 1 are fitted in absolute, not relative, error
#: (e^-20 ≈ 2e-9 per key: far below the 1e-3 output target even summed over 10^5 keys)
FIT_FLOOR_NATS = 20.0


def soe_rates(window: int, max_len: int, num_terms: int, dtype=torch.float64, device=None,
              scale: Tensor | None = None) -> Tensor:
    """`[K]` rates: γ = 1 (a constant tail) and K-1 time scales `τ` (`γ = e^(-1/τ)`)
    log-spaced from `RATE_LO·window` to `RATE_HI·scale` (`scale`: default `max_len`; a 0-dim
    tensor, `live_distance`, where the term dies out sooner).

    Where the grid's ends sit decides how many terms a fit needs (`TERM_CHOICES`). Time scales
    optimized freely for the GPU bench's KERPLE log and power at 64k came out nearly log-spaced
    from about W/3 to about the term's reach, not from W/16 to 4x the reach: a faster rate is
    e^-16 down by the end of the exact band, so it fits only the far field's first distances,
    and one slower than the reach only spreads the grid thin where the constant term already
    serves. Over 26 KERPLE terms (log, power, log3; random and mean inits, 8 heads) at 4k, 16k,
    64k and 256k, W/4 to 0.75x the reach took 1,229 terms in all against 1,534 for W/16 to 4x;
    the bench's KERPLE log at 64k takes 11 instead of 15, its power 9 instead of 12, where
    free rates would take 10 and 8 or fewer (`benchmarks/soe_accuracy.py --grids`,
    docs/RESULTS.md "The rates' grid")."""
    lo = math.log(max(1.0, RATE_LO * window))
    if scale is None:
        scale = torch.tensor(float(max(max_len, window)), dtype=dtype, device=device)
    hi = torch.log(RATE_HI * scale.to(dtype=dtype, device=device))
    frac = torch.linspace(0.0, 1.0, num_terms - 1, dtype=dtype, device=device)
    tau = torch.exp(lo + (hi - lo) * frac)
    return torch.cat([torch.exp(-1.0 / tau), torch.ones(1, dtype=dtype, device=device)])


#: the fastest and slowest time scales of the rates' grid, as multiples of the band width and
#: of the term's reach (`soe_rates`)
RATE_LO = 0.25
RATE_HI = 0.75


def live_distance(b: Tensor, window: int) -> Tensor:
    """0-dim: about one past the largest distance at which any head's coefficient is within
    `FIT_FLOOR_NATS` of its peak (`b: [H, N]`, `b(-d)` with max 0), between `4·window` and N.
    A soft count (`Σ_d σ(envelope(d) + FLOOR)`, the envelope the largest b at or beyond d), so
    the rates move continuously with the term's parameters (a hard threshold would make them,
    and the fit, jump whenever a parameter moved a coefficient across it). Computed on the
    device (no host synchronization)."""
    N = b.shape[-1]
    env = b.amax(0).flip(0).cummax(0).values.flip(0)  # (N,) non-increasing
    alive = torch.sigmoid(env + FIT_FLOOR_NATS).sum()
    return alive.clamp(min=min(4.0 * window, N), max=float(max(N, window)))


def fit_soe(b: Tensor, r_far: Tensor, gamma: Tensor) -> Tensor:
    """Weights `a: [H, K]` with `Σ_k a_k γ_k^r ≈ c(r) = exp(b[:, r])` at the far distances
    `r_far: [n]` (all >= W), by weighted least squares.

    The weight of an error at distance d is `d / Σ_{e<=d} c(e)`: what it adds to the
    misplaced fraction of the first row that sees it (`soe_weight_error`, the test a fit must
    pass), times d, as each log-spaced sample stands for about d distances. (Relative error,
    `1/c(d)` down to e^-20, spent the terms on the tail where c is tiny and weighs nothing:
    KERPLE power r1 = 2, p = 0.25..1 was refused at 64k with any of 16, 24 or 32 terms, 1.5e-4 at
    best; now 2.4e-6 with 16.)

    Args:
        b: `[H, N]` log-coefficients `b(-d)`, `d = 0..N-1`, with max 0 (differentiable).
        r_far: `[n]` distances to fit.
        gamma: `[K]` rates.
    """
    c = torch.exp(b.to(gamma.dtype))  # (H, N)
    w = r_far.to(gamma.dtype) / c.detach().cumsum(-1)[:, r_far]  # (H, n): the weights choose, not fitted
    A = gamma[None, None, :] ** r_far[None, :, None].to(gamma.dtype)  # (1, n, K)
    A = A * w[..., None]  # (H, n, K)
    y = (c[:, r_far] * w)[..., None]  # (H, n, 1)
    # unit columns first: the weights span many orders of magnitude, so slow rates' columns
    # are far larger than fast ones', and a ridge scaled to their mean flattened the fast terms
    # (KERPLE-log r1=2, r2=0.5 misplaced 3e-4 of a row's weight; 8e-7 with unit columns)
    # (a column far below the others keeps its scale: a unit column would take a huge weight
    # that cancels, catastrophically, against the exact band correction)
    s = A.norm(dim=-2, keepdim=True)  # (H, 1, K)
    s = torch.maximum(s, 1e-6 * s.amax(-1, keepdim=True)).clamp_min(torch.finfo(gamma.dtype).tiny)
    A = A / s
    # ridge-regularized normal equations: well-posed for nearly collinear exponentials, differentiable.
    # Besides the small ridge on the unit columns, one on the weights themselves (`RIDGE_A·Σ a_k²`,
    # `a = x/s`): without it, 12 terms fitted KERPLE log with Σ|a| = 190, a fast term cancelling
    # against the exact band correction, which float32 kernels then sum with 1e-5 errors; with it
    # Σ|a| stays under 11 over KERPLE's parameter range and the fits' weight errors barely move
    eye = torch.eye(gamma.numel(), dtype=gamma.dtype, device=gamma.device)
    ridge = 1e-12 * eye + RIDGE_A * torch.diag_embed(s[..., 0, :] ** -2)
    # solve_ex without its error check: `linalg.solve` reads the LU info back to the host (a GPU
    # stream sync per call); the ridge keeps the system nonsingular
    x = torch.linalg.solve_ex(A.transpose(-1, -2) @ A + ridge, A.transpose(-1, -2) @ y,
                              check_errors=False)[0][..., 0]
    return x / s[..., 0, :]  # (H, K)


#: the ridge on the fitted weights themselves (`fit_soe`), against weights that cancel
RIDGE_A = 1e-10


def _far_samples(window: int, max_len: int, n: int = 256, device: torch.device | None = None) -> Tensor:
    """Distances W..max_len-1, log-spaced (plus the ends), to fit and to check the fit.
    Computed on the host from the two lengths alone: `torch.unique` has a data-dependent
    size, which torch.compile cannot trace without a graph break."""
    if max_len <= window:
        return torch.zeros(0, dtype=torch.long, device=device)
    lo, hi = math.log10(window), math.log10(max_len - 1)
    # round() is half-to-even, as torch.round
    r = {min(max(round(10.0 ** (lo + (hi - lo) * i / (n - 1))), window), max_len - 1) for i in range(n)}
    return torch.tensor(sorted(r), dtype=torch.long, device=device)


#: `_far_samples` kept on each device it was copied to (`_far_samples_on`)
_FAR_ON_DEVICE: dict = {}


def _far_samples_on(window: int, max_len: int, device: torch.device) -> Tensor:
    """`_far_samples` on `device`, copied once per (window, length, device) and kept: a term in
    training is fitted at every step, and a copy from pageable host memory at each one cannot
    be captured in a CUDA graph (and is a driver-staged copy every step)."""
    if torch.compiler.is_compiling():
        # traced as a constant made on `device`: one made on the host would be a CPU tensor in a
        # GPU graph, copied inside it (ahead of time by Inductor, at every call by aot_eager)
        return _far_samples(window, max_len, device=device)
    key = (window, max_len, str(device))
    if key not in _FAR_ON_DEVICE:
        if len(_FAR_ON_DEVICE) >= 64:  # 2 KiB each; bounded all the same
            _FAR_ON_DEVICE.clear()
        # non_blocking: a pageable host->GPU copy is staged at once; a blocking one syncs the stream
        _FAR_ON_DEVICE[key] = _far_samples(window, max_len).to(device, non_blocking=True)
    return _FAR_ON_DEVICE[key]


def soe_fit_error(log_coeff_causal: Tensor, window: int = DEFAULT_WINDOW, num_terms: int = DEFAULT_TERMS) -> float:
    """Max absolute error of the fitted far field over every distance `W <= |r| < L`, in
    units of the largest coefficient (c normalized so that max c = 1).
    `log_coeff_causal: [H, L]` holds `b(-d)` for `d = 0..L-1`."""
    H, L = log_coeff_causal.shape
    if L <= window:
        return 0.0
    lc = log_coeff_causal.detach().double()
    plan = soe_plan(lc, window, num_terms)
    d = torch.arange(window, L, dtype=torch.float64)
    approx = (plan.a[:, None, :] * plan.gamma[None, None, :] ** d[None, :, None]).sum(-1)
    exact = torch.exp(lc[:, window:] - plan.shift[:, None])
    return float((approx - exact).abs().max())


#: the far field is fitted over distances up to max(L, SOE_FIT_LENGTH): one fit serves every
#: call up to this length, so a prefix's outputs do not depend on how long the sequence
#: is, and decoding (which fits once) reproduces the full forward pass
SOE_FIT_LENGTH = 4096


@dataclass
class SoEPlan:
    """A fitted sum of exponentials for `c(d) = exp(b(-d) - max b)`, `d = 0..fit_length-1`.

    `gamma: [K]` rates, `a: [H, K]` weights (float64, differentiable in the positional
    parameters), `corr: [H, W]` the exact coefficients minus the fitted ones on the band
    `d < W` (float64), `shift: [H]` the `max b` taken out (detached; None: 0), so the true
    coefficients are `exp(shift)·c(d)`."""

    gamma: Tensor
    a: Tensor
    corr: Tensor
    window: int
    fit_length: int
    shift: Tensor | None = None

    @property
    def num_terms(self) -> int:
        return self.gamma.numel()

    def log_scale(self, Lq: int, dtype: torch.dtype) -> Tensor:
        """`[H, Lq]`: the `log_scale` of the sums made with this plan (`NumDen`'s units): a
        constant per head cancels in num/den, but not against Shaw's sums, which are in true
        units (`ops/kernelized.py`)."""
        H = self.a.shape[0]
        if self.shift is None:
            return torch.zeros(H, Lq, dtype=dtype, device=self.a.device)
        return self.shift.detach().to(dtype)[:, None].expand(H, Lq)


def causal_log_coefficients(position, length: int) -> Tensor:
    """`[H, length]`: `b(-d)` for `d = 0..length-1` from a 1D positional term."""
    return position.log_coefficients(length, 1, 0).flip(-1)


def soe_plan(b: Tensor, window: int = DEFAULT_WINDOW, num_terms: int = DEFAULT_TERMS,
             gamma: Tensor | None = None) -> SoEPlan:
    """Fit the far field of `b: [H, N]` (`b(-d)`, `d = 0..N-1`; N is the fit length) on the
    rates `gamma: [num_terms]` (float64; default `soe_rates`' grid)."""
    H, N = b.shape
    dev = b.device
    shift = b.detach().amax(-1).to(torch.float64)  # (H,)
    b = (b - shift[:, None]).to(torch.float64)
    W = min(window, N)
    if gamma is None:
        gamma = soe_rates(W, N, num_terms, device=dev, scale=live_distance(b.detach(), W))  # (K,) float64
    if N > W:
        rs = _far_samples_on(W, N, dev)
        a = fit_soe(b, rs, gamma)  # (H, K)
    else:
        a = torch.zeros(H, gamma.numel(), dtype=torch.float64, device=dev)
    dW = torch.arange(W, device=dev, dtype=torch.float64)
    fitted = (a[:, None, :] * gamma[None, None, :] ** dW[None, :, None]).sum(-1)  # (H, W)
    return SoEPlan(gamma, a, torch.exp(b[:, :W]) - fitted, W, N, shift)


#: the `soe` backend refuses a term whose fit misplaces more than this fraction of any
#: row's positional weight (`soe_weight_error`); measured, a weight error e moves the
#: output by at most ~2e (benchmarks/soe_accuracy.py), so 1e-4 keeps outputs under 1e-3
SOE_MAX_WEIGHT_ERROR = 1e-4


def soe_weight_error(b: Tensor, plan: SoEPlan | None = None) -> Tensor:
    """`[H]`: the worst fraction of a row's positional weight the fit misplaces,
    `max_n Σ_{d<n} |ĉ(d) - c(d)| / Σ_{d<n} c(d)` over every row length n <= N.

    A causal row at position n - 1 sees distances `d < n`; its output moves with the
    misplaced weight relative to its total weight. `b: [H, N]` holds `b(-d)`, `d < N`.
    """
    with torch.no_grad():
        plan = soe_plan(b.detach()) if plan is None else plan
        bb = b.detach().to(torch.float64)
        return weight_error_of(torch.exp(bb - bb.amax(-1, keepdim=True)), plan)


def weight_error_of(c: Tensor, plan: SoEPlan) -> Tensor:
    """`soe_weight_error`'s `[H]` for the normalized coefficients `c: [H, N]` (float64, max 1),
    differentiable in the plan's rates and weights (a study of the rates optimizes it:
    `benchmarks/soe_accuracy.py --grids`)."""
    N, W = c.shape[-1], plan.window
    if N <= W:
        return c.new_zeros(c.shape[0])
    d = torch.arange(W, N, dtype=torch.float64, device=c.device)
    # the rates' powers once for every head, then one product: `[H, N-W, K]` terms would be 1 GiB
    # of float64 at a 1M-token fit with 16 terms, built once per number of terms tried
    fitted = plan.a @ (plan.gamma[:, None] ** d[None, :])  # (H, N-W)
    miss = torch.cat([c.new_zeros(c.shape[0], W), (fitted - c[:, W:]).abs()], -1)
    ratio = miss.cumsum(-1) / c.cumsum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    return ratio.amax(-1)


def soe_fit_length(length: int) -> int:
    """The distances a fit covers for rows up to `length` (the one rule: the forward backend,
    its refusal and decoding all use it)."""
    return max(int(length), SOE_FIT_LENGTH)


#: the numbers of exponentials tried, fewest first: a fit takes the first whose weight error
#: is within SOE_MAX_WEIGHT_ERROR (each is tried: the ridge-regularized fit's error need not
#: fall with K). Every count from 6 to 16: each term is a state the fused kernel carries, about
#: 0.2 ms of the KERPLE calls' 9.5-10.3 ms at 64k on the H100 (12 and 16 terms, 2026-11-27),
#: and 12 or 16 alone made a term that fits with 9 or 11 pay for 12 or 16. The GPU bench's
#: KERPLE power (r1 = 0.5, p = 0.5..1.5) takes 9 at 64k, its KERPLE log 11
#: (`python benchmarks/soe_accuracy.py --terms-only`)
TERM_CHOICES = (*range(6, DEFAULT_TERMS + 1), 20, 24, 32)

#: a term in training on a GPU takes the fewest terms within this share of SOE_MAX_WEIGHT_ERROR:
#: its verdict's count serves the steps after it (`_checked_on_the_gpu`), each a new term fitted
#: with that count and checked against the whole limit, and a count that fits the verdict's
#: state just within the limit failed a few steps later (then a warning and a verdict again).
#: Elsewhere each parameter state has a verdict of its own, and a call with autograd on or off
#: takes the same count (the same outputs)
TRAINING_HEADROOM = 0.25


def fewest_terms(b: Tensor, target: float = SOE_MAX_WEIGHT_ERROR) -> tuple[int, float]:
    """`(K, weight error)` for the log-coefficients `b: [H, N]` (`b(-d)`): the fewest of
    `TERM_CHOICES` whose fit misplaces at most `target` of a row's weight; where none does, the
    fewest within SOE_MAX_WEIGHT_ERROR; where none does either, the most, with its error (a
    refusal). The verdict of `soe_terms`, without its memo."""
    with torch.no_grad():
        b = b.detach()
        within = None  # the fewest within the limit, where none is within the target
        for K in TERM_CHOICES:
            err = float(soe_weight_error(b, soe_plan(b, num_terms=K)).max())
            if err <= target:
                return K, err
            if within is None and err <= SOE_MAX_WEIGHT_ERROR:
                within = K, err
        return within or (K, err)

#: position -> {(fit length, device, parameter state, on the GPU in training): (terms, weight error)}: the verdict reads
#: the error on the host (a GPU stream sync), so a frozen term pays it on its first call only. Kept on
#: the position (`OnOwner`): read under torch.compile, a module-level dict's every entry was guarded
_VERDICTS = OnOwner("_fastrpe_soe_verdicts")


def _state_key(position, fit_length: int):
    return (fit_length, parameter_state(position))


#: position -> {fit length: (terms, weight error)}: the latest verdict of a term in training on
#: a GPU, kept for its next parameter states (`soe_terms`, `_checked_on_the_gpu`)
_LATEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: each training call's fit check on the GPU, with (position ref, fit length), read once it has
#: landed (`_read_fit_checks`)
_FIT_CHECKS = LaterReads()


def _checked_on_the_gpu(position) -> bool:
    """A term in training on a GPU, eagerly: each step is a new parameter state, and a verdict
    per state would read the fit's error on the host, draining the stream at every call. The
    latest verdict's term count is kept instead, and each call's fit is checked on the GPU
    (`_check_fit_later`), its flag read at a later call (`_read_fit_checks`)."""
    return (takes_grad(position) and not torch.compiler.is_compiling()
            and any(t.is_cuda for t in position.parameters()))


def _check_fit_later(position, fit_length: int, b: Tensor, plan: SoEPlan) -> None:
    """Whether `plan` misplaces more than SOE_MAX_WEIGHT_ERROR of a row's weight (NaN
    failing), copied to the host without waiting (`LaterReads`)."""
    if not _FIT_CHECKS.accepting():
        return
    with torch.no_grad():
        bad = ~(soe_weight_error(b.detach(), plan).max() <= SOE_MAX_WEIGHT_ERROR)
    _FIT_CHECKS.add(bad, (weakref.ref(position), fit_length))


def _read_fit_checks() -> None:
    """The checks whose flags have landed (an event query, never a wait): a fit that failed
    drops its term's latest verdict, so that its next call takes a verdict of its own (one
    read: more terms, or the refusal), and says so."""
    import warnings

    for bad, (ref, fit_length) in _FIT_CHECKS.landed():
        position = ref()
        if bool(bad) and position is not None and _LATEST.get(position, {}).pop(fit_length, None) is not None:
            warnings.warn(f"fastrpe soe: in a training step, the sum-of-exponentials fit of "
                          f"{type(position).__name__} misplaced more than {SOE_MAX_WEIGHT_ERROR:g} of a row's "
                          "positional weight; its next call fits again (more terms, or the refusal)",
                          RuntimeWarning, stacklevel=2)


def soe_terms(position, length: int) -> tuple[int, float]:
    """`(K, weight error)`: the fewest exponentials in `TERM_CHOICES` that fit `position` for
    rows up to `length` within SOE_MAX_WEIGHT_ERROR (the most if none does; the error says so),
    or, for a term in training on a GPU, within `TRAINING_HEADROOM` of it (if any count is).
    Once per parameter state; under torch.compile, without reading anything: the eager
    verdict if there is one, else `(DEFAULT_TERMS, nan)` (`soe_assert_fit` checks in the graph).
    A term in training on a GPU keeps its latest verdict while the GPU's checks of each call's
    fit pass (`_checked_on_the_gpu`): no host read per step."""
    fit_length = soe_fit_length(length)
    memo = _VERDICTS.get(position)
    if torch.compiler.is_compiling():
        for k, v in (memo or {}).items():
            if k[0] == fit_length:
                return v
        return DEFAULT_TERMS, float("nan")
    gpu_checked = _checked_on_the_gpu(position)
    if gpu_checked:
        _read_fit_checks()
        latest = _LATEST.get(position, {}).get(fit_length)
        if latest is not None:
            return latest

    target = SOE_MAX_WEIGHT_ERROR * (TRAINING_HEADROOM if gpu_checked else 1.0)

    @torch.no_grad()
    def verdict():
        return fewest_terms(causal_log_coefficients(position, fit_length), target)

    # parameters in training: every step is a new state, the oldest go
    v = kept(_VERDICTS, position, (*_state_key(position, fit_length), gpu_checked), verdict, entries=16)
    if gpu_checked and v[1] <= SOE_MAX_WEIGHT_ERROR:  # a refusal is not kept: a later state may fit
        _LATEST.setdefault(position, {})[fit_length] = v
    return v


#: position -> {(fit length, parameter state, terms): SoEPlan}: the fit of a term that
#: takes no gradient, kept while its parameters are unchanged (`soe_plan_for`)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def soe_plan_for(position, length: int) -> SoEPlan:
    """The fit the `soe` backends use for `position` with rows up to `length` (`soe_terms`).

    A term that takes no gradient here (its parameters are frozen, or autograd is off) is
    fitted once per parameter state and the plan is kept. The fit is about 70 small launches
    (the term's coefficients, the rates, the solve), which a GPU call would pay every time: at
    4,096 tokens that overhead alone is comparable to the whole attention. A term in training
    is fitted on every call, inside the graph, so its gradients flow."""
    fit_length = soe_fit_length(length)
    K = soe_terms(position, length)[0]
    if takes_grad(position) or torch.compiler.is_compiling():
        b = causal_log_coefficients(position, fit_length)
        plan = soe_plan(b, num_terms=K)
        if _checked_on_the_gpu(position):
            _check_fit_later(position, fit_length, b, plan)
        return plan

    @torch.no_grad()
    def fit():
        return soe_plan(causal_log_coefficients(position, fit_length), num_terms=K)

    # parameters edited in place between calls: every edit is a new state, the oldest go
    return kept(_PLANS, position, (*_state_key(position, fit_length), K), fit, entries=16)


def soe_extend(plan: SoEPlan, position, length: int) -> tuple[SoEPlan | None, str | None]:
    """`plan` checked for rows up to `length` beyond its fit length (decoding on: its states
    were built with these rates and weights, so they are kept): `(plan with a longer
    fit_length, None)` if it still misplaces at most `SOE_MAX_WEIGHT_ERROR` of any row's
    weight up to `max(length, 2·fit_length)`, else `(None, why)`."""
    if length <= plan.fit_length:
        return plan, None
    n = max(int(length), 2 * plan.fit_length)
    with torch.no_grad():
        err = float(soe_weight_error(causal_log_coefficients(position, n).detach(), plan).max())
    if not err <= SOE_MAX_WEIGHT_ERROR:
        return None, (f"the sum-of-exponentials fit made for {plan.fit_length} tokens misplaces {err:.1e} of a "
                      f"row's positional weight at {n} (> {SOE_MAX_WEIGHT_ERROR:g})")
    return dataclasses.replace(plan, fit_length=n), None


def soe_fit_refusal(position, length: int) -> str | None:
    """Why the `soe` form must not run `position` for rows up to `length` (None: it may).
    A term the sum of exponentials cannot represent (steps, noise beyond the exact band)
    would make the output silently wrong rather than approximately right."""
    err = soe_terms(position, length)[1]
    if not err <= SOE_MAX_WEIGHT_ERROR:  # NaN refuses too
        return (f"the sum-of-exponentials fit of {type(position).__name__} misplaces {err:.1e} of a row's "
                f"positional weight (> {SOE_MAX_WEIGHT_ERROR:g}); "
                + ("band is exact and linear-time" if position.finite_support() is not None else "fft is exact"))
    return None


def soe_assert_fit(b: Tensor, plan: SoEPlan) -> None:
    """`soe_fit_refusal` inside a compiled graph: the fit's quality depends on the term's
    parameter values, and reading them on the host would break the graph, so the same test
    (`soe_weight_error` at most `SOE_MAX_WEIGHT_ERROR`, NaN failing) becomes a runtime assert
    (a RuntimeError when the graph runs, not a refusal before it). `b: [H, N]` as `soe_plan`'s."""
    with torch.no_grad():
        err = soe_weight_error(b.detach(), plan).max()
    torch._assert_async(err <= SOE_MAX_WEIGHT_ERROR,
                        f"backend 'soe': the sum-of-exponentials fit misplaces more than {SOE_MAX_WEIGHT_ERROR:g} "
                        "of a row's positional weight (run eagerly for the refusal's details)")


def _near_coefficients(plan: SoEPlan, T: int) -> Tensor:
    """`[H, 2T]` float64: the coefficient at distance `d = 0..2T-1`, exact below W, fitted beyond."""
    d = torch.arange(2 * T, device=plan.a.device, dtype=torch.float64)
    w = (plan.a[:, None, :] * plan.gamma[None, None, :] ** d[None, :, None]).sum(-1)  # (H, 2T)
    return w + torch.nn.functional.pad(plan.corr, (0, 2 * T - plan.window))


def kernelized_num_den_soe(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_coeff: Tensor | None = None, *,
                           q_offset: int = 0, key_padding_mask: Tensor | None = None, window: int = DEFAULT_WINDOW,
                           num_terms: int = DEFAULT_TERMS, chunk_size: int = 64, plan: SoEPlan | None = None,
                           initial_state: Tensor | None = None, return_state: bool = False):
    """Causal `(num, den, log_scale)` like `kernelized_num_den_naive(..., causal=True)`, with
    the coefficients beyond distance `window` replaced by their sum-of-exponentials fit.

    One pass over chunks of `T >= W` positions: each query chunk's product with key chunks
    `c-1, c` is formed once and weighted by the exact coefficients below W (fitted ones up to
    2T); keys further away are read from K decayed states `[B, H, K, F, C]`, all K updated
    in one step per chunk.

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        log_coeff: `[H, Lq+Lk-1]` in the usual offset order (only `r <= 0` is used); the fit
            then covers the distances of this call only. Or pass
        plan: a fit from `soe_plan` (what the backend does, fitted to `max(L, SOE_FIT_LENGTH)`).
        initial_state: `[B, H, K, F, Dv+1]` `Σ_j γ_k^(-1-j) φ(k_j) ⊗ [v_j, 1]` of keys `j < 0`,
            read with the fitted coefficients only (decoding adds the exact band of its last keys).
        return_state: also return that state after the last key (position Lk - 1).

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])` (+ `state` if asked).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt, dev = phi_q.dtype, phi_q.device
    if plan is None:
        L = max(Lk, q_offset + Lq)  # largest distance + 1
        # b(-d) for d = 0..L-1 (offset r = -d sits at index Lq-1+q_offset-d; clamp for d past the vector)
        d = torch.arange(L, device=dev)
        plan = soe_plan(log_coeff[:, (Lq - 1 + q_offset - d).clamp_min(0)], window, num_terms)
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)  # (B, H, Lk, C)
    C, K = Dv + 1, plan.num_terms
    T = max(chunk_size, plan.window)
    n = -(-max(Lk, q_offset + Lq) // T)
    c0, c1 = q_offset // T, (q_offset + Lq - 1) // T  # the query chunks
    m = c1 - c0 + 1
    pad_q = (q_offset - c0 * T, (c1 + 1) * T - q_offset - Lq)
    k_pos = Fn.pad(phi_k, (0, 0, 0, n * T - Lk)).view(B, H, n, T, F)
    v_pos = Fn.pad(vv, (0, 0, 0, n * T - Lk)).view(B, H, n, T, C)
    q_pos = Fn.pad(phi_q, (0, 0, *pad_q)).view(B, H, m, T, F)

    # near field: key chunks c-1 and c, every pair's coefficient from one [H, T, 2T] table
    kp = Fn.pad(k_pos, (0, 0, 0, 0, 1, 0))  # (B, H, n+1, T, F): chunk c sits at c+1
    vp = Fn.pad(v_pos, (0, 0, 0, 0, 1, 0))
    kwin = torch.cat([kp[:, :, c0: c0 + m], kp[:, :, c0 + 1: c0 + 1 + m]], 3)  # (B, H, m, 2T, F)
    vwin = torch.cat([vp[:, :, c0: c0 + m], vp[:, :, c0 + 1: c0 + 1 + m]], 3)  # (B, H, m, 2T, C)
    t = torch.arange(T, device=dev)
    dist = t[:, None] + T - torch.arange(2 * T, device=dev)[None, :]  # (T, 2T): query s, key x
    near = _near_coefficients(plan, T)[:, dist.clamp(0, 2 * T - 1)].masked_fill(dist[None] < 0, 0.0).to(dt)
    a = torch.einsum("bhmsf,bhmxf->bhmsx", q_pos, kwin) * near[None, :, None]  # (B, H, m, T, 2T)
    y = torch.einsum("bhmsx,bhmxc->bhmsc", a, vwin)  # (B, H, m, T, C)

    # far field: keys in chunks <= c-2 (distance > T >= W), from K decayed states
    gam = plan.gamma  # (K,) float64
    to_end = (gam[:, None] ** (T - 1 - t).to(gam.dtype)).to(dt)  # (K, T)
    outer = (k_pos[..., :, None] * v_pos[..., None, :]).flatten(-2)  # (B, H, n, T, F·C)
    kc = (to_end @ outer).view(B, H, n, K, F, C)  # chunk summaries, one (K, T) @ (T, F·C) per chunk
    gT = (gam ** T).to(dt)[:, None, None]  # (K, 1, 1)
    S = kc.new_zeros(B, H, K, F, C) if initial_state is None else initial_state.to(dt)
    # S: keys before chunk c (and the initial state) decayed to position cT - 1;
    # Z[c] = γ^T·S(c-1): what query chunk c reads beyond its window (Z[0]: the initial state)
    Z, Sb = [S], [S]
    ck = (Lk - 1) // T  # the chunk of the last key
    last = max(c1, ck) if return_state else c1
    for c, kc_c in enumerate(kc.unbind(2)):  # unbind: each select's backward would zero-fill all of kc
        if c >= last:
            break
        Z.append(gT * Sb[-1])
        Sb.append(Z[-1] + kc_c)
    Zq = torch.stack(Z[c0: c1 + 1], 2)  # (B, H, m, K, F, C)
    # query s of chunk c is s + 1 positions past Z[c]'s reference point
    qfar = (plan.a[:, :, None] * gam[None, :, None] ** (t + 1).to(gam.dtype)).to(dt)  # (H, K, T)
    u = q_pos @ Zq.permute(0, 1, 2, 4, 3, 5).flatten(-2)  # (B, H, m, T, K·C): φq·Z_k for every term
    y = y + (u.view(B, H, m, T, K, C) * qfar.transpose(1, 2)[None, :, None, :, :, None]).sum(-2)
    y = y.reshape(B, H, m * T, C)[:, :, pad_q[0]: pad_q[0] + Lq]
    out = (y[..., :Dv], y[..., Dv], plan.log_scale(Lq, dt))
    if not return_state:
        return out
    # after key Lk - 1: the chunks before its chunk ck, then that chunk's e real keys
    e = Lk - ck * T
    to_last = (gam[:, None] ** (e - 1 - t[:e]).to(gam.dtype)).to(dt)  # (K, e)
    kl = k_pos[:, :, ck, None, :e] * to_last[None, None, :, :, None]  # (B, H, K, e, F)
    state = (gam ** e).to(dt)[:, None, None] * Sb[ck] + kl.transpose(-1, -2) @ v_pos[:, :, ck, None, :e]
    return (*out, state)


def _band_correction(phi_q: Tensor, keys: Tensor, values: Tensor, corr: Tensor, q_offset: int) -> Tensor:
    """`Σ_{0 <= p_i - j < W} corr(p_i - j)·(φq_i·φk_j)·values_j`, `[B, H, Lq, C]`, dense over the
    few keys given (decoding: the last W - 1 keys and the new ones; queries at `q_offset + i`)."""
    Lq, Lk, W = phi_q.shape[2], keys.shape[2], corr.shape[1]
    d = (torch.arange(Lq, device=phi_q.device) + q_offset)[:, None] - torch.arange(Lk, device=phi_q.device)[None, :]
    cw = corr.to(phi_q.dtype)[:, d.clamp(0, W - 1)].masked_fill(((d < 0) | (d >= W))[None], 0.0)  # (H, Lq, Lk)
    return (torch.einsum("bhif,bhjf->bhij", phi_q, keys) * cw[None]) @ values


def soe_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, state: SoEState | None = None, *, plan: SoEPlan,
             chunk_size: int = 64):
    """Decode `L` new tokens (features `phi_q, phi_k: [B, H, L, F]`, `v: [B, H, L, Dv]`) after
    `state`: returns `(num, den, new_state)`; memory independent of how many tokens came before."""
    dt = phi_q.dtype
    L, Dv = phi_q.shape[2], v.shape[3]
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], -1)
    nb = 0 if state is None else state.keys.shape[2]  # buffered keys, at positions -nb..-1
    if L == 1 and state is not None:
        # one token: every term's state decays by its rate and takes the new key (distance 0)
        g = plan.gamma.to(dt)[None, None, :, None, None]  # (1, 1, K, 1, 1)
        S = g * state.S + torch.einsum("bhf,bhc->bhfc", phi_k[:, :, 0], vv[:, :, 0])[:, :, None]
        y = torch.einsum("bhf,bhkfc,hk->bhc", phi_q[:, :, 0], S, plan.a.to(dt))[:, :, None]  # (B, H, 1, C)
        # the exact band over the buffered keys and the new one
        y = y + _band_correction(phi_q, torch.cat([state.keys, phi_k], 2), torch.cat([state.values, vv], 2),
                                 plan.corr, nb)
    else:
        num, den, _, S = kernelized_num_den_soe(phi_q, phi_k, v, plan=plan, chunk_size=chunk_size,
                                                initial_state=None if state is None else state.S, return_state=True)
        y = torch.cat([num, den[..., None]], -1)
        if nb:  # the state's keys are read with fitted coefficients: add the exact band of the buffered ones
            r = min(L, plan.window - 1)  # only the first W - 1 new queries reach them
            y = torch.cat([y[:, :, :r] + _band_correction(phi_q[:, :, :r], state.keys, state.values, plan.corr, nb),
                           y[:, :, r:]], 2)
    keys, values = phi_k, vv
    if state is not None:
        keys, values = torch.cat([state.keys, phi_k], 2), torch.cat([state.values, vv], 2)
    tail = slice(max(0, keys.shape[2] - (plan.window - 1)), None)
    new = SoEState(S, keys[:, :, tail], values[:, :, tail], plan, (0 if state is None else state.length) + L)
    return y[..., :Dv], y[..., Dv], new
