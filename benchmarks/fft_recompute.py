"""What the FFT path's fixed exact-row recomputation costs, against the FFT product itself,
counted on CPU (every aten op's tensor bytes, `byte_count.ByteCounter`; a lower bound on
memory traffic, as in table_paths.py): the GPU bench's problem per head (B = 1, H = 1, D = 64,
NPRF with 32 features, bf16 q/k/v, a frozen table over all offsets, forward + backward).

The schedule is static (no host sync), so every call recomputes its whole capacity
(`fft.plan.recompute_capacity`) whether any row failed its certificate or not. Measured here:

* `dense_row_bytes_per_key`: (bytes with the capacity forced to R rows - bytes with 1 row) /
  ((R - 1)·L): what one recomputed row costs per key;
* `fft_bytes_per_channel`: bytes with 1 row / (L·F·(Dv+1)): what the rest of the path costs
  per position and feature channel (non-causal; the causal recursion costs more);
* the whole call at each length with the capacity rule before this change (one row in 128,
  O(L²) in all) and after (`plan.recompute_share_rows` caps it), bytes and CPU seconds.

The two constants in `fft/plan.py` (DENSE_ROW_BYTES_PER_KEY, FFT_BYTES_PER_CHANNEL) come from
the L = 65,536 rows.

    python benchmarks/fft_recompute.py --out benchmarks/results/fft_recompute.json
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

F, D = 32, 64


def one_call(family: str, L: int, capacity=None) -> dict:
    """Bytes, launches and CPU seconds of one fwd+bwd call (after a warm-up), the recompute
    capacity forced to `capacity` rows per head if given, or the old rule if "old"."""
    import fastrpe as fr
    import fastrpe.ops.linear.fft as fftmod
    from fastrpe.bench.gpu import _closure, family_causal, make_position
    from fastrpe.ops.linear.fft import plan

    orig, orig_share = fftmod.recompute_capacity, plan.recompute_share_rows
    if capacity == "old":  # the rule without its cap: one row in 128 at any length
        plan.recompute_share_rows = lambda Lq, *a: Lq
    elif capacity is not None:
        fftmod.recompute_capacity = lambda *a, **k: (capacity, min(capacity, orig(*a, **k)[1]))
    try:
        rows = fftmod.recompute_capacity(1, 1, L, L, F, D)[0]
        kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
        pos, causal = make_position(family, 1, L), family_causal(family)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, L, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
        call = _closure(lambda q, k, v: fr.attention(q, k, v, kernel=kern, position=pos, causal=causal,
                                                     backend="fft"), q, k, v, backward=True)
        call()
        t = time.perf_counter()
        call()
        seconds = time.perf_counter() - t
        c = ByteCounter()
        with c:
            call()
    finally:
        fftmod.recompute_capacity, plan.recompute_share_rows = orig, orig_share
    return {"family": family, "causal": causal, "L": L, "capacity_rows": rows, "gib_moved": c.bytes / 2**30,
            "launches": c.launches, "cpu_seconds": seconds, "ms_at_hbm_peak_x8_heads": 8 * c.bytes / HBM_BYTES_PER_S * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constants-at", type=int, default=65536)
    ap.add_argument("--lengths", default="65536,262144")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    L, R = a.constants_at, 512
    one, many = one_call("learned_full", L, 1), one_call("learned_full", L, R)
    constants = {"L": L, "rows": R,
                 "dense_row_bytes_per_key": (many["gib_moved"] - one["gib_moved"]) * 2**30 / ((R - 1) * L),
                 "fft_bytes_per_channel": one["gib_moved"] * 2**30 / (L * F * (D + 1))}
    print(json.dumps(constants), flush=True)
    rows = []
    for n in (int(x) for x in a.lengths.split(",")):
        for fam in ("learned_full", "learned"):
            for rule in ("old", None):
                r = one_call(fam, n, rule)
                r["rule"] = "one row in 128" if rule == "old" else "capped at RECOMPUTE_SHARE"
                rows.append(r)
                print(json.dumps(r), flush=True)
    out = {"meta": {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
                    "command": "python benchmarks/fft_recompute.py " + " ".join(sys.argv[1:]),
                    "problem": {"B": 1, "H": 1, "D": D, "features": F, "kernel": "nprf", "dtype": "bfloat16",
                                "position": "LearnedTable over all offsets, frozen"},
                    "hbm_bytes_per_s": HBM_BYTES_PER_S},
           "constants": constants, "calibration": [one, many], "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
