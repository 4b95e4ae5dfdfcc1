#!/usr/bin/env bash
# One device call for qgemm's kernels: the qgemm GPU tests (SLIPSTREAM_QGEMM picks the default
# kernel), Triton's compiles in 8 processes, then bench/qgemm_wide_bench.py (--sweep unless
# SWEEP=0); with LEVELS=1 also an 8B draft's tree level by width (bench/draft_levels.py) with
# each kernel, the synthetic 8B made beside the compiles. Writes logs and JSON into OUTDIR ($1,
# default $OUT). Carry .whl (the gguf wheel).
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
source bench/device_setup.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUTDIR/gpu.txt"
SW=$([ "${SWEEP:-1}" = 1 ] && echo --sweep)
t0=$(date +%s)
SYN8=$SLIPSTREAM_MODELS/8b-Q4_K.gguf
mkdir -p "$SLIPSTREAM_MODELS"
if [ "${LEVELS:-0}" = 1 ] && [ ! -f "$SYN8" ]; then
  python3 -m slipstream synth --shape 8b --quant Q4_K -o "$SYN8" >/tmp/synth.log 2>&1 &
fi
K=${KTESTS:-"qgemm or matmul_routes"}
( timeout ${TEST_S:-280} python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 \
    tests/gpu/test_kernels.py -k "$K" > "$OUTDIR/pytest-qgemm.log" 2>&1 ) &
for i in 0 1 2 3 4 5 6 7; do
  timeout 280 python3 bench/qgemm_wide_bench.py /tmp/compile $SW --compile-only --part $i/8 \
    > /tmp/compile_$i.log 2>&1 &
done
wait
echo "tests + compiles (+ synth): $(( $(date +%s) - t0 )) s"
grep -h -E "compile |Error" /tmp/compile_*.log | head -8
grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-qgemm.log" | head -10; tail -1 "$OUTDIR/pytest-qgemm.log"
timeout ${BENCH_S:-300} python3 bench/qgemm_wide_bench.py "$OUTDIR" $SW 2>&1 \
  | tee "$OUTDIR/qgemm-wide.log" | grep -v "^sweep"
if [ "${LEVELS:-0}" = 1 ]; then
  for kern in ${LEVEL_KERNELS:-slots wide}; do
    SLIPSTREAM_QGEMM=${kern%_f16} SLIPSTREAM_QGEMM_F16=$([ "${kern#*_}" = f16 ] && echo 1 || echo 0) \
      timeout 150 python3 bench/draft_levels.py "$OUTDIR" --workdir "$SLIPSTREAM_MODELS" \
      --name "levels-$kern.json" 2>&1 | tail -9 | sed "s/^/[$kern] /"
  done
fi
echo "total: $(( $(date +%s) - t0 )) s"
