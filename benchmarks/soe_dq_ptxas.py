"""triton_soe's dq kernel (`_soe_bwd_dq_kernel`, which triton_band runs too) compiled for
Hopper (sm_90) on this CPU, with and without the far weights' gradient (`DWQ`): registers,
spilled bytes and shared memory (ptxas, Triton's metadata), as its autotuner's configs launch
it (4 warps, 1 to 3 stages).

Why: the kernel formed the gradient of the far weights `wq` for every term and chunk, and
read and wrote it back in memory each time, whether the weights took a gradient or not (a
frozen term's, the GPU bench's, do not). Now `DWQ` says whether it is wanted. Run from an older
checkout (its kernel has no `DWQ`), the same script gives the kernel before ("dwq": "always").
(Sums held in registers, `[16, T]` for 11 terms, and stored once per program spilled more than
the kernel before where the gradient is wanted: 568 against 448 B at tf32x3, 4 warps, 1 stage.)

As the GPU bench launches it: a bf16 call's dq, NPRF's float32 features (or bf16 ones,
"bf16"), bf16 values and output gradient, T = 64, F = 32, Dv = 64, the first term group (the
near field: NB = 2 for the SoE band, 3 for T5's), a quotient's gradient (SCALED), every
pointer and the multiple-of-16 ints aligned.

    python benchmarks/soe_dq_ptxas.py --out benchmarks/results/soe_dq_ptxas-sm90.json   # triton 3.6.0
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prf_ptxas import compile_sm90, resource_line, resources, write_rows  # noqa: E402

#: (features, precision) of the bench's rows: float32 features by three tf32 products (the plain
#: rows), by bf16 halves (`+bf16x3`, the library's default for bf16 calls), and bf16 features
PRODUCTS = (("float32", "tf32x3"), ("float32", "bf16x3"), ("bfloat16", "bf16"))
#: the ints that are multiples of 16 at the bench's launches (64k: N = 1024, NS = 128)
ALIGNED = ("Lq", "Lk", "F", "Dv", "N", "NS", "q_offset")


def compile_case(features: str, precision: str, NB: int, dwq: bool | None, num_warps: int,
                 num_stages: int) -> dict:
    """One compilation; `dwq` None: the kernel's own default (a kernel without `DWQ` forms the
    gradient always)."""
    import triton.language as tl

    from fastrpe.ops.linear import triton_soe as ts
    from fastrpe.ops.linear.triton_chunked import dot_mode

    fn = ts._soe_bwd_dq_kernel
    fn = getattr(fn, "fn", fn)  # (the autotuner's JIT function)
    has = "DWQ" in fn.arg_names
    lowp = features == "bfloat16"
    consts = {"BT": 64, "BF": 32, "BDV": 64, "NB": NB, "NEAR": True, "ACCUM": False, "SCALED": True,
              "DT": tl.bfloat16 if lowp else tl.float32, "ACC": tl.float32,
              "MODE": 0 if lowp else dot_mode(precision)}
    if has and dwq is not None:
        consts["DWQ"] = dwq
    ptr = {"q_ptr": "bf16" if lowp else "fp32", "k_ptr": "bf16" if lowp else "fp32", "v_ptr": "bf16",
           "do_ptr": "bf16", "h_ptr": "bf16"}
    k, regs, spilled = compile_sm90(fn, consts, ptr, ALIGNED, num_warps, num_stages)
    return {"kernel": "_soe_bwd_dq_kernel", "dwq": ("wanted" if dwq else "not wanted") if has else "always",
            "features": features, "precision": precision, "NB": NB, **resources(k, regs, spilled, num_warps, num_stages)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="1,2,3")
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    from fastrpe.ops.linear import triton_soe as ts

    fn = getattr(ts._soe_bwd_dq_kernel, "fn", ts._soe_bwd_dq_kernel)
    variants = (False, True) if "DWQ" in fn.arg_names else (None,)
    rows = []
    for features, precision in PRODUCTS:
        for NB in (2, 3):
            for dwq in variants:
                for w in (int(x) for x in a.warps.split(",")):
                    for st in (int(x) for x in a.stages.split(",")):
                        r = compile_case(features, precision, NB, dwq, w, st)
                        rows.append(r)
                        print(f"{precision:7s} NB {NB} dwq {r['dwq']:10s} {resource_line(r)}", flush=True)
    if a.out:
        write_rows(a.out, "soe_dq_ptxas.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
