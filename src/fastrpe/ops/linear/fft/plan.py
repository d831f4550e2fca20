"""Memory and work planning for the FFT path, from shapes alone.

Everything here is a host-side function of the problem's shapes, dtype and memory budget:
the schedule it fixes (feature block, causal leaf and chunk, how many rows may be recomputed
exactly) never depends on tensor values, so the op has no data-dependent control flow and
no host synchronization (it can be captured by CUDA graphs and `torch.compile`).

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, C = Dv + 1
channels per feature, N FFT length >= Lq + Lk - 1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ...toeplitz.fft import fft_length

#: bound on one block's temporaries when the caller gives none, on the CPU (`device_budget`)
DEFAULT_BUDGET = 512 << 20
#: on a GPU the default budget is this share of its memory, from DEFAULT_BUDGET up to
#: MAX_DEVICE_BUDGET (an 80 GB H100: 2.3 GiB; an H200: 4 GiB). With B·H = 8 a block of 512 MiB
#: holds 10 channels of the causal path's blocked product at 65,536 tokens, whose lag
#: matrices every block reads: at 4 GiB the GPU bench's causal table (forward + backward) moves
#: 635 GiB in 2,599 aten ops instead of 740 in 11,602 (byte count on CPU,
#: `benchmarks/table_paths.py --budget-mib`, results/table_paths-learned-64k-h8*.json)
DEVICE_BUDGET_SHARE = 1 / 32
MAX_DEVICE_BUDGET = 4 << 30
_DEVICE_BUDGETS: dict[int, int] = {}


def device_budget(device: torch.device) -> int:
    """The memory budget of a call on `device` whose caller gives none: DEFAULT_BUDGET but on
    CUDA, `DEVICE_BUDGET_SHARE` of the card's memory within `[DEFAULT_BUDGET,
    MAX_DEVICE_BUDGET]` (read once per device: a property, no synchronization). A trace by
    `torch.compile` reads no device property: a device no eager call has met yet takes
    DEFAULT_BUDGET there (the same results, in smaller blocks)."""
    if device.type != "cuda":
        return DEFAULT_BUDGET
    if torch.compiler.is_compiling():
        return _DEVICE_BUDGETS.get(device.index, DEFAULT_BUDGET)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _DEVICE_BUDGETS:
        _DEVICE_BUDGETS[index] = budget_for_memory(torch.cuda.get_device_properties(index).total_memory)
    return _DEVICE_BUDGETS[index]


def budget_for_memory(total_memory: int) -> int:
    """A GPU's default budget from its memory: `DEVICE_BUDGET_SHARE` of it, within
    `[DEFAULT_BUDGET, MAX_DEVICE_BUDGET]`."""
    return int(min(MAX_DEVICE_BUDGET, max(DEFAULT_BUDGET, total_memory * DEVICE_BUDGET_SHARE)))

#: blocks of at most this many positions are done densely by the causal recursion (the
#: smallest leaf; `causal_leaf` picks a larger one when the memory budget allows)
CAUSAL_LEAF = 128
#: the largest leaf: measured on CPU (KERPLE-log, H = 2, F = 32, fwd + bwd) each doubling
#: from 128 to 2048 saves time — 16.9 s -> 9.0 s at L = 16k — since a dense leaf costs
#: O(leaf) per position and every FFT level a full-length product of F·(Dv+1) channels
CAUSAL_LEAF_MAX = 2048

#: rows that may be recomputed exactly per (batch, head): at least this many, and one in
#: RECOMPUTE_FRACTION of the rows, but (beyond the minimum) no more than keep their cost within
#: RECOMPUTE_SHARE of the FFT product's own (see `certify.py`). The schedule is static, so
#: every call pays for the whole capacity, failing rows or not: one row in 128 alone costs
#: 1/128 of dense attention, O(L²), which at L = 262,144 (F = 32, Dv = 64, forward + backward,
#: per head) was 26 % of the non-causal path's memory traffic (248.1 GiB -> 184.6 with the
#: cap, counted once; benchmarks/fft_recompute.py) and at 1M would be more than half
RECOMPUTE_MIN_ROWS = 64
RECOMPUTE_FRACTION = 128
RECOMPUTE_SHARE = 1 / 8
#: bytes moved per (recomputed row, key), forward + backward (the checkpointed dense rows of
#: `certify._exact_rows`), and per (position, feature channel) by the FFT path, non-causal,
#: forward + backward (`product.py`, band and certificates included); counted on CPU with
#: benchmarks/byte_count.py's ByteCounter at L = 65,536, H = 1, F = 32, Dv = 64, float32
#: FFTs (benchmarks/fft_recompute.py, results/fft_recompute.json: 142.6 and 314.0; 143.1 and
#: 340.0 with the counter before 2026-11-28's seventh CPU session, which counted an
#: allocation's bytes and some targets twice)
DENSE_ROW_BYTES_PER_KEY = 143
FFT_BYTES_PER_CHANNEL = 314


def element_size(dtype) -> int:
    """Bytes per real entry of the FFT dtype."""
    return 8 if dtype == torch.float64 else 4


def budget_or_default(memory_budget_bytes: int | None) -> int:
    return DEFAULT_BUDGET if memory_budget_bytes is None else memory_budget_bytes


def _bytes_per_feature(B: int, H: int, Lq: int, Lk: int, Dv: int, el: int) -> int:
    """Extra bytes one feature's channels need during a block (fwd or bwd, the larger)."""
    N = fft_length(Lq + Lk - 1)
    C = Dv + 1
    # x, its spectrum (complex: 2 el), the product, the inverse (N real), the kept rows; x2 in backward
    return B * H * C * el * (Lk + 2 * (N // 2 + 1) * 2 + N + Lq) * 2


def fft_block_size(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, dtype=torch.float32,
                   memory_budget_bytes: int | None = None) -> int:
    """Features per block so that one block's temporaries fit the budget (at least 1)."""
    budget = budget_or_default(memory_budget_bytes)
    per = max(1, _bytes_per_feature(B, H, Lq, Lk, Dv, element_size(dtype)))
    return int(max(1, min(F, budget // per)))


def fft_channel_block(B: int, H: int, Lq: int, Lk: int, Dv: int, dtype=torch.float32,
                      memory_budget_bytes: int | None = None) -> int:
    """Channels of one feature per block: all `Dv + 1` when a whole feature fits the budget,
    else as many as fit (at least 1). One feature's channels at L = 1M with B·H = 8 and
    Dv = 64 need ~35 GB of temporaries, over an 80 GB GPU's room with everything else."""
    C = Dv + 1
    budget = budget_or_default(memory_budget_bytes)
    per_channel = max(1, _bytes_per_feature(B, H, Lq, Lk, Dv, element_size(dtype)) // C)
    return int(max(1, min(C, budget // per_channel)))


def rows_outside_keys(Lq: int, Lk: int, q_offset: int) -> int:
    """Queries whose own position `q_offset + i` is not a key position: they do not see
    offset 0, their largest coefficient drifts with their distance from the keys (a
    decaying term), and one product rescaled for the whole head can lose their digits."""
    inside = max(0, min(Lq, Lk - q_offset) - max(0, -q_offset))
    return Lq - inside


def recompute_share_rows(Lq: int, Lk: int, F: int, Dv: int) -> int:
    """The most rows whose exact recomputation moves at most RECOMPUTE_SHARE of the bytes the
    FFT product moves (`F·(Dv+1)` channels over `N/2` positions each way, against `Lk` keys
    per row): about `0.3·F·(Dv+1)` rows for self-attention, whatever the length."""
    N = fft_length(Lq + Lk - 1)
    fft_bytes = FFT_BYTES_PER_CHANNEL * F * (Dv + 1) * N / 2
    return int(RECOMPUTE_SHARE * fft_bytes / (DENSE_ROW_BYTES_PER_KEY * max(1, Lk)))


def recompute_capacity(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, dtype=torch.float32,
                       memory_budget_bytes: int | None = None, q_offset: int = 0) -> tuple[int, int]:
    """`(rows, chunk)`: how many rows per (batch, head) the exact recomputation handles, and
    how many it materializes at a time (`[B, H, chunk, Lk]` weights, a few copies, within
    the budget). At least RECOMPUTE_MIN_ROWS, one row in RECOMPUTE_FRACTION up to
    `recompute_share_rows` (so the capacity stops growing with L once it would cost more
    than RECOMPUTE_SHARE of the product: the path stays O(L log L)); queries outside the keys
    (`rows_outside_keys`) all get room."""
    share = min(math.ceil(Lq / RECOMPUTE_FRACTION), recompute_share_rows(Lq, Lk, F, Dv))
    rows = max(RECOMPUTE_MIN_ROWS, share, rows_outside_keys(Lq, Lk, q_offset))
    rows = min(Lq, rows)
    per_row = B * H * Lk * element_size(dtype) * 6  # weights, coefficients, their grads
    chunk = int(max(1, min(rows, budget_or_default(memory_budget_bytes) // max(1, per_row))))
    return rows, chunk


def estimate_fft_cost(B: int, H: int, Lq: int, Lk: int, F: int, Dv: int, dtype=torch.float32,
                      memory_budget_bytes: int | None = None) -> tuple[float, int]:
    """(flops, peak extra bytes) of one forward call."""
    el = element_size(dtype)
    N = fft_length(Lq + Lk - 1)
    C = Dv + 1
    fft_flops = 2 * 2.5 * N * math.log2(N) * B * H * F * C  # one rfft + one irfft per channel
    rows, _ = recompute_capacity(B, H, Lq, Lk, F, Dv, dtype, memory_budget_bytes)  # self-attention layout
    flops = fft_flops + 4 * B * H * (Lq + Lk) * F * C + 2 * B * H * rows * Lk * (F + C)
    block = fft_block_size(B, H, Lq, Lk, F, Dv, dtype, memory_budget_bytes)
    cb = fft_channel_block(B, H, Lq, Lk, Dv, dtype, memory_budget_bytes)
    # one block's temporaries, plus features, values and outputs kept for backward
    peak = (block * cb * _bytes_per_feature(B, H, Lq, Lk, Dv, el) // C
            + 3 * B * H * (Lq * (F + C) + Lk * (F + C)) * el)
    return flops, int(peak)


#: the most chunks the causal path cuts the positions into (`blocked.py`). Its per-frequency
#: sum costs about N/2 complex multiply-adds per position and channel for N chunks (4·N flops;
#: four such matmuls forward + backward), while every halving of the chunks adds one FFT level
#: inside them (roughly 100 bytes per position and channel a pass): at an H100's fp32 CUDA-core
#: rate (~60 TFLOP/s) and HBM (3.35 TB/s), 64 chunks' four matmuls cost about half a level
BLOCKED_CHUNKS = 64


#: fewer chunks than this and the causal path stays the recursion: with 4 chunks the blocked
#: product replaces two FFT levels, about what its own transposes and matmuls move
BLOCKED_MIN_CHUNKS = 8


class Shape(NamedTuple):
    """What the causal chunk's cost depends on besides the positions: batch, heads, features,
    value width, the FFT's dtype and the memory budget (None: `DEFAULT_BUDGET`)."""
    B: int
    H: int
    F: int
    Dv: int
    dtype: torch.dtype = torch.float32
    budget: int | None = None


def causal_chunk(Lq: int, q_offset: int, leaf: int, shape: Shape, kernels: bool = False, local: bool = False
                 ) -> int | None:
    """Chunk length of the causal path: of the power-of-two multiples of the leaf that cut the
    positions `0..q_offset+Lq-1` into BLOCKED_MIN_CHUNKS to BLOCKED_CHUNKS chunks, the one whose
    work in full-length product levels (`causal_levels`, the lag matrices' traffic included) is
    least, or None where the recursion over the whole length (`log2(L/leaf)` levels) costs no
    more. With many heads and long sequences few channels fit a block, and the matrices then
    cost more than the levels the chunks save (B = 1, H = 8, F = 32, Dv = 64, the 512 MiB
    budget: the recursion from 262,144 tokens on; before, 64 chunks there moved the matrices
    about 26 times per channel, 1,056 blocks of 2 channels: `benchmarks/fft_blocked_traffic.py`).
    `kernels`: the sums over chunks run in `triton_blocked`'s kernels (`blocked.kernels_take`),
    which build no lag matrices (`KERNEL_BLOCKED_LEVELS`). `local`: each chunk's own pairs run in
    `triton_tiled`'s kernels (`causal.local_on`), from one chunk over all positions to
    BLOCKED_CHUNKS (`local_chunk_choices`, `local_levels`)."""
    best, cost = None, causal_levels(Lq, q_offset, leaf, None, shape)
    for T in (local_chunk_choices(Lq, q_offset) if local else chunk_choices(Lq, q_offset, leaf)):
        c = causal_levels(Lq, q_offset, leaf, T, shape, kernels, local)
        if c < cost:
            best, cost = T, c
    return best


def chunk_choices(Lq: int, q_offset: int, leaf: int) -> list[int]:
    """The chunk lengths `causal_chunk` weighs, most chunks first: the power-of-two multiples of
    the leaf that cut the positions `0..q_offset+Lq-1` into BLOCKED_MIN_CHUNKS to BLOCKED_CHUNKS
    chunks (none where there are too few positions)."""
    end = q_offset + Lq
    T = leaf
    while -(-end // T) > BLOCKED_CHUNKS:
        T *= 2
    out = []
    while -(-end // T) >= BLOCKED_MIN_CHUNKS:
        out.append(T)
        T *= 2
    return out


#: the smallest chunk `local_chunk_choices` offers: the tiled kernels' tiles are 64 rows, and
#: below this many positions a chunk's pairs are too few for the blocked product they add to pay
LOCAL_MIN_CHUNK = 256


def local_chunk_choices(Lq: int, q_offset: int) -> list[int]:
    """The chunk lengths `causal_chunk` weighs where each chunk's own pairs are tiled: the powers
    of two from LOCAL_MIN_CHUNK that cut the positions `0..q_offset+Lq-1` into at most
    BLOCKED_CHUNKS chunks, up to one chunk over them all (no blocked product)."""
    end = q_offset + Lq
    T = LOCAL_MIN_CHUNK
    while -(-end // T) > BLOCKED_CHUNKS:
        T *= 2
    out = [T]
    while T < end:
        T *= 2
        out.append(T)
    return out


#: the tiled kernels' work on one pair (query, key) of a chunk, forward + backward, in the bytes
#: HBM moves meanwhile, per unit of `F + Dv + 1` (the products' widths): `triton_tiled` took 230 ms
#: for the causal table at 65,536 tokens (B·H = 8, F = 32, Dv = 64, tf32x3; H100 at 3.35 TB/s,
#: 2026-11-28), 1.72e10 pairs, 44.9 bytes a pair. bf16x3, which a 16-bit call takes, halved its
#: time at 4,096 tokens under CUDA graphs there; this keeps tf32x3's rate (the chunks then come
#: out no longer than they should). With it, a chunk's own pairs cost `T/2 · LOCAL_PAIR_BYTES ·
#: (F + Dv + 1)` per position against a level's `LEVEL_BYTES · F · (Dv + 1)`: 0.15 levels at
#: T = 2,048, 0.58 at 8,192 (F = 32, Dv = 64), where the recursion inside a chunk took
#: `log2(T/leaf)` levels and its dense leaves. Not timed as part of the FFT path yet
LOCAL_PAIR_BYTES = 0.46


def local_levels(T: int, shape: Shape) -> float:
    """The tiled kernels' work on each chunk's own pairs (chunks of T positions), in full-length
    product levels (`LOCAL_PAIR_BYTES`, `LEVEL_BYTES`)."""
    _, _, F, Dv, dtype, _ = shape
    return T / 2 * LOCAL_PAIR_BYTES * (F + Dv + 1) / (LEVEL_BYTES * element_size(dtype) / 4 * F * (Dv + 1))


#: the blocked product's work in halving levels' worth (each a full-length FFT product of
#: every channel), from the bytes each path's aten ops move on the CPU (forward + backward,
#: B = 1, F = 32, Dv = 64, 2,048-position leaves): the blocked path moved 0.90 of the
#: recursion's bytes at 8 chunks (3 levels: 41.2 against 45.9 GiB, H = 2), 0.72 at 16 (4 levels:
#: 92.3 against 127.4) and 0.62 at 32 (5 levels, the whole attention call, H = 1: 77.3 against
#: 124.5; benchmarks/fft_causal_ab.py, results/fft_causal_ab-*-h2.json,
#: table_paths-blocked-*-65536-h1.json): about 2.5 + N/50 levels for N chunks
BLOCKED_LEVELS = 2.5

#: bytes one full-length FFT product level moves per position and feature channel, forward +
#: backward with the coefficients' gradient, float32 (the causal recursion at 8,192, 16,384
#: and 32,768 tokens, H = 1, F = 32, Dv = 64: 147 and 155 more per level;
#: benchmarks/fft_blocked_traffic.py, results/fft_blocked_traffic.json). It was 170 (158 and
#: 176) until the segments' gradients were added in place (2026-11-29, `segments.SegmentSums`):
#: the recursion's levels got cheaper, and at 262,144 tokens (B·H = 8, an H200's budget) the
#: model's pick, 16 chunks, moved 5% more than 8 (benchmarks/fft_at_scale.py --chunks); it
#: picks 8 now, the counted best, and the counted best at 64k (32) and 1M (the recursion) as before
LEVEL_BYTES = 151
#: the lag matrices' reads and writes per block of channels, in matrices' worth (`[H, T+1, nb,
#: na]` complex), forward + backward with the coefficients' gradient: kept whole (the product
#: and the round-off estimate forward, the product and its adjoint backward, the pair
#: correlations' accumulation), and built a slice of frequencies at a time for every block
#: (the same JSON: 5.6 and 28.2; 26.2 before the byte count took an in-place scatter's touched
#: rows only, 2026-11-29)
MATRIX_PASSES_KEPT = 5.6
MATRIX_PASSES_SLICED = 28.2


def matrix_levels(Lq: int, q_offset: int, T: int, shape: Shape) -> float:
    """The blocked product's lag matrices' traffic over chunks of T positions, in full-length
    product levels (`LEVEL_BYTES`): every block of channels (`blocked_block`) reads them, and
    where they are over `blocked.MATRIX_BYTES` builds them again."""
    from . import blocked
    from .product import _blocks

    B, H, F, Dv, dtype, budget = shape
    end = q_offset + Lq
    _, nb, na = blocked.chunk_layout(Lq, end, q_offset, T)
    if na == 0:
        return 0.0
    el = element_size(dtype)
    blocks = len(_blocks(F, Dv + 1, blocked_block(B, H, nb, na, T, F, Dv, dtype, budget)))
    m = H * (T // 2 + 1) * 2 * nb * na * 2 * el  # the rfft of 2T positions: T + 1 frequencies
    passes = MATRIX_PASSES_KEPT if m <= blocked.MATRIX_BYTES else MATRIX_PASSES_SLICED
    return blocks * passes * m / (LEVEL_BYTES * el / 4 * B * H * F * (Dv + 1) * end)


#: the blocked product's work in levels where its sums over chunks run in Triton kernels on the
#: spectra in place (`blocked.KERNEL`, `triton_blocked.py`): no lag matrices and no
#: frequency-major copies, so about `KERNEL_BLOCKED_LEVELS + N/100` for N chunks. Fitted to the
#: bench's causal table call counted on shapes with the kernels (B = 1, H = 8, F = 32, Dv = 64,
#: 2,048-position leaves, an H200's budget; `python benchmarks/fft_blocked_traffic.py --at-scale
#: 65536,262144,1048576 --at-scale-chunks none,65536,32768,16384,8192,4096,2048 --only-at-scale
#: --out benchmarks/results/fft_blocked_kernel_chunks.json`): the levels the chunks replaced less
#: the levels' worth of bytes they saved, 1.9-2.2 less N/100 at 8 to 64 chunks at 262,144 and
#: 1,048,576 tokens with the kernels' re-reads of the spectra served from the cache (their
#: counted lower bound; with none served, 1.7-2.0 less N/50: the same picks). Where the torch
#: path's lag matrices made the recursion the cheaper at 262k and 1M (H·T·nb·na complex entries
#: a block of channels), with the kernels the most chunks are: 4,240 -> 2,322-2,611 GiB at 262k
#: (64 chunks against 8), 22,416 -> 13,839-14,997 GiB at 1M (against the recursion)
KERNEL_BLOCKED_LEVELS = 2.0


def causal_levels(Lq: int, q_offset: int, leaf: int, chunk: int | None, shape: Shape, kernels: bool = False,
                  local: bool = False) -> float:
    """The causal path's FFT work above its dense leaves, in full-length product levels: the
    recursion's `log2(L/leaf)` (`chunk` None), or with the blocked product over chunks of
    `chunk` positions `BLOCKED_LEVELS + N/50` for its N chunks plus the recursion's levels
    inside a chunk, plus the lag matrices' traffic for `shape` (`matrix_levels`); with
    `kernels` (the sums over chunks in `triton_blocked`'s kernels) `KERNEL_BLOCKED_LEVELS + N/100`
    and the levels inside a chunk. With `local` (each chunk's own pairs tiled: no recursion and
    no leaves inside it) `local_levels` replaces the levels inside a chunk, and one chunk over
    all positions has no blocked product."""
    end = q_offset + Lq
    if chunk is None:
        return float(max(0, math.ceil(math.log2(max(1.0, end / leaf)))))
    n = -(-end // chunk)
    inside = local_levels(chunk, shape) if local else math.log2(chunk // leaf)
    if local and n == 1:
        return inside
    if kernels:
        return KERNEL_BLOCKED_LEVELS + n / 100 + inside
    return BLOCKED_LEVELS + n / 50 + inside + matrix_levels(Lq, q_offset, chunk, shape)


def blocked_block(B: int, H: int, nb: int, na: int, T: int, F: int, Dv: int, dtype=torch.float32,
                  memory_budget_bytes: int | None = None) -> tuple[int, int]:
    """`(features, channels)` per block of the blocked product (`blocked.py`), within the
    budget: per channel, backward (the larger) holds the key and query chunks' padded
    channels, their spectra, both in frequency-major copies, the two matmuls' results and
    their inverse transforms: about `12·(na + nb)·T` reals."""
    C = Dv + 1
    budget = budget_or_default(memory_budget_bytes)
    per_channel = max(1, B * H * element_size(dtype) * 12 * (na + nb) * T)
    channels = max(1, budget // per_channel)
    if channels >= C:
        return int(min(F, channels // C)), C
    return 1, int(channels)


def causal_leaf(B: int, H: int, dtype=torch.float32, memory_budget_bytes: int | None = None) -> int:
    """Diagonal leaf size of the causal recursion: the largest power of two from CAUSAL_LEAF
    to CAUSAL_LEAF_MAX whose dense `[B, H, leaf, leaf]` weights (about 4 copies with the
    backward pass) fit the memory budget."""
    el = element_size(dtype)
    budget = budget_or_default(memory_budget_bytes)
    leaf = CAUSAL_LEAF
    while leaf < CAUSAL_LEAF_MAX and 4 * B * H * (2 * leaf) ** 2 * el <= budget:
        leaf *= 2
    return leaf
