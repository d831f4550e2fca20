"""Compile one small Triton kernel for Hopper (sm_90) into TRITON_CACHE_DIR, without a GPU
(triton ships ptxas), and say whether Triton's cache held it: one JSON line,
{"hit": ..., "seconds": ..., "name": ..., "cubin": <bytes>, "triton": <version>}, or
{"skip": why} where this triton cannot compile for sm_90.

For the compile-cache round trip (benchmarks/compile_cache.py): gpu_run.sh's SMOKE runs it
before packing, so that a machine without a GPU packs a real Triton entry (a CPU smoke compiles
nothing else), and a smoke `rest` unpacking `first`'s pack finds it there (hit: true);
tests/test_compile_cache.py runs it around a pack and an unpack. `--forbid-compile` makes a
miss an error: the compile stages raise (a hit runs none of them).

    TRITON_CACHE_DIR=/tmp/c python benchmarks/compile_cache_toy.py [--forbid-compile]
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # an interpreted kernel does not compile

import triton  # after TRITON_INTERPRET is gone
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.exp(a * x) + y, mask=m)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    forbid = "--forbid-compile" in argv
    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    if forbid:
        def refuse(*a, **k):
            raise AssertionError("compiled: the cache missed")
        ASTSource.make_ir = refuse
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "a": "fp32", "n": "i32", "BLOCK": "constexpr"}
    src = ASTSource(_axpy, sig, constexprs={(5,): 256})
    t0 = time.perf_counter()
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    except Exception as e:  # said: no sm_90 compile here (no ptxas, an old triton)
        if forbid:
            raise
        print(json.dumps({"skip": f"{type(e).__name__}: {str(e).strip()[:300]}"}))
        return 0
    print(json.dumps({"hit": hits[-1] if hits else None, "seconds": round(time.perf_counter() - t0, 3),
                      "name": k.metadata.name, "cubin": len(k.asm["cubin"]), "triton": triton.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
