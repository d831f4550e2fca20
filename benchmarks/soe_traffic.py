"""Bytes the SoE far field's kernels move through memory: the stored states
(`triton_soe.FAR_FIELD = "states"`, term groups of `STATE_BUDGET`) against the walk
(`"walk"`, `triton_soe_walk`), and the stored states with `STACK` terms' states a program in
the state passes (`triton_soe.STATE_TERMS`, `triton_soe_stacked`: each chunk's inputs read
once a stack, in fewer programs, which the H100's "auto" scan blocks), forward and backward,
for the GPU bench's KERPLE calls (B·H = 8,
NPRF's 32 float32 features, bf16 values and output gradient, Dv = 64, T = 64, two near chunks,
the output as a bf16 quotient, bf16 states as the bench's calls store them). Beside them, the
PRF maps' backward (NPRF, D = 64, bf16 q and k) on the stored states' path, unfused (the last
launch group's dq and dk/dv kernels store dφ in float32, the maps' own backward launches read
it again with x) against fused (`triton_soe_prf`, `backends_triton.FUSED_MAPS`: the last group's
kernels take dφ through the maps, in one launch group or several since 2026-11-30).

A count, not a measurement: every launch's loads and stores as its programs issue them, none
served from a cache (an upper bound where neighbours share tiles in L2), from the kernels'
code: the state passes (blocked where `triton_chunked.auto_blocked` blocks them on an H100:
fewer than 66 programs over 256 chunks or more), the output, dq, dk/dv kernels with their
near field in the first group, float32 sums read again by each later group, dv as a bf16
pair between groups; the walk's near-field launches, totals, carries (the forward's kept for
the backward), walks adding to float32 num/dq/dk/dv, and the casts at the end. The feature
maps and the near table's gradient, the same in both, are left out of those totals. The maps'
backward: x and the projection read (by each 64-row program: the maps' launch and the chunk
kernels alike), dx written, and unfused the last group's dφ store (in `bwd_dq`, `bwd_dkv` of
the totals) and the maps' read of it. Time at the H100's HBM3 peak (3.35 TB/s) bounds each
from below.

    python benchmarks/soe_traffic.py --out benchmarks/results/soe_traffic.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HBM_BYTES_PER_S = 3.35e12  # H100 SXM, HBM3 peak
BH, F, DV, T, NB = 8, 32, 64, 64, 2
D = 64  # the maps' input width (q, k)
PHI, VAL, ACC, ST = 4, 2, 4, 2  # bytes: float32 features, bf16 v/do/output, float32 sums, bf16 states
#: (family, L, terms of its fit) as the sixth H100 session's rows had them (docs/RESULTS.md)
CASES = [("kerple_log", 65536, 11), ("kerple_power", 65536, 9), ("kerple_log", 1048576, 15),
         ("kerple_power", 1048576, 9)]
#: the stacked passes' terms a program (the bench's `+stacked-states` rows)
STACK = 4


def _state_pass_passes(programs: int, N: int) -> int:
    """2 where the H100's "auto" scan blocks the pass (`auto_blocked`: 132 SMs), else 1."""
    from fastrpe.ops.linear.triton_chunked import AUTO_BLOCKED_MIN_CHUNKS, AUTO_BLOCKED_SM_SHARE

    return 2 if N >= AUTO_BLOCKED_MIN_CHUNKS and programs < AUTO_BLOCKED_SM_SHARE * 132 else 1


def stored_bytes(L: int, K: int, stack: int = 1) -> dict:
    """The stored states' bytes; `stack`: `triton_soe.STATE_TERMS` (up to that many terms' states
    a program in the state passes, `triton_soe_stacked`: each chunk's inputs read once a stack)."""
    from fastrpe.ops.linear.soe import terms_per_group
    from fastrpe.ops.linear.triton_soe_stacked import stack_size, stacked_group

    N = L // T
    group = stacked_group(terms_per_group(BH, N, F, DV, ST, K), K, stack)  # (whole stacks a group)
    groups = [min(group, K - k0) for k0 in range(0, K, group)]
    q = k = L * F * PHI
    v = do = L * DV * VAL
    rows = L * 2 * ACC  # dd and 1/den
    state = N * F * (DV * ST + ACC)
    out = {"fwd_states": 0, "fwd_out": 0, "bwd_states": 0, "bwd_dq": 0, "bwd_dstates": 0, "bwd_dkv": 0}
    multi = len(groups) > 1
    for i, kg in enumerate(groups):
        first, later = i == 0, i > 0
        stacks = -(-kg // stack_size(kg, stack))  # programs a (batch·head) of the state passes
        passes = _state_pass_passes(BH * stacks, N)
        states = BH * (stacks * passes * (k + v) + kg * state)
        out["fwd_states"] += states
        out["bwd_states"] += states  # made again for the backward
        sums = L * DV * ACC if multi else L * DV * VAL  # num (float32 between groups) or the bf16 quotient
        out["fwd_out"] += BH * (q + first * NB * (k + v) + kg * state + sums * (1 + later) + L * ACC * (1 + later))
        out["bwd_dq"] += BH * (q + do + rows + first * NB * (k + v) + kg * state + L * F * ACC * (1 + later))
        out["bwd_dstates"] += BH * (stacks * passes * (q + do + rows) + kg * state)
        dv = L * DV * (2 * VAL if multi and i < len(groups) - 1 else VAL)  # the bf16 pair between groups
        out["bwd_dkv"] += BH * (k + v + first * NB * (q + do + rows) + kg * state + L * F * ACC * (1 + later)
                                + dv * (1 + later))
    if multi:
        out["fwd_out"] += BH * (L * DV * (ACC + VAL) + L * ACC)  # the quotient formed after the groups
    return {"groups": groups, **out, "total": sum(out.values())}


def maps_backward_bytes(L: int, fused: bool) -> dict:
    """Both PRF maps' backward beside the stored states' last launch group (the earlier groups'
    float32 dφ sums, read by the last, are the same either way): `dphi_store`, the last group's
    float32 dφ (unfused only; part of `stored_bytes`' bwd_dq and bwd_dkv), and `maps`, x and
    the projection read and dx written, with the dφ read back unfused (the maps' own launches;
    fused, the chunk kernels' share)."""
    x, w, dphi = L * D * VAL, (L // T) * F * D * PHI, L * F * ACC
    out = {"dphi_store": 0 if fused else 2 * BH * dphi, "maps": 2 * BH * (2 * x + w + (0 if fused else dphi))}
    return {**out, "total": sum(out.values())}


def walk_bytes(L: int, K: int) -> dict:
    from fastrpe.ops.linear.triton_soe_walk import walk_blocks, walk_terms

    N = L // T
    G, NBK = walk_blocks(N, BH)
    ng = math.ceil(K / walk_terms(K))
    q = k = L * F * PHI
    v = do = L * DV * VAL
    rows = L * 2 * ACC
    carries = BH * K * NBK * F * (DV + 1) * ACC * 4  # totals written, read; carries written, read
    num, den = L * DV * ACC, L * ACC
    out = {
        "fwd_near": BH * (q + NB * (k + v) + num + den),
        "fwd_totals": BH * ng * (k + v) + carries,
        "fwd_walk": BH * (ng * (q + k + v + 2 * (num + den)) + num + den + L * DV * VAL),  # + the quotient
        "bwd_near": BH * (q + do + rows + NB * (k + v) + L * F * ACC          # dq
                          + k + v + NB * (q + do + rows) + L * F * ACC + num),  # dk, dv (float32)
        "bwd_totals": BH * ng * (q + do + rows) + carries,  # (the key carries: the forward's, kept)
        "bwd_dq_walk": BH * ng * (q + do + rows + k + v + 2 * L * F * ACC),
        "bwd_dkv_walk": BH * ng * (k + v + q + do + rows + 2 * L * F * ACC + 2 * num),
        "bwd_casts": BH * (num + L * DV * VAL),  # dv to bf16 (dq, dk are float32 as the features)
    }
    return {"blocks": NBK, "chunks_a_block": G, "passes": ng, **out, "total": sum(out.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for fam, L, K in CASES:
        s, w, st = stored_bytes(L, K), walk_bytes(L, K), stored_bytes(L, K, STACK)
        mu, mf = maps_backward_bytes(L, False), maps_backward_bytes(L, True)
        rows.append({"family": fam, "L": L, "terms": K, "stored": s, "walk": w, f"stored_stack{STACK}": st,
                     "stored_ms_at_peak": s["total"] / HBM_BYTES_PER_S * 1e3,
                     "walk_ms_at_peak": w["total"] / HBM_BYTES_PER_S * 1e3,
                     f"stored_stack{STACK}_ms_at_peak": st["total"] / HBM_BYTES_PER_S * 1e3,
                     "maps_backward": {"unfused": mu, "fused": mf, "fused_saves": mu["total"] - mf["total"],
                                       "fused_saves_ms_at_peak": (mu["total"] - mf["total"]) / HBM_BYTES_PER_S * 1e3}})
        print(f"{fam:12s} L={L:8d} K={K:2d}: stored {s['total'] / 1e9:6.1f} GB ({len(s['groups'])} groups, "
              f"{rows[-1]['stored_ms_at_peak']:5.1f} ms at peak), {STACK} terms a state program "
              f"{st['total'] / 1e9:6.1f} GB ({rows[-1][f'stored_stack{STACK}_ms_at_peak']:5.1f} ms), "
              f"walk {w['total'] / 1e9:6.1f} GB ({w['passes']} passes, {rows[-1]['walk_ms_at_peak']:5.1f} ms); "
              f"maps' backward unfused {mu['total'] / 1e9:.2f} GB, fused {mf['total'] / 1e9:.2f} GB "
              f"({rows[-1]['maps_backward']['fused_saves_ms_at_peak']:.2f} ms less at peak)")
    if a.out:
        meta = {"command": "python benchmarks/soe_traffic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "model": "loads and stores of each launch's programs, no cache reuse; PRF maps and dcn left out of "
                          "the totals, the maps' backward apart (maps_backward)",
                "hbm_bytes_per_s": HBM_BYTES_PER_S}
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
