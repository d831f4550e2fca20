"""Each Triton kernel compiled for Hopper (sm_90) without a GPU: its shared memory, ptxas'
registers and spills, its SASS instructions (cuobjdump's, all of the kernel's), and the
stores that Triton 3.4-3.7.0 miscompiles there (a transposed
product rounded to 16 bits and stored to shared memory for the next `tl.dot`: a 16-bit
`#linear` `local_alloc` in the TTGIR; `triton_chunked.HOPPER_TRANS_NOTE`).

The cases are tests/test_triton_compile.py's (every kernel as the backends launch it, in the
three feature modes: bf16 features, float32 by tf32x3, float32 by bf16x3), each at 4 and 8
warps and one pipeline stage. fastrpe is imported from wherever Python finds it, so that
another commit's kernels can be compiled against the same cases (`PYTHONPATH=<its src>`).
Run it with the triton the GPU runs (the H100 image's is 3.6.0: `pip install triton==3.6.0`).

    python benchmarks/hopper_trans.py --kernels dkv --out benchmarks/results/hopper_trans.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cases_module():
    """tests/test_triton_compile.py's SCRIPT as a module (triton.jit reads its kernels' source
    from a file): `all_cases`, `compile_for_h100`, `ptxas_counts`, `hopper_trans_stores`."""
    src = (HERE.parent / "tests" / "test_triton_compile.py").read_text()
    script = src.split('SCRIPT = r"""', 1)[1].split('"""', 1)[0]
    path = Path(tempfile.mkdtemp()) / "triton_compile_cases.py"
    path.write_text("RUN, TRANS = False, False\n" + script)
    spec = importlib.util.spec_from_file_location("triton_compile_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sass(k) -> list[tuple[int, str]]:
    """The SASS instructions of compiled kernel `k`, in order, as (address, text) (cuobjdump,
    from the triton install)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in out.splitlines()) if m]


def measure(kernels: str, warps: tuple[int, ...]) -> list[dict]:
    mod = cases_module()
    rows = []
    for dt, kernel, types, consts in mod.all_cases():
        fn = kernel.fn if type(kernel).__name__ == "Autotuner" else kernel
        if kernels not in fn.__name__:
            continue
        for nw in warps:
            k = mod.compile_for_h100(kernel, types, consts, num_warps=nw)
            regs, spilled = mod.ptxas_counts(k)
            rows.append({"features": dt, "MODE": consts.get("MODE"), "kernel": fn.__name__, "NB": consts.get("NB"),
                         "NEAR": consts.get("NEAR"), "num_warps": nw, "shared_bytes": k.metadata.shared,
                         "registers": regs, "spilled_bytes": spilled, "sass_instructions": len(sass(k)),
                         "hopper_trans_stores": mod.hopper_trans_stores(k)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="", help="only kernels whose name contains this (default: all)")
    ap.add_argument("--warps", default="4,8", help="num_warps to compile each case with")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import triton

    rows = measure(a.kernels, tuple(int(w) for w in a.warps.split(",")))
    # (benchmarks/ is this script's sys.path[0]; imported after the compilations, as it sets
    # TRITON_INTERPRET, with which triton.jit would interpret the kernels it decorates)
    from decode_ops import source_commit
    meta = {"command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]),
            "fastrpe_commit": source_commit(),
            "triton": triton.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (no GPU: triton's ptxas for sm_90a)",
            "target": "sm_90, one pipeline stage"}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
