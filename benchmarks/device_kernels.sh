#!/usr/bin/env bash
# One device call: GPU tests of the Triton kernels, then the kernel benchmark (JSON to $OUT).
#   bash bench/device_kernels.sh [sweep|main|all]
# Needs the gguf wheel in .whl/ (see /work/.library/device/README.md): the device image lacks it.
set -u
MODE=${1:-all}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

SWEEP=""; NOMAIN=""
[ "$MODE" = sweep ] && { SWEEP=--sweep; NOMAIN=--no-main; }
[ "$MODE" = all ] && SWEEP=--sweep

# Compile everything first, in parallel: tests (xdist) and the bench's launches (8 parts).
t0=$(date +%s)
( timeout -s INT -k 20 140 python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/gpu/test_kernels.py \
    > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log" ) &
PYT=$!
for i in 0 1 2 3 4 5 6 7; do
  timeout 140 python3 bench/kernels_bench.py /tmp/compile --compile-only --part $i/8 $SWEEP $NOMAIN \
    > /tmp/compile_$i.log 2>&1 &
done
wait
echo "compile+tests took $(( $(date +%s) - t0 ))s"
grep -h -i -E "error|Traceback" /tmp/compile_*.log | head -5
tail -25 "$OUT/pytest.log"

t1=$(date +%s)
timeout 145 python3 bench/kernels_bench.py "$OUT" $SWEEP $NOMAIN 2>&1 | tee "$OUT/bench.log" | \
  grep -v "^sweep " | tail -150
echo "bench took $(( $(date +%s) - t1 ))s"
