#!/usr/bin/env bash
# The GPU suite, run whole across device calls, with one summary at the end.
#
# Tests come in two tiers, chosen by markers (pyproject.toml):
#   python3 -m pytest -m "not slow"   the fast tier: under 5 minutes on a 2-core machine; a test
#                                     over about 1 s there, or behind a module fixture that is
#                                     (a real-model load, a server process, transformers), is
#                                     marked slow, and every feature keeps a fast test
#   python3 -m pytest                 everything (the README's command and .ci/run)
# Tests marked `gpu` (all of tests/gpu, and a few beside the CPU tests they mirror) skip
# without CUDA. `compile_heavy` marks the GPU tests whose Triton compiles take minutes (the
# exact qgemm for Q2_K and Q3_K: 265 and 390 s on an H200). `default_model` is set on every
# test that uses the real default model (the smollm_path fixture).
#
# The GPU suite (`-m gpu`) takes longer than one device call (10 minutes at most), so this
# script runs it in pieces through tests/suite_plugin.py: each call runs the tests the state
# file does not hold yet, starts none after BUDGET_S seconds, records every outcome in
# .gpu-suite/state.json as it goes, and ends with the merged summary of all calls so far.
# Run the same command in every call until the summary says the suite has run whole:
#
#   call:   bash benchmarks/device/gpu_suite.sh
#           carry: .whl (the gguf wheel), .gpu-suite (from the second call on), and the
#           default model's two parts (.model/a in one call, .model/b in a later one on the
#           same warm machine; until both have come, the default model's tests wait)
#   after:  mkdir -p .gpu-suite && cp <files_at>/gpu-suite-state.json .gpu-suite/state.json
#
# On a machine that stays warm the state also stays in its tree; carrying it back is what
# lets a fresh machine carry on. Its exit status is --suite-summary's: 0 the suite ran whole
# and green, 1 some test failed, 2 tests are left (call again), 4 no state.
#
# Settings: HEAVY=1 also runs the compile_heavy tests; FRESH=1 starts from an empty state;
# SHARDS (default 8) pytest processes side by side, balanced by the test durations of
# DURATIONS (default: the newest benchmarks/results/*-gpu-suite-*.json, an earlier whole run's
# state), ALONE_S (default 120) kept for the tests
# marked gpu_alone, run after them in one process;
# BUDGET_S (default 420) is the time after which no test starts, HARD_S (default 540) the
# time at which pytest is interrupted (a test cut there runs again first in the next call,
# and counts as failed if it is cut twice); PYTEST_ARGS adds pytest arguments (-k, say).
# The plugin works without this script too: `pytest -m gpu --suite-state FILE --time-budget S`
# in each call, then `pytest --suite-state FILE --suite-summary tests`.
# Files back in $OUT: gpu-suite-logs.tgz (gpu-suite-I.log of shard I of this call, 0 the tests
# run alone; verbose, with the passing tests' output), gpu-suite-state.json,
# gpu-suite-summary.txt (and setup.sh's host.txt): few files, as a call brings back only 8,
# and 9 logs beside the state once left the state behind.
set -uo pipefail
OUTDIR=${OUT:-/tmp/slipstream-out}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/../.."
STATE=.gpu-suite/state.json
[ "${FRESH:-0}" = 1 ] && rm -f "$STATE"
mkdir -p .gpu-suite

source benchmarks/device/setup.sh

marks="gpu"
[ "${HEAVY:-0}" = 1 ] || marks="$marks and not compile_heavy"
later=()
if ! ls "${SLIPSTREAM_CACHE:-/tmp/slipstream-cache}" 2>/dev/null | grep -q "^SmolLM2.*\.gguf$"; then
  # in the suite as not yet run, for a call that has the model
  echo "the default model is not in the cache: its tests wait for a call that has it"
  later=(--suite-later default_model)
fi
# SHARDS processes share the GPU (default 8): Triton compiles on the CPU, and a cold machine
# spends most of a call compiling. Each shard runs its group of tests (suite_plugin's
# --suite-shard) from a copy of the state and logs to gpu-suite-I.log; their states are merged
# into the main one after. Then the tests marked gpu_alone (they read the device's memory use
# as their own, or time work) run in one process, alone on the GPU, logged to gpu-suite-0.log;
# the shards stop starting tests ALONE_S (default 120) seconds before the call's budget for it.
# 8 on the 16-core hosts: by the durations of a whole run on an H100 (2073 s of tests, 4
# shards then), 4 shards come to 513-524 s each, past one call's budget, and 8 to 252-266 s
shards=${SHARDS:-8}
durations=${DURATIONS:-$(ls benchmarks/results/*-gpu-suite-*.json 2>/dev/null | tail -1)}
budget=${BUDGET_S:-420}; hard=${HARD_S:-540}; alone=${ALONE_S:-120}
settings=$(env | grep '^SLIPSTREAM_' | sort)  # the settings this call ran under head each log
run_pytest() {  # LOG STATE TIME_BUDGET HARD_LIMIT MARKS [ARGS...]: one pytest process
  local log=$1 state=$2 tb=$3 hl=$4 m=$5; shift 5
  echo "$settings" > "$log"
  # a module that cannot be imported here (a package the device lacks) is named in the summary
  timeout -s INT -k 20 "$hl" python3 -m pytest -v -p no:cacheprovider -rsP \
    --durations=10 --continue-on-collection-errors -m "$m" "${later[@]}" \
    --suite-state "$state" --time-budget "$tb" "$@" ${PYTEST_ARGS:-} tests >> "$log" 2>&1
}
start=$SECONDS
pids=()
for i in $(seq 1 "$shards"); do
  if [ -f "$STATE" ]; then cp "$STATE" ".gpu-suite/shard-$i.json"; else rm -f ".gpu-suite/shard-$i.json"; fi
  run_pytest "$OUTDIR/gpu-suite-$i.log" ".gpu-suite/shard-$i.json" $((budget - alone)) \
    $((hard - alone)) "$marks and not gpu_alone" --suite-shard "$i/$shards" \
    ${durations:+--suite-durations "$durations"} &
  pids+=($!)
done
wait "${pids[@]}"
python3 -m pytest -p no:cacheprovider --suite-state "$STATE" \
  --suite-merge $(seq -f ".gpu-suite/shard-%g.json" 1 "$shards") tests
spent=$((SECONDS - start))
run_pytest "$OUTDIR/gpu-suite-0.log" "$STATE" $((budget > spent ? budget - spent : 0)) \
  $((hard > spent + 30 ? hard - spent : 30)) "$marks and gpu_alone"
grep -hE "^(FAILED|ERROR)|this call ran" "$OUTDIR"/gpu-suite-*.log | head -20
cp "$STATE" "$OUTDIR/gpu-suite-state.json"
python3 -m pytest -p no:cacheprovider --suite-state "$STATE" --suite-summary tests \
  | tee "$OUTDIR/gpu-suite-summary.txt"
rc=${PIPESTATUS[0]}
tar czf "$OUTDIR/gpu-suite-logs.tgz" -C "$OUTDIR" $(cd "$OUTDIR" && ls gpu-suite-*.log) \
  && rm -f "$OUTDIR"/gpu-suite-*.log
exit "$rc"
