#!/usr/bin/env bash
# A/B of the recurrent kernels (decode, verify, commit by recompute) in one run on the GPU machine, after
# tools/gpu-suite.sh built build-gpu and ran the default benchmarks:
#   - GDNKIT_RECURRENT_KERNEL=block: the block kernel (recurrent_kernel.cuh) instead of the warp kernel;
#   - GDNKIT_PDL=0: decode without programmatic dependent launch.
# Writes $OUT/ab_{block,nopdl}_{decode,verify}.{json,md} and prints the tables last. Needs the build of
# tools/gpu-suite.sh (build-gpu, or GDNKIT_GPU_BUILD). About 1-2 minutes on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
BUILD=${GDNKIT_GPU_BUILD:-build-gpu}
mkdir -p "$OUT"
[ -x "$BUILD/gdnkit" ] || { echo "no $BUILD/gdnkit: run tools/gpu-suite.sh build first"; exit 1; }

bench() {  # name env op [args...]
  local name=$1 env=$2 op=$3
  shift 3
  env "$env" "$BUILD"/gdnkit bench "$op" --json "$OUT/ab_${name}_$op.json" --markdown "$OUT/ab_${name}_$op.md" "$@" \
    >"$OUT/ab_${name}_$op.log" 2>&1
  echo "== bench $op ($env): rc=$?"
}
bench block GDNKIT_RECURRENT_KERNEL=block decode
bench block GDNKIT_RECURRENT_KERNEL=block verify
bench nopdl GDNKIT_PDL=0 decode --layout klast

for f in "$OUT"/ab_*.md; do
  echo; echo "### $(basename "$f" .md)"; cat "$f"
done
