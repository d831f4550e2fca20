"""Content kernels: how `q_i` and `k_j` are compared.

Either exact softmax (`Softmax`) or a feature map `φ` with
`κ(q, k) = φ(q)·φ(k)` (`FeatureMap` subclasses). Layout: inputs
`[B, H, L, D]`, features `[B, H, L, F]`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class Kernel:
    """Marker base of every content kernel."""

    name: str = "kernel"


class Softmax(Kernel):
    """Exact softmax attention: `score_ij = scale·q_i·k_j (+ b(j-i))`."""

    name = "softmax"

    def __repr__(self) -> str:
        return "Softmax()"


class FeatureMap(nn.Module, Kernel):
    """Base of the feature maps. `forward(x, is_query) -> [B, H, L, F]`.

    Args:
        normalize: l2-normalize `x` over its last dim first (NPRF, Luo et al. 2021 §3.3).
    """

    name = "feature_map"

    def __init__(self, normalize: bool = False):
        nn.Module.__init__(self)
        self.normalize = bool(normalize)

    def num_features(self, head_dim: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _prepare(self, x: Tensor) -> Tensor:
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.normalize:
            x = torch.nn.functional.normalize(x, dim=-1)
        return x

    def features(self, x: Tensor, is_query: bool) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor, is_query: bool = True) -> Tensor:
        return self.features(self._prepare(x), is_query)


class EluPlusOne(FeatureMap):
    """`φ(x) = elu(x) + 1` (Katharopoulos et al., "Transformers are RNNs", 2020)."""

    name = "elu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        return torch.nn.functional.elu(x) + 1.0


class ReLU(FeatureMap):
    """`φ(x) = relu(x)` (used as a baseline in Luo et al. 2021 and FastRPB)."""

    name = "relu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        return torch.relu(x)


class Exp(FeatureMap):
    """SIKF, `φ(x) = exp(x)` ("FastRPB: a Scalable Relative Positional Encoding for Long
    Sequence Tasks", ICLR 2022 submission).

    Stabilized per position: `φ(x) = exp(x - max_d x)`. For a query the factor cancels
    exactly; for a key it is part of this map's definition (each key's kernel values are
    scaled by the positive factor `exp(-max_d k)`), so no position ever influences another.
    """

    name = "exp"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        return torch.exp(x - x.amax(-1, keepdim=True))


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al., "Linear Transformers Are
    Secretly Fast Weight Programmers", ICML 2021): `F = 2·D·nu` features
    `relu([x, -x])_i · relu([x, -x])_{i+j}` for rolls `j = 1..nu`."""

    name = "dpfp"

    def __init__(self, nu: int = 1, normalize: bool = False):
        super().__init__(normalize)
        if nu < 1:
            raise ValueError(f"DPFP: nu must be >= 1, got {nu}")
        self.nu = nu

    def num_features(self, head_dim: int) -> int:
        return 2 * head_dim * self.nu

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        r = torch.relu(torch.cat([x, -x], dim=-1))  # (.., 2D)
        return torch.cat([r * r.roll(j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)


def _orthogonal_rows(m: int, d: int, g: torch.Generator) -> Tensor:
    """`[m, d]` rows in blocks of d orthonormal rows (QR of Gaussian blocks), rescaled to
    chi-distributed norms like i.i.d. Gaussian rows (Choromanski et al. 2021, ORF)."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        qm, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        blocks.append(qm.T)
    w = torch.cat(blocks, 0)[:m]
    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return w * norms


class _RandomFeatures(FeatureMap):
    """Base of the random-projection maps: projection `w: [F, D]` is a buffer drawn from a
    seeded generator and redrawn only by `redraw()`."""

    def __init__(self, head_dim: int, num_features: int = 64, *, projection: str = "iid", seed: int = 0,
                 input_scale: float | None = None, normalize: bool = False):
        super().__init__(normalize)
        if projection not in ("iid", "orthogonal", "sphere"):
            raise ValueError(f"projection must be 'iid', 'orthogonal' or 'sphere', got {projection!r}")
        if head_dim <= 0 or num_features <= 0:
            raise ValueError(f"head_dim and num_features must be positive, got {head_dim}, {num_features}")
        self.head_dim, self.m, self.projection, self.seed = head_dim, num_features, projection, seed
        # φ(q)·φ(k) estimates exp(q·k/√D) when each input is scaled by D^-1/4, as softmax does
        self.input_scale = head_dim ** -0.25 if input_scale is None else float(input_scale)
        self.register_buffer("w", self._draw(seed))

    def _draw(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        d, m = self.head_dim, self.m
        if self.projection == "iid":
            w = torch.randn(m, d, generator=g, dtype=torch.float64)
        elif self.projection == "orthogonal":
            w = _orthogonal_rows(m, d, g)
        else:  # uniform on the sphere of radius √d
            w = torch.randn(m, d, generator=g, dtype=torch.float64)
            w = w / w.norm(dim=-1, keepdim=True) * math.sqrt(d)
        return w.float()

    def redraw(self, seed: int | None = None) -> None:
        """Draw a new projection (seed default: the previous seed + 1)."""
        self.seed = self.seed + 1 if seed is None else seed
        self.w.copy_(self._draw(self.seed).to(self.w.device))

    def num_features(self, head_dim: int) -> int:
        return self._out_features()

    def _out_features(self) -> int:
        return self.m

    def _project(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"kernel: {type(self).__name__} was built for head_dim={self.head_dim}, got {x.shape[-1]}")
        return (x * self.input_scale) @ self.w.to(x.dtype).T  # (.., F)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.m}, projection={self.projection!r}, "
                f"seed={self.seed}, normalize={self.normalize}")


class PRF(_RandomFeatures):
    """Positive random features, FAVOR+ (Choromanski et al., "Rethinking Attention with
    Performers", ICLR 2021): `φ(x) = exp(w·x − ‖x‖²/2)/√m`, `E[φ(q)·φ(k)] = exp(q·k)`
    (on inputs scaled by `D^-1/4`). `projection`: "iid", "orthogonal" (ORF) or "sphere"
    (rows uniform on `√d·S^{d−1}`). With `normalize=True` this is Luo et al.'s NPRF.

    Stabilizers keep every position independent: a query subtracts its own max exponent
    (cancels exactly in attention); a key subtracts the data-independent bound
    `max_m ‖w_m‖²/2 ≥ w·x − ‖x‖²/2`, which cancels too and can never overflow.
    """

    name = "prf"

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        x = x * 1.0
        wx = self._project(x)  # (.., F)
        e = wx - (x * self.input_scale).pow(2).sum(-1, keepdim=True) / 2
        if is_query:
            e = e - e.amax(-1, keepdim=True)
        else:
            e = e - self.w.to(x.dtype).pow(2).sum(-1).amax() / 2
        return torch.exp(e) / math.sqrt(self.m)


class TRF(_RandomFeatures):
    """Trigonometric random features (Peng et al., "Random Feature Attention", ICLR 2021):
    `φ(x) = [sin(w·x), cos(w·x)]/√m`, `F = 2m`, estimating the Gaussian kernel
    `exp(-‖q-k‖²/2)` (on inputs scaled by `D^-1/4`).

    With l2-normalized q and k — RFA's setting, and the default here — the Gaussian kernel
    equals `exp(q·k)` times a constant, i.e. softmax attention. The factors `exp(‖x‖²/2)`
    that would turn it into `exp(q·k)` for unnormalized inputs are left out: a key's would
    overflow for large norms. TRF features can be negative, so the denominator is an
    estimate that can approach 0; without normalization (`normalize=False`) large inputs
    make every kernel value ~0 and the ratio pure noise, which is why it is not the default.
    """

    name = "trf"

    def __init__(self, head_dim: int, num_features: int = 64, *, normalize: bool = True, **kw):
        super().__init__(head_dim, num_features, normalize=normalize, **kw)

    def _out_features(self) -> int:
        return 2 * self.m

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        wx = self._project(x)
        return torch.cat([torch.sin(wx), torch.cos(wx)], dim=-1) / math.sqrt(self.m)


_SIMPLE = {"elu": EluPlusOne, "relu": ReLU, "exp": Exp, "dpfp": DPFP}
_RANDOM = {"prf": ("iid", PRF), "orf": ("orthogonal", PRF), "sphere_prf": ("sphere", PRF), "trf": ("iid", TRF)}
NAMES = ("softmax", *_SIMPLE, *_RANDOM)


def get_kernel(spec, head_dim: int | None = None, num_features: int | None = None, seed: int = 0) -> Kernel:
    """A `Kernel` from a spec: a Kernel instance (returned as is) or a name in `NAMES`;
    prefix "n" l2-normalizes q and k first ("nprf" is NPRF). Random maps need `head_dim`
    and default to 64 features."""
    if isinstance(spec, Kernel):
        return spec
    if spec is None or spec == "softmax":
        return Softmax()
    if not isinstance(spec, str):
        raise ValueError(f"kernel: expected a name or a fastrpe.kernels object, got {type(spec).__name__}")
    name, normalize = spec, False
    if name not in NAMES and name.startswith("n") and name[1:] in NAMES and name[1:] != "softmax":
        name, normalize = name[1:], True
    if name in _SIMPLE:
        return _SIMPLE[name](normalize=normalize)
    if name in _RANDOM:
        if head_dim is None:
            raise ValueError(f"kernel: {spec!r} draws random projections and needs head_dim")
        proj, cls = _RANDOM[name]
        normalize = normalize or cls is TRF  # TRF is RFA's normalized form ("trf" == "ntrf")
        return cls(head_dim, num_features or 64, projection=proj, seed=seed, normalize=normalize)
    raise ValueError(f"kernel: unknown kernel {spec!r}; known: {', '.join(NAMES)} (prefix 'n' to normalize q/k)")
