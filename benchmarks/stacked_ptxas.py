"""The stacked chunk-state passes (`fastrpe.ops.linear.triton_soe_stacked`) compiled for Hopper
(sm_90) on this CPU, per stacked terms KG, precision, warps and stages: registers, spilled
bytes, shared memory and the programs an SM holds (ptxas, Triton's metadata).

Why: a program holds KG terms' states `[KG·F, BV]` in float32 registers over its chunks, and
its products split float32 operands (tf32x3, bf16x3: hi and lo halves). `STACK_WARPS` and the
terms a program (`triton_soe.STATE_TERMS`, the bench's `+stacked-states` rows: 4) are chosen
from this before a GPU session times them.

As the GPU bench launches them: a bf16 call, NPRF's float32 features (or bf16 ones, "bf16"),
bf16 values, output gradient and states, T = 64, F = 32, Dv = 64 (one value block), two near
chunks, a quotient's gradient (SCALED), the blocked scan's second phase (PHASE 2: from the
carries, storing every chunk's state), every pointer and the multiple-of-16 ints aligned.

    python benchmarks/stacked_ptxas.py --out benchmarks/results/stacked_ptxas-sm90.json   # triton 3.6.0
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prf_ptxas import compile_sm90, programs_per_sm, write_rows  # noqa: E402

KERNELS = ("_stacked_state_kernel", "_stacked_bwd_state_kernel")
#: (features, precision) of the bench's rows: float32 features by three tf32 products, by bf16
#: halves (`+bf16x3`), and bf16 features
PRODUCTS = (("float32", "tf32x3"), ("float32", "bf16x3"), ("bfloat16", "bf16"))
#: the ints that are multiples of 16 at the bench's launches (64k: N = 1024)
ALIGNED = ("Lq", "Lk", "F", "Dv", "N", "q_offset")


def compile_case(name: str, features: str, precision: str, KG: int, num_warps: int, num_stages: int) -> dict:
    import triton.language as tl

    from fastrpe.ops.linear import triton_soe_stacked as tss
    from fastrpe.ops.linear.triton_chunked import dot_mode

    fn = getattr(tss, name)
    fn = fn.fn if type(fn).__name__ == "Autotuner" else fn
    lowp = features == "bfloat16"
    consts = {"BT": 64, "BF": 32, "BV": 64, "BDV": 64, "NB": 2, "KG": KG, "SCALED": True, "PHASE": 2,
              "DT": tl.bfloat16 if lowp else tl.float32, "ACC": tl.float32, "MODE": 0 if lowp else dot_mode(precision)}
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    ptr = {"q_ptr": "bf16" if lowp else "fp32", "k_ptr": "bf16" if lowp else "fp32", "v_ptr": "bf16",
           "do_ptr": "bf16", "h_ptr": "bf16", "dh_ptr": "bf16"}
    k, regs, spilled = compile_sm90(fn, consts, ptr, ALIGNED, num_warps, num_stages)
    return {"kernel": name, "features": features, "precision": precision, "KG": KG, "num_warps": num_warps,
            "num_stages": num_stages, "registers": regs, "spilled_bytes": spilled, "shared_bytes": k.metadata.shared,
            "programs_per_sm": None if regs is None else programs_per_sm(regs, num_warps, k.metadata.shared)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--terms", default="2,4")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3")
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    for name in KERNELS:
        for features, precision in PRODUCTS:
            for KG in (int(x) for x in a.terms.split(",")):
                for w in (int(x) for x in a.warps.split(",")):
                    for st in (int(x) for x in a.stages.split(",")):
                        r = compile_case(name, features, precision, KG, w, st)
                        rows.append(r)
                        print(f"{name:26s} {precision:7s} KG {KG} warps {w} stages {st}: {r['registers']} registers, "
                              f"{r['spilled_bytes']} B spilled, {r['shared_bytes'] // 1024} KiB shared, "
                              f"{r['programs_per_sm']} an SM", flush=True)
    if a.out:
        write_rows(a.out, "stacked_ptxas.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
