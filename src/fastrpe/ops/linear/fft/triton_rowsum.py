"""The FFT path's row contractions in one Triton kernel: `out += (a * b).sum(dim)`.

After each inverse transform the FFT products (`product._FFTNumDen`, `blocked._BlockedNumDen`,
Luo et al. 2021, Eq. 10-13) contract a block's features or channels position by position:
`y[i, c] += Σ_f t[f, c, i]·φq[i, f]` forward, and the gradients' three of the same form. `a`
is the big operand (the inverse transform's slice, `[..., f, c, positions]`, positions with
unit stride), `b` a factor broadcast along the kept axis, `out` a strided slice of an output
(a transposed view where the output is position-major). Torch runs `(a * b).sum(dim)` as a
full-size product written to memory and read back by the sum (or `linalg.vecdot`'s mul and
sum), then `+=` reads and writes `out`: three times the bytes of reading `a` once. The kernel
reads `a` once, `b` once per tile of the kept axis, and reads and writes `out` once:

    out[g, k, p] += Σ_r a[g, r, k, p]·b[g, r, p]

with every tensor addressed by its own strides (`a`'s r and k axes in either order, `b`
without a k axis or with a stride-0 one, `out` without an r axis), the sums in float32
(float64 for float64 inputs). A program holds a tile of BK kept rows by BP positions of one
g and loops over r.

`add_row_sum(out, a, b, dim)` is `out += (a * b).sum(dim)` for the call sites' shapes: the
leading dims merged into g (they must merge by strides), `dim` r, the other of the last three
k, the last p. It takes the kernel where `ROW_SUMS` routes the device (`ops.common.device_route`)
and the call fits (float32 or float64, one dtype and device, no autograd graph to record, not
under `torch.compile`, whose Inductor fuses the torch expression itself), else the torch
expression (`row_sum`). Nothing is read on the host. A launch is no aten op, so
`benchmarks/byte_count.ByteCounter` cannot see it: `count_traffic` tallies each launch's bytes
from shapes (and, with `simulate`, launches nothing: `FakeTensorMode`,
`benchmarks/fft_at_scale.py`).

Notation: G merged leading rows (batch, heads, chunks), R contracted features or channels, K
kept ones, P positions; BK, BP power-of-two tiles.
"""
from __future__ import annotations

import math
import sys

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ...common import device_route, route_setting

#: where `add_row_sum` takes the kernel: "cuda" (CUDA devices), "always" (wherever the kernel
#: runs: the interpreter too, for the tests) or "never" (the torch expression everywhere).
#: Counted on shapes at the GPU bench's problem (B = 1, H = 8, F = 32, Dv = 64, bf16, a frozen
#: table, the H200's budget, forward + backward; benchmarks/fft_blocked_traffic.py --at-scale,
#: fft_at_scale.py), the causal call with the blocked product's kernels moved 312.8 GiB at
#: 65,536 tokens and 1,331.0 at 262,144 with the torch expression, 281.0 and 1,199.1 with the
#: kernel (its own 39.7 and 165.9); the not-causal call 336.0 and 303.2 at 65,536
#: (results/fft_local_at_scale*.json, fft_at_scale*.json). Not timed on a GPU yet.
ROW_SUMS = "cuda"

# triton is imported where a call is routed to the kernel, not with this module (the FFT path
# imports it, and a CPU call, or a process without triton, never needs it): `kernel()` jits
# the function below then, with `triton` and `tl` bound in this module's globals
triton = tl = None


def _row_sum_kernel(a_ptr, b_ptr, out_ptr, R, K, P, NKT, NPT, sag, sar, sak, sap, sbg, sbr, sbk, sbp,
                    sog, sok, sop, LB, B_K: tl.constexpr, ACC: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """One tile (g, BK kept rows, BP positions): `out += Σ_r a[g, r]·b[g, r]` (B_K: b has a k
    axis of its own, else one row broadcast along k). LB: the autotuner's length bucket, not
    read. (The Triton source `kernel()` compiles.)"""
    pid = tl.program_id(0)
    pt = pid % NPT
    rest = pid // NPT
    kt = rest % NKT
    g = (rest // NKT).to(tl.int64)
    k = kt * BK + tl.arange(0, BK)
    p = pt * BP + tl.arange(0, BP)
    mk, mp = k < K, p < P
    m = mk[:, None] & mp[None, :]
    k64, p64 = k.to(tl.int64), p.to(tl.int64)
    ap = a_ptr + g * sag + k64[:, None] * sak + p64[None, :] * sap  # (BK, BP)
    if B_K:
        bp = b_ptr + g * sbg + k64[:, None] * sbk + p64[None, :] * sbp
    else:
        bp = b_ptr + g * sbg + p64 * sbp  # (BP,): one row for every k
    acc = tl.zeros((BK, BP), dtype=ACC)
    for _ in range(0, R):
        x = tl.load(ap, mask=m, other=0.0).to(ACC)
        if B_K:
            y = tl.load(bp, mask=m, other=0.0).to(ACC)
            acc += x * y
        else:
            y = tl.load(bp, mask=mp, other=0.0).to(ACC)
            acc += x * y[None, :]
        ap += sar
        bp += sbr
    op = out_ptr + g * sog + k64[:, None] * sok + p64[None, :] * sop
    cur = tl.load(op, mask=m, other=0.0)
    tl.store(op, (cur.to(ACC) + acc).to(cur.dtype), mask=m)


_KERNEL: list = []


def kernel():
    """`_row_sum_kernel` jitted (autotuned on the GPU: `triton_chunked._tuned`), once; None
    without triton. Sizes and strides are not specialized (Triton would compile again for each
    pattern of which of them are 1 or multiples of 16, and they follow the length): one
    compilation a layout serves every length. The positions' strides are: 1 (the inverse
    transforms' slices, the chunked outputs) or a feature or channel count (a position-major
    output or factor), the same at every length, and unit strides are what lets loads along p
    coalesce."""
    global triton, tl
    if not _KERNEL:
        from ..triton_chunked import HAS_TRITON, _tuned

        if not HAS_TRITON:
            return None
        import triton as triton_
        import triton.language as tl_

        triton, tl = triton_, tl_
        jitted = triton.jit(do_not_specialize=["R", "K", "P", "NKT", "NPT", "sag", "sar", "sak", "sbg", "sbr", "sbk",
                                               "sog", "sok", "LB"])(_row_sum_kernel)
        # (the kernel adds into out: the autotuner's timed runs put it back after each)
        _KERNEL.append(_tuned(jitted, ["R", "K", "LB", "B_K", "BK", "BP"], restore=["out_ptr"]))
    return _KERNEL[0]


#: the largest 1-D grid
_MAX_PROGRAMS = 2 ** 31 - 1


def _pow2(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, int(n) - 1).bit_length())


def row_sum_tiles(K: int, P: int) -> tuple[int, int]:
    """`(BK, BP)`: up to 8 kept rows by 2,048 / BK positions, 2,048 sums a program (16 float32
    accumulators a thread of 4 warps, and as many loaded values an iteration): a channel
    block's 65 kept channels in 9 tiles of 8 (72 rows, 7 masked), one kept feature in rows of
    2,048 positions. Not timed on a GPU yet."""
    BK = _pow2(K, 8)
    return BK, _pow2(P, 2048 // BK)


# ---- the torch expression ---------------------------------------------------------------------------

def row_sum(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """`(a * b).sum(dim)` in torch: a contraction that keeps the rows (each query or key position
    contracts a block's few features or channels on its own). Written as a broadcast product,
    not an einsum: the einsum became a batched matrix-vector product with a batch per row,
    which cuBLAS ran as gemv, 2,568 launches and 166 of the 555 ms of GPU time of one
    non-causal learned-table call at 65,536 tokens (forward + backward, blocks of 1 feature by
    15 channels; H100, 2026-11-27, benchmarks/results/gpu/h100-2026-11-27c-profile.json)."""
    if a.shape[dim] == 1 and b.shape[dim] == 1:  # one feature a block (long sequences): no sum to take
        return (a * b).squeeze(dim)
    if a.dtype != b.dtype:  # (vecdot does not promote)
        return (a * b).sum(dim)
    return torch.linalg.vecdot(a, b, dim=dim)  # (a mul and a sum: no BLAS call)


# ---- counting: a Triton launch is no aten op, so `ByteCounter` cannot see it ----------------------

_COUNTERS: list = []  # of `triton_blocked.Traffic`
#: with `count_traffic(simulate=True)`: no launch (for `FakeTensorMode`)
_SIMULATE = [False]


def count_traffic(simulate: bool = False):
    """`with count_traffic() as t:` every launch here adds its bytes to `t`
    (`triton_blocked.Traffic`): `lower` each operand once (`a` and `b` read, `out` read and
    written: `ByteCounter`'s convention), `upper` with `b` read once per tile of kept rows.
    `simulate`: launch nothing (shapes for `FakeTensorMode`: the device check is skipped, as on
    the GPU being counted; `out` is left as it is)."""
    from .triton_blocked import counting

    return counting(_COUNTERS, _SIMULATE, simulate)


def traffic(a: Tensor, b: Tensor, out: Tensor, n_k_tiles: int) -> tuple[int, int]:
    """`(lower, upper)` bytes of one launch (`count_traffic`)."""
    e = a.element_size()
    a_b, b_b, o_b = a.numel() * e, b.numel() * e, out.numel() * e
    return a_b + b_b + 2 * o_b, a_b + n_k_tiles * b_b + 2 * o_b


# ---- the route ------------------------------------------------------------------------------------

def _routed(device: torch.device, route: str | None = None) -> bool:
    """Whether `route` (default `ROW_SUMS`) sends a call on `device` to the kernel
    (`device_route`, which says what a bad value is)."""
    return device_route(ROW_SUMS if route is None else route, "fastrpe.ops.linear.fft.triton_rowsum.ROW_SUMS", device)


def use_row_sums(route: str):
    """`ROW_SUMS = route` ("cuda", "always" or "never") inside the block, restored after it."""
    return route_setting(sys.modules[__name__], "ROW_SUMS", route)


def _merged_stride(sizes, strides) -> int | None:
    """The one stride of `sizes` (row-major) merged into one axis, or None where they do not
    merge (sizes of 1 merge with anything; 0 for no axis of more than one)."""
    stride = step = None
    for n, s in zip(reversed(sizes), reversed(strides)):
        if n == 1:
            continue
        if stride is None:
            stride = s
        elif s != step:
            return None
        step = s * n
    return 0 if stride is None else stride


def layout(out: Tensor, a: Tensor, b: Tensor, dim: int):
    """`(G, R, K, P, a's, b's and out's strides (g, r, k, p; out's without r), b has a k axis)`
    of `out += (a * b).sum(dim)` in the kernel's terms, or None where the call does not fit:
    a and b of one rank (at least 3) broadcasting to a shape whose sum over `dim` is out's,
    `dim` one of the two before the last, and the dims before those mergeable into one axis in
    each tensor; out with no axis of stride 0 (it is written)."""
    n = a.ndim
    if n < 3 or b.ndim != n or out.ndim != n - 1:
        return None
    d = dim % n
    if d not in (n - 3, n - 2):
        return None
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return None
    kd = (n - 2) if d == n - 3 else (n - 3)
    kept = shape[:d] + shape[d + 1:]
    if tuple(out.shape) != tuple(kept):
        return None
    if any(s == 0 and k > 1 for s, k in zip(out.stride(), out.shape)):
        return None
    lead = shape[:n - 3]

    def strides(t: Tensor) -> list[int]:  # of t broadcast to `shape`: 0 along the broadcast dims
        return [0 if (k == 1 and s > 1) else st for k, s, st in zip(t.shape, shape, t.stride())]

    sa, sb = strides(a), strides(b)
    so = list(out.stride())
    so = so[:d] + [0] + so[d:]  # (out's strides at a's dims, 0 at the summed one)
    merged = [_merged_stride(lead, s[:n - 3]) for s in (sa, sb, so)]
    if any(m is None for m in merged):
        return None
    G = math.prod(lead)
    R, K, P = shape[d], shape[kd], shape[-1]
    a_s = (merged[0], sa[d], sa[kd], sa[-1])
    b_s = (merged[1], sb[d], sb[kd], sb[-1])
    o_s = (merged[2], so[kd], so[-1])
    b_k = b_s[2] != 0 and K > 1
    return G, R, K, P, a_s, b_s, o_s, b_k


def declined(out: Tensor, a: Tensor, b: Tensor) -> list[str]:
    """Why the kernel cannot take the call, from its tensors' kinds alone (empty: it can; the
    shapes are `layout`'s)."""
    from ..triton_chunked import HAS_TRITON, triton_unavailable_reason

    if not HAS_TRITON:
        return ["needs triton (pip install 'fastrpe[triton]')"]
    why = []
    if not (a.dtype == b.dtype == out.dtype and a.dtype in (torch.float32, torch.float64)):
        why.append(f"one float32 or float64 dtype, got {a.dtype}, {b.dtype} and out {out.dtype}")
    if not (a.device == b.device == out.device):
        why.append(f"one device, got {a.device}, {b.device} and out {out.device}")
    if torch.compiler.is_compiling():
        why.append("torch.compile: Inductor fuses the torch expression itself")
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        why.append("a graph to record (the kernel has no backward)")
    if not _SIMULATE[0]:
        dev = triton_unavailable_reason(out.device)
        if dev is not None:
            why.append(dev)
        if is_fake(out) or is_fake(a) or is_fake(b):
            why.append("fake tensors (shapes only): nothing to launch on (count_traffic(simulate=True) counts)")
    return why


def add_row_sum(out: Tensor, a: Tensor, b: Tensor, dim: int) -> Tensor:
    """`out += (a * b).sum(dim)`, in place, and `out`: by the kernel where `ROW_SUMS` routes
    out's device and the call fits (`declined`, `layout`), else by the torch expression
    (`row_sum`). `out` may be any view (a slice, a transposed slice) of the tensor it adds to,
    sharing no memory with `a` or `b` (the kernel reads them while it writes out; the call
    sites' outputs are fresh gradients and sums). The bytes it saves: `ROW_SUMS`."""
    if torch.compiler.is_compiling() or not _routed(out.device) or declined(out, a, b):
        return out.add_(row_sum(a, b, dim))
    lay = layout(out, a, b, dim)
    if lay is None:
        return out.add_(row_sum(a, b, dim))
    G, R, K, P, a_s, b_s, o_s, b_k = lay
    BK, BP = row_sum_tiles(K, P)
    n_kt, n_pt = -(-K // BK), -(-P // BP)
    if G * n_kt * n_pt > _MAX_PROGRAMS:
        return out.add_(row_sum(a, b, dim))
    if G * n_kt * n_pt == 0:
        return out
    if _COUNTERS:
        lo, hi = traffic(a, b, out, n_kt)
        for t in _COUNTERS:
            t.add(lo, hi)
    if _SIMULATE[0]:
        return out
    from ..triton_chunked import launch_device, length_bucket

    run = kernel()  # (binds `tl`)
    acc = tl.float64 if a.dtype == torch.float64 else tl.float32
    with launch_device(out):
        run[(G * n_kt * n_pt,)](a, b, out, R, K, P, n_kt, n_pt, *a_s, *b_s, *o_s, length_bucket(G * P),
                                B_K=b_k, ACC=acc, BK=BK, BP=BP)
    return out
