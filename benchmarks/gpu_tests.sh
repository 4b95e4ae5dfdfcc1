#!/usr/bin/env bash
# `pytest -m gpu` in parts that each fit a device call: the whole of tests/gpu ran past 480 s in
# session 37 (163 tests, cut in test_engine.py: a fresh machine compiles every Triton kernel).
#   PART=1 bash bench/gpu_tests.sh OUTDIR   the attention kernels and the engine
#   PART=2 bash bench/gpu_tests.sh OUTDIR   the quantized GEMV/GEMM kernels
#   PART=3 bash bench/gpu_tests.sh OUTDIR   hybrid, streaming, tier C
#   PART=4 bash bench/gpu_tests.sh OUTDIR   speculative decoding
# The part's files run one after another within PART_S seconds (default 540: under one call's
# 600 s with the setup), each cut by SIGINT at what is left so that pytest still reports what
# ran, verbosely into OUTDIR/pytest-<file>.log, with what passing tests printed (the greedy
# tests' near-ties); one summary line per file.
# The default model's tests need it in the device's cache: carry .model/a in one call and
# .model/b in a later one on the same warm machine (bench/device_setup.sh reassembles it).
# PYTEST_K: pytest's -k expression for the part's files (e.g. "not default_model" in the call
# before the model's second half arrives). HEAVY=1 also runs the compile_heavy tests
# (pyproject.toml's markers: Triton compiles of minutes), left out otherwise.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
source bench/device_setup.sh
case ${PART:-1} in
  1) FILES="test_attention_kernels.py test_engine.py" ;;
  2) FILES="test_kernels.py" ;;
  3) FILES="test_hybrid_gpu.py test_streaming_gpu.py test_tier_c_gpu.py" ;;
  4) FILES="test_speculative_gpu.py" ;;
  *) echo "PART must be 1, 2, 3 or 4"; exit 2 ;;
esac
ls "$SLIPSTREAM_CACHE" 2>/dev/null | grep -q "SmolLM2" \
  || echo "the default model is not in $SLIPSTREAM_CACHE: its tests will skip"
deadline=$((SECONDS + ${PART_S:-540}))
for f in $FILES; do
  left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then echo "$f: not run (the part's ${PART_S:-540} s are spent)"; continue; fi
  log="$OUTDIR/pytest-${f%.py}.log"
  marks="gpu"; [ "${HEAVY:-0}" = 1 ] || marks="gpu and not compile_heavy"
  # the settings the part ran under (SLIPSTREAM_LAYER_GRAPHS=1, say) head its log
  env | grep '^SLIPSTREAM_' | sort > "$log"
  timeout -s INT -k 20 "$left" python3 -m pytest -v -p no:cacheprovider -m "$marks" \
    ${PYTEST_K:+-k "$PYTEST_K"} "tests/gpu/$f" -rsP --durations=10 >> "$log" 2>&1
  echo "$f: $(grep -E '(passed|failed|error|skipped)' "$log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$log" | head -10
done
