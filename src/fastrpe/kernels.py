"""Content kernels: how `q_i` and `k_j` are compared.

Either exact softmax (`Softmax`) or a feature map `φ` with `κ(q, k) = φ(q)·φ(k)`
(`FeatureMap` subclasses). Layout: inputs `[B, H, L, D]`, features `[B, H, L, F]`,
computed in float32 (float64 for float64 inputs) whatever the input dtype.

Stabilizers (exp-based maps) are exact: they cancel in every term of the attention
formula (`fastrpe.ops.kernelized` states the formula and the bookkeeping):
- a query may be rescaled by any positive factor of its own: it multiplies the numerator
  and the denominator of its attention row alike (Shaw's `φ(q)·RP` included). Exp-based
  maps subtract the query's own maximum exponent.
- keys may only be rescaled by a factor shared by every key a row sees. `key_features`
  returns the features and that shift `s` (true features `φ̃·exp(s)`): `PRF` subtracts a
  data-independent bound (`key_log_shift()`), normalized `Exp` ("nexp") the constant 1,
  SIKF `Exp` one shift per (batch, head) over all keys, or, causal, a running maximum
  (each row is rescaled by the maximum up to its own last key, as in online softmax).
  `TRF` drops the factor `exp(‖k‖²/2)`, which is shared by all keys only when they are
  normalized (its default; see `TRF`).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["Kernel", "Softmax", "FeatureMap", "EluPlusOne", "ReLU", "Exp", "DPFP", "PRF", "TRF",
           "NAMES", "DEFAULT_NUM_FEATURES", "get_kernel"]

#: number of random features `get_kernel` gives a random map when none is asked for
DEFAULT_NUM_FEATURES = 64

#: where `PRF` computes its features by Triton (`ops/triton_prf.py`: one launch forward and
#: one backward instead of about 11 and 15 elementwise ones): "cuda" (default: CUDA tensors,
#: triton installed), "always" (wherever the kernels run, the interpreter included: the
#: tests), "never" (the PyTorch ops). float64 inputs, a trainable `w` and `torch.compile`
#: always take the PyTorch ops.
TRITON_FEATURES = "cuda"


class Kernel:
    """Marker base of every content kernel."""

    name: str = "kernel"


class Softmax(Kernel):
    """Exact softmax attention, `score_ij = scale·q_i·k_j (+ b(j-i))` (Vaswani et al.,
    "Attention Is All You Need", 2017)."""

    name = "softmax"

    def __repr__(self) -> str:
        return "Softmax()"


class FeatureMap(nn.Module, Kernel):
    """Base of the feature maps: `forward(x: [B, H, L, D], is_query) -> [B, H, L, F]`.

    Inputs in bf16/fp16 are computed in float32, float64 stays float64; the features come
    back in that compute dtype.

    Args:
        normalize: l2-normalize `x` over its last dim first (NPRF, Luo et al., "Stable, Fast
            and Accurate: Kernelized Attention with Relative Positional Encoding", 2021, §3.3).
    """

    name = "feature_map"
    #: True when causal key features need a per-key running maximum (`key_features` returns
    #: a `[B, H, Lk]` shift): only algorithms that rescale rows per key can run the map causally
    per_key_shift_when_causal: bool = False

    def __init__(self, normalize: bool = False):
        nn.Module.__init__(self)
        self.normalize = bool(normalize)

    def num_features(self, head_dim: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def key_log_shift(self) -> Tensor | float:
        """The data-independent constant subtracted from every key's log-features
        (`φ_key = exp(-shift)·φ`): a number, a 0-dim tensor or `[H, 1]` (per head). The
        composition cancels it in every term; 0 unless a map says otherwise."""
        return 0.0

    def key_features(self, k: Tensor, *, causal: bool = False,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | float]:
        """Key features as the kernelized composition uses them: `(phi_k, s)` with true
        features `phi_k·exp(s)`. `s` is one shift shared by every key a row sees: `()`-shaped,
        `[H, 1]` or `[B, H, 1]`, or, for causal maps with no data-independent bound, `[B, H, Lk]`,
        non-decreasing over keys (a running maximum: row i uses the shift of its own last key).

        Args:
            k: `[B, H, Lk, D]`; causal: the caller attends causally; key_padding_mask:
                `[B, Lk]`, True marks keys that do not count (they may not set the shift).
        """
        return self(k, is_query=False), self.key_log_shift()

    def _prepare(self, x: Tensor) -> Tensor:
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        return x

    def features(self, x: Tensor, is_query: bool) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor, is_query: bool = True) -> Tensor:
        """Args: x: `[B, H, L, D]` (any leading dims); is_query: queries may be stabilized
        differently from keys. Returns: `[B, H, L, F]`, `F = num_features(D)`."""
        return self.features(self._prepare(x), is_query)

    def extra_repr(self) -> str:
        return f"normalize={self.normalize}"


class EluPlusOne(FeatureMap):
    """`φ(x) = elu(x) + 1`, `F = D` (Katharopoulos et al., "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention", 2020)."""

    name = "elu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        # elu(x) + 1 = x + 1 (x > 0), exp(x) (x <= 0), gradient 1 or exp(x) as elu's; not F.elu: in
        # torch 2.13 its CPU backward lays out its output unlike its meta function, and a compiled
        # (aot_eager) backward then fails on a view. min(x, 0): the unused branch cannot overflow
        return torch.where(x > 0, x + 1.0, torch.exp(x.clamp_max(0.0)))


class ReLU(FeatureMap):
    """`φ(x) = relu(x)`, `F = D`; the ReLU kernel baseline of Luo et al., "Stable, Fast and
    Accurate: Kernelized Attention with Relative Positional Encoding" (2021). Rows of
    attention whose features are all zero return 0."""

    name = "relu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        return torch.relu(x)


class Exp(FeatureMap):
    """SIKF, `φ(x) = exp(x)`, `F = D` ("FastRPB: a Scalable Relative Positional Encoding for
    Long Sequence Tasks", ICLR 2022 submission, 2021, §3.1). `φ(q)·φ(k) = Σ_d exp(q_d + k_d)`.

    Stabilizers, all exact (Eq. 9: the kernel is invariant to one constant shared by all keys):
    - a query subtracts its own maximum (`exp(x - max_d x)`; the factor cancels in its row);
    - keys (`key_features`): without `normalize`, one shift per (batch, head), the largest
      entry of every (non-padding) key; causal, a running maximum over keys instead, and
      each row is rescaled by the maximum up to its own last key (online softmax), so no
      output depends on a later key. Only the dense algorithm rescales per key, so causal
      SIKF runs on backend "dense" (`per_key_shift_when_causal`).
    - `normalize=True` ("nexp"): `|x̂_d| <= 1`, so keys subtract the constant 1
      (`key_log_shift()`) and the map runs on every backend.

    Called directly on keys (`kernel(k, is_query=False)`), the map returns `exp(k)` exactly
    without `normalize` (it cannot know which keys share a shift); `exp(k̂ - 1)` with it.
    """

    name = "exp"

    @property
    def per_key_shift_when_causal(self) -> bool:
        return not self.normalize

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def key_log_shift(self) -> Tensor | float:
        return 1.0 if self.normalize else 0.0

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        if is_query:
            return torch.exp(x - x.amax(-1, keepdim=True))
        return torch.exp(x - self.key_log_shift())

    def key_features(self, k: Tensor, *, causal: bool = False,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor | float]:
        if self.normalize:
            return super().key_features(k, causal=causal, key_padding_mask=key_padding_mask)
        x = self._prepare(k)  # (B, H, Lk, D)
        own = x.detach().amax(-1)  # (B, H, Lk): each key's largest entry
        real = own if key_padding_mask is None else own.masked_fill(key_padding_mask[:, None, :], float("-inf"))
        if causal:
            s = real.cummax(-1).values  # (B, H, Lk): running maximum over keys 0..j
        else:
            s = real.amax(-1, keepdim=True)  # (B, H, 1): one shift for every key
        s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))  # no real key (yet): any constant
        # padding keys are never used; shifting them by their own maximum keeps them finite
        shift = s.expand_as(own) if key_padding_mask is None else torch.where(
            key_padding_mask[:, None, :], own, s.expand_as(own))
        return torch.exp(x - shift[..., None]), s


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al., "Linear Transformers Are
    Secretly Fast Weight Programmers", 2021): with `r = relu([x, -x])` (`2D` wide), the
    `F = 2·D·nu` features `r_i · r_{i-j}` (cyclic) for rolls `j = 1..nu`. Non-negative."""

    name = "dpfp"

    def __init__(self, nu: int = 1, normalize: bool = False):
        super().__init__(normalize)
        if nu < 1:
            raise ValueError(f"kernel: DPFP needs nu >= 1, got {nu}")
        self.nu = int(nu)

    def num_features(self, head_dim: int) -> int:
        return 2 * head_dim * self.nu

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        r = torch.relu(torch.cat([x, -x], dim=-1))  # (.., 2D)
        return torch.cat([r * r.roll(j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)  # (.., 2D·nu)

    def extra_repr(self) -> str:
        return f"nu={self.nu}, normalize={self.normalize}"


def _orthogonal_rows(m: int, d: int, g: torch.Generator) -> Tensor:
    """`[m, d]` float64 rows in blocks of d mutually orthogonal rows, each block a Haar-random
    orthogonal matrix, rescaled to chi(d)-distributed norms so that every row is marginally
    `N(0, I_d)` (Choromanski et al. 2021, ORF)."""
    qm, rm = torch.linalg.qr(torch.randn(math.ceil(m / d), d, d, generator=g, dtype=torch.float64))
    # without the sign fix, Householder QR pins the sign of a coordinate per column: not Haar
    qm = qm * torch.where(rm.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0)[:, None, :]
    w = qm.transpose(-1, -2).reshape(-1, d)[:m]  # (blocks·d, d): each block's rows are Q's columns
    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return w * norms


class _RandomFeatures(FeatureMap):
    """Base of the random-projection maps: the projection `w` is a buffer (it moves with
    `.to()` and is saved in `state_dict` and checkpoints) drawn from a generator seeded with
    `seed`, and redrawn only by `redraw()`.

    Args:
        head_dim: `D`, the width of q and k.
        num_features: `m`, the number of random projections.
        projection: "iid" (Gaussian rows), "orthogonal" (ORF: blocks of orthogonal rows with
            Gaussian-like norms) or "sphere" (rows uniform on the sphere of radius `√D`).
        seed: seed of the draw.
        input_scale: every input is multiplied by it before projecting. Default: `D^-1/4`,
            so that `φ(q)·φ(k)` estimates `exp(q·k/√D)`, softmax attention's kernel; for
            `PRF` with `normalize` the default is 1, so the kernel is `exp(q̂·k̂)` with
            `q̂·k̂ ∈ [−1, 1]` (NPRF, Luo et al. 2021, §3.2: the positional term supplies the
            sharpness). Any other value is an explicit temperature.
        normalize: l2-normalize q and k first (NPRF); the input scale applies after it.
            False by default, True for `TRF`.
        num_heads: None: one projection `w: [m, D]` shared by every head. H: an independent
            draw per head, `w: [H, m, D]` (as Performer draws per head), all from `seed`;
            inputs must then have H heads (`[B, H, L, D]`).
    """

    def __init__(self, head_dim: int, num_features: int = DEFAULT_NUM_FEATURES, *, projection: str = "iid",
                 seed: int = 0, input_scale: float | None = None, normalize: bool = False,
                 num_heads: int | None = None):
        super().__init__(normalize)
        if projection not in ("iid", "orthogonal", "sphere"):
            raise ValueError(f"kernel: projection must be 'iid', 'orthogonal' or 'sphere', got {projection!r}")
        if int(head_dim) <= 0 or int(num_features) <= 0:
            raise ValueError(f"kernel: head_dim and num_features must be positive, got {head_dim}, {num_features}")
        if num_heads is not None and (isinstance(num_heads, bool) or int(num_heads) <= 0):
            raise ValueError(f"kernel: num_heads must be a positive int or None, got {num_heads!r}")
        self.head_dim, self.m, self.projection, self.seed = int(head_dim), int(num_features), projection, int(seed)
        self.num_heads = None if num_heads is None else int(num_heads)
        # φ(q)·φ(k) estimates exp(q·k/√D) when each input is scaled by D^-1/4, as softmax does
        self.input_scale = self.head_dim ** -0.25 if input_scale is None else float(input_scale)
        self.register_buffer("w", self._draw(self.seed))  # (m, D) or (H, m, D)

    def _draw_one(self, g: torch.Generator) -> Tensor:
        d, m = self.head_dim, self.m
        if self.projection == "iid":
            return torch.randn(m, d, generator=g, dtype=torch.float64)
        if self.projection == "orthogonal":
            return _orthogonal_rows(m, d, g)
        w = torch.randn(m, d, generator=g, dtype=torch.float64)  # uniform on the sphere of radius √d
        return w / w.norm(dim=-1, keepdim=True) * math.sqrt(d)

    def _draw(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.num_heads is None:
            return self._draw_one(g).float()
        # one generator, drawn H times in a row: independent draws, reproducible from seed
        return torch.stack([self._draw_one(g) for _ in range(self.num_heads)]).float()

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw new projections (every head's) in place, same device and dtype, from `seed`,
        by default the previous seed + 1."""
        self.seed = self.seed + 1 if seed is None else int(seed)
        self.w.copy_(self._draw(self.seed))

    def num_features(self, head_dim: int) -> int:
        return self._out_features()

    def _out_features(self) -> int:
        return self.m

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Scaled input `s·x` and its projections `w·(s·x)`: `(.., D)`, `(.., m)`."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"kernel: {type(self).__name__} was built for head_dim={self.head_dim}, "
                             f"got inputs with last dim {x.shape[-1]}")
        xs = x * self.input_scale
        w = self.w.to(x.dtype)
        if self.num_heads is None:
            return xs, xs @ w.T
        if x.dim() < 3 or x.shape[-3] != self.num_heads:
            raise ValueError(f"kernel: {type(self).__name__} draws per head for num_heads={self.num_heads}; "
                             f"inputs must be [B, H, L, D], got {list(x.shape)}")
        return xs, torch.einsum("...hld,hmd->...hlm", xs, w)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.m}, projection={self.projection!r}, "
                f"seed={self.seed}, input_scale={self.input_scale:.4g}, normalize={self.normalize}, "
                f"num_heads={self.num_heads}")


class PRF(_RandomFeatures):
    """Positive random features, FAVOR+ (Choromanski et al., "Rethinking Attention with
    Performers", 2021): `φ(x) = exp(w·x − ‖x‖²/2)/√m`, `F = m`, with
    `E[φ(q)·φ(k)] = exp(q·k)` on inputs scaled by `input_scale` (default `D^-1/4`, so the
    estimate is of `exp(q·k/√D)`; 1 with `normalize`, `exp(q̂·k̂)`). `two_sided=True` is the
    positive hyperbolic form of the same paper (Lemma 1, `SM⁺_hyp`), as FastRPB uses it:
    `φ(x) = exp(−‖x‖²/2)/√(2m)·[exp(w·x), exp(−w·x)]`, `F = 2m`, same expectation, lower
    variance. `projection="orthogonal"` is ORF (same paper), `"sphere"` is sphere-PRF and
    `normalize=True` is NPRF (both Luo et al., "Stable, Fast and Accurate: Kernelized
    Attention with Relative Positional Encoding", 2021). See `_RandomFeatures` for the
    other arguments.

    Stabilizers, all exact, none mixing positions:
    - a query subtracts its own maximum exponent (its features peak at `1/√m`);
    - every key subtracts the same data-independent constant `key_log_shift()` (per head
      with `num_heads`), an upper bound of the exponent: `±w·x − ‖x‖²/2 ≤ ‖w‖²/2` for any
      x, and `≤ ‖w‖·s − s²/2` (`‖w‖ ≥ s`) when the inputs are normalized to norm
      `s = |input_scale|`. Key features are therefore at most `1/√m` and never overflow;
      very unlikely keys underflow to 0 instead (without `normalize`, at float32 and large
      D, ~`D ≥ 150`, typical keys already do: use NPRF).
    """

    name = "prf"

    def __init__(self, head_dim: int, num_features: int = DEFAULT_NUM_FEATURES, *, projection: str = "iid",
                 seed: int = 0, input_scale: float | None = None, normalize: bool = False,
                 num_heads: int | None = None, two_sided: bool = False):
        if input_scale is None and normalize:
            input_scale = 1.0  # NPRF: exp(q̂·k̂), q̂·k̂ in [−1, 1] (Luo §3.2), no D^-1/4
        super().__init__(head_dim, num_features, projection=projection, seed=seed, input_scale=input_scale,
                         normalize=normalize, num_heads=num_heads)
        self.two_sided = bool(two_sided)

    def _out_features(self) -> int:
        return 2 * self.m if self.two_sided else self.m

    def key_log_shift(self) -> Tensor:
        """`max_m sup_x (±w_m·x − ‖x‖²/2)` over the inputs this map can see: a 0-dim tensor,
        or `[H, 1]` (one per head) with `num_heads`.

        Kept while `w` is the same tensor at the same version (`redraw`, `.to()`, an in-place
        write, `broadcast_parameters` all change one of them): it is read twice per key call,
        about ten kernel launches each, which a one-token decoding step notices."""
        w = self.w
        caching = not torch.compiler.is_compiling() and not w.requires_grad  # a traced graph: no Python state
        if caching:
            key = (w._version, self.normalize, self.input_scale)
            cached = getattr(self, "_shift_cache", None)  # (w itself, held so that its id is not reused; key; shift)
            if cached is not None and cached[0] is w and cached[1] == key:
                return cached[2]
        wn = w.pow(2).sum(-1).sqrt()  # (m,) or (H, m): ‖w_m‖
        if not self.normalize:
            bound = wn * wn / 2
        else:
            # normalized inputs have norm r = s: the sup over r <= s of ‖w‖·r − r²/2 is at r = min(‖w‖, s)
            r = wn.clamp(max=abs(self.input_scale))
            bound = wn * r - r * r / 2
        shift = bound.amax() if self.num_heads is None else bound.amax(-1, keepdim=True)
        if caching:
            self._shift_cache = (w, key, shift)
        return shift

    def _exponents(self, x: Tensor) -> Tensor:
        """`(.., F)` exponents `±w·xs − ‖xs‖²/2` of prepared inputs, before any shift."""
        xs, wx = self._project(x)  # (.., D), (.., m)
        if self.two_sided:
            wx = torch.cat([wx, -wx], dim=-1)  # (.., 2m)
        return wx - xs.pow(2).sum(-1, keepdim=True) / 2

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        e = self._exponents(x)  # (.., F)
        if is_query:
            e = e - e.amax(-1, keepdim=True)
        else:
            shift = self.key_log_shift().to(e.dtype)
            e = e - (shift if self.num_heads is None else shift[:, None, :])  # (H, 1, 1) per head
        return torch.exp(e) / math.sqrt(self._out_features())

    def forward(self, x: Tensor, is_query: bool = True) -> Tensor:
        """As `FeatureMap.forward`: by Triton where `TRITON_FEATURES` says (one launch each
        way); else, when x needs a gradient, by `_PRFFeatures`, which keeps only x and φ for
        backward instead of every intermediate (see there)."""
        if self._triton_features(x):
            from .ops import triton_prf

            return triton_prf.prf_features_triton(x, self, is_query)
        if (torch.is_grad_enabled() and x.requires_grad and not self.w.requires_grad
                and not torch.compiler.is_compiling()):  # a compiled graph plans its own memory
            return _PRFFeatures.apply(x, self, is_query)
        return super().forward(x, is_query)

    def _triton_features(self, x: Tensor) -> bool:
        from .ops.common import MAX_GRID_YZ
        from .ops.linear.triton_chunked import triton_route

        return (triton_route(TRITON_FEATURES, "fastrpe.kernels.TRITON_FEATURES", x.device)
                and x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and x.shape[0] * x.shape[1] <= MAX_GRID_YZ  # B·H: the kernels' grid's second axis
                and not self.w.requires_grad and not torch.compiler.is_compiling() and x.shape[-1] == self.head_dim
                and (self.num_heads is None or x.shape[1] == self.num_heads))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", two_sided={self.two_sided}"


class _PRFFeatures(torch.autograd.Function):
    """`PRF.features(_prepare(x))` with a hand-written backward that saves x (the caller
    holds it) and φ (the attention op saves it too), not autograd's float32 copy, normalized
    copy, scaled copy, projections and exponents: for bf16 inputs with D = 64, F = 32, those
    are 528 more bytes per (head, position), 4.1 GiB per map at B·H = 8 and a million
    tokens, held from the forward to the end of the backward.

    Backward, with `de = dφ·φ` (`φ = exp(e)/√F`): a query's `e = e₀ − max e₀` sends
    `−Σde` to its maximal entries (split evenly among ties, as `amax` does); a key's shift
    is a constant. `e₀ = [w·xs, −w·xs] − ‖xs‖²/2` gives `dxs = dwx·w − xs·Σde₀`;
    `xs = s·x̂`, and `x̂ = x/max(‖x‖, 1e-12)` (`F.normalize`) gives
    `dx = (dx̂ − x̂·(x̂·dx̂))/‖x‖` (`dx̂/1e-12` below the clamp). Second derivatives
    work (the backward is made of differentiable ops); tests check both against autograd
    through `PRF.features`."""

    @staticmethod
    def forward(ctx, x: Tensor, kern: "PRF", is_query: bool) -> Tensor:
        # blocks of positions, as backward: every step is per position (a query's shift is its
        # own maximum, a key's a constant), and the float32 temporaries of a whole bf16 map
        # (normalized x, its square, projections: 4 of x's width) were the forward's peak
        L = x.shape[-2]
        step = _prf_block(x, 4 if x.dtype in (torch.float16, torch.bfloat16) else x.element_size())
        if step >= L:
            phi = kern.features(kern._prepare(x), is_query)
        else:
            phi = None
            for i in range(0, L, step):
                sl = (..., slice(i, i + step), slice(None))
                part = kern.features(kern._prepare(x[sl]), is_query)
                if phi is None:
                    phi = part.new_empty(*x.shape[:-1], part.shape[-1])
                phi[sl] = part
        ctx.kern, ctx.is_query = kern, is_query
        ctx.save_for_backward(x, phi)
        return phi

    @staticmethod
    def backward(ctx, dphi: Tensor):
        x, phi = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: out of place, one block (second derivatives)
            return _prf_input_grad(ctx.kern, x, phi, dphi, ctx.is_query, inplace=False), None, None
        # blocks of positions (dim -2), so that the float32 temporaries (x̂, dx: about 3
        # bytes of them per byte of bf16 x) stay near PRF_BLOCK_BYTES at any length
        L = x.shape[-2]
        step = _prf_block(x, phi.element_size())
        if step >= L:
            return _prf_input_grad(ctx.kern, x, phi, dphi, ctx.is_query, inplace=True), None, None
        dx = torch.empty_like(x)
        for i in range(0, L, step):
            sl = (..., slice(i, i + step), slice(None))
            dx[sl] = _prf_input_grad(ctx.kern, x[sl], phi[sl], dphi[sl], ctx.is_query, inplace=True)
        return dx, None, None


#: float32 bytes of x that one block of `_PRFFeatures`' forward or backward widens at a time
#: (256 MiB: at B·H = 8 and a million tokens, 8 blocks)
PRF_BLOCK_BYTES = 1 << 28


def _prf_block(x: Tensor, itemsize: int) -> int:
    """Positions (dim -2) of x per block of `_PRFFeatures`: x widened to `itemsize` bytes fits
    `PRF_BLOCK_BYTES` (from shapes alone: no host synchronization)."""
    return max(1, PRF_BLOCK_BYTES * x.shape[-2] // max(1, x.numel() * itemsize))


def _prf_input_grad(kern: PRF, x: Tensor, phi: Tensor, dphi: Tensor, is_query: bool, inplace: bool) -> Tensor:
    """`dx` of `_PRFFeatures` (its docstring has the formulas) for x, φ, dφ of some positions;
    `inplace` (not under create_graph) reuses the temporaries: x̂ and dx, `[.., D]` float32."""
    cd, eps, s = phi.dtype, 1e-12, kern.input_scale
    de = dphi * phi  # (.., F)
    xh = x.to(cd)
    if kern.normalize:
        n = xh.norm(dim=-1, keepdim=True).clamp_min(eps)
        xh = xh.div_(n) if inplace and xh is not x else xh / n
    w = kern.w.to(cd)
    if is_query:  # the gradient of the subtracted maximum, at the entries the forward's amax found
        e0 = kern._exponents(xh)
        top = (e0 == e0.amax(-1, keepdim=True)).to(cd)
        del e0
        share = de.sum(-1, keepdim=True) / top.sum(-1, keepdim=True)
        de = de.addcmul_(top, share, value=-1.0) if inplace else de - top * share
        del top
    m = kern.m
    dwx = de[..., :m] - de[..., m:] if kern.two_sided else de  # (.., m)
    sde = de.sum(-1, keepdim=True)
    del de
    # e₀ = [s·w·x̂, −s·w·x̂] − s²‖x̂‖²/2:  dx̂ = s·dwx·w − s²·x̂·Σde₀
    dx = dwx @ w if kern.num_heads is None else torch.einsum("...hlm,hmd->...hld", dwx, w)
    del dwx
    dx = dx.mul_(s).addcmul_(xh, sde, value=-s * s) if inplace else dx * s - (s * s) * xh * sde
    if kern.normalize:  # through x̂ = x/max(‖x‖, eps): the radial part goes, unless clamped
        radial = torch.einsum("...d,...d->...", xh, dx).unsqueeze(-1) * (n > eps)
        dx = dx.addcmul_(xh, radial, value=-1.0).div_(n) if inplace else (dx - xh * radial) / n
    return dx.to(x.dtype)


class TRF(_RandomFeatures):
    """Trigonometric random features (Peng et al., "Random Feature Attention", 2021):
    `φ(x) = [sin(w·x), cos(w·x)]·exp(‖x‖²/2)/√m`, `F = 2m`, with `E[φ(q)·φ(k)] = exp(q·k)`
    on inputs scaled by `input_scale` (default `D^-1/4`: `exp(q·k/√D)`). See
    `_RandomFeatures` for the arguments.

    Stabilized per position by dropping the factor `exp(‖x‖²/2)`, so what is computed is
    `[sin(w·x), cos(w·x)]/√m`, RFA's estimator of the Gaussian kernel `exp(−‖q−k‖²/2)`.
    For queries this is exact (a per-query factor cancels). Keys have no data-independent
    bound (the factor overflows float32 for norms past ~13 after scaling), so for keys
    it is part of the map's definition: each key's kernel values are scaled by its own
    `exp(−‖k‖²/2)`. With `normalize=True` (RFA's setting, the default) every key has the
    same norm, the factor is shared by all keys, and `φ(q)·φ(k)` is an unbiased estimate of
    softmax's kernel up to it.

    TRF features can be negative: the estimated denominator can approach 0, and without
    normalization large inputs make every kernel value ~0 and the attention row noise (with
    non-finite gradients once cast to fp16). So, unlike the other maps, `normalize` defaults
    to True here and `get_kernel("trf")` is RFA's normalized form (the same as "ntrf");
    Luo et al.'s unnormalized TRF is `TRF(..., normalize=False)`.
    """

    name = "trf"

    def __init__(self, head_dim: int, num_features: int = DEFAULT_NUM_FEATURES, *, projection: str = "iid",
                 seed: int = 0, input_scale: float | None = None, normalize: bool = True,
                 num_heads: int | None = None):
        super().__init__(head_dim, num_features, projection=projection, seed=seed, input_scale=input_scale,
                         normalize=normalize, num_heads=num_heads)

    def _out_features(self) -> int:
        return 2 * self.m

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        _, wx = self._project(x)  # (.., m)
        return torch.cat([torch.sin(wx), torch.cos(wx)], dim=-1) / math.sqrt(self.m)  # (.., 2m)


_SIMPLE = {"elu": EluPlusOne, "relu": ReLU, "exp": Exp, "dpfp": DPFP}
_RANDOM = {"prf": (PRF, "iid"), "prf2": (PRF, "iid"), "orf": (PRF, "orthogonal"), "sphere_prf": (PRF, "sphere"),
           "trf": (TRF, "iid")}
#: kernel names `get_kernel` knows; every one but "softmax" also with the prefix "n" (normalize)
NAMES = ("softmax", *_SIMPLE, *_RANDOM)


def get_kernel(spec, head_dim: int | None = None, num_features: int | None = None, seed: int = 0,
               num_heads: int | None = None) -> Kernel:
    """A `Kernel` from a spec.

    Args:
        spec: a `Kernel` instance (returned as is), None (softmax) or a name in `NAMES`;
            the prefix "n" l2-normalizes q and k first ("nprf" is NPRF: the kernel is
            `exp(q̂·k̂)`, no `D^-1/4` scale; "nelu", ...). "prf2" is FAVOR+'s two-sided
            positive form `[exp(w·x), exp(−w·x)]` (`PRF(two_sided=True)`).
            "trf" is always normalized (RFA's form, see `TRF`).
        head_dim: `D`; required by the random maps ("prf", "prf2", "orf", "sphere_prf", "trf").
        num_features: random projections `m` of a random map (default
            `DEFAULT_NUM_FEATURES` = 64); ignored by the other maps.
        seed: seed of the random projections.
        num_heads: random maps only: an independent projection per head (`w: [H, m, D]`),
            all drawn from `seed`; None shares one projection across heads.
    """
    if isinstance(spec, Kernel):
        return spec
    if spec is None:
        return Softmax()
    if not isinstance(spec, str):
        raise ValueError(f"kernel: expected a name or a fastrpe.kernels object, got {type(spec).__name__}")
    name, normalize = spec, False
    if name not in NAMES and name.startswith("n") and name[1:] in NAMES and name[1:] != "softmax":
        name, normalize = name[1:], True
    if name == "softmax":
        return Softmax()
    if name in _SIMPLE:
        return _SIMPLE[name](normalize=normalize)
    if name in _RANDOM:
        if head_dim is None:
            raise ValueError(f"kernel: {spec!r} draws random projections and needs head_dim")
        cls, projection = _RANDOM[name]
        m = DEFAULT_NUM_FEATURES if num_features is None else num_features
        normalize = normalize or cls is TRF  # "trf" is RFA's normalized form, the same as "ntrf"
        extra = {"two_sided": True} if name == "prf2" else {}
        return cls(head_dim, m, projection=projection, seed=seed, normalize=normalize, num_heads=num_heads, **extra)
    known = ", ".join(NAMES)
    raise ValueError(f"kernel: unknown kernel {spec!r}; valid names: {known}, "
                     f"and each but softmax with the prefix 'n' (l2-normalize q/k), e.g. 'nprf'")
