"""Every Triton kernel compiles for Hopper (sm_90) on a machine without a GPU: triton ships
ptxas, so type errors, unsupported ops and shared memory beyond the H100's 227 KiB show up
in CI, not first on the GPU. In a subprocess: the interpreter tests set TRITON_INTERPRET for
this whole process, and interpreted kernels cannot be compiled.

Each kernel is compiled with one pipeline stage (the autotuner's smallest shared-memory
config) and ptxas' register and spill counts are printed (`-s` shows them): at a 128-token
chunk the float32-feature `_soe_bwd_dkv` needed 295 KB in every config, which is why the
near field now spans several 64-token chunks instead.

175 compilations (the bf16 features, and the float32 ones by tf32x3 and by bf16x3, the FFT
path's kernels once): 111 s for the file on 2 cores under triton 3.6.0 (2026-11-29, beside other
work; 113 took 85 s with a cold Triton cache, results/ptxas-sm90-bf16x3.json), over the suite's
30-s budget per test: it runs when FASTRPE_COMPILE_CHECK=1 is set, e.g.
`FASTRPE_COMPILE_CHECK=1 python -m pytest -q -s tests/test_triton_compile.py`."""
import os
import sys

import pytest
from _compiled import compile_run

pytest.importorskip("triton")

SCRIPT = r"""
import inspect, os, re, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastrpe.ops.linear import triton_chunked as tc, triton_soe as ts, triton_recurrent as tr, triton_tiled as tt
from fastrpe.ops.linear import triton_soe_walk as tw, triton_soe_stacked as tss
from fastrpe.ops import triton_prf as tp
from fastrpe.ops.linear import triton_chunked_prf as tcp, triton_soe_prf as tsp
from fastrpe.ops.linear.fft import triton_blocked as tb, triton_rowsum as trs

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = next((p for p in (os.path.join(BIN, "ptxas-blackwell"), os.path.join(BIN, "ptxas")) if os.path.exists(p)), None)

# the ints that are multiples of 16 in the bench's launches (4k to 1M tokens, F = 32, D = Dv = 64,
# q_offset 0), which Triton marks so at a launch, as it does every 16-byte aligned pointer
# (the PRF maps' M, x's strides and w's head stride too: D = 64, M = 32 or 16, a [B, H, L, D] or
# head-split view)
ALIGNED_INTS = ("D", "Dv", "F", "L", "Lk", "Lq", "N", "q_offset", "M", "sxb", "sxh", "sxl", "swh")

def compile_for_h100(kernel, ptr_types, consts, num_warps=8, num_stages=1):
    fn = kernel.fn if type(kernel).__name__ == "Autotuner" else kernel
    # a constexpr left out takes its default, as a launch would (not a runtime i32)
    unset = inspect.Parameter.empty
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not unset}, **consts}
    sig = {n: "constexpr" if n in consts else "*" + ptr_types[n] if n.endswith("_ptr") else ptr_types.get(n, "i32")
           for n in fn.arg_names}
    # as launched: without these, loads of rows F or Dv wide are not vectorized, and ptxas'
    # counts are not a launch's (triton_tiled's forward spilled 488 B with tf32x3, none as launched)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n in ALIGNED_INTS)}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    # one stage: the autotuner's smallest shared-memory config (it also tries 2 and 3)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})

def hopper_trans_stores(k):
    # 16-bit tensors stored to shared memory from a transposed product's layout (`#linear` in
    # the TTGIR): what Triton 3.4-3.7.0 miscompiles on Hopper (triton_chunked.HOPPER_TRANS_NOTE)
    return len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor<[^>]*x(?:bf16|f16), #linear\d*>", k.asm["ttgir"]))

# the pattern itself, for the check's control: dot(trans(dot(a, b) rounded to bf16), c)
@triton.jit
def _trans_of_product(a_ptr, c_ptr, o_ptr):
    r = tl.arange(0, 64)
    a = tl.load(a_ptr + r[:, None] * 64 + r[None, :])
    c = tl.load(c_ptr + r[:, None] * 64 + r[None, :])
    p = tl.dot(a, tl.trans(a)).to(tl.bfloat16)
    tl.store(o_ptr + r[:, None] * 64 + r[None, :], tl.dot(tl.trans(p), c))

def control():
    sig = {"a_ptr": "*bf16", "c_ptr": "*bf16", "o_ptr": "*fp32"}
    return triton.compile(ASTSource(_trans_of_product, sig, constexprs={}), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})

def ptxas_counts(k):
    # (registers, spilled bytes) as ptxas reports them, None where it says nothing (no ptxas)
    # (informative: spills are slow, not wrong)
    if PTXAS is None:
        return None, None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
    r, sp = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return (int(r.group(1)) if r else None), (int(sp.group(1)) if sp else None)

def spills(k):
    regs, spilled = ptxas_counts(k)
    return f"{'?' if regs is None else regs} regs, {'?' if spilled is None else spilled} B spilled"

def all_cases():
    # (features dtype, kernel, pointer types, constexprs) of each compilation, as the backends
    # launch them (benchmarks/compile_time.py times them in every autotuner config)
    out = []
    for dt, mode in (("bf16", 0), ("fp32", 2), ("fp32", 3)):  # bf16 features; float32 features by tf32x3, by bf16x3
        D, A = {"bf16": tl.bfloat16, "fp32": tl.float32}[dt], tl.float32
        io = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "do_ptr", "dd_ptr", "num_ptr", "den_ptr"], dt)
        if mode:  # float32 features multiplied on the tensor cores: a bf16 call's, whose values
            io["v_ptr"] = "bf16"  # are read as they come (`triton_chunked.value_dtype`)
        sums = dict.fromkeys(["lg_ptr", "z_ptr", "dz_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dvlo_ptr", "cn_ptr", "wq_ptr",
                              "lgk_ptr", "p_ptr", "dwq_ptr", "g_ptr", "s_ptr", "out_s_ptr", "y_ptr", "inv_ptr",
                              "c_ptr", "cz_ptr"],
                             acc := "fp32")
        # a bf16 call stores the chunk states in bf16 (`backends_triton._state_dtype`)
        geo = {**io, **sums, "h_ptr": "bf16", "dh_ptr": "bf16"}
        soe = {**io, **sums, "h_ptr": "bf16", "dh_ptr": "bf16"}
        m = dict(DT=D, ACC=A, MODE=mode)
        # backward as the composition runs it: the bf16 quotient's gradient, scaled by 1/den inside
        sc, geo_b, soe_b = dict(SCALED=True, **m), {**geo, "do_ptr": "bf16"}, {**soe, "do_ptr": "bf16"}
        tile = dict(BT=64, BF=32, BDV=64)
        cases = [(tc._fwd_state_kernel, geo, dict(BV=16, **tile, **m)),
                 # as the composition runs it: the quotient written in bf16 (bits), den in float32
                 (tc._fwd_out_kernel, {**geo, "num_ptr": "i16", "den_ptr": acc},
                  dict(BV=64, STRICT=False, DIVIDE=True, THR=1e-31, OUT_BF16=True, **tile, **m)),
                 (tc._bwd_state_kernel, geo_b, dict(BV=16, **tile, **sc)),
                 # STATE_SCAN = "blocked": the blocks' totals (PHASE 1), then the states from the carries (2)
                 (tc._fwd_state_kernel, geo, dict(BV=16, PHASE=1, **tile, **m)),
                 (tc._fwd_state_kernel, geo, dict(BV=16, PHASE=2, **tile, **m)),
                 (tc._bwd_state_kernel, geo_b, dict(BV=16, PHASE=1, **tile, **sc)),
                 (tc._bwd_state_kernel, geo_b, dict(BV=16, PHASE=2, **tile, **sc)),
                 (tc._bwd_dkv_kernel, geo_b, dict(STRICT=True, **tile, **sc)),
                 (tc._bwd_dq_kernel, geo_b, dict(STRICT=True, **tile, **sc)),
                 (ts._soe_state_kernel, soe, dict(BV=64, **tile, **m)),
                 (ts._soe_state_kernel, soe, dict(BV=64, PHASE=1, **tile, **m)),
                 (ts._soe_state_kernel, soe, dict(BV=64, PHASE=2, **tile, **m)),
                 (ts._soe_bwd_state_kernel, soe_b, dict(BV=64, NB=3, PHASE=1, **tile, **sc)),
                 (ts._soe_bwd_state_kernel, soe_b, dict(BV=64, NB=3, PHASE=2, **tile, **sc))]
        for NB in (2, 3):  # the soe band (64 distances), T5's (113)
            first, later = dict(NB=NB, NEAR=True, ACCUM=False), dict(NB=NB, NEAR=False, ACCUM=True)
            cases += [(ts._soe_out_kernel, {**soe, "num_ptr": "i16", "den_ptr": acc},  # one launch: the bf16 quotient
                       dict(BV=64, DIVIDE=True, THR=1e-31, OUT_BF16=True, **first, **tile, **m)),
                      (ts._soe_out_kernel, soe, dict(BV=64, **later, **tile, **m)),
                      (ts._soe_bwd_state_kernel, soe_b, dict(BV=64, NB=NB, **tile, **sc)),
                      # a frozen term's (the bench's: no far weights' gradient) and a trainable one's
                      (ts._soe_bwd_dq_kernel, soe_b, dict(DWQ=False, **first, **tile, **sc)),
                      (ts._soe_bwd_dq_kernel, soe_b, dict(DWQ=True, **first, **tile, **sc)),
                      (ts._soe_bwd_dkv_kernel, soe_b, dict(**first, **tile, **sc)),
                      (ts._soe_bwd_dcn_kernel, soe_b, dict(NB=NB, **tile, **sc))]
        # the far field walked in blocks (triton_soe_walk), four terms a state, float32 sums
        walk, wt = {**soe, "num_ptr": acc, "den_ptr": acc}, dict(BT=64, BF=32, BDV=64, KG=4)
        walk_b = {**walk, "do_ptr": "bf16"}
        cases += [(tw._walk_totals_kernel, walk, dict(BV=64, **wt, **m)),
                  (tw._walk_out_kernel, walk, dict(BV=64, NB=2, **wt, **m)),
                  (tw._walk_dq_kernel, walk_b, dict(NB=2, **wt, **sc)),
                  (tw._walk_rtotals_kernel, walk_b, dict(BV=64, NB=2, **wt, **sc)),
                  (tw._walk_dkv_kernel, walk_b, dict(NB=2, **wt, **sc))]
        # the chunk-state passes with four terms' states stacked a program (triton_soe_stacked, 8 warps)
        st = dict(BV=64, KG=4, **tile)
        cases += [(tss._stacked_state_kernel, soe, dict(PHASE=phase, **st, **m)) for phase in (0, 1, 2)]
        cases += [(tss._stacked_bwd_state_kernel, soe_b, dict(NB=nb, PHASE=phase, **st, **sc))
                  for nb, phase in ((2, 0), (3, 1), (3, 2))]
        if dt == "fp32":
            cases.append((tr._step_kernel, {**geo, "h_ptr": acc}, dict(BF=32, BC=64)))
            # the blocked scan's carries (forward from a bf16 start state; reverse from zero)
            carry = {"tot_ptr": acc, "lg_ptr": acc, "start_ptr": "bf16", "c_ptr": acc}
            cases += [(tc._carry_kernel, carry, dict(BT=64, REVERSE=False, FROM_ZERO=False, BW=1024, ACC=A)),
                      (tc._carry_kernel, carry, dict(BT=64, REVERSE=True, FROM_ZERO=True, BW=32, ACC=A))]
            # the layer's fused decode step: bf16 q/k/[v, 1] rows of the fused matmul, the quotient in bf16
            cases.append((tr._prf_step_kernel, {"q_ptr": "bf16", "k_ptr": "bf16", "vv_ptr": "bf16", "w_ptr": acc,
                                                "shift_ptr": acc, "g_ptr": acc, "s_ptr": acc, "out_s_ptr": acc,
                                                "o_ptr": "i16", "scale": acc, "inv_sqrt_f": acc, "tiny": acc},
                          dict(BD=64, BF=32, BC=128, NORMALIZE=True, HAS_G=True, O_BF16=True)))
            # NPRF's map of bf16 q (a query: its own maximum, found again in backward), its product
            # by tf32x3 (triton_prf.PRECISION, the GPU's default) and by bf16x3 (the sweep's other)
            prf = {"x_ptr": "bf16", "w_ptr": acc, "shift_ptr": acc, "phi_ptr": acc, "dphi_ptr": acc, "dx_ptr": "i16",
                   "scale": acc, "inv_sqrt_f": acc}
            tiles = dict(BR=64, BD=64, NORMALIZE=True, QUERY=True, MODE=mode)
            cases += [(tp._prf_fwd_kernel, prf, dict(BM=32, TWO_SIDED=False, **tiles)),
                      (tp._prf_bwd_kernel, prf, dict(BF=32, DX_BF16=True, **tiles))]
            qdd = {"do_ptr": "bf16", "o_ptr": "bf16", "den_ptr": acc, "inv_ptr": acc, "dd_ptr": acc}
            cases += [(tc._quotient_dd_kernel, qdd, dict(BR=64, BC=64, ACC=A, THR=1e-31, DD=True)),
                      (tc._quotient_dd_kernel, qdd, dict(BR=64, BC=16, ACC=A, THR=1e-31, DD=False))]  # inverse_rows
            # float32 features, bf16 values: dv written as bf16 bits
            cases.append((tc._bwd_dkv_kernel, {**geo_b, "v_ptr": "bf16", "dv_ptr": "i16"},
                          dict(STRICT=True, DV_BF16=True, **tile, **sc)))
            # the same with NPRF's backward inside (triton_chunked_prf): bf16 q and k in, their bf16 grads out
            fm = {"x_ptr": "bf16", "w_ptr": acc, "shift_ptr": acc, "dx_ptr": "i16", "scale": acc, "inv_sqrt_f": acc}
            cases += [(tcp._bwd_dkv_map_kernel, {**geo_b, **fm, "v_ptr": "bf16", "dv_ptr": "i16"},
                       dict(STRICT=False, DV_BF16=True, BD=64, NORMALIZE=True, DX_BF16=True, **tile, **sc)),
                      (tcp._bwd_dq_map_kernel, {**geo_b, **fm}, dict(STRICT=False, BD=64, NORMALIZE=True,
                                                                     DX_BF16=True, **tile, **sc))]
            # and inside the fused SoE kernels (triton_soe_prf): T5's band (three near chunks, the
            # first: the Hopper check's) and KERPLE's (two) in one launch group, and the last of
            # KERPLE's groups at 1M (the earlier groups' float32 dφ added, dv carried as a bf16
            # pair); bf16 v, a frozen term's dq (no dwq)
            sfm = {**soe_b, **fm, "early_ptr": acc}
            for NB, near in ((3, True), (2, True), (2, False)):
                groups = dict(NB=NB, NEAR=near, ACCUM=not near)
                cases += [(tsp._soe_bwd_dkv_map_kernel, {**sfm, "v_ptr": "bf16", "dv_ptr": "i16", "dvlo_ptr": "i16"},
                           dict(DV_BF16=True, BD=64, NORMALIZE=True, DX_BF16=True, **groups, **tile, **sc)),
                          (tsp._soe_bwd_dq_map_kernel, sfm,
                           dict(DWQ=False, BD=64, NORMALIZE=True, DX_BF16=True, **groups, **tile, **sc))]
            # T5's band in one launch (triton_band), bf16 v: dv written as bf16 bits
            cases.append((ts._soe_bwd_dkv_kernel, {**soe_b, "v_ptr": "bf16", "dv_ptr": "i16", "dvlo_ptr": "i16"},
                          dict(NB=3, NEAR=True, ACCUM=False, DV_BF16=True, **tile, **sc)))
            # a middle group of KERPLE's terms at 1M, bf16 v: dv carried as a pair of bf16 bits
            cases.append((ts._soe_bwd_dkv_kernel, {**soe_b, "v_ptr": "bf16", "dv_ptr": "i16", "dvlo_ptr": "i16"},
                          dict(NB=2, NEAR=False, ACCUM=True, DV_BF16=True, LAST=False, **tile, **sc)))
            # a table over all offsets in tiles (triton_tiled), as the composition runs it: float32
            # features, bf16 v and output gradient, the bf16 quotient written as bits
            # (each head's weights from the call's table `exp(b - top)` where its span allows, ETAB)
            tl_io = {**io, **sums, "q_ptr": acc, "k_ptr": acc, "v_ptr": "bf16", "lc_ptr": acc, "ks_ptr": acc, "m_ptr": acc,
                     "db_ptr": acc, "do_ptr": "bf16", "et_ptr": acc, "top_ptr": acc, "fast_ptr": "i32", "span": acc}
            tiles2 = dict(BM=64, BN=64, BF=32, BDV=64, CAUSAL=True, **m)
            cases += [(tt._tiled_fwd_kernel, {**tl_io, "num_ptr": "i16", "den_ptr": acc},
                       dict(DIVIDE=True, THR=1e-31, OUT_BF16=True, ETAB=True, **tiles2)),
                      (tt._tiled_bwd_dq_kernel, tl_io, dict(SCALED=True, ETAB=True, **tiles2)),
                      (tt._tiled_bwd_dkv_kernel, {**tl_io, "dv_ptr": "i16"},
                       dict(SCALED=True, DV_BF16=True, ETAB=True, **tiles2)),
                      # causal SIKF: keys stabilized one by one (their log-scale read per key tile; no table)
                      (tt._tiled_fwd_kernel, tl_io, dict(KEY_SCALE=True, **tiles2))]
            if mode == 2:  # the table itself (`exp_table`), float32
                cases.append((tt._exp_table_kernel, {"lc_ptr": acc, "e_ptr": acc, "top_ptr": acc, "fast_ptr": "i32",
                                                     "span": acc}, dict(BR=1024, ACC=A)))
                # the FFT path's sums over chunks on the spectra in place (fft/triton_blocked.py): the
                # forward with its energies, without (the backward's), the adjoint; the lags' correlations
                lags = {**dict.fromkeys(["x_ptr", "k_ptr", "z_ptr", "w_ptr", "out_ptr", "e2_ptr", "corr_ptr"], "fp32"),
                        "lag_ptr": "i32", "lo_ptr": "i32", "hi_ptr": "i32", "ok_ptr": "i8"}
                cases += [(tb._mix_kernel, lags, dict(ADJOINT=adj, ENERGY=en, BR=16, BC=4, BP=32))
                          for adj, en in ((False, True), (False, False), (True, False))]
                cases.append((tb._corr_kernel, lags, dict(BI=8, BA=8, BP=32)))
                # the FFT products' row contractions (fft/triton_rowsum.py), as launched: the positions'
                # unit strides specialized (1), the others not; the forward's 65 kept channels in
                # tiles of 8 into a position-major output, a gradient's one kept feature in rows of
                # 2,048 positions into a chunked one, and the float64 sums
                rs = trs.kernel()
                for rt, ones, tiles in (("fp32", dict(sap=1), dict(BK=8, BP=256)),
                                        ("fp32", dict(sap=1, sbp=1, sop=1), dict(BK=1, BP=2048)),
                                        ("fp64", dict(sap=1), dict(BK=8, BP=256))):
                    cases.append((rs, dict.fromkeys(["a_ptr", "b_ptr", "out_ptr"], rt),
                                  dict(B_K=False, ACC={"fp32": tl.float32, "fp64": tl.float64}[rt], **ones, **tiles)))
            # the fused decode step of a full band (T5) and of a sum of exponentials (KERPLE-log), as
            # `_prf_step_kernel`'s: bf16 q/k/[v, 1] rows, float32 states and windows, the quotient in bf16
            win = {"q_ptr": "bf16", "k_ptr": "bf16", "vv_ptr": "bf16", "o_ptr": "i16",
                   **dict.fromkeys(["w_ptr", "shift_ptr", "s_ptr", "keys_ptr", "vals_ptr", "bw_ptr", "tail_ptr", "g_ptr",
                                    "a_ptr", "cw_ptr", "out_s_ptr", "out_keys_ptr", "out_vals_ptr", "scale", "inv_sqrt_f",
                                    "tiny"], acc)}
            cases += [(kernel, win, dict(BD=64, BF=32, BC=128, BJ=16, NORMALIZE=True, DROP=1, O_BF16=True))
                      for kernel in (tr._prf_band_step_kernel, tr._prf_soe_step_kernel)]
        out += [(dt, *c) for c in cases]
    return out

if RUN:
    assert hopper_trans_stores(control()) > 0  # the check below sees the pattern
    for dt, kernel, types, consts in all_cases():
        k = compile_for_h100(kernel, types, consts)
        assert k.metadata.shared <= 227 * 1024, (dt, k.metadata.name, consts.get("NB"), k.metadata.shared)
        assert hopper_trans_stores(k) == 0, (dt, consts.get("MODE"), k.metadata.name, consts.get("NB"))
        print(dt, "MODE=%s" % consts.get("MODE", "-"), k.metadata.name, "NB=%s" % consts.get("NB", "-"),
              k.metadata.shared, spills(k))

if TRANS:  # the key-tile gradient kernels, where the pattern was: bf16 features (MODE 0) and bf16x3 (3),
    # and the walk's dq (its state transposed); TRANS = "walk": the walk's alone, else the others
    print("control", hopper_trans_stores(control()))
    seen = set()
    for dt, kernel, types, consts in all_cases():
        fn = kernel.fn if type(kernel).__name__ == "Autotuner" else kernel
        if ("dkv" in fn.__name__ or fn.__name__ == "_walk_dq_kernel") and consts.get("MODE") in (0, 3) \
                and ("_walk_" in fn.__name__) == (TRANS == "walk") and (fn.__name__, consts["MODE"]) not in seen:
            seen.add((fn.__name__, consts["MODE"]))  # the first case of each (soe's: its near field)
            k = compile_for_h100(kernel, types, consts, num_warps=4)
            print(dt, consts["MODE"], k.metadata.name, consts.get("NB"), hopper_trans_stores(k))
"""

#: the list per feature mode (bf16; float32 by tf32x3; by bf16x3; the walk's 5 and the stacked passes' 6 in each) and the
#: float32 modes' extras (the fused maps' kernels among them: triton_chunked_prf's 2, triton_soe_prf's 6), the
#: table's, the FFT path's sums over chunks (4) and its row contractions (3) once
N_COMPILED = 3 * (14 + 5 + 6 + 2 * 7) + 2 * 25 + 1 + 4 + 3


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTRPE_COMPILE_CHECK") != "1",
                    reason="1.5 min of compilation: set FASTRPE_COMPILE_CHECK=1 to run")
def test_every_kernel_compiles_for_sm90(tmp_path):
    script = tmp_path / "every.py"  # (triton.jit reads its function's source from a file)
    script.write_text("RUN, TRANS = True, False\n" + SCRIPT)
    out = compile_run([sys.executable, str(script)], 600)
    print(out)
    assert len(out.splitlines()) == N_COMPILED


def trans_stores_of(tmp_path, which):
    # (kernel, mode, name, NB, 16-bit #linear stores) of `which` ("key-tile", "walk"), after the control
    script = tmp_path / "trans.py"  # (triton.jit reads its function's source from a file)
    script.write_text(f"RUN, TRANS = False, {which!r}\n" + SCRIPT)
    out = compile_run([sys.executable, str(script)], 300, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    lines = [line.split() for line in out.splitlines()]
    assert lines[0][0] == "control" and int(lines[0][1]) > 0, out
    return lines[1:], out


def test_no_key_tile_kernel_stores_a_transposed_product_in_16_bits(tmp_path):
    """No gradient kernel feeds `tl.dot` a transposed product rounded to 16 bits, the pattern
    Triton 3.4-3.7.0 miscompiles on Hopper (`triton_chunked.HOPPER_TRANS_NOTE`; the H100's
    illegal memory accesses in bf16x3 and wrong gradients with bf16 features): the sm_90 TTGIR
    of each key-tile kernel (chunked, soe's with its near field, tiled, and the two with the
    PRF maps' backward inside: `triton_chunked_prf`'s, `triton_soe_prf`'s) in the two 16-bit
    modes has no shared-memory store of a 16-bit `#linear` tensor, while a kernel written with
    the pattern has one (so the check sees it). Every kernel in every mode:
    FASTRPE_COMPILE_CHECK=1."""
    kernels, out = trans_stores_of(tmp_path, "key-tile")
    assert {(x[0], x[1], x[2]) for x in kernels} >= {("bf16", "0", "_bwd_dkv_kernel"), ("fp32", "3", "_bwd_dkv_kernel"),
                                                     ("bf16", "0", "_soe_bwd_dkv_kernel"),
                                                     ("fp32", "3", "_soe_bwd_dkv_kernel"),
                                                     ("fp32", "3", "_tiled_bwd_dkv_kernel"),
                                                     ("fp32", "3", "_bwd_dkv_map_kernel"),
                                                     ("fp32", "3", "_soe_bwd_dkv_map_kernel")}, out
    assert all(x[-1] == "0" for x in kernels), out


def test_the_walks_gradients_store_no_transposed_product_in_16_bits(tmp_path):
    """The same for the SoE walk's dq and dk/dv kernels (`triton_soe_walk`), which multiply by
    the transposed state: in the 16-bit modes they hold it transposed. Written with `tl.trans`
    of their state, they had the pattern, and the H100 stopped at their first bf16x3 call with
    an illegal memory access (2026-11-28)."""
    kernels, out = trans_stores_of(tmp_path, "walk")
    assert {(x[0], x[1], x[2]) for x in kernels} == {("bf16", "0", "_walk_dq_kernel"), ("fp32", "3", "_walk_dq_kernel"),
                                                     ("bf16", "0", "_walk_dkv_kernel"),
                                                     ("fp32", "3", "_walk_dkv_kernel")}, out
    assert all(x[-1] == "0" for x in kernels), out


PASSES = r"""
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastrpe.ops.linear.triton_chunked import _dot

@triton.jit
def product(a_ptr, b_ptr, c_ptr, MODE: tl.constexpr, DT: tl.constexpr):
    m, n = tl.arange(0, 64), tl.arange(0, 64)
    a = tl.load(a_ptr + m[:, None] * 64 + n[None, :])
    b = tl.load(b_ptr + m[:, None] * 64 + n[None, :])
    tl.store(c_ptr + m[:, None] * 64 + n[None, :], _dot(a, b, DT, tl.float32, MODE))

for a, b in (("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
    for mode in (0, 2, 3):  # (DT float32: the float32 features' kernels, where the modes differ)
        sig = {"a_ptr": "*" + a, "b_ptr": "*" + b, "c_ptr": "*fp32", "MODE": "constexpr", "DT": "constexpr"}
        k = triton.compile(ASTSource(product, sig, constexprs={(3,): mode, (4,): tl.float32}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(a, b, mode, len(re.findall(r"wgmma\.mma_async", k.asm["ptx"])))
"""


def test_bf16x3_takes_three_passes_two_against_bf16_one_for_two_bf16(tmp_path):
    """`_dot`'s tensor-core passes for sm_90 (wgmma instructions in the PTX, one 64x64x64
    product, float32 features' DT): two bf16 operands take the one bf16 pass in every mode;
    bf16x3 (MODE 3) takes 2 against a bf16 operand and 3 for two float32 ones; tf32x3 (MODE 2)
    takes 3 tf32 passes for two float32 operands and 2 against a bf16 one (`_dot_tf32x2`; it
    took 3 whichever until 2026-11-27), each of twice a bf16 pass's instructions (tf32's K is
    8, bf16's 16). (A MODE 3 that split a bf16 operand again doubled `do·vᵀ`'s passes.)"""
    script = tmp_path / "passes.py"  # (triton.jit reads its function's source from a file)
    script.write_text(PASSES)
    out = compile_run([sys.executable, str(script)], 300, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    n = {tuple(line.split()[:3]): int(line.split()[3]) for line in out.splitlines()}
    one = n[("bf16", "bf16", "0")]
    assert one > 0 and n[("bf16", "bf16", "2")] == n[("bf16", "bf16", "3")] == one
    assert n[("fp32", "bf16", "3")] == n[("bf16", "fp32", "3")] == 2 * one
    assert n[("fp32", "fp32", "3")] == 3 * one
    assert n[("fp32", "fp32", "2")] == 6 * one
    assert n[("fp32", "bf16", "2")] == n[("bf16", "fp32", "2")] == 4 * one
    assert n[("fp32", "fp32", "0")] == 0  # "ieee": CUDA cores
