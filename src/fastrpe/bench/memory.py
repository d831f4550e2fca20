"""Peak memory of a call on CPU, as the allocator sees it.

`ru_maxrss` (resident set size) depends on how malloc returns and reuses pages and on
which zero pages were touched, so its growth between two lengths is noisy. The
profiler's allocation events give every tensor allocation and free in order; the peak
of their running sum is the most memory the call's tensors held at once — the number
to compare with an algorithm's memory complexity (what `torch.cuda.max_memory_allocated`
is on a GPU).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def allocator_peak_bytes(fn: Callable[[], object]) -> tuple[int, int]:
    """Run `fn()` under the profiler; return `(peak, net)` bytes of CPU tensor memory
    allocated during the call, relative to its start (net: still held at its end)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            # alloc_size < 0 for a free
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    cur = peak = 0
    live: dict[int, int] = {}
    for _, size, ptr in events:
        if size < 0 and live.pop(ptr, None) is None:
            # a block allocated before the call (the profiler knows its size if an earlier
            # measured call allocated it; the Triton interpreter leaves a launch's arguments
            # to the garbage collector): not this call's memory, and counting its free
            # would lower this call's peak
            continue
        if size > 0:
            live[ptr] = size
        cur += size
        peak = max(peak, cur)
    return peak, cur


def measure_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak extra bytes of `fn()`: the CUDA allocator's peak on a GPU, the profiler's
    allocation peak on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return allocator_peak_bytes(fn)[0]
