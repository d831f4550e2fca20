"""`fastrpe explain`: which backend `auto` picks for a shape, and why."""
from __future__ import annotations

import argparse

import torch


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="show which backend auto picks for a problem and why",
                       description="Builds random q, k, v of the given shapes and prints fastrpe.explain().")
    p.add_argument("--batch", "-B", type=int, default=1)
    p.add_argument("--heads", "-H", type=int, default=8)
    p.add_argument("--length", "-L", type=int, default=4096, help="query length (and key length unless --key-length)")
    p.add_argument("--key-length", type=int, default=None)
    p.add_argument("--dim", "-D", type=int, default=64)
    p.add_argument("--kernel", default="softmax", help="softmax, elu, relu, exp, prf, orf, sphere_prf, trf, dpfp (n-prefix: normalized)")
    p.add_argument("--position", default="none", help="none or a positional family name (see fastrpe.positions.NAMES)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--grad", action="store_true", help="plan for a backward pass")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    return p


def run(args) -> int:
    import fastrpe as fr
    from .._validate import FastRPEError, check_device

    for opt in ("batch", "heads", "length", "key_length", "dim"):
        v = getattr(args, opt)
        if v is not None and v < 1:
            raise FastRPEError(f"--{opt.replace('_', '-')}: must be >= 1, got {v}")
    check_device(args.device, "--device")
    dt = getattr(torch, args.dtype)
    Lk = args.key_length or args.length
    # meta-free: explain only needs shapes, but attention's checks look at values; keep tensors tiny in D
    q = torch.zeros(args.batch, args.heads, args.length, args.dim, dtype=dt, device=args.device, requires_grad=args.grad)
    k = torch.zeros(args.batch, args.heads, Lk, args.dim, dtype=dt, device=args.device)
    v = torch.zeros(args.batch, args.heads, Lk, args.dim, dtype=dt, device=args.device)
    position = None if args.position == "none" else fr.positions.make(args.position, args.heads).to(args.device)
    with torch.set_grad_enabled(args.grad):  # learnable positional terms would otherwise imply a backward
        print(fr.explain(q, k, v, kernel=args.kernel, position=position, causal=args.causal))
    return 0
