"""Host time of one `fastrpe.attention` call on the Triton backends, forward and backward, eager
and under `torch.compile`, counted on the CPU: what the Python around the kernels costs.

At 4,096 tokens on the H100 every eager Triton row took 1.8-3.8 ms against compiled Flex's
0.9-1.6, and about 1.6 ms of triton_chunked's time did not grow with L (docs/RESULTS.md, "Second
H100 session"). `benchmarks/gpu_profile.py` measures the GPU's busy share there; this measures,
without a GPU, the host side that a GPU call pays before its launches reach the device:
- the Triton kernels run under the interpreter with their launches replaced by no-ops (a GPU
  launch's own host cost, Triton's launcher, is not in these numbers);
- the aten ops run on CPU tensors at a toy length (`--length`, default 16), so that their
  arithmetic is negligible and their dispatch is what is left;
- the GPU's bf16 policy is forced (`backends_triton.lowp_dots`), and the input check's
  non-finite test, which runs on CPU tensors only, is switched off as on a GPU.
"compiled" is `torch.compile(fullgraph=True, dynamic=False)` (Inductor): the kernels are custom
ops in the graph and the feature maps Inductor's C++ kernels, which do real (small) work here,
while eager's feature maps are Triton kernels and stubbed. Best of `--repeats` rounds of
`--calls` calls, one thread.

    python benchmarks/host_time.py --out benchmarks/results/host_time.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch

HERE = Path(__file__).resolve().parent
CASES = (("triton_chunked", "alibi"), ("triton_soe", "kerple_log"), ("triton_band", "t5"),
         ("triton_tiled", "learned"))


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def measure(L: int, calls: int, repeats: int, modes: tuple[str, ...]) -> list[dict]:
    import triton.runtime.interpreter as interp

    import fastrpe as fr
    from fastrpe import api, kernels
    from fastrpe import backends_triton as bt
    from fastrpe.bench.gpu import make_position

    H, D, F = 8, 64, 32
    lowp, check = bt.lowp_dots, api.check_qkv
    saved = (interp.InterpretedFunction.run, bt.INTERPRET_ON_CPU, bt.lowp_dots, kernels.TRITON_FEATURES,
             api.check_qkv)
    interp.InterpretedFunction.run = lambda self, *a, **k: None  # no kernel runs: host time only
    bt.INTERPRET_ON_CPU = True
    bt.lowp_dots = lambda p: lowp(dataclasses.replace(p, device=torch.device("cuda")))
    kernels.TRITON_FEATURES = "always"
    api.check_qkv = lambda q, k, v: check(q, k, v, check_finite=False)  # skipped on a GPU
    rows = []
    try:
        for backend, family in CASES:
            kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
            pos = make_position(family, H, L)
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, H, L, D, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))

            def f(q, k, v, backend=backend, kern=kern, pos=pos):
                return fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=backend)

            row = {"backend": backend, "family": family, "L": L}
            for mode in modes:
                torch._dynamo.reset()
                fn = f if mode == "eager" else torch.compile(f, fullgraph=True, dynamic=False)

                def call(fn=fn, q=q, k=k, v=v):
                    fn(q, k, v).float().sum().backward()

                row[f"{mode}_us"] = round(per_call_us(call, calls, repeats), 1)
            rows.append(row)
    finally:
        (interp.InterpretedFunction.run, bt.INTERPRET_ON_CPU, bt.lowp_dots, kernels.TRITON_FEATURES,
         api.check_qkv) = saved
    return rows


def _source_commit():
    spec = importlib.util.spec_from_file_location("decode_ops", HERE / "decode_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.source_commit()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16, help="tokens (toy: the aten ops' arithmetic stays negligible)")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    if not modes or any(m not in ("eager", "compiled") for m in modes):
        print(f"host_time: --modes takes eager and/or compiled, got {a.modes!r}")
        return 2
    torch.set_num_threads(1)
    rows = measure(a.length, a.calls, a.repeats, modes)
    print(f"{'backend':15s} {'family':11s} " + " ".join(f"{m + ' µs':>12s}" for m in modes))
    for r in rows:
        print(f"{r['backend']:15s} {r['family']:11s} " + " ".join(f"{r[m + '_us']:12.1f}" for m in modes))
    if a.out:
        meta = {"command": " ".join(["python", "benchmarks/host_time.py", *(argv if argv is not None else sys.argv[1:])]),
                "fastrpe_commit": _source_commit(), "torch": torch.__version__, "python": platform.python_version(),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread",
                "config": {"B": 1, "H": 8, "D": 64, "features": 32, "kernel": "nprf", "dtype": "bfloat16",
                           "causal": True, "calls": a.calls, "repeats": a.repeats}}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
