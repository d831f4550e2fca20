"""How far triton_tiled's weight table (`exp_table`: `exp(b - top)` times each row's
`exp(top - m)`) moves a float32 call from float64, against the span of the table, compared with
the same kernels taking an exponential per pair and with the dense float32 path.

Why: each table weight and each row factor is the exponential of a rounded float32 number as
large as the head's span, so a weight near its row's maximum errs by about span·2^-24 where
`exp(b - m)` errs by an ulp. `EXP_TABLE_SPAN` (float32: 20 nats) is where the table stops; this
says what the error is on either side of it.

How: under the Triton interpreter on the CPU (the products are float32 ones there, as ieee's
on a GPU). One causal head, 130 tokens, 8 features and 6 values per token from
`fastrpe.testing.features_and_values`, the features scaled by `--feature-scale` (small features:
a small den), and a table `b(r) = slope·|r|` whose largest entry is the farthest offset, so the
first queries' own maxima lie the whole span below the top. For each span, the largest absolute
error against float64 of the output (the quotient) and of the gradients of the features, the
values and the table (`weighted_grads`), for three float32 computations: the kernels with the
table (forced on whatever the span, `EXP_TABLE_SPAN` raised), with exponentials
(`EXP_TABLE = False`), and the dense reference (`kernelized_num_den_naive`); and each kernel's
error over the dense path's.

    python benchmarks/table_span.py --out benchmarks/results/table_span.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch

NAMES = ("out", "dq", "dk", "dv", "dtable")


def _dense(q, k, v, lc):
    """The quotient from the dense reference (`kernelized_num_den_naive`), causal."""
    from fastrpe.ops.linear.naive import kernelized_num_den_naive
    from fastrpe.testing import quotient_reference

    num, den, _ = kernelized_num_den_naive(q, k, v, lc, causal=True)
    return quotient_reference(num, den)


def errors(span: float, feature_scale: float, L: int = 130) -> dict:
    from fastrpe.ops.linear import triton_tiled as tt
    from fastrpe.testing import features_and_values, weighted_grads

    q, k, v = features_and_values(1, 1, L, L, 8, 6)
    r = torch.arange(-(L - 1), L, dtype=torch.float64)
    lc = (span / (L - 1) * r.abs())[None]
    base = (feature_scale * q.detach(), feature_scale * k.detach(), v.detach(), lc)

    def run(dtype, how):
        leaves = [t.to(dtype).requires_grad_() for t in base]
        if how == "dense":
            out = _dense(*leaves)
        else:
            saved = tt.EXP_TABLE, dict(tt.EXP_TABLE_SPAN)
            tt.EXP_TABLE = how == "table"
            tt.EXP_TABLE_SPAN[torch.float32] = max(saved[1][torch.float32], span + 1.0)
            try:
                out = tt.kernelized_num_den_triton_tiled(*leaves, causal=True, divide=dtype)[0]
            finally:
                tt.EXP_TABLE, tt.EXP_TABLE_SPAN[torch.float32] = saved[0], saved[1][torch.float32]
        return [out.detach(), *weighted_grads([out], leaves)]

    ref = run(torch.float64, "dense")
    row = {"span": span, "feature_scale": feature_scale}
    for how in ("table", "exponentials", "dense"):
        got = run(torch.float32, how)
        row[how] = {n: (g.double() - w).abs().max().item() for n, g, w in zip(NAMES, got, ref)}
    for how in ("table", "exponentials"):
        row[f"{how}_over_dense"] = {n: row[how][n] / max(row["dense"][n], 1e-300) for n in NAMES}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spans", default="5,10,20,40,60,77", help="nats between the table's smallest and largest entry")
    ap.add_argument("--feature-scale", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [errors(float(s), a.feature_scale) for s in a.spans.split(",")]
    print(f"{'span':>5s}  " + "  ".join(f"{n + ' tab/exp':>16s}" for n in NAMES) + "   (x the dense float32 error)")
    for r in rows:
        print(f"{r['span']:5.0f}  " + "  ".join(f"{r['table_over_dense'][n]:7.2f}/{r['exponentials_over_dense'][n]:<7.2f}"
                                            for n in NAMES))
    if a.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from decode_ops import source_commit
        meta = {"command": " ".join(["python benchmarks/table_span.py", *(argv if argv is not None else sys.argv[1:])]),
                "fastrpe_commit": source_commit(), "torch": torch.__version__, "python": platform.python_version(),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Triton interpreter (float32 products)",
                "config": {"B": 1, "H": 1, "L": 130, "F": 8, "Dv": 6, "causal": True, "dtype": "float32",
                           "feature_scale": a.feature_scale}}
        a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
