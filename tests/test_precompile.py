"""benchmarks/precompile.py: the GPU bench's Triton kernels recorded and built on a CPU machine
for the H100 image, so that its cache already holds them.

Each case runs in a subprocess without TRITON_INTERPRET (this process interprets its kernels:
conftest.py sets it, and `triton.jit` reads it when it decorates), on the CPU, no GPU."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _compiled import compiled_env

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

TOY = '''
import triton, triton.language as tl

@triton.jit
def toy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)
'''


def _run(code: str, tmp_path: Path, timeout: int = 120) -> str:
    env = compiled_env(TRITON_CACHE_DIR=str(tmp_path / "default_cache"),  # never the user's own cache
                       PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                   os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, check=False,
                       timeout=timeout, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_a_kernel_built_under_another_triton_key_is_a_hit_under_that_key_only(tmp_path):
    """record (the hook keeps the launch's specialization; nothing runs), compile under the
    key given (as the image's), then a preload in a fresh process: a cache hit where
    `triton_key()` answers that key, a compilation where it answers its own."""
    (tmp_path / "toymod.py").write_text(TOY)
    out = _run('''
        import json, torch, precompile, toymod
        specs = {}
        with precompile.no_gpu_driver(), precompile.recording(specs):
            x = torch.ones(40)
            toymod.toy_kernel[(3,)](x, torch.empty(40), 40, BLOCK=16)
        json.dump({"specs": specs}, open("specs.json", "w"))
        info = precompile.compile_all(__import__("pathlib").Path("specs.json"), "KEY-OF-THE-IMAGE",
                                      __import__("pathlib").Path("built"), jobs=1, log=lambda s: None)
        print(json.dumps({"specs": specs, "info": info}))
    ''', tmp_path)
    res = json.loads(out.strip().splitlines()[-1])
    (name, per_key), = res["specs"].items()
    assert name == "toymod:toy_kernel" and len(per_key) == 1
    spec = json.loads(next(iter(per_key.values())))
    # as a launch on the GPU specializes: 16-byte aligned pointers, n = 40 a plain i32
    assert spec["signature"]["x_ptr"] == "*fp32" and spec["signature"]["n"] == "i32"
    assert res["info"]["compiled"] == 1 and res["info"]["failed"] == 0

    probe = '''
        import os, json, precompile, toymod
        from triton import knobs
        from triton.runtime import cache
        os.environ["TRITON_CACHE_DIR"] = "built"
        if {patch}:
            cache.triton_key = lambda: "KEY-OF-THE-IMAGE"
        hits = []
        knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
        data = next(iter(json.load(open("specs.json"))["specs"]["toymod:toy_kernel"].values()))
        with precompile.no_gpu_driver():
            toymod.toy_kernel.preload(data)
        print(hits)
    '''
    assert _run(probe.format(patch=True), tmp_path).strip() == "[True]"
    assert _run(probe.format(patch=False), tmp_path).strip() == "[False]"


def test_record_runs_a_bench_row_as_on_the_gpu(tmp_path):
    """A bf16 ALiBi row of triton_chunked at a small length: its kernels are recorded as the
    GPU launches them (CUDA's tf32x3 products for the float32 features, MODE 2; every
    autotuner config), with no kernel run and no compilation."""
    out = _run('''
        import json, torch, precompile
        specs = {}
        with precompile.no_gpu_driver(), precompile.recording(specs), precompile.on_a_gpu():
            from fastrpe.bench import gpu
            from fastrpe.bench.registry import Problem
            cfg = gpu.GpuConfig()
            p = Problem(position="alibi", kernel="nprf", causal=True, L=256, B=1, H=8, D=64, features=32)
            gpu.registry(cfg)["fastrpe-triton_chunked"](p, torch.device("cpu"), torch.bfloat16)()
        print(json.dumps({k: list(v.values()) for k, v in specs.items()}))
    ''', tmp_path)
    specs = json.loads(out.strip().splitlines()[-1])
    names = {k.split(":")[1] for k in specs}
    assert {"_prf_fwd_kernel", "_prf_bwd_kernel", "_fwd_state_kernel", "_fwd_out_kernel", "_bwd_state_kernel",
            "_bwd_dkv_kernel", "_bwd_dq_kernel"} <= names
    from fastrpe.ops.linear.triton_chunked import tune_configs

    out_kernel = [json.loads(s) for s in specs["fastrpe.ops.linear.triton_chunked:_fwd_out_kernel"]]
    assert len(out_kernel) == len(tune_configs())  # one per autotuner config
    for s in out_kernel:
        consts = dict(zip(map(tuple, s["constant_keys"]), s["constant_vals"]))
        assert consts[(list(s["signature"]).index("MODE"),)] == 2
        assert s["signature"]["q_ptr"] == "*fp32" and s["signature"]["v_ptr"] == "*bf16"
    assert not list((tmp_path / "default_cache").glob("**/*.cubin"))  # nothing was compiled


def test_recording_spares_the_autotuners_copies_and_the_inputs_values(tmp_path):
    """Nothing runs while recording: the autotuners zero and restore no outputs around their
    configs (at 1M the copies of the kept states took most of a row's time) and the bench's
    inputs are zeros; both come back after."""
    out = _run('''
        import json, torch, precompile
        from fastrpe.bench import gpu
        from fastrpe.bench.registry import Problem
        from fastrpe.ops.linear import triton_chunked as tc, triton_soe  # noqa: F401
        hooks = lambda: [(list(t.reset_to_zero), list(t.restore_value)) for t in tc.TUNED]
        with precompile.on_a_gpu():
            pass  # (it imports every Triton backend: their autotuners join tc.TUNED)
        before = hooks()
        p = Problem(position="alibi", kernel="nprf", causal=True, L=64, B=1, H=2, D=16, features=8)
        with precompile.on_a_gpu():
            inside = hooks()
            q, k, v = gpu._qkv(p, torch.device("cpu"), torch.bfloat16)
        q2 = gpu._qkv(p, torch.device("cpu"), torch.bfloat16)[0]
        print(json.dumps({"some": any(r or s for r, s in before), "inside": any(r or s for r, s in inside),
                          "restored": hooks() == before, "zeros": bool((q == 0).all() and (v == 0).all()),
                          "grad": q.requires_grad, "dtype": str(q.dtype), "shape": list(k.shape),
                          "seeded_after": bool((q2 != 0).any())}))
    ''', tmp_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"some": True, "inside": False, "restored": True, "zeros": True, "grad": True,
                   "dtype": "torch.bfloat16", "shape": [1, 2, 64, 16], "seeded_after": True}


def test_key_hash_says_whether_the_pack_was_built_for_this_triton(tmp_path):
    out = _run('''
        import hashlib, json, precompile
        from triton.runtime.cache import triton_key
        mine = hashlib.sha256(triton_key().encode()).hexdigest()
        json.dump({"triton_key_sha256": mine, "compiled": 3, "made": "now"}, open("same.json", "w"))
        json.dump({"triton_key_sha256": "0" * 64, "compiled": 3, "made": "now"}, open("other.json", "w"))
        # the kernels' keys as the pack recorded them: one as it is now, one since edited
        keys = precompile.kernel_keys(["fastrpe.ops.linear.triton_chunked:_fwd_out_kernel",
                                       "fastrpe.ops.triton_prf:_prf_fwd_kernel"])
        keys["fastrpe.ops.triton_prf:_prf_fwd_kernel"] = "0" * 64
        json.dump({"triton_key_sha256": mine, "compiled": 3, "made": "now", "kernels": keys}, open("stale.json", "w"))
        for f in ("same.json", "other.json", "missing.json", "stale.json"):
            precompile.main(["key-hash", "--expect", f])
    ''', tmp_path)
    same, other, missing, stale = out.strip().splitlines()[-4:]
    assert "built for this image's triton" in same and "changed since" not in same
    assert "built for another triton" in other and "compile here as before" in other
    assert missing.startswith("precompiled kernels: no record")
    assert stale.endswith("1 kernels changed since, they compile here: _prf_fwd_kernel")


def test_outdated_names_the_kernels_edited_or_added_since_the_pack(tmp_path):
    out = _run('''
        import json, precompile
        lib = sorted(precompile.library_kernels())
        keys = precompile.kernel_keys(lib)
        json.dump({"kernels": keys, "library": lib}, open("fresh.json", "w"))
        edited = dict(keys)
        edited["fastrpe.ops.triton_prf:_prf_fwd_kernel"] = "0" * 64
        json.dump({"kernels": edited, "library": lib}, open("edited.json", "w"))
        json.dump({"kernels": keys, "library": [n for n in lib if not n.endswith("_soe_bwd_dq_map_kernel")]},
                  open("grown.json", "w"))
        for f in ("fresh.json", "edited.json", "grown.json", "missing.json"):
            print("rc", precompile.main(["outdated", "--info", f]))
    ''', tmp_path)
    lines = out.strip().splitlines()
    assert "fastrpe.ops.linear.triton_soe_prf:_soe_bwd_dq_map_kernel" not in out  # names, not paths
    fresh, edited, grown, missing = (lines[i:i + 2] for i in range(0, 8, 2))
    assert fresh == ["the pack covers every kernel", "rc 0"]
    assert edited[0].endswith("1 kernels (changed: _prf_fwd_kernel)") and edited[1] == "rc 1"
    assert grown[0].endswith("1 kernels (new: _soe_bwd_dq_map_kernel)") and grown[1] == "rc 1"
    assert missing[0].startswith("no pack record") and missing[1] == "rc 1"


def test_warm_workers_count_the_kernels_found_in_the_cache(tmp_path):
    """`gpu_warm.watch_triton_compiles`: what gpu_warm.json says of a precompiled pack on the
    device, a compilation that found its binary (hit) or built it (miss, named)."""
    (tmp_path / "toymod.py").write_text(TOY)
    out = _run('''
        import json, triton, toymod
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from fastrpe.bench.gpu_warm import watch_triton_compiles
        counts = {}
        watch_triton_compiles(counts)
        sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
        for _ in range(2):
            src = ASTSource(toymod.toy_kernel, sig, constexprs={(3,): 16})
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print(json.dumps(counts))
    ''', tmp_path)
    assert json.loads(out.strip().splitlines()[-1]) == {"hits": 1, "misses": 1, "missed": ["toy_kernel"]}
