#!/usr/bin/env bash
# Speculative decoding on the GPU machine, in one call (issue 12's H200 acceptance):
#   bash bench/spec_device.sh OUTDIR
#   PART=prep   park the model part carried, untar .llama.tar.xz and build llama-bench, and
#               synthesize the 70B and 8B Q4_K files (all kept while the machine stays warm)
#   PART=all    (default) also: llama.cpp's -ngl 46 on the 70B file, then bench/spec_bench.py
#               (default-spec, the 70B cases with the floor bracketed: --tokens 64 --bracket),
#               in this call. Session 23 ran these in 332 s after a prep call, about 400 s
#               with the prep (s23-spec-bench-h200-call3.json)
#   TESTS=1 / LLAMA=0 add the speculative GPU tests (cut at TEST_S, default 240 s, by SIGINT,
#   on which pytest still prints the failures it has; about 3 minutes more: past one call's
#   600 s with the rest) / leave out llama.cpp; SPEC_ARGS: bench/spec_bench.py's;
#   SHAPES: the synthetic files made (default "70b 8b")
# Carry .whl, .anchors (a copy of ../shared/anchors/, which does not travel), one model part
# (.model/a or .model/b), and .llama.tar.xz (llama.cpp's source,
# made by ../shared/anchors/fetch_llamacpp.sh, then `tar cJf .llama.tar.xz .llama`: the source
# and a model part together pass the 64 MiB a call may carry only compressed).
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
PART=${PART:-all}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
source bench/deadline_arm.sh  # DEADLINE_S: OUTDIR packed at a deadline
source bench/device_setup.sh
W=$SLIPSTREAM_MODELS  # device_setup.sh: /dev/shm where it has room
mkdir -p $W
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUTDIR/gpu.txt"
if [ -f .llama.tar.xz ] && [ ! -d /tmp/llama-src/.llama ]; then
  mkdir -p /tmp/llama-src && tar xJf .llama.tar.xz -C /tmp/llama-src
fi
export LLAMA_SRC=/tmp/llama-src/.llama
LB=.anchors/llamacpp_bench.sh  # a copy of ../shared/anchors/llamacpp_bench.sh, carried
# the build runs beside the synthesis (both CPU-bound; about a minute each on 16 cores)
( [ "${LLAMA:-1}" = 0 ] || [ -x /tmp/lbuild/bin/llama-bench ] || bash $LB /dev/null >/dev/null 2>&1 ) &
BUILD=$!
for shape in ${SHAPES:-70b 8b}; do
  [ -f $W/$shape-Q4_K.gguf ] || python3 -m slipstream synth --shape $shape --quant Q4_K \
    -o $W/$shape-Q4_K.gguf >/dev/null 2>&1
done
wait $BUILD
# files written to a disk: let the writeback finish before anything is timed
case $W in /dev/shm/*) ;; *) sync ;; esac
ls -la $W /tmp/lbuild/bin/llama-bench 2>&1 | tail -4
[ "$PART" = prep ] && exit 0
if [ "${LLAMA:-1}" = 1 ]; then
  timeout 120 bash $LB $W/70b-Q4_K.gguf -ngl 46 -p 512 -n 16 -r 1 -fa 1 -t 16 \
    > "$OUTDIR/llamacpp-70b-ngl46.txt" 2>&1
  grep -E "tg16|pp512|max memory" "$OUTDIR/llamacpp-70b-ngl46.txt"
fi
if [ "${TESTS:-0}" = 1 ]; then
  timeout -s INT -k 20 ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_speculative_gpu.py tests/gpu/test_streaming_gpu.py -k "spec or skip or graph" \
    > "$OUTDIR/pytest-spec.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-spec.log" | head; tail -1 "$OUTDIR/pytest-spec.log"
fi
python3 bench/spec_bench.py "$OUTDIR" --model "$MODEL" --workdir $W \
  ${SPEC_ARGS:---tokens 64 --bracket} > "$OUTDIR/spec-bench.log" 2>&1
grep -v "^{" "$OUTDIR/spec-bench.log" | tail -25
