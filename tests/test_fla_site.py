"""The trimmed triton that benchmarks/fla_site.sh packs for fla's rows on the device machine:
it imports (with TRITON_BACKENDS_IN_TREE=1, as gpu_run.sh sets), fla imports with it, a kernel
runs under the interpreter, and a kernel with a matrix product compiles for sm_90 through the
stripped libtriton and the ptxas that gpu_run.sh borrows from the image's own triton.

Opt-in (it needs a pack built for this machine's Python, a few minutes with network):

    PYVER=3.11 OUT_DIR=/tmp/fla-pack bash benchmarks/fla_site.sh
    mkdir -p /tmp/fla-site && tar -C /tmp/fla-site -xJf /tmp/fla-pack/site.tar.xz
    FASTRPE_FLA_SITE=/tmp/fla-site python -m pytest -q tests/test_fla_site.py
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

SITE = os.environ.get("FASTRPE_FLA_SITE")
pytestmark = pytest.mark.skipif(not SITE, reason="FASTRPE_FLA_SITE names no unpacked fla_site.sh pack")

SCRIPT = r"""
import os, sys
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
assert triton.__file__.startswith(sys.argv[1]), triton.__file__
import fla
from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401

@triton.jit
def mm(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "N": "constexpr"}
k = triton.compile(ASTSource(mm, sig, constexprs={(3,): 32}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})
assert "wgmma" in k.asm["ptx"] or "mma" in k.asm["ptx"], "no tensor-core product in the PTX"
print("triton", triton.__version__, "fla", fla.__version__, "sm_90 cubin", len(k.asm["cubin"]), "bytes")
"""

INTERPRET = r"""
import torch, triton, triton.language as tl

@triton.jit
def twice(x_ptr, y_ptr, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y_ptr + o, 2 * tl.load(x_ptr + o, mask=o < n), mask=o < n)

x = torch.arange(10.0)
y = torch.empty_like(x)
twice[(1,)](x, y, 10, B=16)
assert torch.equal(y, 2 * x)
print("interpreted", triton.__version__)
"""


def _run(code: str, env_extra: dict, tmp_path: Path) -> str:
    import triton  # this environment's: its ptxas stands in for the image's

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TRITON_BACKENDS_IN_TREE": "1", "TRITON_PTXAS_PATH": str(ptxas), **env_extra}
    if "TRITON_INTERPRET" not in env_extra:
        env.pop("TRITON_INTERPRET", None)
    script = tmp_path / "check.py"  # @triton.jit reads its function's source from a file
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script), SITE], check=False, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_the_pack_imports_with_fla_and_compiles_a_product_for_sm90(tmp_path):
    out = _run(SCRIPT, {}, tmp_path)
    assert "sm_90 cubin" in out and "fla " in out


def test_the_pack_runs_a_kernel_under_the_interpreter(tmp_path):
    assert "interpreted" in _run(INTERPRET, {"TRITON_INTERPRET": "1"}, tmp_path)
