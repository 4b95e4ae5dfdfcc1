#!/usr/bin/env bash
# Issue 13's per-layer costs on the GPU machine, in one call (bench/hybrid_diag.py):
#   bash bench/hybrid_diag.sh OUTDIR
# synthesizes the 70B (spec_device.sh PART=prep, SHAPES=70b) and builds llama-bench, runs the
# new hybrid GPU tests, llama.cpp -ngl 46 on the 70B, then hybrid_diag.py at the plan's share
# and at SHARE (default 0.5625; none leaves it out). SHAPES="70b 8b" also makes the 8B draft
# for a spec_bench.py call after this one. Carry .whl, .anchors and .llama.tar.xz.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
SHAPES=${SHAPES:-70b} LLAMA=${LLAMA:-1} PART=prep bash bench/spec_device.sh /tmp/prep > /tmp/prep.log 2>&1; tail -3 /tmp/prep.log
source bench/device_setup.sh
W=$SLIPSTREAM_MODELS
timeout -s INT -k 20 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_hybrid_gpu.py \
  -k "fused or host_flag or run_ahead or matches_whole" > "$OUTDIR/pytest-hybrid.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-hybrid.log" | head; tail -1 "$OUTDIR/pytest-hybrid.log"
if [ "${LLAMA:-1}" = 1 ]; then
  timeout 150 bash .anchors/llamacpp_bench.sh $W/70b-Q4_K.gguf -ngl 46 -p 512 -n 16 -r 3 -fa 1 \
    -t 15,16 > "$OUTDIR/llamacpp-70b-ngl46.txt" 2>&1
  grep -E "tg16|max memory" "$OUTDIR/llamacpp-70b-ngl46.txt"
fi
timeout 200 python3 bench/hybrid_diag.py "$OUTDIR/auto" --model $W/70b-Q4_K.gguf --rounds 3 \
  > "$OUTDIR/diag-auto.log" 2>&1; grep -v "^{" "$OUTDIR/diag-auto.log" | tail -6
[ "${SHARE:-}" = none ] || timeout 120 python3 bench/hybrid_diag.py "$OUTDIR/share" --model $W/70b-Q4_K.gguf --rounds 1 \
  --hybrid ${SHARE:-0.5625} > "$OUTDIR/diag-share.log" 2>&1; grep -v "^{" "$OUTDIR/diag-share.log" | tail -4
