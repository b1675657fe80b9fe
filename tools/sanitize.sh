#!/usr/bin/env bash
# compute-sanitizer over the whole GPU suite: memcheck, racecheck, synccheck and initcheck, each over every test
# of gdnkit_gpu_tests, the tests split into shards that run side by side (the CPU reference is most of a test's
# time; the GPU is shared), and over a sample of the randomized differential test's fast tier (its first cases)
# beside them. Prints one line per tool: tests passed and failed, the sanitizers' error count; logs per shard in
# $OUT/sanitize/.
#
#   tools/sanitize.sh BUILD_DIR [tool ...]      tools: memcheck racecheck synccheck initcheck (default: all four)
#   GDNKIT_SANITIZE_FILTER=...                  gtest filter, positive patterns only (default: every test)
#   GDNKIT_SANITIZE_JOBS=N                      shards per tool (default: the cores / 2, at most 8)
#   GDNKIT_SANITIZE_RANDOM_CASES=N              randomized cases per tool (default 300; 0: none)
#   GDNKIT_SOAK_REPLAYS=N                       graph replays of the soak test (default here 200; its own 3000)
# Exit status: 0 when every tool reports 0 errors and every test passes.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: tools/sanitize.sh BUILD_DIR [tool ...]}
shift
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
OUT=${OUT:-$PWD/gpu-out}
LOGS="$OUT/sanitize"
mkdir -p "$LOGS"
BIN="$BUILD/tests/gdnkit_gpu_tests"
[ -x "$BIN" ] || { echo "sanitize: no $BIN (build the CUDA backend first)" >&2; exit 2; }
cores=$(nproc 2>/dev/null || echo 2)
jobs=${GDNKIT_SANITIZE_JOBS:-$(( cores / 2 > 8 ? 8 : (cores / 2 < 1 ? 1 : cores / 2) ))}
filter="${GDNKIT_SANITIZE_FILTER:-*}-RandomDifferential.*"
random_cases=${GDNKIT_SANITIZE_RANDOM_CASES:-300}
export GDNKIT_SOAK_REPLAYS=${GDNKIT_SOAK_REPLAYS:-200}

# Options per tool: racecheck looks at shared memory hazards; initcheck reports reads of uninitialized device
# memory, but does not see stores by bulk copies (cp.async.bulk from shared memory: the head pass's states, o and
# the context-parallel local pass's states and transitions), so reads of those, e.g. by the context-parallel scan, are
# reported; the tests that fill their workspaces with NaN bytes check those reads instead. No leak check: the
# prefill's library-owned workspace lives as long as the process (docs/api.md).
opts() {
  case $1 in
    memcheck) echo "--tool memcheck" ;;
    racecheck) echo "--tool racecheck" ;;
    synccheck) echo "--tool synccheck" ;;
    initcheck) echo "--tool initcheck" ;;
    *) echo "sanitize: unknown tool $1" >&2; return 1 ;;
  esac
}

# Errors in sanitizer logs: "ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY: ... (N errors, ...)".
count_errors() {
  cat "$@" | grep -oE 'ERROR SUMMARY: [0-9]+|\([0-9]+ errors' | grep -oE '[0-9]+' | awk '{s += $1} END {print s + 0}'
}

status=0
for tool in "${tools[@]}"; do
  o=$(opts "$tool") || exit 2
  start=$(date +%s)
  pids=()
  for ((i = 0; i < jobs; i++)); do
    # shellcheck disable=SC2086
    GTEST_TOTAL_SHARDS=$jobs GTEST_SHARD_INDEX=$i compute-sanitizer $o --error-exitcode 9 --print-limit 20 \
      "$BIN" --gtest_filter="$filter" >"$LOGS/$tool.$i.log" 2>&1 &
    pids+=($!)
  done
  if [ "$random_cases" -gt 0 ]; then
    # shellcheck disable=SC2086
    GDNKIT_RANDOM_FAST_CASES=$random_cases compute-sanitizer $o --error-exitcode 9 --print-limit 20 "$BIN" \
      --gtest_filter='RandomDifferential.FastTier' >"$LOGS/$tool.random.log" 2>&1 &
    pids+=($!)
  fi
  rcs=()
  for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
  tests=$(cat "$LOGS/$tool".*.log | grep -c '^\[       OK \]')
  failed=$(cat "$LOGS/$tool".*.log | grep -c '^\[  FAILED  \] .*(')
  skipped=$(cat "$LOGS/$tool".*.log | grep -c '^\[  SKIPPED \] .*(')
  errors=$(count_errors "$LOGS/$tool".*.log)
  bad=0
  for rc in "${rcs[@]}"; do [ "$rc" -eq 0 ] || bad=1; done
  line="compute-sanitizer $tool: $tests passed, $failed failed, $skipped skipped, $errors errors, $jobs shards, $(( $(date +%s) - start )) s"
  if [ "$random_cases" -gt 0 ]; then
    line+="; randomized: $(grep -oE '^random differential.*' "$LOGS/$tool.random.log" | tail -1)"
  fi
  echo "$line" | tee -a "$LOGS/summary.txt"
  [ $bad -eq 0 ] && [ "$errors" -eq 0 ] || status=1
done
exit $status
