"""The FFT product (`fastrpe.ops.linear.fft.product._FFTNumDen`, forward + backward) of this
tree against the same file at another git revision, in one process, alternating: CPU seconds
(median of `--repeats`), and whether both give the same outputs and gradients. `--op
toeplitz`: the plain Toeplitz product (`fastrpe.ops.toeplitz.fft.toeplitz_matmul_fft`,
FastRPB's `W·V`) of `--value-dim` channels, the same way.

Why: until 2026-11-27 the product laid its channels out `[B, H, L, f·c]` and transformed
along L, the middle axis. torch's FFTs (pocketfft here, cuFFT on a GPU) then pad the block to
the FFT's length in one copy and move that axis last in another, inside the transform. The
channel-major layout `[B, H, f·c, N]`, with the products written into the padded buffer,
leaves both out. A GPU measures the change in the bench's `fastrpe-fft` rows; this measures
it where there is none.

    python benchmarks/fft_product_ab.py --base 9248786 --out benchmarks/results/fft_product_ab.json
    python benchmarks/fft_product_ab.py --op toeplitz --base dfa5882 --length 65536 --blocks 0 \
        --out benchmarks/results/fft_toeplitz_ab.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fastrpe.ops.linear.fft import product as current  # noqa: E402
from fastrpe.ops.toeplitz import fft as current_toeplitz  # noqa: E402

PATHS = {"product": "src/fastrpe/ops/linear/fft/product.py", "toeplitz": "src/fastrpe/ops/toeplitz/fft.py"}


def product_at(rev: str, op: str = "product"):
    """The op's file as it was at `rev`, imported as a module of its own (its relative imports
    made absolute: the rest of the package is this tree's)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{PATHS[op]}"], check=True, capture_output=True,
                          text=True).stdout
    package = PATHS[op].removeprefix("src/").rsplit("/", 1)[0].split("/")  # the file's package

    def absolute(m: re.Match) -> str:  # `from ..x import` -> `from fastrpe.ops.x import`
        up = len(m.group(1)) - 1
        return "from " + ".".join(package[:len(package) - up] + [m.group(2)]) + " import"

    text = re.sub(r"^from (\.+)([\w.]+) import", absolute, text, flags=re.M)
    path = Path(tempfile.mkdtemp()) / "product_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("product_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare with")
    ap.add_argument("--op", choices=tuple(PATHS), default="product")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--features", type=int, default=32)
    ap.add_argument("--value-dim", type=int, default=64)
    ap.add_argument("--blocks", default="8,32", help="features per block, comma-separated (toeplitz: ignored)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    base = product_at(a.base, a.op)
    this = current if a.op == "product" else current_toeplitz
    B, H, L, F, C = 1, a.heads, a.length, a.features, a.value_dim + 1
    g = torch.Generator().manual_seed(0)
    # features positive (as PRF's), values signed, a table over every offset; all take gradients
    pq, pk = (torch.rand(B, H, L, F, generator=g).requires_grad_() for _ in range(2))
    vv = torch.randn(B, H, L, C, generator=g).requires_grad_()
    c = torch.rand(H, 2 * L - 1, generator=g).requires_grad_()

    def call(mod, block):
        if a.op == "toeplitz":  # the values' C - 1 = Dv channels, a table over every offset
            y = mod.toeplitz_matmul_fft(c, vv[..., :-1], L)
            return (y, *torch.autograd.grad(y.sum(), (vv, c)))
        y, err = mod._FFTNumDen.apply(pq, pk, vv, c, block)
        return (y, err, *torch.autograd.grad(y.sum(), (pq, pk, vv, c)))

    rows = []
    names = ("y", "g_v", "g_c") if a.op == "toeplitz" else ("y", "err", "g_q", "g_k", "g_v", "g_c")
    for block in ((0,) if a.op == "toeplitz" else (int(b) for b in a.blocks.split(","))):
        times = {"base": [], "this": []}
        outs = {}
        for name, mod in (("base", base), ("this", this)) * 2:  # alternating, each warmed
            outs[name] = call(mod, block)
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                call(mod, block)
                times[name].append(time.perf_counter() - t0)
        diff = [float((x - y).detach().abs().max()) for x, y in zip(outs["base"], outs["this"])]
        row = {"block": block, "base_s": statistics.median(times["base"]), "this_s": statistics.median(times["this"]),
               "max_abs_diff": dict(zip(names, diff))}
        row["speedup"] = row["base_s"] / row["this_s"]
        rows.append(row)
        print(f"block {block:3d}: {a.base} {row['base_s']:.2f} s, this tree {row['this_s']:.2f} s "
              f"({row['speedup']:.2f}x); max |diff| " + ", ".join(f"{k} {v:.1e}" for k, v in row["max_abs_diff"].items()))
    if a.out:
        res = {"command": "python benchmarks/fft_product_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
               "op": a.op, "problem": {"B": B, "H": H, "L": L, "F": F, "C": C, "dtype": "float32"}, "base": a.base,
               "rows": rows}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
