#!/usr/bin/env bash
# Build, on this CPU machine, everything a GPU session's device calls carry, from a fresh
# checkout: a session's checkout may start without the ignored folders the last one built
# (.fla_site, .gpu_cache, .gpu_runs, runs/), or with them (2026-11-29: the sixth session's
# pack, which the kernels' edits since had made stale: `precompile.py outdated` finds that, and
# the pack is built again), so a session lent a GPU runs this first, before its first device
# call (device time counts from that call, not from this):
#
#   bash benchmarks/gpu_prep.sh 2>&1 | tee /tmp/gpu_prep.log
#   (.gpu_runs/ starts empty: `first` resumes the newest committed JSON of the GPU it finds,
#   benchmarks/results/gpu/, or starts afresh; after each call copy its gpu.json there)
#   run(command="bash benchmarks/gpu_run.sh first", carry=[".fla_site", ".gpu_runs", ".gpu_cache"], timeout_s=540)
#
# Steps (each skipped when its result is already here; the log says how long each took; the
# times in brackets are this script's on a 2-core CPU machine, 2026-11-28, at 453c9fa, with the
# record as fast as since: about 16 minutes in all, so start it first thing):
# 1. .fla_site/site.tar.xz: fla-core 0.6.0 and a trimmed triton 3.7.1 (benchmarks/fla_site.sh)
#    [82 s, 35 MiB];
# 2. the image's triton_key() under Python 3.12 and triton 3.6.0 (a venv without torch) [6 s];
# 3. a venv with the image's torch 2.11.0 and triton 3.6.0 (PyPI's CUDA build, about 3 GB: it
#    runs on the CPU here) and this project with its test tools [53 s, and 36 s for the tools];
# 4. `precompile.py record` of every row the bench times at 4k-262k and of the 1M window's
#    families, the two at once (one thread each) [470 s: 452 specializations of 30 kernels;
#    504 s: 302 of 26 at 1M; before the record skipped the autotuners' copies and the inputs'
#    values, 1,122 and 1,830 s for the same specializations];
# 5. `precompile.py compile` for sm_90 under the image's key, then the pack
#    (.gpu_cache/compile_cache.tar.xz, under 16 MiB) and its record (.gpu_cache/precompiled.json)
#    [532 kernels in 144 s; 5.7 MiB without Triton's intermediate stages; `precompile.py verify`
#    after it, the bench's rows at 4k and 64k compiled from that folder: 318 kernels from the
#    cache, 0 compiled, 260 s: not a step here];
# 6. the carry's size against the device tool's 64 MiB [9 MiB of tree, 40 of carried folders],
#    and `gpu_run.sh first` in its CPU smoke mode (SMOKE=0 skips it), which checks the script
#    itself [95 s].
# A pack built here holds fastrpe's kernels only: Flex's (Inductor's) and fla's compile on the
# device in the warm-up, as on a cold machine; a device call's returned pack
# (compile_cache.tar.xz in its files) holds them too: copy it into .gpu_cache/ for the next call.
# V312 and V211 name the two venvs (/tmp/venv312, /tmp/venv211); JOBS the compile's processes.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
step() { echo "[gpu_prep +$(( $(date +%s) - t0 )) s] $*"; }
# a Python 3.12 (the image's): on the PATH, else pyenv's
py312() {
    if python3.12 -c '' 2>/dev/null; then python3.12 "$@"
    else PYENV_VERSION=$(pyenv versions --bare 2>/dev/null | grep -m1 '^3\.12') python3.12 "$@"; fi
}
for d in .whl .gpu_runs .gpu_cache .fla_site; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done
PRE=runs/precompile
mkdir -p .gpu_runs .gpu_cache "$PRE/inductor"

if [ ! -f .fla_site/site.tar.xz ]; then
    step "1. fla's site (fla-core + trimmed triton 3.7.1)"
    bash benchmarks/fla_site.sh
fi

V312=${V312:-/tmp/venv312}
if [ ! -x "$V312/bin/python" ]; then
    step "2. $V312: Python 3.12 with triton 3.6.0"
    py312 -m venv "$V312"
    "$V312/bin/pip" install -q triton==3.6.0
fi
"$V312/bin/python" benchmarks/precompile.py key > "$PRE/triton_key_cp312.txt"

V211=${V211:-/tmp/venv211}
if [ ! -x "$V211/bin/python" ]; then
    step "3. $V211: torch 2.11.0 and triton 3.6.0, the image's (about 3 GB)"
    python3.11 -m venv "$V211"
    "$V211/bin/pip" install -q torch==2.11.0 triton==3.6.0 -e ".[test]"
fi
PY=(env PYTHONPATH="$PWD/src" OMP_NUM_THREADS=1 TRITON_INTERPRET=0 "$V211/bin/python")

# a pack (and its record of launches) from an earlier checkout whose kernels have changed or
# grown since is built again: a checkout may keep the ignored folders of the session before
if [ -f .gpu_cache/precompiled.json ] && ! "${PY[@]}" benchmarks/precompile.py outdated --info .gpu_cache/precompiled.json; then
    step "the pack is outdated: recording and compiling again"
    rm -f "$PRE/specs.json" "$PRE/specs_1m.json" .gpu_cache/compile_cache.tar.xz .gpu_cache/precompiled.json
fi
if [ ! -f "$PRE/specs.json" ] || [ ! -f "$PRE/specs_1m.json" ]; then
    step "4. record the bench's launches (4k-262k, and the 1M window's families), both at once"
    "${PY[@]}" benchmarks/precompile.py record --out "$PRE/specs.json" > "$PRE/record.log" 2>&1 &
    rec=$!
    "${PY[@]}" benchmarks/precompile.py record --out "$PRE/specs_1m.json" \
        --families alibi,kerple_log,kerple_power,t5 --lengths 1048576 --no-prf-sweep > "$PRE/record_1m.log" 2>&1 \
        || { tail -20 "$PRE/record_1m.log"; exit 1; }
    wait "$rec" || { tail -20 "$PRE/record.log"; exit 1; }
    tail -n 2 "$PRE/record.log" "$PRE/record_1m.log"
fi

if [ ! -f .gpu_cache/compile_cache.tar.xz ]; then
    step "5. compile for sm_90 under the image's key, and pack"
    rm -rf "$PRE/triton"
    "${PY[@]}" benchmarks/precompile.py compile --specs "$PRE/specs.json" "$PRE/specs_1m.json" \
        --triton-key-file "$PRE/triton_key_cp312.txt" --triton-dir "$PRE/triton" \
        --jobs "${JOBS:-$(nproc)}" --info .gpu_cache/precompiled.json
    "${PY[@]}" benchmarks/compile_cache.py pack --triton-dir "$PRE/triton" --inductor-dir "$PRE/inductor" \
        --out .gpu_cache/compile_cache.tar.xz --max-bytes 16711680
fi

tree=$(du -sb --exclude=./.git --exclude=./.gpu_cache --exclude=./.fla_site --exclude=./.gpu_runs \
    --exclude=./runs --exclude=__pycache__ . | cut -f1)
carry=$(du -sbc .fla_site .gpu_runs .gpu_cache | tail -1 | cut -f1)
step "6. the carry: tree $((tree / 1048576)) MiB + .fla_site/.gpu_runs/.gpu_cache $((carry / 1048576)) MiB of 64"
if [ $((tree + carry)) -gt $((64 * 1048576)) ]; then
    echo "over the device tool's 64 MiB: pack smaller (compile_cache.py pack --max-bytes)"; exit 1
fi
if [ "${SMOKE:-1}" != 0 ]; then
    step "6. gpu_run.sh first, CPU smoke mode"
    # (under the image's torch and triton; fla's site is for the image's Python 3.12, not this one)
    rm -rf /tmp/gpu_prep_smoke
    PATH="$V211/bin:$PATH" FLA_SITE=/nonexistent OUT=/tmp/gpu_prep_smoke SMOKE=1 \
        bash benchmarks/gpu_run.sh first > /tmp/gpu_prep_smoke.log 2>&1 \
        || { tail -30 /tmp/gpu_prep_smoke.log; exit 1; }
    tail -3 /tmp/gpu_prep_smoke.log
fi
step "done: carry .fla_site .gpu_runs .gpu_cache"
