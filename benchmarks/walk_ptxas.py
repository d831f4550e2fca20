"""The kernels that stack KG terms' states a program, compiled for Hopper (sm_90) on this CPU,
per KG, precision, warps and stages: registers, spilled bytes, shared memory and the programs
an SM holds (ptxas, Triton's metadata). By default the walked far field's
(`fastrpe.ops.linear.triton_soe_walk`); `--kernels` names others, the stacked chunk-state passes
(`triton_soe_stacked`: `_stacked_state_kernel`, `_stacked_bwd_state_kernel`, compiled in their
blocked scan's second phase, which stores every chunk's state) among them.

Why: a walk program holds KG terms' states `[KG·F, Dv]` in float32 registers across its
block, and its products split float32 operands (tf32x3: hi and lo halves). More terms a state
means fewer passes over the block (`ceil(K / KG)`) and larger tensor-core tiles, until the
state spills. This says where that happens before a GPU session times it
(`triton_soe_walk.WALK_TERMS`).

As the GPU bench launches them: a bf16 call, NPRF's float32 features (or bf16 ones, "bf16"),
bf16 values, T = 64, F = 32, Dv = 64, two near chunks, a quotient's gradient (SCALED), every
pointer and the multiple-of-16 ints aligned; the autotuner's stages (1 to 3 at 4 warps) and 8
warps.

    python benchmarks/walk_ptxas.py --out benchmarks/results/walk_ptxas-sm90.json   # triton 3.6.0
    python benchmarks/walk_ptxas.py --kernels _stacked_state_kernel,_stacked_bwd_state_kernel --terms 2,4 \
        --warps 4,8 --stages 3 --out benchmarks/results/stacked_ptxas-sm90.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prf_ptxas import compile_sm90, resource_line, resources, write_rows  # noqa: E402

KERNELS = ("_walk_totals_kernel", "_walk_out_kernel", "_walk_dq_kernel", "_walk_rtotals_kernel", "_walk_dkv_kernel")
#: (features, precision) of the bench's rows: float32 features by three tf32 products (the
#: default), by bf16 halves (`+bf16x3`), and bf16 features (`+bf16-features`)
PRODUCTS = (("float32", "tf32x3"), ("float32", "bf16x3"), ("bfloat16", "bf16"))
#: the ints that are multiples of 16 at the bench's launches (64k: N = 1024, NBK = 128)
ALIGNED = ("Lq", "Lk", "F", "Dv", "N", "NBK", "q_offset")


def compile_case(name: str, features: str, precision: str, KG: int, num_warps: int, num_stages: int = 3) -> dict:
    import triton.language as tl

    from fastrpe.ops.linear import triton_soe_stacked as tss, triton_soe_walk as tw
    from fastrpe.ops.linear.triton_chunked import dot_mode

    fn = getattr(tss if name.startswith("_stacked_") else tw, name)
    fn = fn.fn if type(fn).__name__ == "Autotuner" else fn  # (the autotuner's JIT function)
    lowp = features == "bfloat16"
    consts = {"BT": 64, "BF": 32, "BV": 64, "BDV": 64, "NB": 2, "KG": KG, "SCALED": True, "PHASE": 2,
              "DT": tl.bfloat16 if lowp else tl.float32, "ACC": tl.float32,
              "MODE": 0 if lowp else dot_mode(precision)}
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    ptr = {"q_ptr": "bf16" if lowp else "fp32", "k_ptr": "bf16" if lowp else "fp32", "v_ptr": "bf16",
           "do_ptr": "bf16", "h_ptr": "bf16", "dh_ptr": "bf16"}  # (bf16 states, as a bf16 call keeps them)
    k, regs, spilled = compile_sm90(fn, consts, ptr, ALIGNED, num_warps, num_stages)
    return {"kernel": name, "features": features, "precision": precision, "KG": KG,
            **resources(k, regs, spilled, num_warps, num_stages)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--terms", default="1,2,4,8", help="the KG values compiled")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    for name in a.kernels.split(","):
        for features, precision in PRODUCTS:
            for KG in (int(x) for x in a.terms.split(",")):
                for w in (int(x) for x in a.warps.split(",")):
                    for st in (int(x) for x in a.stages.split(",")):
                        r = compile_case(name, features, precision, KG, w, st)
                        rows.append(r)
                        print(f"{name:26s} {precision:7s} KG {KG} {resource_line(r)}", flush=True)
    if a.out:
        write_rows(a.out, "walk_ptxas.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
