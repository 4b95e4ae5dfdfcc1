#!/usr/bin/env bash
# One device call for qgemm's kernels, in this order:
#   1. the qgemm GPU tests (KTESTS: a -k filter; EXTRA_TESTS: more test paths), 8 processes,
#      without the compile_heavy ones unless HEAVY=1;
#   2. with LEVELS=1, an 8B draft's tree level by width (bench/draft_levels.py) with each kernel
#      of LEVEL_KERNELS (default "slots wide"; the synthetic 8B is made beside the tests);
#   3. unless BENCH=0, Triton's compiles for the benchmark in 8 processes, then bench/qgemm_wide_bench.py
#      (--sweep unless SWEEP=0), cut at BENCH_S seconds.
# Writes logs and JSON into OUTDIR ($1, default $OUT). Carry .whl (the gguf wheel).
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
SEL=$([ "${HEAVY:-0}" = 1 ] && echo gpu || echo "gpu and not compile_heavy")
timeout -s INT -k 20 ${TEST_S:-280} python3 -m pytest -q -p no:cacheprovider -m "$SEL" -n 8 \
  tests/gpu/test_kernels.py ${EXTRA_TESTS:-} -k "${KTESTS:-qgemm or matmul_routes or seeded}" \
  --durations=8 > "$OUTDIR/pytest-qgemm.log" 2>&1
echo "tests: $(( $(date +%s) - t0 )) s"
grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-qgemm.log" | head -10; tail -12 "$OUTDIR/pytest-qgemm.log"
wait
if [ "${LEVELS:-0}" = 1 ]; then
  for kern in ${LEVEL_KERNELS:-slots wide}; do
    SLIPSTREAM_QGEMM=$kern timeout 150 python3 bench/draft_levels.py "$OUTDIR" \
      --workdir "$SLIPSTREAM_MODELS" --name "levels-$kern.json" 2>&1 | tail -9 | sed "s/^/[$kern] /"
  done
fi
[ "${BENCH:-1}" = 1 ] || { echo "total: $(( $(date +%s) - t0 )) s"; exit 0; }
for i in 0 1 2 3 4 5 6 7; do
  timeout 200 python3 bench/qgemm_wide_bench.py /tmp/compile $SW --compile-only --part $i/8 \
    > /tmp/compile_$i.log 2>&1 &
done
wait
grep -h -E "compile |Error" /tmp/compile_*.log | head -8
timeout ${BENCH_S:-300} python3 bench/qgemm_wide_bench.py "$OUTDIR" $SW 2>&1 \
  | tee "$OUTDIR/qgemm-wide.log" | grep -v "^sweep"
echo "total: $(( $(date +%s) - t0 )) s"
