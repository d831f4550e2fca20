"""Causal products by divide and conquer over positions, decided from shapes alone.

The positions are cut into chunks (`plan.causal_chunk`); the pairs across chunks are one
blocked product (`blocked.py`: each chunk transformed once, a lower-triangular sum per
frequency). Inside each chunk, where the Triton kernels run (`LOCAL`), `triton_tiled` takes
every chunk's own pairs densely, in tiles, the chunks as one batch; elsewhere the positions are
split in halves down to dense diagonal leaves, every pair (later half's queries, earlier
half's keys) one full FFT product with no mask. No computation for query i ever reads a key
after i (the future cannot leak into the past, even through round-off). The schedule depends
on `(Lq, Lk, q_offset, leaf, chunk)` and the route only.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from ...common import device_route, route_setting
from .blocked import _chunks, blocked_product, chunk_layout
from .plan import CAUSAL_LEAF, Shape, blocked_block, causal_chunk, fft_block_size, fft_channel_block
from .product import scaled_product
from .segments import recomputed, segment_sums


def _tree(Lq: int, Lk: int, q_offset: int, leaf: int, chunk: int | None = None):
    """`causal_segments` with each cross segment's half size h (its offsets lie in `[-(2h-1), -1]`);
    with `chunk` (a power of two), only the pairs inside each chunk of that many positions."""

    def solve(lo: int, hi: int):
        qa, qb = max(0, lo - q_offset), min(Lq, hi - q_offset)  # queries with positions in [lo, hi)
        ka, kb = max(0, lo), min(Lk, hi)
        if qa >= qb or ka >= kb:
            return
        if hi - lo <= leaf:
            yield "leaf", qa, qb, ka, kb, 0
            return
        mid = (lo + hi) // 2
        yield from solve(lo, mid)
        yield from solve(mid, hi)
        qa2, qb2 = max(0, mid - q_offset), min(Lq, hi - q_offset)
        ka2, kb2 = max(0, lo), min(Lk, mid)
        if qa2 < qb2 and ka2 < kb2:
            yield "cross", qa2, qb2, ka2, kb2, mid - lo

    end = q_offset + Lq  # keys after the last query are never needed
    if chunk is None:
        yield from solve(0, max(1, 1 << max(0, (end - 1).bit_length())))
    else:
        for c in range(q_offset // chunk, -(-end // chunk)):
            yield from solve(c * chunk, (c + 1) * chunk)


def causal_segments(Lq: int, Lk: int, q_offset: int, leaf: int = CAUSAL_LEAF):
    """Divide and conquer over positions for a causal product: yields
    `(kind, qa, qb, ka, kb)` — query indices `qa..qb-1` against key indices `ka..kb-1` —
    with kind "leaf" (a diagonal block: mask `j > i` inside) or "cross" (every key
    strictly earlier than every query: a full product). Together they cover each causal
    pair exactly once, and no segment pairs a query with a later key. O(log L) levels.
    """
    for kind, qa, qb, ka, kb, _ in _tree(Lq, Lk, q_offset, leaf):
        yield kind, qa, qb, ka, kb


def _leaf_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lcs: Tensor, scale: Tensor) -> Tensor:
    """A diagonal leaf of the causal recursion, dense: `[B, H, n, C]` in the rows' own units
    (`lcs: [H, n+k-1]` is masked: `-inf` for keys after a query; `scale: [H, n]` is each
    row's largest log-coefficient, so no weight exceeds 1 and none underflows because of
    another row's scale)."""
    k = phi_k.shape[2]
    w = torch.exp(lcs.unfold(-1, k, 1).flip(-2) - scale[..., None])  # (H, n, k): row i's offsets start at n-1-i
    a = torch.einsum("bhif,bhjf->bhij", phi_q, phi_k) * w  # (B, H, n, k)
    return a @ vv


#: whether each FFT product of the recursion sizes its feature blocks from its own segment
#: ("always"), every product from the whole call's shapes ("never"), or per segment on CUDA
#: only ("cuda", the default). Blocks for the whole length are one feature at a time from
#: about 16k tokens on (B·H = 8, the 512 MiB budget), and the deepest levels' small products
#: then launch thousands of ops that each do microseconds of work: at 65,536 tokens, B·H = 8,
#: F = 32, Dv = 64, one call (forward + backward) launched 171,529 ops, 21,241 with blocks per
#: segment (benchmarks/table_paths.py --segment-blocks, results/table_paths-segment-*.json).
#: On the CPU the whole length's narrower blocks are faster (the same JSON's cpu_seconds)
SEGMENT_BLOCKS = "cuda"


#: where the pairs across chunks go through one blocked product (`blocked.py`): "cuda" (the
#: default), "always" or "never" (the halving recursion over the whole length, the path
#: before). It moves fewer bytes, in far fewer ops (B = 1, H = 2, F = 32, Dv = 64, causal,
#: forward + backward, 32,768 tokens in 16 chunks: 92.3 against 127.4 GiB, 2,500 ops against
#: 20,245), but on the CPU the recursion is the faster: the blocked product's transposes to
#: and from frequency-major order and its small batched complex matmuls cost more there than
#: the FFT levels they replace (26.8 s against 18.6; benchmarks/fft_causal_ab.py,
#: results/fft_causal_ab-32k-h2.json). A GPU has not timed it yet. Where it may run,
#: `plan.causal_chunk` still weighs it against the recursion, its lag matrices' traffic
#: included: with many heads, long sequences and a small budget it takes the recursion (B·H = 8
#: with the CPU's 512 MiB from 262,144 tokens; with an H200's 4 GiB from 1,048,576)
BLOCKED = "cuda"


#: where a causal call's pairs inside each chunk (those the blocked product leaves) run in
#: `triton_tiled`'s kernels, one batch of chunks, instead of the halving recursion inside each
#: chunk down to dense leaves: "cuda" (the default), "always" (wherever the kernels run: the
#: interpreter, for the tests) or "never". The recursion costs `log2(chunk/leaf)` full-length FFT
#: levels and dense `[leaf, leaf]` weights in torch ops; the tiled kernels read the chunk's rows
#: once per tile of queries and hold no `[T, T]` tensor, at O(L·T) products. Counted on shapes
#: at the GPU bench's causal table call (B = 1, H = 8, F = 32, Dv = 64, frozen table, an H200's
#: budget, forward + backward; `benchmarks/fft_blocked_traffic.py --at-scale`,
#: results/fft_local_at_scale-tiled.json against -before.json) the call moves 22% fewer bytes at
#: 64k and 39% at 262k, 27-31% and 41-44% with the lag kernels, 51-55% at 1M (see
#: `plan.LOCAL_PAIR_BYTES` for how the chunk is chosen with it). A GPU has not timed it yet: the
#: bench's `fastrpe-fft+chunk-recursion` row
#: times the path before. Calls whose queries pass the keys (`q_offset + Lq > Lk`: their last
#: chunk's padding would enter a row's largest coefficient) keep the recursion.
LOCAL = "cuda"


#: how the tiled kernels multiply the chunks' float32 features (`LOCAL`) for a 16-bit call:
#: bf16x3, 16 significant bits, the Triton backends' default for such calls
#: (`backends_triton.FLOAT32_PRODUCTS`), far below the output's 8; other calls "ieee" (exact)
LOCAL_PRODUCTS = "bf16x3"


def local_products(dtype: torch.dtype) -> str:
    """`LOCAL_PRODUCTS` for a call whose inputs are `dtype` if 16-bit, else "ieee"."""
    return LOCAL_PRODUCTS if dtype in (torch.bfloat16, torch.float16) else "ieee"


def use_local(route: str):
    """`LOCAL = route` ("cuda", "always" or "never") inside the block, restored after it."""
    return route_setting(sys.modules[__name__], "LOCAL", route)


def local_on(device: torch.device, Lq: int, Lk: int, q_offset: int, table_grad: bool = False) -> bool:
    """Whether `causal_product` takes each chunk's own pairs by `triton_tiled` on `device`
    (`LOCAL`, where the kernels can run and every query's position is a key's; not for a table
    that takes a gradient under `torch.use_deterministic_algorithms`: the kernels add it
    atomically, as `triton_blocked`'s correlations, which refuse it too)."""
    if not device_route(LOCAL, "fastrpe.ops.linear.fft.causal.LOCAL", device) or q_offset + Lq > Lk:
        return False
    if table_grad and torch.are_deterministic_algorithms_enabled():
        return False
    from ..triton_chunked import triton_unavailable_reason

    return triton_unavailable_reason(device) is None


def chunk_on(device: torch.device, Lq: int, q_offset: int, leaf: int, shape: Shape, local: bool = False
             ) -> int | None:
    """The chunk length `causal_product` cuts the positions into on `device` (`BLOCKED`, then
    `plan.causal_chunk`'s cost, with the blocked product's kernels where they take the call, and
    the chunks' own pairs tiled with `local`, `local_on`), or None: the recursion over the whole
    length. `auto`'s cost of the path reads it too (`plan.causal_levels`, `kernels_on`)."""
    blocked = device_route(BLOCKED, "fastrpe.ops.linear.fft.causal.BLOCKED", device)
    return causal_chunk(Lq, q_offset, leaf, shape, kernels_on(device, shape), local) if blocked else None


def kernels_on(device: torch.device, shape: Shape) -> bool:
    """Whether the blocked product's sums over chunks run in its Triton kernels on `device` for
    `shape` (`blocked.kernels_take`: `blocked.KERNEL`), whose dtype may be the inputs' (the FFTs
    run in `fft_dtype_for` of it: float32 for 16-bit inputs)."""
    from ...toeplitz.fft import fft_dtype_for
    from .blocked import kernels_take

    return kernels_take(device, fft_dtype_for(shape.dtype), shape.B, shape.H)


def causal_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int,
                   memory_budget_bytes: int | None = None, leaf: int = CAUSAL_LEAF, products: str = "ieee"
                   ) -> tuple[Tensor, Tensor]:
    """Causal product `[B, H, Lq, C]` (rows in units of `exp(scale)`) and its estimated
    round-off per entry (`scaled_product`): the pairs across chunks by one blocked product
    (`BLOCKED`), those inside each chunk by the tiled kernels (`LOCAL`, `local_product`, their
    float32 products multiplied as `products` says: `triton_chunked.PRECISIONS`) or over the
    recursion's segments, diagonal leaves dense, the rest FFT products each rescaled by its own
    largest coefficient. `lc` is already masked (`-inf` for `r > 0`). Every segment is
    computed: the schedule is static. Each product's feature blocks fit the memory budget,
    sized from its own segment or from the whole call (`SEGMENT_BLOCKS`)."""
    B, H, Lq, F = phi_q.shape
    Lk, C = phi_k.shape[2], vv.shape[-1]
    local = local_on(phi_q.device, Lq, Lk, q_offset, lc.requires_grad and torch.is_grad_enabled())
    chunk = chunk_on(phi_q.device, Lq, q_offset, leaf, Shape(B, H, F, C - 1, phi_q.dtype, memory_budget_bytes),
                     local)
    # each part is added in place as it comes (index_add_: its backward passes the gradient
    # through and gathers the part's rows, no full-size copy): holding every part for one
    # scatter at the end kept one [B, H, Lq, C] tensor per level of the recursion, and as
    # many round-off estimates (46 GB at L = 1M, B·H = 8, Dv = 64); adding each into a
    # fresh copy (out of place) allocated O(L) per segment, O(L²/leaf) in all
    _, nb, na = (0, 0, 0) if chunk is None else chunk_layout(Lq, Lk, q_offset, chunk)
    if na:  # the pairs across chunks first, the chunks' own pairs added to them
        block = blocked_block(B, H, nb, na, chunk, F, C - 1, phi_q.dtype, memory_budget_bytes)
        y, err = blocked_product(phi_q, phi_k, vv, lc, scale, q_offset, chunk, block)
    else:
        y = phi_q.new_zeros(B, H, Lq, C)
        err = phi_q.new_zeros(B, H, Lq, C)  # dense leaves add no FFT round-off
    if local and chunk is not None:  # each chunk's own pairs tiled, added in its rows' units
        # (into y in place: the blocked product's rescaled sum or fresh zeros, which no backward reads)
        return local_product(phi_q, phi_k, vv, lc, scale, q_offset, chunk, products, into=y), err
    per_segment = device_route(SEGMENT_BLOCKS, "fastrpe.ops.linear.fft.causal.SEGMENT_BLOCKS", phi_q.device)

    def block_of(qa: int, qb: int, ka: int, kb: int) -> tuple[int, int]:
        nq, nk = (qb - qa, kb - ka) if per_segment else (Lq, Lk)
        return (fft_block_size(B, H, nq, nk, F, C - 1, phi_q.dtype, memory_budget_bytes),
                fft_channel_block(B, H, nq, nk, C - 1, phi_q.dtype, memory_budget_bytes))

    segments = [(kind, qa, qb, ka, kb, block_of(qa, qb, ka, kb) if kind == "cross" else None)
                for kind, qa, qb, ka, kb, _ in _tree(Lq, Lk, q_offset, leaf, chunk)]
    return segment_sums(_segment, segments, y, err, (phi_q, phi_k, vv, lc, scale))


def _chunk_rows(x: Tensor, start: int, n: int, T: int, pos0: int) -> Tensor:
    """`x: [B, H, L, k]` whose rows sit at positions `pos0..pos0+L-1` -> `[B·n, H, T, k]`: chunks
    `start..start+n-1` of T positions as a batch (zeros where x has no row; `blocked._chunks`)."""
    B, H, _, k = x.shape
    return _chunks(x, start, n, T, pos0).transpose(-1, -2).transpose(1, 2).reshape(B * n, H, T, k)


def local_product(phi_q: Tensor, phi_k: Tensor, vv: Tensor, lc: Tensor, scale: Tensor, q_offset: int, T: int,
                  products: str = "ieee", into: Tensor | None = None) -> Tensor:
    """`[B, H, Lq, C]` in the rows' units `exp(scale)`: each query's pairs with the keys of its
    own chunk of T positions (key position <= query position), by `triton_tiled` over the chunks
    as one batch. Every chunk has the same offsets `-(T-1)..0`, so one `[H, 2T-1]` slice of the
    table serves all; each row comes back in units of its largest coefficient inside the chunk,
    `m_i <= scale_i`, and is brought to `scale_i` (the clamp at 0 only guards the two maxima's
    round-off). Needs `q_offset + Lq <= Lk` (`local_on`): a key past the last one would be
    padding that still counts in `m_i`. Dense: no FFT round-off; a row whose in-chunk maximum
    lies more than about 87 nats below its own loses the chunk's pairs to float32 underflow, as
    the recursion's dense leaves' `exp(b - scale)` did. `into`: a `[B, H, Lq, C]` tensor in the
    same units, which the pairs are added to in place and which is returned."""
    from ..triton_tiled import kernelized_num_den_triton_tiled

    B, H, Lq, F = phi_q.shape
    C = vv.shape[-1]
    b0 = q_offset // T
    n = -(-(q_offset + Lq) // T) - b0
    lo = b0 * T
    q = _chunk_rows(phi_q, b0, n, T, q_offset)
    k = _chunk_rows(phi_k, b0, n, T, 0)
    v = _chunk_rows(vv[..., :C - 1], b0, n, T, 0)
    # offset d (query position minus key's) of row i sits at lc[:, Lq-1+q_offset-d]; the tiled
    # op's own table for T queries and T keys holds offsets j - i = -(T-1)..T-1 at index T-1+j-i
    c0 = Lq - 1 + q_offset
    pad = torch.nn.functional.pad(lc, (T, T), value=float("-inf"))  # (never read past: d >= 0 here)
    lct = pad[:, c0 + 1: c0 + 2 * T]  # (H, 2T-1): j - i = -(T-1)..T-1
    num, den, m = kernelized_num_den_triton_tiled(q, k, v, lct, causal=True, precision=products)
    y = torch.cat([num, den[..., None]], dim=-1)  # (B·n, H, T, C)
    first = q_offset - lo
    y = y.view(B, n, H, T, C).transpose(1, 2).reshape(B, H, n * T, C)[:, :, first: first + Lq]
    with torch.no_grad():
        rows = m.repeat(1, n)[:, first: first + Lq]  # (H, Lq): row i's in-chunk maximum
        factor = torch.exp((rows - scale).clamp_max(0.0))
    factor = factor[None, :, :, None]
    # added into `into` scaled, in one op (at a million tokens each full-size temporary is 2.2 GB)
    return y * factor if into is None else into.addcmul_(y, factor)


def _segment(seg: tuple, args: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """`(part, part_err)` of one segment: a diagonal leaf dense (no round-off: err None), a
    cross segment one FFT product."""
    if seg[0] == "leaf":
        # recomputed in backward: autograd would otherwise keep every leaf's [leaf, leaf]
        # weights until then (O(L·leaf) bytes: 3.3 GiB at 64k with 2048-position leaves)
        return recomputed(_leaf_product, *args), None
    return scaled_product(*args, seg[5])
