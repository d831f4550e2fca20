"""What one tile pair costs in triton_tiled's loops on Hopper (sm_90), counted without a GPU:
the SASS instructions of a loop iteration, edge tile pairs (masked: the call's borders and the
causal diagonal) against interior ones (read without masks), each with its weights by an
exponential per pair ("exp") or from the call's table `exp(b - top)` ("table",
`triton_tiled.exp_table`), with each kernel's registers and spills as ptxas reports them.

Why: at 64k tokens and causal, 1,023 of every 1,024 tile pairs of a query tile's walk are
interior, and every one of them paid for the masks of a 64x64 tile until `_interior` split
them off. A kernel whose loop is mostly instruction issue (the bf16-feature loops have 6-12
tensor-core instructions among 500-900 per iteration) should feel the difference; the H100
says whether it does (the bench's triton_tiled rows).

How: the kernels are compiled as the bench launches them (tests/test_triton_compile.py's
`compile_for_h100`: every pointer 16-byte aligned, L, F = 32, Dv = 64 and q_offset multiples of
16; here at 4 warps, the H100 autotuner's pick, and one stage), in its three feature modes
(bf16 features; float32 features by tf32x3; by bf16x3). Each kernel three ways: as shipped, and with its loop's branch
fixed to the edge body (every tile masked: the kernel before `_interior`, the same registers
and spills) or to the interior one (wrong results; counted only), and its head's weights fixed to
one source (`WEIGHTS`), from a rewritten copy of ops/linear/triton_tiled.py. An iteration's SASS is the instructions between the loop's head
and its backward branch (cuobjdump, from the triton install).

    python benchmarks/tile_bodies.py --out benchmarks/results/tile_bodies.json   # triton 3.6.0
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the branch each kernel's loop takes per tile pair (forward and dq walk keys, dkv queries)
BRANCHES = ("if (j0 >= a) & (j0 < b):", "if (i0 >= a) & (i0 < b):")
#: where each kernel reads its head's choice: the weights from the table, or by exponentials
WEIGHTS = "fast = tl.load(fast_ptr + hh) != 0"
#: the variants measured: as shipped, then (body, weights) fixed
VARIANTS = ("shipped", "edge-exp", "interior-exp", "edge-table", "interior-table")


@functools.cache
def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiled_variant(variant: str):
    """ops/linear/triton_tiled.py as shipped ("shipped"), or with every loop's branch fixed to
    the "edge" or the "interior" body and every head's weights to the "exp" or the "table" walk
    ("interior-table", ...), imported from a copy (triton.jit reads a kernel's source from its
    file)."""
    from fastrpe.ops.linear import triton_tiled

    if variant == "shipped":
        return triton_tiled
    body, weights = variant.split("-")
    src = Path(triton_tiled.__file__).read_text()
    for cond in BRANCHES:
        assert src.count(cond) == (2 if cond.startswith("if (j0") else 1), f"{cond!r}: the loops changed"
        src = src.replace(cond, "if True:" if body == "interior" else "if False:")
    assert src.count(WEIGHTS) == 1, f"{WEIGHTS!r}: the kernels changed"
    src = src.replace(WEIGHTS, f"fast = tl.full((), {int(weights == 'table')}, tl.int32) != 0")
    src = src.replace("from ..._validate", "from fastrpe._validate").replace("from .triton_chunked",
                                                                             "from fastrpe.ops.linear.triton_chunked")
    path = Path(tempfile.mkdtemp()) / f"triton_tiled_{body}_{weights}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loop_sass(k) -> dict:
    """The SASS of `k`'s loops (instructions between a branch target and a later branch back to
    it): instructions, and local-memory stores and loads (spills) among them."""
    ins = _sibling("hopper_trans").sass(k)
    at = {a: n for n, (a, _) in enumerate(ins)}
    loop = set()
    for n, (_, text) in enumerate(ins):
        m = re.search(r"BRA.*?(0x[0-9a-f]+)", text)
        if m and at.get(int(m.group(1), 16), n) < n:
            loop.update(range(at[int(m.group(1), 16)], n + 1))
    return {"loop_sass": len(loop), "loop_local": sum(1 for n in loop if re.search(r"\b(STL|LDL)", ins[n][1]))}


def cases(compiled):
    """(features, MODE, kernel name, pointer types, constexprs): test_triton_compile's tiled
    cases (float32 features, tf32x3 and bf16x3; with the table, `ETAB`) and the same with bf16
    features (MODE 0)."""
    import triton.language as tl

    out = []
    for dt, kernel, types, consts in compiled.all_cases():
        fn = kernel.fn if type(kernel).__name__ == "Autotuner" else kernel
        if not fn.__name__.startswith("_tiled") or not consts.get("ETAB"):
            continue
        out.append((dt, consts["MODE"], fn.__name__, types, consts))
        if consts["MODE"] == 2:
            out.append(("bf16", 0, fn.__name__, {**types, "q_ptr": "bf16", "k_ptr": "bf16"},
                        {**consts, "DT": tl.bfloat16, "MODE": 0}))
    return sorted(out, key=lambda c: (c[2], c[1]))


def measure(compiled, kernels: str = "", modes: tuple[int, ...] = (0, 2, 3), log=print) -> list[dict]:
    """`compiled`: tests/test_triton_compile.py's script as a module (`hopper_trans.cases_module`)."""
    mods = {v: tiled_variant(v) for v in VARIANTS}
    rows = []
    for dt, mode, name, types, consts in cases(compiled):
        if kernels not in name or mode not in modes:
            continue
        row = {"kernel": name, "features": dt, "MODE": mode}
        for v, mod in mods.items():
            k = compiled.compile_for_h100(getattr(mod, name), types, consts, num_warps=4)
            regs, spilled = compiled.ptxas_counts(k)
            row[v] = {"registers": regs, "spilled_bytes": spilled, "shared_bytes": k.metadata.shared,
                      **loop_sass(k)}
        rows.append(row)
        log(json.dumps(row))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="", help="only kernels whose name contains this (default: all three)")
    ap.add_argument("--modes", default="0,2,3", help="feature modes (`_dot`'s MODE): 0 bf16 features, 2 float32 by "
                    "tf32x3, 3 float32 by bf16x3")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import triton

    compiled = _sibling("hopper_trans").cases_module()
    rows = measure(compiled, a.kernels, tuple(int(m) for m in a.modes.split(",")))
    if a.out:
        # (benchmarks/ is this script's sys.path[0]; imported after the compilations, as it sets
        # TRITON_INTERPRET, as hopper_trans.py does)
        from decode_ops import source_commit
        meta = {"command": " ".join(["python benchmarks/tile_bodies.py", *(argv if argv is not None else sys.argv[1:])]),
                "triton": triton.__version__, "python": platform.python_version(),
                "machine": f"{platform.machine()}, no GPU (sm_90 by triton's ptxas)",
                "fastrpe_commit": source_commit(),
                "config": {"num_warps": 4, "num_stages": 1,
                           "aligned_ints": list(compiled.ALIGNED_INTS)}}
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
