#!/usr/bin/env bash
# `pytest -m gpu` in parts that each fit a device call: the whole of tests/gpu ran past 480 s in
# session 37 (163 tests, cut in test_engine.py: a fresh machine compiles every Triton kernel).
#   PART=1 bash bench/gpu_tests.sh OUTDIR   the kernels, the attention kernels, the engine
#   PART=2 bash bench/gpu_tests.sh OUTDIR   hybrid, streaming, tier C
#   PART=3 bash bench/gpu_tests.sh OUTDIR   speculative decoding
# Each file runs under its own limit (FILE_S seconds, default 240), cut by SIGINT so that pytest
# still reports what ran, verbosely into OUTDIR/pytest-<file>.log; one summary line per file.
# The default model's tests need it in the device's cache: carry .model/a in one call and
# .model/b in a later one on the same warm machine (bench/device_setup.sh reassembles it).
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
source bench/device_setup.sh
case ${PART:-1} in
  1) FILES="test_kernels.py test_attention_kernels.py test_engine.py" ;;
  2) FILES="test_hybrid_gpu.py test_streaming_gpu.py test_tier_c_gpu.py" ;;
  3) FILES="test_speculative_gpu.py" ;;
  *) echo "PART must be 1, 2 or 3"; exit 2 ;;
esac
ls -la "$SLIPSTREAM_CACHE" | grep -q "SmolLM2" || echo "the default model is not in $SLIPSTREAM_CACHE: its tests will skip"
for f in $FILES; do
  log="$OUTDIR/pytest-${f%.py}.log"
  timeout -s INT -k 20 "${FILE_S:-240}" python3 -m pytest -v -p no:cacheprovider -m gpu \
    "tests/gpu/$f" -rs --durations=10 > "$log" 2>&1
  echo "$f: $(grep -E '(passed|failed|error|skipped)' "$log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$log" | head -10
done
