"""The causal FFT path on this machine: the pairs across chunks by the blocked product, or the
halving recursion over the whole length (`fastrpe.ops.linear.fft.causal.BLOCKED`), timed in one
process on the same inputs, forward + backward, best of `--repeats`, with their largest
difference; and the bytes every aten op of one call reads and writes (`byte_count.ByteCounter`:
a lower bound on a GPU's memory traffic, which the CPU's time does not follow).

A learned table over all offsets (`N(0, 0.5²)` log-coefficients), uniform positive features,
normal values, float32, `B = 1`; the chunks and leaves are the library's for the shapes
(`fft.plan.causal_chunk`, `causal_leaf`), or the leaf given.

    python benchmarks/fft_causal_ab.py --length 32768 --heads 2 --out benchmarks/results/fft_causal_ab.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--value-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--leaf", type=int, default=None, help="the causal leaf (default: the library's for the shapes)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import fastrpe.ops.linear.fft as fftmod
    from fastrpe.ops.linear.fft import causal as fft_causal
    from fastrpe.ops.linear.fft import kernelized_num_den_fft
    from fastrpe.ops.linear.fft.plan import Shape, causal_chunk

    if a.leaf is not None:
        fftmod.causal_leaf = lambda *args, **kwargs: a.leaf

    L, H, F, Dv = a.length, a.heads, a.features, a.value_dim
    g = torch.Generator().manual_seed(0)
    pq, pk = (torch.rand(1, H, L, F, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(1, H, L, Dv, generator=g).requires_grad_()
    lc = (0.5 * torch.randn(H, 2 * L - 1, generator=g)).requires_grad_()
    leaf = fftmod.causal_leaf(1, H, torch.float32)
    rows, outs = [], {}
    for mode in ("always", "never"):
        fft_causal.BLOCKED = mode
        best_f = best_b = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            num, den, ls = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
            t1 = time.perf_counter()
            (num.sum() + den.sum()).backward()
            t2 = time.perf_counter()
            best_f, best_b = min(best_f, t1 - t), min(best_b, t2 - t1)
        outs[mode] = (num.detach(), den.detach())
        with ByteCounter() as count:
            num, den, ls = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
            (num.sum() + den.sum()).backward()
        rows.append({"blocked": mode, "forward_s": best_f, "backward_s": best_b, "total_s": best_f + best_b,
                     "gib_moved": count.bytes / 2**30, "launches": count.launches})
        print(f"BLOCKED={mode:6s} forward {best_f:7.2f} s  backward {best_b:7.2f} s  "
              f"{count.bytes / 2**30:8.2f} GiB in {count.launches} ops", flush=True)
    (na, da), (nr, dr) = outs["always"], outs["never"]
    diff = {"num_max_abs_over_max": ((na - nr).abs().max() / nr.abs().max()).item(),
            "den_max_rel": ((da - dr).abs() / dr.abs()).max().item()}
    print(f"largest difference: num {diff['num_max_abs_over_max']:.2e} of its largest entry, "
          f"den {diff['den_max_rel']:.2e} relative")
    out = {"meta": {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
                    "command": "python benchmarks/fft_causal_ab.py " + " ".join(sys.argv[1:]),
                    "problem": {"B": 1, "H": H, "L": L, "features": F, "value_dim": Dv, "dtype": "float32",
                                "leaf": leaf, "chunk": causal_chunk(L, 0, leaf, Shape(1, H, F, Dv))}},
           "rows": rows, "difference": diff}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
