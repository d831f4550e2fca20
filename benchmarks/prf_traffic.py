"""Bytes that PRF's feature maps move through memory, PyTorch ops against the Triton kernels
(`ops/triton_prf.py`), for the GPU bench's maps (NPRF, D = 64, 32 features, bf16 q and k,
B·H = 8), forward and backward of q's and k's maps. Counted on CPU: every aten op the PyTorch
map dispatches adds the bytes it reads and writes (`byte_count.ByteCounter`: each tensor
once; views and allocations count nothing); the Triton kernels' bytes are what they read and
write (x, w, φ forward; x, w, dφ, dx backward: since 2026-11-28, third session, the backward
computes φ again from x instead of reading the forward's). Time at the H100's HBM3 peak (3.35 TB/s) is
a lower bound for each, as if every op ran at full bandwidth; per-op launch overhead comes on
top (launch counts in the JSON).

    python benchmarks/prf_traffic.py --out benchmarks/results/prf_traffic.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

HBM_BYTES_PER_S = 3.35e12  # H100 SXM, HBM3 peak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from byte_count import ByteCounter  # noqa: E402


def pytorch_bytes(L: int, H: int, D: int, F: int) -> dict:
    import fastrpe as fr
    from fastrpe import kernels

    kernels.TRITON_FEATURES = "never"
    kern = fr.kernels.get_kernel("nprf", head_dim=D, num_features=F)
    kern.key_log_shift()  # cached, as in a run
    out = {}
    for name, is_query in (("q", True), ("k", False)):
        x = torch.randn(1, H, L, D, dtype=torch.bfloat16, requires_grad=True)
        with ByteCounter() as fwd:
            phi = kern(x, is_query=is_query)
        dphi = torch.randn_like(phi)
        with ByteCounter() as bwd:
            phi.backward(dphi)
        out[name] = {"forward_bytes": fwd.bytes, "forward_launches": fwd.launches,
                     "backward_bytes": bwd.bytes, "backward_launches": bwd.launches}
    return out


def triton_bytes(L: int, H: int, D: int, F: int) -> dict:
    rows, x, phi, w = H * L, 2 * D, 4 * F, 4 * F * D
    one = {"forward_bytes": rows * (x + phi) + w, "forward_launches": 1,
           "backward_bytes": rows * (x + phi + x) + w, "backward_launches": 1}  # x, dφ in; dx out
    return {"q": dict(one), "k": dict(one)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,65536")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    H, D, F = 8, 64, 32
    rows = []
    for L in (int(s) for s in a.lengths.split(",")):
        for path, fn in (("pytorch", pytorch_bytes), ("triton", triton_bytes)):
            per = fn(L, H, D, F)
            total = sum(v["forward_bytes"] + v["backward_bytes"] for v in per.values())
            launches = sum(v["forward_launches"] + v["backward_launches"] for v in per.values())
            rows.append({"L": L, "path": path, "maps": per, "total_bytes": total, "launches": launches,
                         "hbm_bound_ms": total / HBM_BYTES_PER_S * 1e3})
            print(f"L={L:<7d} {path:8s} {total / 2**20:9.1f} MiB  {launches:3d} launches  "
                  f">= {total / HBM_BYTES_PER_S * 1e3:6.3f} ms at {HBM_BYTES_PER_S / 1e12:.2f} TB/s")
    if a.out:
        meta = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                "machine": platform.machine(), "config": {"B": 1, "H": H, "D": D, "features": F, "kernel": "nprf",
                                                          "dtype": "bfloat16"},
                "hbm_bytes_per_s": HBM_BYTES_PER_S}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
