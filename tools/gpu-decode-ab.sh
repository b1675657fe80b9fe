#!/usr/bin/env bash
# A/B of the K-last decode kernels in one run on the GPU machine: builds the GPU tests and the CLI, runs
# the decode tests (the warp-independent kernel), then `gdnkit bench decode --layout klast` twice:
# GDNKIT_DECODE_KERNEL=block (the block kernel verify/commit use) and the default (warp kernel).
# Writes $OUT/decode_{block,warp}.{json,md} and $OUT/decode_ab_{build,tests}.log; prints both tables last.
# Needs GoogleTest in carry/gtest (tools/carry-gtest.sh). About 2-3 minutes on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"

cmake -G Ninja -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DGDNKIT_CUDA=ON -DGTEST_ROOT="$PWD/carry/gtest" \
  >"$OUT/decode_ab_build.log" 2>&1 &&
  cmake --build build-gpu -j16 --target gdnkit_gpu_tests gdnkit_cli >>"$OUT/decode_ab_build.log" 2>&1
rc=$?
grep -E "spill|error" "$OUT/decode_ab_build.log" | grep -v "0 bytes spill" | grep decode_warp
if [ $rc -ne 0 ]; then
  tail -40 "$OUT/decode_ab_build.log"
  echo "== build: rc=$rc"
  exit 1
fi

build-gpu/tests/gdnkit_gpu_tests --gtest_filter='*Decode*' >"$OUT/decode_ab_tests.log" 2>&1
test_rc=$?
grep -E "^\[  FAILED  \]" "$OUT/decode_ab_tests.log" | head -20
echo "== decode tests: rc=$test_rc ($(grep -c '^\[       OK \]' "$OUT/decode_ab_tests.log") ok)"

GDNKIT_DECODE_KERNEL=block build-gpu/gdnkit bench decode --layout klast \
  --json "$OUT/decode_block.json" --markdown "$OUT/decode_block.md" >"$OUT/decode_block.log" 2>&1
echo "== bench block: rc=$?"
build-gpu/gdnkit bench decode --layout klast \
  --json "$OUT/decode_warp.json" --markdown "$OUT/decode_warp.md" >"$OUT/decode_warp.log" 2>&1
echo "== bench warp: rc=$?"

echo; echo "### K-last decode, block kernel (GDNKIT_DECODE_KERNEL=block)"
cat "$OUT/decode_block.md" 2>/dev/null || tail -20 "$OUT/decode_block.log"
echo; echo "### K-last decode, warp-independent kernel (default)"
cat "$OUT/decode_warp.md" 2>/dev/null || tail -20 "$OUT/decode_warp.log"
exit $test_rc
