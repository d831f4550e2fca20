"""Problems (kernel × positional term × causal × shapes) and competitors.

A competitor is a function `setup(problem, device, dtype) -> callable | str` returning a
closure that runs forward(+backward) once, or a string saying why it cannot run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Problem:
    position: str = "kerple_log"  # a fastrpe.positions family name, or "none"
    kernel: str = "nprf"  # fastrpe kernel for the fastrpe competitors (softmax competitors ignore it)
    causal: bool = True
    L: int = 4096
    B: int = 1
    H: int = 8
    D: int = 64
    features: int = 32
    backward: bool = True

    def tag(self) -> str:
        return f"{self.position}-{self.kernel}-{'causal' if self.causal else 'full'}-L{self.L}"

    def to_dict(self) -> dict:
        return asdict(self)


def _inputs(p: Problem, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(p.B, p.H, p.L, p.D, generator=g).to(device=device, dtype=dtype).requires_grad_(p.backward)
               for _ in range(3))
    return q, k, v


def _position(p: Problem, device):
    if p.position == "none":
        return None
    import fastrpe as fr

    return fr.positions.make(p.position, p.H, causal=p.causal, max_len=p.L).to(device)


def _closure(fn, q, k, v, backward: bool):
    def run():
        out = fn(q, k, v)
        if backward:
            out.float().sum().backward()
        return out

    return run


def fastrpe_backend(backend: str) -> Callable:
    def setup(p: Problem, device, dtype):
        import fastrpe as fr

        q, k, v = _inputs(p, device, dtype)
        pos = _position(p, device)
        kern = fr.kernels.get_kernel(p.kernel, head_dim=p.D, num_features=p.features)
        if isinstance(kern, torch.nn.Module):
            kern = kern.to(device)
        try:
            fr.attention(q[:, :, :8].detach(), k[:, :, :8].detach(), v[:, :, :8].detach(), kernel=kern, position=pos,
                         causal=p.causal, backend=backend if backend != "auto" else "auto")
        except fr.FastRPEError as e:
            return str(e)
        return _closure(lambda q, k, v: fr.attention(q, k, v, kernel=kern, position=pos, causal=p.causal, backend=backend),
                        q, k, v, p.backward)

    return setup


def flex_same_position(p: Problem, device, dtype):
    """FlexAttention (softmax) with the same positional term as a score_mod: what a user picks today."""
    from fastrpe.ops.softmax.flex import (
        flex_available,
        kernel_options_for,
        softmax_attention_flex,
    )

    if not flex_available():
        return "FlexAttention is not in this PyTorch"
    if device.type != "cuda" and p.backward:
        return "FlexAttention has no backward on CPU"
    q, k, v = _inputs(p, device, dtype)
    pos = _position(p, device)
    mod = pos.score_mod(0) if pos is not None else None
    opts = kernel_options_for(pos)
    return _closure(lambda q, k, v: softmax_attention_flex(q, k, v, mod, causal=p.causal, kernel_options=opts),
                    q, k, v, p.backward)


def sdpa_no_rpe(p: Problem, device, dtype):
    """SDPA (FlashAttention on GPU) without any positional term: the exact-softmax speed ceiling."""
    q, k, v = _inputs(p, device, dtype)
    return _closure(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p.causal),
                    q, k, v, p.backward)


COMPETITORS: dict[str, Callable] = {
    "sdpa-no-rpe": sdpa_no_rpe,
    "flex-same-rpe": flex_same_position,
    "fastrpe-auto": fastrpe_backend("auto"),
    "fastrpe-fft": fastrpe_backend("fft"),
    "fastrpe-dense": fastrpe_backend("dense"),
}


def competitor_names() -> list[str]:
    return list(COMPETITORS)


def _sweep(lengths, **kw) -> list[Problem]:
    return [Problem(L=L, **kw) for L in lengths]


SUITES: dict[str, list[Problem]] = {
    # CPU-sized: runs in a few minutes on 2 cores
    "quick": _sweep([512, 1024, 2048], H=2, features=32, position="kerple_log", kernel="nprf"),
    # the GPU problems: KERPLE-log, causal, B=1 H=8 D=64, 32 features
    "gpu": _sweep([4096, 16384, 65536], position="kerple_log") + _sweep([4096, 16384, 65536], position="alibi")
    + _sweep([4096, 16384, 65536], position="learned", causal=False),
}
