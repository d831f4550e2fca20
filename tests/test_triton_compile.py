"""Every Triton kernel compiles for Hopper (sm_90) on a machine without a GPU: triton ships
ptxas, so type errors, unsupported ops and shared memory beyond the H100's 227 KiB show up
in CI, not first on the GPU. In a subprocess: the interpreter tests set TRITON_INTERPRET for
this whole process, and interpreted kernels cannot be compiled.

About 2 minutes on 2 cores with a cold Triton cache (20 compilations), over the suite's
30-s budget per test: it runs when FASTRPE_COMPILE_CHECK=1 is set, e.g.
`FASTRPE_COMPILE_CHECK=1 python -m pytest -q tests/test_triton_compile.py`."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastrpe.ops.linear import triton_chunked as tc, triton_soe as ts, triton_recurrent as tr

def compile_for_h100(kernel, ptr_types, consts):
    fn = kernel.fn if type(kernel).__name__ == "Autotuner" else kernel
    sig = {n: "constexpr" if n in consts else "*" + ptr_types[n] if n.endswith("_ptr") else "i32"
           for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})

for dt, acc in (("bf16", "fp32"), ("fp32", "fp32")):
    D, A = {"bf16": tl.bfloat16, "fp32": tl.float32}[dt], tl.float32
    io = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "do_ptr", "dd_ptr", "num_ptr", "den_ptr"], dt)
    sums = dict.fromkeys(["lg_ptr", "z_ptr", "dz_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "cn_ptr", "wq_ptr", "lgk_ptr",
                          "p0_ptr", "p1_ptr", "dwq_ptr", "g_ptr", "s_ptr", "out_s_ptr", "y_ptr"], acc)
    geo = {**io, **sums, "h_ptr": acc, "dh_ptr": acc}
    soe = {**io, **sums, "h_ptr": dt, "dh_ptr": dt}
    m = dict(DT=D, ACC=A, INTERP=False)
    tile = dict(BT=64, BF=32, BDV=64)
    cases = [(tc._fwd_state_kernel, geo, dict(BV=16, **tile, **m)),
             (tc._fwd_out_kernel, geo, dict(BV=64, STRICT=False, **tile, **m)),
             (tc._bwd_state_kernel, geo, dict(BV=16, **tile, **m)),
             (tc._bwd_grads_kernel, geo, dict(STRICT=True, **tile, **m)),
             (ts._soe_state_kernel, soe, dict(BV=64, **tile, **m)),
             (ts._soe_out_kernel, soe, dict(BV=64, **tile, **m)),
             (ts._soe_bwd_state_kernel, soe, dict(BV=64, **tile, **m)),
             (ts._soe_bwd_dq_kernel, soe, dict(**tile, **m)),
             (ts._soe_bwd_dkv_kernel, soe, dict(**tile, **m)),
             (tr._step_kernel, geo, dict(BF=32, BC=64))]
    for kernel, types, consts in cases:
        k = compile_for_h100(kernel, types, consts)
        assert k.metadata.shared <= 227 * 1024, (dt, k.metadata.name, k.metadata.shared)
        print(dt, k.metadata.name, k.metadata.shared)
'''


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FASTRPE_COMPILE_CHECK") != "1",
                    reason="2 min of compilation: set FASTRPE_COMPILE_CHECK=1 to run")
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(res.stdout.splitlines()) == 20
