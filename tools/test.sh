#!/usr/bin/env bash
# gdnkit's tests, from a fresh clone: install what is missing, build in build/, run every CTest suite
# (the GPU suite skips visibly with exit 77 where there is no GPU: CTest reports it "Skipped"), check
# that an installed gdnkit works from another CMake project (tests/install) and that the README's
# example is that project's source, then build the Python package and run its tests.
# Exits non-zero when any step fails. CI runs exactly this (.ci/run).
#
#   bash tools/test.sh
#   GDNKIT_BUILD_DIR=dir      build folder (default build)
#   GDNKIT_JOBS=n             parallel build/test jobs (default: all cores)
#   GDNKIT_CUDA=ON|OFF|AUTO   CUDA backend of the C++ build (default AUTO: built when nvcc is found)
#   GDNKIT_PY_CUDA=ON|OFF     CUDA backend of the Python build (default OFF: its tests run on the CPU)
#   GDNKIT_SKIP_PYTHON=1      skip the Python package and its tests
#   GDNKIT_SKIP_TORCH=1       do not install PyTorch (tools/install-deps.sh): the torch tests then skip
#   GTEST_ROOT=<prefix>       a GoogleTest install (include/, lib/) to use where the system has none
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
BUILD=${GDNKIT_BUILD_DIR:-build}
case $BUILD in /*) ;; *) BUILD=$root/$BUILD ;; esac  # absolute: the steps below run from other folders too
JOBS=${GDNKIT_JOBS:-$(nproc)}
start=$(date +%s)

failed=()
passed=()
step() {  # step NAME COMMAND...: runs it, records the result, keeps going
  local name=$1; shift
  local t0=$(date +%s)
  echo
  echo "==== $name"
  if "$@"; then
    passed+=("$name ($(( $(date +%s) - t0 ))s)")
  else
    echo "==== $name: FAILED"
    failed+=("$name")
  fi
}

bash tools/install-deps.sh || { echo "tools/install-deps.sh failed"; exit 1; }

# nvcc outside PATH (a toolkit in /usr/local/cuda): let CMake's AUTO find it.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

gtest_root=()
if [ -n "${GTEST_ROOT:-}" ]; then
  gtest_root=(-DGTEST_ROOT="$GTEST_ROOT")
fi
configure() {
  cmake -G Ninja -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGDNKIT_CUDA="${GDNKIT_CUDA:-AUTO}" \
    -DGDNKIT_BUILD_TESTS=ON -DGDNKIT_BUILD_CLI=ON "${gtest_root[@]}"
}
build() { cmake --build "$BUILD" -j "$JOBS"; }
run_ctest() { ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"; }

step configure configure || true
if [ ${#failed[@]} -eq 0 ]; then
  step build build
fi
if [ ${#failed[@]} -eq 0 ]; then
  step ctest run_ctest

  # An installed gdnkit used through find_package(gdnkit) by another project.
  install_consumer() {
    local prefix="$BUILD/install-test/prefix" cbuild="$BUILD/install-test/build"
    rm -rf "$BUILD/install-test"
    cmake --install "$BUILD" --prefix "$prefix" >/dev/null &&
      cmake -G Ninja -S tests/install -B "$cbuild" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
        >/dev/null &&
      cmake --build "$cbuild" -j "$JOBS" &&
      "$cbuild/decode_example"
  }
  step install-consumer install_consumer
fi

# The README's C++ example is tests/install/decode_example.cpp, so it stays true.
readme_example() {
  python3 - <<'EOF'
import re, sys
readme = open("README.md").read()
m = re.search(r"<!-- example: tests/install/decode_example.cpp -->\s*```cpp\n(.*?)```", readme, re.S)
if not m:
    sys.exit("README.md: no example block marked tests/install/decode_example.cpp")
src = open("tests/install/decode_example.cpp").read()
if m.group(1).strip() != src.strip():
    sys.exit("README.md: the example differs from tests/install/decode_example.cpp (copy the file into the README)")
print("README example == tests/install/decode_example.cpp")
EOF
}
step readme-example readme_example

# Python package: CPU build by default (the C++ suites above cover CUDA compilation).
if [ "${GDNKIT_SKIP_PYTHON:-0}" != 1 ] && [ -f pyproject.toml ]; then
  python_install() {
    # Debian's system Python refuses pip installs (PEP 668) unless told otherwise; a venv or pyenv does not.
    local flags=()
    if python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
      flags+=(--break-system-packages)
    fi
    python3 -m pip install -q "${flags[@]}" --no-build-isolation \
      -C cmake.define.GDNKIT_CUDA="${GDNKIT_PY_CUDA:-OFF}" .
  }
  python_tests() {
    # The torch tests (torch_ops, adapters, torch.compile) run here, on the CPU, with the PyTorch that
    # tools/install-deps.sh installed; the GPU tests skip without a GPU (tools/gpu-suite.sh runs them).
    python3 -c 'import torch; print("PyTorch", torch.__version__, "(torch tests run on the CPU)")' 2>/dev/null ||
      echo "PyTorch is not installed: the torch tests skip"
    # GDNKIT_CLI: test_package.py checks that `gdnkit --version` is the package's version.
    local cli=()
    if [ -x "$BUILD/gdnkit" ]; then cli=(env GDNKIT_CLI="$BUILD/gdnkit"); fi
    "${cli[@]}" python3 -m pytest -q -rs
    local rc=$?
    if [ $rc -eq 5 ]; then echo "pytest: no tests collected"; return 1; fi
    return $rc
  }
  step python-install python_install
  if [[ ! " ${failed[*]} " =~ " python-install " ]]; then
    step python-tests python_tests
  fi
fi

echo
echo "==== summary ($(( $(date +%s) - start ))s)"
for s in "${passed[@]}"; do echo "  ok      $s"; done
for s in "${failed[@]}"; do echo "  FAILED  $s"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "tools/test.sh: ${#failed[@]} step(s) failed"
  exit 1
fi
echo "tools/test.sh: all steps passed"
