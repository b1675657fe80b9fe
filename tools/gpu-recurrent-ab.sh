#!/usr/bin/env bash
# A/B of the recurrent kernels' launch in one run on the GPU machine, after tools/gpu-suite.sh built
# build-gpu and ran the default benchmarks: `gdnkit bench decode` with GDNKIT_PDL=0 (no programmatic
# dependent launch). Writes $OUT/ab_nopdl_decode.{json,md,log} and prints the table last. Needs the build
# of tools/gpu-suite.sh (build-gpu, or GDNKIT_GPU_BUILD). Under a minute on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BUILD=${GDNKIT_GPU_BUILD:-build-gpu}
mkdir -p "$OUT"
[ -x "$BUILD/gdnkit" ] || { echo "no $BUILD/gdnkit: run tools/gpu-suite.sh build first"; exit 1; }

GDNKIT_PDL=0 "$BUILD"/gdnkit bench decode --json "$OUT/ab_nopdl_decode.json" --markdown "$OUT/ab_nopdl_decode.md" \
  >"$OUT/ab_nopdl_decode.log" 2>&1
echo "== bench decode (GDNKIT_PDL=0): rc=$?"
echo; echo "### decode without PDL (GDNKIT_PDL=0)"
cat "$OUT/ab_nopdl_decode.md" 2>/dev/null || tail -20 "$OUT/ab_nopdl_decode.log"
