"""Pack the compile caches a GPU session filled (Triton's and Inductor's) into one file that the
next session carries back and unpacks first, so that it starts warm.

Why: on a fresh device machine every process of benchmarks/gpu_run.sh compiles from cold
caches. On 2026-11-27 the warm-up (six processes, one per autotuner config) reached about 10
of 36 rows in 140 s in `first`, and 10 of 292 in 90 s in `rest`; most kernels do not change
from one session to the next, and their binaries are a few MB.

What: gpu_run.sh points every process at fixed folders: TRITON_CACHE_DIR (Triton's JIT kernels
and, since torch's Inductor puts its own Triton kernels under TRITON_CACHE_DIR when that is
set, Inductor's: torch/_inductor/runtime/cache_dir_utils.py, `triton_cache_dir`, torch 2.11
and 2.13 alike) and TORCHINDUCTOR_CACHE_DIR (Inductor's FX graph and AOTAutograd caches and
its generated modules). fla's processes (triton 3.7.1) share the Triton folder: an entry's key
hashes the triton version, so the versions' entries never meet, and fla's autotuned kernels
are among the slowest to compile. The archive holds `triton/` and `inductor/`.

Triton's cache (triton/runtime/cache.py, triton/compiler/compiler.py `compile`): each kernel
is a folder named by its key, holding the binary (.cubin), its metadata (.json), the
intermediate stages (.source, .ttir, .ttgir, .llir, .ptx) and a group file
`__grp__<name>.json` whose `child_paths` maps each file's name to its ABSOLUTE path. A lookup
reads the group: triton 3.9 treats a group with any missing child as a miss; 3.6 (the device
image's) and 3.7.1 (fla's) drop the missing children, and miss where the metadata is among
them (as all are where the folder moved). `CompiledKernel` needs the metadata and
the binary only (torch 2.11's Inductor reads `asm["ptx"]` only to save AOT kernels, with
`.get`). So a pack that leaves the intermediates out rewrites each group without them, and
every group in the archive names its children relatively; `unpack` makes them absolute
again under the folder it unpacks into (so the archive is not tied to one path either).
Left out always: Triton's autotuner results (`*.autotune.json`: each session tunes its own,
alone, as gpu_run.sh's warm-up intends), partial writes (`*.tmp.pid_*`) and lock files.

Size: a device call brings back files of at most 16 MiB, and the next call carries the file
within 64 MiB together with the repository and .fla_site (`--max-bytes`, gpu_run.sh). The
pack tries, within `--deadline-s`: everything (where the raw size is under 20 times the bound,
in half the time at most); then without Triton's intermediates (about a third of the xz size:
13.7 MiB -> 4.2 MiB for the 232 sm_90 compilations of tests/test_triton_compile.py in all six
autotuner configs); then, still too big, fewer entries, as many as xz's ratio on a sample says
fit, dropping the least valuable first: those no process of this session used (oldest first),
then those first used last in this session. A kernel folder or an Inductor file is "used" when
it was written or read: max(mtime, atime); the archive keeps that time as the entry's mtime,
and unpacking sets it, so a hit this session reads as used where the file system updates
atime on the first read after the unpack (relatime does); elsewhere only what this session
compiled counts as used. Nothing is written when nothing fits in time.

    python benchmarks/compile_cache.py pack --triton-dir D --inductor-dir E --out F.tar.xz \\
        --max-bytes 16711680 --deadline-s 30 --since <epoch of the session's start>
    python benchmarks/compile_cache.py unpack F.tar.xz --triton-dir D --inductor-dir E

Standard library only (it runs under any Python the image has); xz through the `xz` tool
with all cores where there is one, else Python's lzma.
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Triton's intermediate stages: what a pack leaves out first (never the binary or metadata)
INTERMEDIATE = (".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn")
GROUP = "__grp__"


def _skipped(name: str) -> bool:
    return ".tmp.pid_" in name or name.endswith((".lock", ".autotune.json"))


@dataclass
class Unit:
    """What a pack keeps or drops whole: a Triton kernel folder, or one Inductor file."""
    root: str  # "triton" | "inductor"
    rel: str  # its path under the root
    files: list[tuple[str, Path, int]] = field(default_factory=list)  # (name under the unit, path, bytes)
    groups: dict[str, dict[str, str]] = field(default_factory=dict)  # group file -> {child: its file name}
    used: float = 0.0  # max(mtime, atime) of its files

    def members(self, prune: bool) -> list[tuple[str, Path, int]]:
        if not prune:
            return self.files
        return [f for f in self.files if not f[0].endswith(INTERMEDIATE)]

    def size(self, prune: bool) -> int:
        return sum(f[2] for f in self.members(prune))


def _group(path: Path, unit_dir: Path) -> dict[str, str] | None:
    """A group file's children as {child: file name in the unit's folder}, those present only;
    None where it is unreadable or has no metadata left (then no lookup can hit it)."""
    try:
        child_paths = json.loads(path.read_text())["child_paths"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out = {c: os.path.basename(p) for c, p in child_paths.items() if (unit_dir / os.path.basename(p)).is_file()}
    return out if any(c.endswith(".json") for c in out) else None


def _size(p: Path) -> int | None:
    try:
        return p.stat().st_size
    except OSError:  # gone meanwhile
        return None


def scan(dirs: dict[str, Path]) -> list[Unit]:
    """The units under the cache folders ({"triton": ..., "inductor": ...})."""
    units: list[Unit] = []
    for root, base in dirs.items():
        if not base or not base.is_dir():
            continue
        # Triton: one unit per kernel folder; Inductor (and a stray file in Triton's): per file
        if root == "triton":
            tops = sorted(base.iterdir())
            folders, loose = [p for p in tops if p.is_dir()], [p for p in tops if not p.is_dir()]
        else:
            folders, loose = [], sorted(base.rglob("*"))
        for top in folders:
            u = Unit(root, top.name)
            for p in sorted(p for p in top.rglob("*") if p.is_file() and not _skipped(p.name)):
                rel = p.relative_to(top).as_posix()
                if p.parent == top and p.name.startswith(GROUP):
                    g = _group(p, top)
                    if g is not None:
                        u.groups[rel] = g
                    continue  # written from `groups`, rewritten
                if (n := _size(p)) is not None:
                    u.files.append((rel, p, n))
            if u.files:
                units.append(u)
        for p in loose:
            if p.is_file() and not _skipped(p.name) and (n := _size(p)) is not None:
                units.append(Unit(root, p.relative_to(base).as_posix(), [("", p, n)]))
    for u in units:
        st = [f[1].stat() for f in u.files]
        u.used = max(max(s.st_mtime, s.st_atime) for s in st)
    return units


def kernels_by_version(units: list[Unit]) -> dict[str, int]:
    """Triton kernels in the cache per triton version (their metadata's `triton_version`)."""
    out: dict[str, int] = {}
    for u in units:
        for g in u.groups.values():
            meta = next((n for c, n in g.items() if c.endswith(".json")), None)
            try:
                v = json.loads((u.files[0][1].parent / meta).read_text()).get("triton_version", "?")
            except (OSError, ValueError, TypeError):
                v = "?"
            out[v] = out.get(v, 0) + 1
    return out


def value_order(units: list[Unit], since: float) -> list[Unit]:
    """Most valuable first: what this session used, in the order it first did (the priority
    rows run first), then what it did not, most recently used first."""
    now = [u for u in units if u.used >= since]
    old = [u for u in units if u.used < since]
    return sorted(now, key=lambda u: u.used) + sorted(old, key=lambda u: -u.used)


def archive_order(units: list[Unit]) -> list[Unit]:
    """The order units go into the archive: a kernel's variants (autotuner configs, constexprs)
    side by side, by name, where xz finds their likeness (6 % smaller than in order of use)."""
    return sorted(units, key=lambda u: (u.root, min(u.groups, default=""), u.rel))


class _Over(Exception):
    pass


def _tar(units: list[Unit], prune: bool, sink, manifest: dict, check) -> int:
    """The tar stream of `units` into `sink`; `check()` every 16 units may raise. Raw bytes."""
    raw = 0
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        def add_bytes(name: str, data: bytes, mtime: float) -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), int(mtime), 0o644
            tar.addfile(ti, io.BytesIO(data))

        add_bytes("MANIFEST.json", json.dumps(manifest, indent=1).encode(), time.time())
        for i, u in enumerate(units):
            prefix = f"{u.root}/{u.rel}"
            kept = set()
            for name, path, _ in u.members(prune):
                try:
                    with open(path, "rb") as f:
                        ti = tar.gettarinfo(arcname=f"{prefix}/{name}" if name else prefix, fileobj=f)
                        ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = int(u.used), 0, 0, "", ""
                        tar.addfile(ti, f)
                except FileNotFoundError:  # gone since the scan: its group leaves it out
                    continue
                kept.add(name)
                raw += ti.size
            for gname, children in u.groups.items():  # the children packed, by name
                left = {c: n for c, n in children.items() if n in kept}
                if any(c.endswith(".json") for c in left):
                    data = json.dumps({"child_paths": left}).encode()
                    add_bytes(f"{prefix}/{gname}", data, u.used)
                    raw += len(data)
            if i % 16 == 0:
                check()
    return raw


def _write(units: list[Unit], prune: bool, out: Path, max_bytes: int, deadline: float, level: int,
           manifest: dict) -> tuple[int, int]:
    """One archive of `units` at `out`: (raw bytes, archive bytes). Raises _Over once the
    archive passes max_bytes, TimeoutError at the deadline (the file is then removed)."""
    def check() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError
        if out.stat().st_size > max_bytes:  # xz -T0 writes late: checked at the end too
            raise _Over

    xz = shutil.which("xz")
    try:
        with open(out, "wb") as fh:
            if xz:
                # blocks of 8 MiB: more of them at once on many cores (24 MiB at -6 by default),
                # for 2 % in size
                with subprocess.Popen([xz, f"-{level}", "-T0", "--block-size=8MiB", "-c"], stdin=subprocess.PIPE,
                                      stdout=fh) as proc:
                    try:
                        raw = _tar(units, prune, proc.stdin, manifest, check)
                        proc.stdin.close()
                    except BaseException:
                        proc.kill()
                        raise
                if proc.returncode != 0:
                    raise OSError(f"xz exited {proc.returncode}")
            else:
                with lzma.open(fh, "wb", preset=level) as sink:
                    raw = _tar(units, prune, sink, manifest, check)
        size = out.stat().st_size
        if size > max_bytes:
            raise _Over
        return raw, size
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def pack(dirs: dict[str, Path], out: Path, max_bytes: int, deadline_s: float, since: float = 0.0,
         prune: str = "auto", level: int = 6, log=print) -> dict:
    """Write `out` (xz tar) from the cache folders `dirs` ({"triton": ..., "inductor": ...}),
    under max_bytes, within deadline_s; returns what it did (`written` False: nothing fit)."""
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    units = value_order(scan(dirs), since)
    raw_full, raw_pruned = sum(u.size(False) for u in units), sum(u.size(True) for u in units)
    res = {"units": len(units), "triton_kernels": kernels_by_version(units),
           "inductor_files": sum(u.root == "inductor" for u in units), "raw_bytes": raw_full,
           "raw_bytes_without_intermediates": raw_pruned, "max_bytes": max_bytes, "written": False, "tries": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="compile-cache-"))  # not in `out`'s folder: a kill leaves nothing there
    part = tmp / out.name

    def attempt(kept: list[Unit], pruned: bool, label: str, until: float) -> bool:
        manifest = {"made": time.strftime("%Y-%m-%d %H:%M:%S"), "what": label, "units": len(kept),
                    "of_units": len(units), "intermediates": not pruned,
                    "triton_kernels": kernels_by_version(kept)}
        t = time.monotonic()
        try:
            raw, size = _write(archive_order(kept), pruned, part, max_bytes, until, level, manifest)
        except _Over:
            res["tries"].append({"what": label, "over": True, "seconds": round(time.monotonic() - t, 1)})
            log(f"compile cache: {label}: over {max_bytes / 2**20:.1f} MiB ({time.monotonic() - t:.1f} s)")
            return False
        except TimeoutError:
            res["tries"].append({"what": label, "out_of_time": True, "seconds": round(time.monotonic() - t, 1)})
            log(f"compile cache: {label}: out of time ({time.monotonic() - t:.1f} s)")
            return False
        shutil.move(part, out)
        res.update(written=True, what=label, units_kept=len(kept), bytes=size, raw_bytes_kept=raw,
                   intermediates=not pruned)
        res["tries"].append({"what": label, "bytes": size, "seconds": round(time.monotonic() - t, 1)})
        log(f"compile cache: {label}: {size / 2**20:.2f} MiB from {raw / 2**20:.1f} MiB "
            f"({time.monotonic() - t:.1f} s)")
        return True

    try:
        out.unlink(missing_ok=True)
        if not units:
            log("compile cache: the folders are empty, nothing packed")
            return res
        # everything, where it can fit (xz leaves the intermediates' text at about a fifteenth),
        # with half the time at most; then without the intermediates
        if prune != "always" and raw_full <= 20 * max_bytes and attempt(
                units, False, "everything", t0 + deadline_s / 2):
            return res
        if prune == "never":
            return res
        if attempt(units, True, "without Triton's intermediates", deadline):
            return res
        # fewer entries, the least valuable out, as many as xz's ratio on a sample says fit
        ratio, share = _ratio(units, level), 0.9
        res["sample_ratio"] = round(ratio, 4)
        while time.monotonic() < deadline:
            kept, acc = [], 0
            for u in units:
                if (acc + u.size(True)) * ratio > share * max_bytes:
                    break
                kept.append(u)
                acc += u.size(True)
            if not kept or attempt(kept, True, f"the {len(kept)} most valuable of {len(units)} entries, "
                                   "without Triton's intermediates", deadline):
                return res
            share *= 0.8
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        res["seconds"] = round(time.monotonic() - t0, 1)


def _ratio(units: list[Unit], level: int) -> float:
    """xz's ratio on a sample of the units without intermediates (every fourth, up to 8 MiB)."""
    buf, n = io.BytesIO(), 0
    for u in units[::4]:
        for _, path, size in u.members(True):
            buf.write(path.read_bytes())
            n += size
        if n > 8 << 20:
            break
    data = buf.getvalue()
    return max(0.02, len(lzma.compress(data, preset=level)) / len(data)) if data else 1.0


def unpack(archive: Path, dirs: dict[str, Path], log=print) -> dict:
    """Unpack `archive` into the cache folders, keeping any entry already there (a warm
    machine's second call has them from its first); Triton's group files name their children
    under the folder they land in."""
    t0 = time.monotonic()
    n = {"files": 0, "kept_present": 0, "groups": 0, "skipped": 0}
    manifest = {}
    dirs = {k: Path(os.path.abspath(v)) for k, v in dirs.items()}  # the groups' paths are absolute
    with tarfile.open(archive, "r:*") as tar:
        for m in tar:
            if m.name == "MANIFEST.json":
                manifest = json.loads(tar.extractfile(m).read())
                continue
            root, _, rel = m.name.partition("/")
            if root not in dirs or not rel or not m.isfile() or rel.startswith("/") or ".." in rel.split("/"):
                n["skipped"] += 1
                continue
            dest = dirs[root] / rel
            if dest.exists():
                n["kept_present"] += 1
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = tar.extractfile(m).read()
            if root == "triton" and dest.name.startswith(GROUP):
                child = json.loads(data)["child_paths"]
                data = json.dumps({"child_paths": {c: str(dest.parent / name) for c, name in child.items()}}).encode()
                n["groups"] += 1
            tmp = dest.with_name(dest.name + f".tmp.pid_{os.getpid()}")
            tmp.write_bytes(data)
            os.utime(tmp, (m.mtime, m.mtime))
            os.replace(tmp, dest)
            n["files"] += 1
    n["seconds"] = round(time.monotonic() - t0, 1)
    log(f"compile cache: unpacked {n['files']} files ({n['groups']} Triton kernels; {n['kept_present']} "
        f"already there) from {archive} ({archive.stat().st_size / 2**20:.2f} MiB, made {manifest.get('made', '?')}: "
        f"{manifest.get('what', '?')}; Triton kernels by version: {manifest.get('triton_kernels', '?')}) "
        f"in {n['seconds']} s")
    return {**n, "manifest": manifest}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("pack", "unpack"):
        p = sub.add_parser(name)
        p.add_argument("--triton-dir", type=Path, required=True)
        p.add_argument("--inductor-dir", type=Path, required=True)
    p = sub.choices["pack"]
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-bytes", type=int, default=16 * 2**20 - 2**16)
    p.add_argument("--deadline-s", type=float, default=30.0)
    p.add_argument("--since", type=float, default=0.0, help="epoch seconds: the session's start")
    p.add_argument("--prune", choices=("auto", "always", "never"), default="auto",
                   help="Triton's intermediates: left out where everything does not fit (auto), always, never")
    p.add_argument("--level", type=int, default=6, help="xz preset")
    p.add_argument("--json", type=Path, help="also write what it did here")
    sub.choices["unpack"].add_argument("archive", type=Path)
    args = ap.parse_args(argv)
    dirs = {"triton": args.triton_dir, "inductor": args.inductor_dir}
    if args.cmd == "unpack":
        if not args.archive.is_file():
            print(f"compile cache: no {args.archive}, the caches start cold")
            return 0
        try:
            unpack(args.archive, dirs)
        except (OSError, tarfile.TarError, lzma.LZMAError, ValueError, KeyError) as e:
            print(f"compile cache: {args.archive} did not unpack ({type(e).__name__}: {e}); going on with what is there")
        return 0
    if args.max_bytes <= 0:
        print(f"compile cache: no room for it ({args.max_bytes} bytes), nothing packed")
        return 0
    res = pack(dirs, args.out, args.max_bytes, args.deadline_s, args.since, args.prune, args.level)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print("compile cache: " + json.dumps({k: v for k, v in res.items() if k != "tries"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
