"""Memory of the kernelized composition per token, forward + backward, on CPU.

Issue 12 asks for a decaying term at L = 1,048,576 (B = 1, H = 8, D = 64, 32 features,
bf16) within 8 GiB above the inputs and their gradients: 1,024 bytes per (head, token).
Every buffer of a linear-time backend is proportional to B·H·L, so the bytes per token
measured here at a small length, times 8·2^20, is the 1M-token peak (chunk states
included; allocator rounding and the CUDA context are not). The one cap that is not
proportional, the sum-of-exponentials states' `soe.STATE_BUDGET` (1 GiB per group of terms),
is scaled down here by the same factor, so that terms are grouped as they are at 1M; so is
the block of positions that PRF's forward and backward widen at a time (`PRF_BLOCK_BYTES`).

Each row runs what `fastrpe bench --suite gpu` times, `fastrpe.attention(...)` then
`out.float().sum().backward()`, with bf16 `q, k, v: [1, H, L, 64]` (their `.grad` already
held, as after the bench's warm-up) and NPRF with 32 features, causal; the Triton backends run under
the interpreter (`TRITON_INTERPRET=1`, set here), whose kernels allocate what they do on
a GPU. The interpreter's launch leaves its arguments in a reference cycle (a recursive
closure over their storages), which would hold every kernel argument until the garbage
collector runs; a collection after each launch frees them when the GPU would. Peak = the
profiler's allocator peak of the call (`fastrpe.bench.memory`): above the inputs and their
gradients, as the GPU bench counts it.

    python benchmarks/composition_memory.py --out benchmarks/results/composition_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROWS = (("triton_chunked", "alibi"), ("triton_soe", "kerple_log"), ("triton_soe", "kerple_power"),
        ("triton_band", "t5"), ("chunked", "alibi"))
#: (head, token) pairs of the issue's 1M problem: B = 1, H = 8, L = 2^20
TOKENS_1M = 8 * 2**20


def _collect_after_each_launch() -> None:
    """Free what an interpreted launch leaves in a reference cycle as soon as it returns."""
    import gc

    from triton.runtime import interpreter

    call = interpreter.GridExecutor.__call__
    if getattr(call, "_collects", False):
        return

    def collecting(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        finally:
            gc.collect()

    collecting._collects = True
    interpreter.GridExecutor.__call__ = collecting


def measure(backend: str, family: str, L: int, H: int, D: int = 64, F: int = 32, state_terms: int = 1) -> dict:
    import fastrpe as fr
    from fastrpe import backends_triton
    from fastrpe.bench.gpu import _closure, make_position
    from fastrpe import kernels
    from fastrpe.bench.memory import allocator_peak_bytes
    from fastrpe.ops.linear import soe, triton_soe

    backends_triton.INTERPRET_ON_CPU = True
    if backend.startswith("triton_"):
        _collect_after_each_launch()
    budget, block = soe.STATE_BUDGET, kernels.PRF_BLOCK_BYTES
    soe.STATE_BUDGET = max(1, budget * H * L // TOKENS_1M)  # terms grouped as at 1M tokens
    kernels.PRF_BLOCK_BYTES = max(1, block * H * L // TOKENS_1M)
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    pos = make_position(family, H, L)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
    # the GPU bench's own call: out.float().sum().backward(), gradients accumulated in .grad
    def attend(q, k, v):
        with triton_soe.use_state_terms(state_terms):  # (the backward keeps the forward's)
            return fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=backend)

    call = _closure(attend, q, k, v, backward=True)
    try:
        call()  # warm-up: the .grad tensors, and one-time allocations (plans, fits), are not counted
        peak, _ = allocator_peak_bytes(call)
    finally:
        soe.STATE_BUDGET, kernels.PRF_BLOCK_BYTES = budget, block
    per_token = peak / (H * L)
    return {"backend": backend, "family": family, "L": L, "H": H, "D": D, "features": F, "state_terms": state_terms,
            "peak_bytes": peak, "bytes_per_token": per_token, "gib_at_1m": per_token * TOKENS_1M / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rows", default=None, help="comma-separated backend:family (default: all)")
    ap.add_argument("--state-terms", type=int, default=None,
                    help="triton_soe.STATE_TERMS: the state passes' terms a program, and a launch group's "
                         "whole stacks (triton_soe_stacked.stacked_group); default 1")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [tuple(r.split(":")) for r in a.rows.split(",")] if a.rows else ROWS
    res = []
    print(f"{'backend':16s} {'family':14s} {'B/token':>8s} {'GiB at 1M x 8 heads':>20s}")
    for backend, family in rows:
        r = measure(backend, family, a.length, a.heads, state_terms=a.state_terms or 1)
        res.append(r)
        print(f"{backend:16s} {family:14s} {r['bytes_per_token']:8.0f} {r['gib_at_1m']:20.2f}")
    if a.out:
        meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
                "command": "python benchmarks/composition_memory.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None and k != "out")}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
