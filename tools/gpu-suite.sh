#!/usr/bin/env bash
# The GPU machine's one script: build, run the GPU tests, the sanitizers and the benchmarks, write logs, JSON,
# Markdown and plots to $OUT, print a short table last.
#
#   tools/gpu-suite.sh [stage ...]     stages: build tests sanitize bench-decode bench-verify bench-prefill
#                                      bench-prefill-split (2 or more GPUs) python all (default: all)
#   GDNKIT_GTEST_FILTER=...            restricts the GPU tests (gtest filter)
#   GDNKIT_SANITIZE_TOOLS="memcheck ..." the sanitize stage's tools (default: all four; GDNKIT_SANITIZE_FILTER: its tests)
#   GTEST_ROOT=<prefix>                a GoogleTest install (include/, lib/) where the system has none
#   GDNKIT_WHEELS=<dir>                wheels (FLA and its needs) installed to /tmp/site first, for offline machines
#   GDNKIT_PEER_SOURCES=<dir>          vLLM's and SGLang's GDN op sources for the adapter tests (tools/fetch-peer-sources.sh)
#
# Needs: CUDA toolkit, CMake, ninja, GoogleTest; the python stage Python 3 with nanobind and PyTorch.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${GDNKIT_GPU_BUILD:-build-gpu}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"

build() {
  cmake -G Ninja -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGDNKIT_CUDA=ON \
    ${GTEST_ROOT:+-DGTEST_ROOT="$GTEST_ROOT"} >"$OUT/build.log" 2>&1 &&
  cmake --build "$BUILD" -j16 >>"$OUT/build.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || tail -40 "$OUT/build.log"
  note "build: rc=$rc"
  return $rc
}
build || exit 1

if want tests; then
  "$BUILD"/tests/gdnkit_gpu_tests --gtest_filter="${GDNKIT_GTEST_FILTER:-*}" \
    --gtest_output=json:"$OUT/gpu_tests.json" >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED) |^\[==========\]" "$OUT/gpu_tests.log" | tail -3
  grep -E "^\[  FAILED  \]" "$OUT/gpu_tests.log" | head -20
  note "gpu tests: rc=$rc ($(grep -c '^\[       OK \]' "$OUT/gpu_tests.log") ok)"
fi

if want sanitize; then
  # The four compute-sanitizer tools over the whole GPU suite (tools/sanitize.sh; GDNKIT_SANITIZE_TOOLS picks some).
  rm -f "$OUT/sanitize/summary.txt"
  # shellcheck disable=SC2086
  OUT="$OUT" tools/sanitize.sh "$BUILD" ${GDNKIT_SANITIZE_TOOLS:-} >"$OUT/sanitize.log" 2>&1
  while IFS= read -r line; do note "$line"; done <"$OUT/sanitize/summary.txt"
fi

# Benchmarks: docs/benchmarks.md's sweep per op (GDNKIT_BENCH_ARGS adds options, e.g. "--quick" or "--shape all"),
# then the plots of tools/plot_bench.py next to the JSON.
benched=()
for op in decode verify prefill; do
  if want bench-$op; then
    # shellcheck disable=SC2086
    "$BUILD"/gdnkit bench $op --json "$OUT/bench_$op.json" --markdown "$OUT/bench_$op.md" \
      ${GDNKIT_BENCH_ARGS:-} >"$OUT/bench_$op.log" 2>&1
    rc=$?
    note "bench $op: rc=$rc ($(grep -o '[0-9]* rows in [0-9.]* s' "$OUT/bench_$op.log" | tail -1))"
    [ -f "$OUT/bench_$op.json" ] && benched+=("$OUT/bench_$op.json")
  fi
done
if [ ${#benched[@]} -gt 0 ]; then
  python3 tools/plot_bench.py "${benched[@]}" --out "$OUT" >"$OUT/plot.log" 2>&1
  note "plots: rc=$? ($(grep -c wrote "$OUT/plot.log") PNG)"
fi

# Python package (tests/python, python/README.md): the extension built against this build's library
# (GDNKIT_PY_PIP=1: `pip install --no-build-isolation .` instead); then `python -m gdnkit.bench`, gdnkit vs
# FLA on identical inputs (fla_compare.{json,md}; options in GDNKIT_PYBENCH_ARGS, GDNKIT_PYBENCH=0 skips it);
# then the pytest suite, GPU tests included (GDNKIT_PYTEST_ARGS adds options, GDNKIT_PYTEST_TIMEOUT caps it).
if want python; then
  if [ -n "${GDNKIT_WHEELS:-}" ] && ls "$GDNKIT_WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$GDNKIT_WHEELS"/*.whl >"$OUT/python_build.log" 2>&1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if [ "${GDNKIT_PY_PIP:-0}" = 1 ]; then
    python3 -m pip install -q --no-build-isolation --no-deps . >>"$OUT/python_build.log" 2>&1
    rc=$?
    py_path=${PYTHONPATH:-}
  else
    cmake -S . -B "$BUILD" -DGDNKIT_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" \
      >>"$OUT/python_build.log" 2>&1 &&
    cmake --build "$BUILD" --target _gdnkit -j16 >>"$OUT/python_build.log" 2>&1 &&
    cp "$BUILD"/python/_gdnkit*.so python/gdnkit/
    rc=$?
    py_path=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
    export GDNKIT_CLI="$BUILD/gdnkit"  # the CLI version test
  fi
  [ $rc -eq 0 ] || tail -30 "$OUT/python_build.log"
  note "python build: rc=$rc"
  if [ $rc -eq 0 ]; then
    if [ "${GDNKIT_PYBENCH:-1}" = 1 ]; then
      # shellcheck disable=SC2086
      PYTHONPATH=$py_path python3 -m gdnkit.bench --out "$OUT" ${GDNKIT_PYBENCH_ARGS:-} >"$OUT/fla_compare.log" 2>&1
      rc=$?
      [ $rc -eq 0 ] || tail -30 "$OUT/fla_compare.log"
      note "fla compare (python -m gdnkit.bench): rc=$rc"
    fi
    # The error tests in a process of their own: a crash there shows as such, apart from the suite.
    PYTHONPATH=$py_path timeout 300 python3 -m pytest tests/python/test_errors.py -q -rs -p no:cacheprovider \
      >"$OUT/python_probe.log" 2>&1
    note "python error tests: rc=$? ($(tail -1 "$OUT/python_probe.log"))"
    # GDNKIT_PYTEST_TIMEOUT: seconds for pytest
    # shellcheck disable=SC2086
    PYTHONPATH=$py_path timeout "${GDNKIT_PYTEST_TIMEOUT:-3000}" python3 -m pytest tests/python -q -rs \
      -p no:cacheprovider --ignore=tests/python/test_errors.py ${GDNKIT_PYTEST_ARGS:-} >"$OUT/python_tests.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/python_tests.log" | head -30
    note "python tests: rc=$rc ($(tail -1 "$OUT/python_tests.log"))"
  fi
fi

echo
echo "================ summary ================"
for line in "${summary[@]}"; do echo "$line"; done
# The split prefill over the machine's GPUs (stage bench-prefill-split; skipped on a machine of one GPU).
if want bench-prefill-split && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  "$BUILD"/gdnkit bench prefill-split --json "$OUT/bench_prefill_split.json" --markdown "$OUT/bench_prefill_split.md" \
    >"$OUT/bench_prefill_split.log" 2>&1
  note "bench prefill-split: rc=$?"
fi
for op in decode verify prefill prefill_split; do
  [ -f "$OUT/bench_$op.md" ] && { echo; cat "$OUT/bench_$op.md"; }
done
[ -f "$OUT/fla_compare.md" ] && { echo; cat "$OUT/fla_compare.md"; }
exit 0
