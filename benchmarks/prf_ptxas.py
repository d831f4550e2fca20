"""The PRF map kernels (`fastrpe.ops.triton_prf`) compiled for Hopper (sm_90) on this CPU, per
launch choice: registers, spilled bytes and shared memory (ptxas, Triton's metadata), and
whether the row loop's loads became asynchronous copies (the TTGIR's
`async_copy_global_to_local`: Triton pipelined them).

Why: at one row tile a program (`triton_prf.TILES = 1`) the maps moved about a third of the
H100's bandwidth (2026-11-27, h100-2026-11-27b-profile.json, `prf_sweep`). A program that walks
several tiles has its next tiles' loads in flight while it computes, at the price of shared
memory for the stages, which bounds the programs an SM holds. What the H100 makes of that is
`benchmarks/prf_sweep.py`'s to time; this says what each choice costs in resources.

As the GPU bench launches them: NPRF (normalized, one-sided), bf16 x, D = 64, 32 features,
every pointer and the multiple-of-16 ints aligned, 4 warps, 3 stages (Triton's default).

    python benchmarks/prf_ptxas.py --out benchmarks/results/prf_ptxas-sm90.json   # triton 3.6.0
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

#: (pass, precision, row tiles, rows a tile) compiled
CASES = [(p, prec, t, 64) for p in ("fwd", "bwd") for prec in ("tf32x3", "bf16x3") for t in (1, 4, 8)]
#: and the PRF sweep's one-tile shapes (rows, warps) in bf16x3, both passes: what each holds an SM
SWEEP_SHAPES = ((16, 4), (32, 8), (64, 8), (128, 8), (16, 2), (32, 4))
CASES += [(p, "bf16x3", 1, rows, warps) for p in ("fwd", "bwd") for rows, warps in SWEEP_SHAPES]


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Programs an sm_90 SM holds: 64K registers (allocated per thread in steps of 8), 228 KiB of
    shared memory (1 KiB of it reserved per program), 32 programs at most."""
    regs = -(-registers // 8) * 8
    return min(65536 // (regs * 32 * num_warps), (228 * 1024) // (shared_bytes + 1024), 32)
#: the ints that are multiples of 16 at the bench's launches (as tests/test_triton_compile.py)
ALIGNED = ("D", "L", "M", "F", "sxb", "sxh", "sxl", "swh")


def ptxas(ptx: str) -> tuple[int | None, int | None]:
    """(registers, spilled bytes) as the triton install's ptxas reports them for sm_90a."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    exe = next((p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), None)
    if exe is None:
        return None, None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([str(exe), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    os.unlink(f.name)
    r, s = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return (int(r.group(1)) if r else None), (int(s.group(1)) if s else None)


def compile_sm90(fn, consts: dict, ptrs: dict, aligned, num_warps: int, num_stages: int, floats=()):
    """`fn` compiled for sm_90 with the constexprs `consts`, pointer element types `ptrs`
    (default fp32), float args `floats` (the rest i32), the pointers and the ints `aligned` as
    multiples of 16: `(CompiledKernel, registers, spilled bytes)` (`ptxas`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else ("*" + ptrs.get(n, "fp32")) if n.endswith("_ptr")
           else ("fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n in aligned)}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})
    return (k, *ptxas(k.asm["ptx"]))


def compile_case(which: str, precision: str, tiles: int, rows: int, num_warps: int = 4, num_stages: int = 3):
    from fastrpe.ops import triton_prf as tp
    from fastrpe.ops.linear.triton_chunked import dot_mode

    fn = tp._prf_fwd_kernel if which == "fwd" else tp._prf_bwd_kernel
    consts = {"BR": rows, "BD": 64, "NORMALIZE": True, "QUERY": True, "MODE": dot_mode(precision), "TILES": tiles,
              **({"BF": 32, "DX_BF16": True} if which == "bwd" else {"BM": 32, "TWO_SIDED": False})}
    k, regs, spilled = compile_sm90(fn, consts, {"x_ptr": "bf16", "dx_ptr": "i16"}, ALIGNED, num_warps, num_stages,
                                    floats=("scale", "inv_sqrt_f"))
    return {"pass": which, "precision": precision, "tiles": tiles, "rows": rows, "num_warps": num_warps,
            "num_stages": num_stages, "registers": regs, "spilled_bytes": spilled,
            "shared_bytes": k.metadata.shared,
            "programs_per_sm": None if regs is None else programs_per_sm(regs, num_warps, k.metadata.shared),
            "async_copies": len(re.findall(r"async_copy_global_to_local", k.asm["ttgir"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    rows = []
    for case in CASES:
        r = compile_case(*case)
        rows.append(r)
        print(f"{r['pass']} {r['precision']:7s} {r['rows']:3d} rows {r['num_warps']} warps tiles {r['tiles']}: "
              f"{r['programs_per_sm']} programs an SM, {r['registers']} registers, "
              f"{r['spilled_bytes']} B spilled, {r['shared_bytes'] // 1024} KiB shared, "
              f"{r['async_copies']} async copies", flush=True)
    if a.out:
        write_rows(a.out, "prf_ptxas.py", argv, rows)
    return 0


def resources(k, regs: int | None, spilled: int | None, num_warps: int, num_stages: int) -> dict:
    """A compiled kernel's row fields: its launch (warps, stages) and what it holds of an SM."""
    return {"num_warps": num_warps, "num_stages": num_stages, "registers": regs, "spilled_bytes": spilled,
            "shared_bytes": k.metadata.shared,
            "programs_per_sm": None if regs is None else programs_per_sm(regs, num_warps, k.metadata.shared)}


def resource_line(r: dict) -> str:
    """`resources`' fields as the scripts print them."""
    return (f"warps {r['num_warps']} stages {r['num_stages']}: {r['registers']} registers, {r['spilled_bytes']} B "
            f"spilled, {r['shared_bytes'] // 1024} KiB shared, {r['programs_per_sm']} an SM")


def write_rows(out: str, script: str, argv, rows: list) -> None:
    """The compiled cases' rows as JSON at `out`, with the command, triton and machine."""
    import triton

    meta = {"command": f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "triton": triton.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "target": "cuda sm_90 (compiled on the CPU, not run)"}
    Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
