"""Launches of one `fastrpe.attention` call, forward and backward, on the Triton backends, as a
GPU would issue them: the aten operations dispatched outside the kernels (a
`TorchDispatchMode`; views and ops that launch nothing are left out, as in decode_ops.py) and
the Triton kernel launches. Counted on CPU, with the kernels under Triton's interpreter and the
backends' GPU choices forced (`backends_triton.INTERPRET_ON_CPU`, the bf16 policy of CUDA). The
ops the interpreter itself dispatches inside a kernel are not counted. The forward counts
include the input check's non-finite test (18 launches: `isfinite`, `all`, `stack`, `item`),
which runs on CPU tensors only: a CUDA call has 18 fewer.

At short lengths a call's GPU time is mostly launches: at 4,096 tokens, compiled Flex with ALiBi
takes 1.36 ms on the H100 (issue 12's table), and each eager launch costs several µs of GPU time
and more of Python time.

    python benchmarks/call_launches.py --out benchmarks/results/call_launches.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = (("triton_chunked", "alibi"), ("triton_soe", "kerple_log"), ("triton_band", "t5"),
         ("triton_tiled", "learned"))


def _decode_ops():
    spec = importlib.util.spec_from_file_location("decode_ops", HERE / "decode_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def gpu_policy_on_cpu(run, features: str):
    """Inside: the Triton backends take CPU tensors under the interpreter, each interpreted
    launch goes through `run(self, *args, **kwargs)` (in place of `InterpretedFunction.run`),
    the bf16 policy is CUDA's (`backends_triton.lowp_dots`) and `kernels.TRITON_FEATURES` is
    `features`; all restored after."""
    import triton.runtime.interpreter as interp

    import fastrpe.backends_triton as bt
    from fastrpe import kernels

    lowp = bt.lowp_dots
    saved = (interp.InterpretedFunction.run, bt.INTERPRET_ON_CPU, bt.lowp_dots, kernels.TRITON_FEATURES)
    interp.InterpretedFunction.run = run
    bt.INTERPRET_ON_CPU = True
    bt.lowp_dots = lambda p: lowp(dataclasses.replace(p, device=torch.device("cuda")))
    kernels.TRITON_FEATURES = features
    try:
        yield
    finally:
        interp.InterpretedFunction.run, bt.INTERPRET_ON_CPU, bt.lowp_dots, kernels.TRITON_FEATURES = saved


def case_call(backend: str, family: str, L: int, H: int, D: int, F: int):
    """`(f, q, k, v)`: `f(q, k, v)`, the case's causal `fastrpe.attention` call (NPRF features,
    the bench's frozen term), and its seeded bf16 inputs `[1, H, L, D]`, requiring grad."""
    import fastrpe as fr
    from fastrpe.bench.gpu import make_position

    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    pos = make_position(family, H, L)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))

    def f(q, k, v):
        return fr.attention(q, k, v, kernel=kern, position=pos, causal=True, backend=backend)

    return f, q, k, v


def count(L: int, H: int, D: int, F: int, features: str) -> list[dict]:
    import triton.runtime.interpreter as interp

    ops = _decode_ops()
    inside = {"depth": 0, "kernels": collections.Counter()}
    run = interp.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        inside["kernels"][self.fn.__name__] += 1
        inside["depth"] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside["depth"] -= 1

    class Outside(ops.OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if inside["depth"]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    rows = []
    with gpu_policy_on_cpu(counted_run, features):
        for backend, family in CASES:
            f, q, k, v = case_call(backend, family, L, H, D, F)

            def call(f=f, q=q, k=k, v=v):
                return f(q, k, v)

            call().sum().backward()  # warm: memos, fit verdicts
            row = {"backend": backend, "family": family, "L": L, "features": features}
            for phase in ("forward", "backward"):
                inside["kernels"].clear()
                with Outside() as c:
                    if phase == "forward":
                        out = call()
                    else:
                        out.backward(torch.ones_like(out))
                row[phase] = {"aten_launches": c.launches, "triton_launches": sum(inside["kernels"].values()),
                              "aten_ops": c.by_name(), "kernels": dict(inside["kernels"])}
            row["total_launches"] = sum(row[ph]["aten_launches"] + row[ph]["triton_launches"]
                                        for ph in ("forward", "backward"))
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=256, help="tokens (the counts do not depend on it)")
    ap.add_argument("--features", default="always,never",
                    help="kernels.TRITON_FEATURES settings to count (always: the Triton maps)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    H, D, F = 8, 64, 32
    rows = [r for f in a.features.split(",") for r in count(a.length, H, D, F, f)]
    print(f"{'backend':15s} {'family':11s} {'features':8s} {'fwd aten+triton':>16s} {'bwd aten+triton':>16s} {'total':>6s}")
    for r in rows:
        fw, bw = r["forward"], r["backward"]
        print(f"{r['backend']:15s} {r['family']:11s} {r['features']:8s} "
              f"{fw['aten_launches']:>10d} + {fw['triton_launches']:<3d} {bw['aten_launches']:>10d} + "
              f"{bw['triton_launches']:<3d} {r['total_launches']:6d}")
    if a.out:
        sys.path.insert(0, str(HERE))
        meta = {"command": " ".join(["python", *sys.argv]), "fastrpe_commit": _decode_ops().source_commit(),
                "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "config": {"B": 1, "H": H, "D": D, "features": F, "kernel": "nprf", "dtype": "bfloat16",
                           "L": a.length, "causal": True}}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
