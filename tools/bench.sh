#!/usr/bin/env bash
# gdnkit's benchmark, from a fresh clone: install what is missing, build the CLI in build/ (with the CUDA
# backend when nvcc is found), then run `build/gdnkit bench "$@"`. See docs/benchmarks.md / README.md for the method.
#
#   bash tools/bench.sh                      # every op, the default shapes
#   bash tools/bench.sh decode --json out.json --markdown out.md
#   bash tools/bench.sh --help               # the CLI's options
#   GDNKIT_BUILD_DIR=dir  GDNKIT_JOBS=n  GDNKIT_CUDA=ON|OFF|AUTO  as in tools/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${GDNKIT_BUILD_DIR:-build}
JOBS=${GDNKIT_JOBS:-$(nproc)}

bash tools/install-deps.sh build
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
# The tests are not needed to benchmark (nor GoogleTest); tools/test.sh turns them back on in the same folder.
cmake -G Ninja -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGDNKIT_CUDA="${GDNKIT_CUDA:-AUTO}" \
  -DGDNKIT_BUILD_TESTS=OFF -DGDNKIT_BUILD_CLI=ON >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target gdnkit_cli
exec "$BUILD/gdnkit" bench "$@"
