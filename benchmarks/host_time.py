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
`--calls` calls (after 20 to warm), one thread.

    python benchmarks/host_time.py --out benchmarks/results/host_time.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """The module of benchmarks/<name>.py (the cases and the CPU setup are call_launches'; the
    timing loop is auto_overhead's)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_launches = _sibling("call_launches")
CASES = _launches.CASES


def measure(L: int, calls: int, repeats: int, modes: tuple[str, ...]) -> list[dict]:
    from unittest import mock

    from fastrpe import api

    per_call_ms = _sibling("auto_overhead").per_call_ms
    H, D, F = 8, 64, 32
    check = api.check_qkv
    rows = []
    # no kernel runs (host time only), and the non-finite check is skipped, as on a GPU
    with _launches.gpu_policy_on_cpu(lambda self, *a, **k: None, "always"), \
            mock.patch.object(api, "check_qkv", lambda q, k, v: check(q, k, v, check_finite=False)):
        for backend, family in CASES:
            f, q, k, v = _launches.case_call(backend, family, L, H, D, F)
            row = {"backend": backend, "family": family, "L": L}
            for mode in modes:
                torch._dynamo.reset()
                fn = f if mode == "eager" else torch.compile(f, fullgraph=True, dynamic=False)

                def call(fn=fn, q=q, k=k, v=v):
                    fn(q, k, v).float().sum().backward()

                row[f"{mode}_us"] = round(per_call_ms(call, calls, repeats) * 1e3, 1)
            rows.append(row)
    return rows


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
                "fastrpe_commit": _launches._decode_ops().source_commit(), "torch": torch.__version__, "python": platform.python_version(),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread",
                "config": {"B": 1, "H": 8, "D": 64, "features": 32, "kernel": "nprf", "dtype": "bfloat16",
                           "causal": True, "calls": a.calls, "repeats": a.repeats}}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
