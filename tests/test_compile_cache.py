"""benchmarks/compile_cache.py, the compile-cache round trip of benchmarks/gpu_run.sh: a kernel
compiled for Hopper (sm_90, no GPU needed: triton ships ptxas) into one Triton cache folder,
packed without Triton's intermediate stages, unpacked into another folder, is found there:
the second compile is a cache hit (triton's compilation listener says so, and the compile
stages are made to raise; benchmarks/compile_cache_toy.py). Triton 3.9 (and 3.7, fla's) treats a group file naming a missing
file as a miss, so the pack must rewrite the groups it prunes; the unpack must point them at
their new folder. Skipped where this triton cannot compile for sm_90."""
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from _benchmarks import load_benchmark
from _compiled import compiled_env

ROOT = Path(__file__).resolve().parents[1]

def load_packer():
    return load_benchmark("compile_cache", register=True)  # its dataclass looks its module up


def compile_once(cache: Path, forbid: bool = False) -> dict:
    """benchmarks/compile_cache_toy.py in a process of its own (conftest's TRITON_INTERPRET
    left out): one kernel compiled for sm_90 into `cache`, and whether it was a hit."""
    env = compiled_env(TRITON_CACHE_DIR=str(cache))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compile_cache_toy.py")] + (["--forbid-compile"] if forbid else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_pruned_pack_unpacked_elsewhere_is_a_cache_hit_for_sm90(tmp_path):
    pytest.importorskip("triton")
    cc = load_packer()
    first = compile_once(tmp_path / "a" / "triton")
    if "skip" in first:
        pytest.skip(f"this triton cannot compile for sm_90 here: {first['skip']}")
    assert first["hit"] is False and first["cubin"] > 0
    (kdir,) = (tmp_path / "a" / "triton").iterdir()
    assert {p.suffix for p in kdir.iterdir()} >= {".ptx", ".llir", ".ttgir", ".ttir", ".source", ".cubin"}

    out = tmp_path / "out" / "compile_cache.tar.xz"
    dirs = {"triton": tmp_path / "a" / "triton", "inductor": tmp_path / "a" / "inductor"}
    res = cc.pack(dirs, out, max_bytes=16 << 20, deadline_s=20, prune="always", log=lambda *_: None)
    assert res["written"] and not res["intermediates"] and res["bytes"] == out.stat().st_size < 16 << 20
    with tarfile.open(out) as tar:
        names = tar.getnames()
        (grp,) = [n for n in names if "/__grp__" in n]
        children = json.loads(tar.extractfile(grp).read())["child_paths"]
    assert not [n for n in names if n.endswith(cc.INTERMEDIATE)]
    assert sorted(Path(c).suffix for c in children) == [".cubin", ".json"]  # rewritten, by name only
    assert all("/" not in p for p in children.values())

    # somewhere else: the group's paths follow the folder
    b = tmp_path / "b"
    cc.unpack(out, {"triton": b / "triton", "inductor": b / "inductor"}, log=lambda *_: None)
    t0 = time.perf_counter()
    again = compile_once(b / "triton", forbid=True)
    assert again["hit"] is True and again["name"] == first["name"] and again["cubin"] == first["cubin"]
    print(f"triton {first['triton']}: cold {first['seconds']:.2f} s, from the unpacked cache {again['seconds']:.3f} s "
          f"({time.perf_counter() - t0:.1f} s with the process); archive {res['bytes']} B")

    # everything kept (no pruning): a hit too
    out2 = tmp_path / "out2" / "compile_cache.tar.xz"
    res2 = cc.pack(dirs, out2, max_bytes=16 << 20, deadline_s=20, log=lambda *_: None)
    assert res2["written"] and res2["intermediates"] and res2["bytes"] > res["bytes"]
    cc.unpack(out2, {"triton": tmp_path / "c" / "triton", "inductor": tmp_path / "c" / "inductor"},
              log=lambda *_: None)
    assert compile_once(tmp_path / "c" / "triton", forbid=True)["hit"] is True


def fake_kernel(root: Path, key: str, used: float, size: int) -> None:
    d = root / key
    d.mkdir(parents=True)
    files = {f"k.{ext}": os.urandom(size if ext == "cubin" else 64) for ext in ("cubin", "json", "ptx")}
    for name, data in files.items():
        (d / name).write_bytes(data)
        os.utime(d / name, (used, used))
    (d / "__grp__k.json").write_text(json.dumps({"child_paths": {n: str(d / n) for n in files}}))
    os.utime(d / "__grp__k.json", (used, used))


def test_over_the_budget_the_least_valuable_entries_go_first(tmp_path):
    """Too big even without intermediates: kept first what this session used, in the order it
    first did; an entry it did not use goes first (all incompressible here)."""
    cc = load_packer()
    tri, since = tmp_path / "triton", 1_000_000.0
    fake_kernel(tri, "OLD", since - 500, 60_000)  # not used this session
    for i in range(4):
        fake_kernel(tri, f"NEW{i}", since + 10 * i, 60_000)
    (tmp_path / "inductor" / "fxgraph").mkdir(parents=True)
    (tmp_path / "inductor" / "fxgraph" / "entry").write_bytes(os.urandom(1000))
    os.utime(tmp_path / "inductor" / "fxgraph" / "entry", (since + 5, since + 5))
    (tmp_path / "triton" / "NEW0" / "k.autotune.json").write_text("{}")  # each session tunes its own
    out = tmp_path / "o" / "cc.tar.xz"
    res = cc.pack({"triton": tri, "inductor": tmp_path / "inductor"}, out, max_bytes=220_000, deadline_s=20,
                  since=since, log=lambda *_: None)
    assert res["written"] and res["bytes"] <= 220_000 and res["units"] == 6
    with tarfile.open(out) as tar:
        names = tar.getnames()
        mtimes = {m.name: m.mtime for m in tar.getmembers()}
    kept = sorted({n.split("/")[1] for n in names if n.startswith("triton/")})
    # three 60 kB binaries and the Inductor file (used between the first two) fit in 220 kB:
    # out go the last used this session and the one it did not use
    assert kept == ["NEW0", "NEW1", "NEW2"] and "inductor/fxgraph/entry" in names
    assert not [n for n in names if n.endswith((".ptx", ".autotune.json"))]
    assert mtimes["triton/NEW1/k.cubin"] == int(since + 10)  # the last use, restored on unpack
    # unpacking over a folder keeps what is there
    dest = {"triton": tmp_path / "u" / "triton", "inductor": tmp_path / "u" / "inductor"}
    (dest["triton"] / "NEW0").mkdir(parents=True)
    (dest["triton"] / "NEW0" / "k.cubin").write_bytes(b"present")
    n = cc.unpack(out, dest, log=lambda *_: None)
    assert (dest["triton"] / "NEW0" / "k.cubin").read_bytes() == b"present" and n["kept_present"] == 1
    grp = json.loads((dest["triton"] / "NEW2" / "__grp__k.json").read_text())["child_paths"]
    assert grp == {n: str(dest["triton"] / "NEW2" / n) for n in ("k.cubin", "k.json")}
    assert os.stat(dest["triton"] / "NEW2" / "k.cubin").st_mtime == int(since + 20)
    assert (dest["inductor"] / "fxgraph" / "entry").stat().st_size == 1000


def test_nothing_fits_nothing_written(tmp_path):
    cc = load_packer()
    fake_kernel(tmp_path / "triton", "A", time.time(), 50_000)
    out = tmp_path / "o" / "cc.tar.xz"
    res = cc.pack({"triton": tmp_path / "triton", "inductor": tmp_path / "none"}, out, max_bytes=1000,
                  deadline_s=10, log=lambda *_: None)
    assert not res["written"] and not out.exists() and list(out.parent.iterdir()) == []
