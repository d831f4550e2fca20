#!/usr/bin/env bash
# Build .fla_site/site.tar.xz: fla-core and a trimmed triton 3.7.1 that benchmarks/gpu_run.sh
# unpacks on the device machine and puts first on the path of the process that times fla's
# rows, and of that process alone.
#
# Why: fla-core 0.6.0 does not run on the device image (torch 2.11, triton 3.6). Its
# chunk_simple_gla broke the CUDA context there with "an illegal memory access" (2026-11-26).
# fla itself refuses its gated backward on Hopper with triton >= 3.4.0 and < 3.7.1
# (fla/ops/common/chunk_o.py, fla-org/flash-linear-attention#640): it asks for 3.7.1. The
# triton 3.7.1 wheel is 198 MB, over the 64 MiB a device call carries, but most of it is
# debug info and tools fla does not use:
# - libtriton.so carries 235 MB of DWARF, so it is stripped (461 MB -> 180 MB);
# - gone: CUPTI and proton (profiling), ptxas-blackwell (sm_100), instrumentation, plugins,
#   FileCheck, and the AMD backend;
# - ptxas, cuobjdump and nvdisasm come from the image's triton 3.6 on the device machine.
#   Both wheels bundle the same ptxas, CUDA 12.8.93 (checked 2026-11-27).
# xz leaves about 40 MB. torch 2.11 stays the image's, and so do the Flex and fastrpe rows'
# triton.
#
#   bash benchmarks/fla_site.sh            # here, with network; then carry .fla_site:
#   run(command="bash benchmarks/gpu_run.sh first", carry=[".fla_site", ".gpu_runs"], ...)
#
# PYVER=3.11 builds for this machine's Python, to check the trimmed tree here
# (tests/test_fla_site.py, when FASTRPE_FLA_SITE names the unpacked tree).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
TRITON=${TRITON:-3.7.1}
FLA=${FLA:-0.6.0}
OUT_DIR=${OUT_DIR:-.fla_site}
case "$OUT_DIR" in  # a folder in the checkout stays out of git (it travels as a carried path)
    /*) ;;
    *) grep -qx "/$OUT_DIR/" .git/info/exclude 2>/dev/null || echo "/$OUT_DIR/" >> .git/info/exclude ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/whl" "triton==$TRITON" "fla-core==$FLA"
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done

t="$work/site/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/bin" "$t/instrumentation" \
       "$t/plugins" "$t/FileCheck" "$t/_C/libproton.so"
strip --strip-unneeded "$t/_C/libtriton.so"
find "$work/site" -name '__pycache__' -prune -exec rm -rf {} +
# what the site holds, for the run's log
python3 - "$work/site" "$TRITON" "$FLA" "$PYVER" > "$work/site/FLA_SITE.txt" <<'EOF'
import sys
site, tv, fv, py = sys.argv[1:]
print(f"triton {tv} (trimmed, libtriton.so stripped; ptxas from the image) and fla-core {fv}, for Python {py}")
EOF
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/site.tar.xz"
tar -C "$work/site" -cf - . | xz -9 -T0 > "$OUT_DIR/site.tar.xz"
ls -l "$OUT_DIR/site.tar.xz"
