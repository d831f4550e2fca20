"""What the two exact paths for a table over all offsets cost, at the GPU bench's problem
(B = 1, H = 8, D = 64, NPRF with 32 features, bf16 q/k/v, forward + backward), counted on CPU:

* `fft` (Luo et al. 2021's Toeplitz product by FFT): every aten op it dispatches is counted
  with a `TorchDispatchMode` (what it reads and writes, each tensor once, views and
  allocations left out; `byte_count.ByteCounter`), so the bytes are a lower bound on its memory traffic and
  `bytes / 3.35 TB/s` (the H100's HBM3 peak) a lower bound on its time; each launch adds its
  overhead on top.
* `triton_tiled` (flash-style tiles, `ops/linear/triton_tiled.py`): its work is in its three
  kernels, so it is counted from their loops: per (query, key) pair visited, `φq·φk` and the
  value product forward (2F + 2Dv flops), and backward `do·vᵀ` and `(G∘w)·φk` (dq kernel), then
  `φq·φk`, `do·vᵀ`, `dAᵀ·φq` and `(A∘w)ᵀ·do` (dk/dv kernel): 6F + 6Dv more. Time at the
  tensor cores' dense peak (H100 SXM: 989 TFLOP/s bf16, 495 tf32) is a lower bound. With the
  default float32 features every product with a float32 operand runs as three tf32 products
  (tf32x3: 165 TFLOP/s); the two `do·vᵀ` (4Dv per pair) have two bf16 operands and run as
  one bf16 product (`triton_chunked._dot`). With bf16 features (`LOWP_FEATURES`) all run in
  bf16.

FlexAttention's measured times are in issue 12's table (Flex + ALiBi: 4.16 ms at 16k, 51.8 at
64k, causal, forward + backward); nothing here ran on a GPU.

    python benchmarks/table_paths.py --out benchmarks/results/table_paths.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_count import ByteCounter  # noqa: E402
from prf_traffic import HBM_BYTES_PER_S  # noqa: E402

#: H100 SXM dense tensor-core peaks, flop/s
PEAK = {"bf16": 989e12, "tf32": 495e12, "tf32x3": 495e12 / 3}


def fft_row(family: str, L: int, H: int, D: int, F: int) -> dict:
    import fastrpe as fr
    from fastrpe.bench.gpu import _closure, family_causal, make_position

    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    pos, causal = make_position(family, H, L), family_causal(family)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
    call = _closure(lambda q, k, v: fr.attention(q, k, v, kernel=kern, position=pos, causal=causal, backend="fft"),
                    q, k, v, backward=True)
    call()  # warm-up: the table kept for a frozen term, as the bench's timed calls find it
    t = time.perf_counter()
    call()
    uncounted = time.perf_counter() - t
    c = ByteCounter()
    t = time.perf_counter()
    with c:
        call()
    return {"backend": "fft", "family": family, "causal": causal, "L": L, "gib_moved": c.bytes / 2**30,
            "launches": c.launches, "ms_at_hbm_peak": c.bytes / HBM_BYTES_PER_S * 1e3,
            "by_op": [{"op": op, "gib": b / 2**30, "launches": n} for op, b, n in c.top(12)],
            "cpu_seconds": time.perf_counter() - t, "cpu_seconds_uncounted": uncounted}


def tiled_row(family: str, L: int, H: int, Dv: int, F: int) -> dict:
    from fastrpe.bench.gpu import family_causal

    causal = family_causal(family)
    pairs = H * L * (L + 1) / 2 if causal else H * L * L
    flops = pairs * ((2 * F + 2 * Dv) + (2 * Dv + 2 * F) + (4 * F + 4 * Dv))
    bf16_pass = pairs * 4 * Dv  # the two do·vᵀ: bf16 operands on both sides
    return {"backend": "triton_tiled", "family": family, "causal": causal, "L": L, "pairs": pairs, "flops": flops,
            "ms_at_peak": {"float32 features": ((flops - bf16_pass) / PEAK["tf32x3"] + bf16_pass / PEAK["bf16"]) * 1e3,
                           "bf16 features": flops / PEAK["bf16"] * 1e3}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--families", default="learned,learned_full", help="comma-separated, of learned, learned_full")
    ap.add_argument("--segment-blocks", choices=("always", "never", "cuda"), default=None,
                    help="fft.causal.SEGMENT_BLOCKS for the run (default: the library's)")
    ap.add_argument("--causal-blocked", choices=("always", "never", "cuda"), default=None,
                    help="fft.causal.BLOCKED for the run: the pairs across chunks by one blocked product (always), "
                         "or the halving recursion over the whole length (never); default: the library's")
    ap.add_argument("--budget-mib", type=int, default=None,
                    help="fft.plan.DEFAULT_BUDGET for the run, MiB (default: the library's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    H, D, F = a.heads, 64, 32
    from fastrpe.ops.linear.fft import causal as fft_causal
    from fastrpe.ops.linear.fft import plan as fft_plan

    if a.budget_mib is not None:
        fft_plan.DEFAULT_BUDGET = a.budget_mib << 20

    if a.segment_blocks is not None:
        fft_causal.SEGMENT_BLOCKS = a.segment_blocks
    if a.causal_blocked is not None:
        fft_causal.BLOCKED = a.causal_blocked
    rows = []
    for L in (int(x) for x in a.lengths.split(",")):
        for fam in a.families.split(","):
            rows.append(fft_row(fam, L, H, D, F))
            rows.append(tiled_row(fam, L, H, D, F))
            for r in rows[-2:]:
                ms = r.get("ms_at_hbm_peak") or r["ms_at_peak"]["float32 features"]
                print(f"{r['backend']:13s} {fam:13s} L={L:6d}  >= {ms:8.2f} ms"
                      + (f"  ({r['gib_moved']:.1f} GiB, {r['launches']} launches)" if "launches" in r else
                         f"  (float32 features; bf16 features {r['ms_at_peak']['bf16 features']:.2f} ms)"), flush=True)
    out = {"meta": {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
                    "torch": torch.__version__, "command": "python benchmarks/table_paths.py " + " ".join(sys.argv[1:]),
                    "problem": {"B": 1, "H": H, "D": D, "features": F, "kernel": "nprf", "dtype": "bfloat16"},
                    "segment_blocks": fft_causal.SEGMENT_BLOCKS, "causal_blocked": fft_causal.BLOCKED,
                    "budget_bytes": fft_plan.DEFAULT_BUDGET,
                    "hbm_bytes_per_s": HBM_BYTES_PER_S, "tensor_peaks": PEAK,
                    "byte_count": "each op's reads and writes, each tensor once (benchmarks/byte_count.py, "
                                  "since 2026-11-28's seventh CPU session)"},
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
