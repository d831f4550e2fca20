"""PRF/NPRF feature-map kernels (`fastrpe.ops.triton_prf`) over their launch choices, at the
GPU bench's shape: positions per program (BR), warps and the projection's product precision.

Why: on the H100 (2026-11-27, benchmarks/results/gpu/h100-2026-11-27-profile.json) q's and
k's maps took 0.37 ms per forward launch and 0.31 ms per backward launch at 65,536 tokens x 8
heads, 1.37 ms of triton_chunked's 5.6 ms ALiBi call. Each forward launch reads bf16 x
(64 MiB) and writes float32 phi (64 MiB): about 0.04 ms at the H100's 3.35 TB/s. A 64-row
program holds 150 registers per thread (ptxas, sm_90), three programs per SM, and multiplies
its [64, 64] x [64, 32] projection on the CUDA cores ("ieee"); which of these holds the
kernels 9x above their traffic is what this measures. Every variant's output is checked
against the library's launch (the default choice) first.

    python benchmarks/prf_sweep.py --warm                                 # compile only (beside other work)
    python benchmarks/prf_sweep.py --out runs/gpu/prf_sweep.json          # then time (~15 s warm, ~1 min cold)
    python benchmarks/prf_sweep.py --device cpu --lengths 40 --configs 16:4:ieee  # interpreter
    python benchmarks/prf_sweep.py --choose runs/gpu/prf_sweep.json   # the config to adopt, or nothing

`choose` takes, for each pass, the fastest config whose q and k maps' results are within
ADOPT_RTOL of the library's launch's, and adopts the pair ("FWD" or "FWD/BWD") where its four
launches take at most ADOPT_SHARE of the library's. A query map's backward is fed the dφ an
attention call gives it (`attention_like_query_grad`). benchmarks/gpu_run.sh sets
FASTRPE_PRF_LAUNCH to it (`triton_prf` reads it when imported) for the bench rows it times
after the sweep; the rows' run records the choice (gpu.json's `envs`, `prf_launch`). Making
it the default is then a one-line change in triton_prf.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fastrpe import kernels
from fastrpe._validate import FastRPEError
from fastrpe.bench.runner import _time as time_call
from fastrpe.ops import triton_prf as tp
from fastrpe.ops.linear import triton_chunked as tc

#: BR:num_warps:precision[:tiles], each tried in turn (the first are the library's own choices,
#: triton_prf's forward and backward launches). tf32x3 shapes since it won on the H100
#: (2026-11-27: the four launches 0.75 ms against ieee's 1.71). The seventh H100 session
#: (2026-11-28) found row tiles no faster (":4" 0.983 ms, ":8" 0.988, against 0.925) and bf16x3
#: faster (0.771); since, each pass has its own pick (`choose`), and the shapes tried are those
#: that hold more rows or warps an SM (ptxas for sm_90, results/prf_ptxas-sm90.json,
#: `programs_per_sm`): the backward holds 2 programs of 64 rows and 4 warps an SM in tf32x3 (183
#: registers a thread), 3 in bf16x3 (167), 5 of 16 rows and 4 warps, 4 of 32 rows and 4 warps,
#: 7 of 16 rows and 2 warps; the forward 6 of 64 rows and 4 warps in tf32x3, 10 in bf16x3
CONFIGS = tuple(dict.fromkeys((tp.forward_launch().spec(), tp.backward_launch().spec(), "64:4:bf16x3", "16:4:bf16x3",
                                "32:4:bf16x3", "16:2:bf16x3", "128:8:bf16x3", "64:8:bf16x3", "32:4:tf32x3",
                                "64:4:bf16x3:4")))


def _launch(which: str, x, w, shift, phi, dphi, dx, kern, is_query: bool, launch):
    """The library's launch (`triton_prf.prf_forward_launch` / `prf_backward_launch`) with
    these choices (a `triton_prf.Launch`)."""
    choices = launch._asdict()
    if which == "fwd":
        tp.prf_forward_launch(x, w, shift, phi, kern, is_query, **choices)
    else:
        tp.prf_backward_launch(x, w, phi, dphi, dx, kern, is_query, **choices)


def _time(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` after one call (CUDA events on a GPU, the bench's timer);
    `repeats` 0 (--warm): the one call only."""
    if repeats == 0:
        fn()
        return 0.0
    return time_call(fn, device, repeats, warmup=1, cpu_peak=False)[0]


def attention_like_query_grad(dphi: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """dφ less, in each row, its part along φ: what a query map receives from normalized
    attention, whose output `φ(q)·S / φ(q)·z` does not change when a row of φ(q) is scaled, so
    that `Σ_f dφ·φ = 0` in every row (to round-off: tests/test_prf_sweep.py,
    `test_attention_gives_a_query_map_a_gradient_orthogonal_to_its_features`, float64). Fed a
    random dφ instead, the query map's backward sends the row's `Σ dφ·φ` to the feature of its
    largest exponent, and two precisions that pick different features in a near tie differ by
    that much times the gap of their projections: 0.30 of 0.98 for bf16x3 on the H100
    (2026-11-28, h100-2026-11-28-profile.json), a difference no attention call can see."""
    return dphi - phi * ((dphi * phi).sum(-1, keepdim=True) / (phi * phi).sum(-1, keepdim=True).clamp_min(1e-30))


def sweep(device: torch.device, L: int, configs, repeats: int = 20, H: int = 8, D: int = 64, features: int = 32,
          dtype=torch.bfloat16, log=print) -> list[dict]:
    """One row per (config, map: query or key, direction), seconds per launch and the largest
    difference from the first config's result (a query's backward fed
    `attention_like_query_grad`)."""
    kern = kernels.get_kernel("nprf", head_dim=D, num_features=features)
    kern = kern.to(device) if isinstance(kern, torch.nn.Module) else kern
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, H, L, D, generator=g).to(device=device, dtype=dtype)
    w = kern.w.to(device=device, dtype=torch.float32).contiguous()
    shift = kern.key_log_shift().to(device=device, dtype=torch.float32).reshape(-1)
    F = kern.num_features(D)
    dphi = torch.randn(1, H, L, F, generator=g).to(device)
    rows, ref, dphi_q = [], {}, None  # (dphi_q: the query backward's, made once from the first forward)
    for spec in configs:
        launch = tp.parse_launch(spec)
        for is_query in (True, False):
            phi = torch.empty(1, H, L, F, dtype=torch.float32, device=device)
            dx = torch.empty_like(x)
            for which in ("fwd", "bwd"):
                if which == "bwd":  # from the library's own forward, as autograd runs it
                    phi_in = ref[(is_query, "fwd")]
                else:
                    phi_in = phi
                grad = dphi
                if is_query and which == "bwd":
                    if dphi_q is None:
                        dphi_q = attention_like_query_grad(dphi, ref[(True, "fwd")])
                    grad = dphi_q

                def call(which=which, phi_in=phi_in, grad=grad, dx=dx, is_query=is_query, launch=launch):
                    _launch(which, x, w, shift, phi_in, grad, dx, kern, is_query, launch)
                row = {"config": spec, "BR": launch.block_rows, "num_warps": launch.num_warps,
                       "precision": launch.precision, "tiles": launch.tiles,
                       "map": "query" if is_query else "key", "pass": which}
                try:
                    row["seconds"] = _time(call, device, repeats)
                    got = (phi_in if which == "fwd" else dx).float().clone()
                    key = (is_query, which)
                    if key not in ref:
                        ref[key] = got
                    row["max_abs_diff"] = float((got - ref[key]).abs().max())
                    row["ref_max_abs"] = float(ref[key].abs().max())
                except Exception as e:  # noqa: BLE001 - a config that does not compile says why, the next goes on
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                rows.append(row)
                head = row.get("error") or f"{row['seconds'] * 1e3:8.4f} ms  max |diff| {row['max_abs_diff']:.2e}"
                log(f"L={L:<7d} {spec:14s} {row['map']:5s} {which}  {head}", flush=True)
    return rows


#: how far a choice's result may be from the library's launch's, relative to its largest
#: entry, to be adopted: phi (float32) to about tf32x3's accuracy; dx is stored in x's dtype,
#: where another summation order may round the largest entry one bf16 step the other way
ADOPT_RTOL = {"fwd": 1e-4, "bwd": 2.0 ** -7}
#: a choice is adopted when the four launches (q and k, forward and backward) take at most
#: this share of the library's choice's time (the rest is noise between runs)
ADOPT_SHARE = 0.95


def library_launches(configs) -> list[str]:
    """`[forward, backward]`: the library's launches where `configs` has both, else its first
    config for both (what `choose` compares against)."""
    lib = [tp.forward_launch().spec(), tp.backward_launch().spec()]
    return lib if all(c in configs for c in lib) else [configs[0], configs[0]]


def choose(rows: list[dict], L: int, library: tuple[str, str] | None = None) -> tuple[str | None, dict]:
    """`(launch to adopt or None, totals)` at length L: for each pass (forward, backward) the
    config whose two launches (q's and k's maps) take least time among those whose results are
    within `ADOPT_RTOL` of the library's launch's (and whose four launches all ran); adopted as
    "FWD" (one config for both) or "FWD/BWD" (`triton_prf.parse_launches`) when the four
    launches take at most `ADOPT_SHARE` of the library's (`library`: its forward and backward
    configs, `library_launches`; default the rows' first config for both). `totals`: each
    config's four launches, seconds."""
    at = [r for r in rows if r.get("L", L) == L]
    if not at:
        return None, {}
    lib = library or (at[0]["config"], at[0]["config"])
    by: dict[str, list[dict]] = {}
    for r in at:
        by.setdefault(r["config"], []).append(r)

    def timed(rs):
        return all("seconds" in r and "error" not in r for r in rs)

    def close(r):
        return ("max_abs_diff" in r
                and r["max_abs_diff"] <= ADOPT_RTOL[r["pass"]] * max(r.get("ref_max_abs", 0.0), 1e-30))

    totals = {c: sum(r["seconds"] for r in rs) for c, rs in by.items() if len(rs) == 4 and timed(rs)}
    per: dict[str, dict[str, float]] = {"fwd": {}, "bwd": {}}  # pass -> config -> its two launches
    for c, rs in by.items():
        if c not in totals:  # a config with a launch that failed is taken for neither pass
            continue
        for w in per:
            two = [r for r in rs if r["pass"] == w]
            if len(two) == 2 and timed(two) and all(close(r) for r in two):
                per[w][c] = sum(r["seconds"] for r in two)
    if lib[0] not in per["fwd"] or lib[1] not in per["bwd"]:
        return None, totals
    best = {w: min(per[w], key=per[w].get) for w in per}
    now = per["fwd"][lib[0]] + per["bwd"][lib[1]]
    if (best["fwd"], best["bwd"]) == lib or per["fwd"][best["fwd"]] + per["bwd"][best["bwd"]] > ADOPT_SHARE * now:
        return None, totals
    return best["fwd"] + ("" if best["bwd"] == best["fwd"] else "/" + best["bwd"]), totals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="65536")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="BR:num_warps:precision[:tiles], comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="runs/gpu/prf_sweep.json")
    ap.add_argument("--warm", action="store_true",
                    help="only compile every config (one untimed call each at L=256, the same binaries: the length "
                         "is a runtime argument), e.g. beside the bench's warm-up; writes nothing")
    ap.add_argument("--choose", default=None, metavar="JSON",
                    help="print the config to adopt from a sweep's JSON (`choose`; nothing if none), time nothing")
    args = ap.parse_args(argv)
    if args.choose:
        res = json.loads(Path(args.choose).read_text())
        Ls = sorted({r["L"] for r in res.get("rows", [])})
        lib = res.get("library")
        pick, _ = choose(res.get("rows", []), Ls[-1], tuple(lib) if lib else None) if Ls else (None, {})
        try:  # what triton_prf would refuse when imported is not offered
            tp.parse_launches(pick or "")
        except Exception:  # noqa: BLE001 - nothing to adopt
            pick = None
        print(pick or "")
        return 0
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        try:
            tp.parse_launch(c, "prf_sweep: --configs")
        except FastRPEError as e:
            print(e)
            return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("prf_sweep: needs CUDA (--device cpu runs the kernels in the interpreter, TRITON_INTERPRET=1)")
        return 2
    if dev.type == "cpu" and not tc.INTERPRETED:
        print("prf_sweep: on the CPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1")
        return 2
    if args.warm:
        t = time.perf_counter()
        sweep(dev, 256, configs, repeats=0, log=lambda *a, **k: None)
        print(f"prf_sweep: {len(configs)} configs compiled in {time.perf_counter() - t:.1f} s")
        return 0
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({platform.machine()}), "
                     "Triton interpreter: not a timing", "torch": torch.__version__,
           "command": "python benchmarks/prf_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "library": library_launches(configs), "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for L in (int(s) for s in args.lengths.split(",")):
        res["rows"] += [{"L": L, **r} for r in sweep(dev, L, configs, args.repeats)]
        out.write_text(json.dumps(res, indent=1))
    for L in sorted({r["L"] for r in res["rows"]}):
        pick, tot = choose(res["rows"], L, tuple(res["library"]))
        if not tot:
            continue
        best = min(tot, key=tot.get)
        print(f"L={L}: q and k maps, forward + backward: {configs[0]} {tot.get(configs[0], float('nan')) * 1e3:.3f} ms, "
              f"fastest {best} {tot[best] * 1e3:.3f} ms; adopt: {pick or 'none'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
