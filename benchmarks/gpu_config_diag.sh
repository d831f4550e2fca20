#!/usr/bin/env bash
# Which autotuner config breaks a GPU test: each (test, config) in a process of its own, the
# config pinned (FASTRPE_TRITON_CONFIG, an index into triton_chunked.TUNE_CONFIGS), launches
# blocking so that a fault names its kernel; then the whole GPU suite under one config.
#
# Why: an illegal memory access poisons the process's CUDA context, so one faulting autotuner
# config fails every later test (2026-11-27: 55 of 57). On the device machine (repo root):
#   run(command="BUDGET=290 bash benchmarks/gpu_config_diag.sh", carry=[".gpu_cache"], timeout_s=320)
# Writes $OUT/diag.log (each run's outcome, the failures' output) and $OUT/gpu_tests_c$SUITE_CONFIG.log.
# CASES: "test-id:config ..." (test ids of test_sixteen_bit_products_match_float64_at_4096);
# SUITE_CONFIG: the config of the final whole-suite run (empty: none).
# 2026-11-27's cases (benchmarks/results/gpu/h100-2026-11-27c-tests.json) were the default.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_diag}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${BUDGET:-300} - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/cc/triton TORCHINDUCTOR_CACHE_DIR=/tmp/cc/inductor
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
[ -f .gpu_cache/compile_cache.tar.xz ] && python3 benchmarks/compile_cache.py unpack .gpu_cache/compile_cache.tar.xz \
    --triton-dir "$TRITON_CACHE_DIR" --inductor-dir "$TORCHINDUCTOR_CACHE_DIR" | tail -1
# (config indices into TUNE_CONFIGS: 4 warps at 1, 2 and 3 stages since 2026-11-27; the 8-warp
# configs this script isolated the fault in are gone)
CASES=${CASES:-"triton_soe-bf16x3:0 triton_soe-bf16x3:1 triton_soe-bf16x3:2 triton_soe-bf16-features:0
triton_band-bf16x3:0 triton_tiled-bf16x3:0 triton_band-bf16-features:0 triton_tiled-bf16-features:0
triton_band-bf16x3:1 triton_tiled-bf16x3:1"}
SUITE_CONFIG=${SUITE_CONFIG-0}
L=$OUT/diag.log
for case in $CASES; do
    t=${case%:*} c=${case##*:}
    [ "$(left)" -lt 40 ] && { echo "skip $t config $c (time)" | tee -a "$L"; continue; }
    s=$(date +%s)
    FASTRPE_TRITON_CONFIG=$c CUDA_LAUNCH_BLOCKING=1 timeout 45 python3 -m pytest -x -q -p no:cacheprovider \
        "tests/test_gpu.py::test_sixteen_bit_products_match_float64_at_4096[$t]" > /tmp/diag_one.log 2>&1
    rc=$?
    echo "==== $t config $c rc=$rc $(( $(date +%s) - s ))s" | tee -a "$L"
    if [ $rc -ne 0 ]; then
        grep -E "_kernel\[|Error|assert|error" /tmp/diag_one.log | grep -v "Search for\|For debugging\|Compile with\|CUDA kernel errors" \
            | head -8 | cut -c1-220 | tee -a "$L"
        cat /tmp/diag_one.log >> "$L"
    fi
done
R=$(left)
if [ -n "$SUITE_CONFIG" ] && [ "$R" -gt 30 ]; then
    echo "==== full GPU tests, config $SUITE_CONFIG only, $R s" | tee -a "$L"
    FASTRPE_TRITON_CONFIG=$SUITE_CONFIG timeout $((R - 10)) python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests \
        > "$OUT/gpu_tests_c$SUITE_CONFIG.log" 2>&1
    echo "rc=$?"
    grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_c$SUITE_CONFIG.log" | head -30 | cut -c1-200
fi
