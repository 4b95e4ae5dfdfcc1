#!/usr/bin/env bash
# Hybrid decode on the GPU machine, in one call (issue 13's H200 acceptance):
#   bash bench/hybrid_device.sh OUTDIR
# synthesizes the 70B and 8B Q4_K files and builds llama-bench (spec_device.sh PART=prep),
# times llama.cpp on each shape (-ngl 46 / 16, threads 8,12,16), then bench/hybrid_bench.py
# (whole layers and hybrid, 70B at 24 GiB and 8B at 4 GiB, the thread sweep) with llama.cpp's
# best figure from this call.
# PREFETCH=1 times q4vnni's L2 prefetch distances on the host's cores before the benches.
# TESTS=1 also runs the hybrid and streaming GPU tests first (PART=tests: only those, after the
# synthesis and llama.cpp's build, which stay on the machine while it is warm).
# All of it takes more than one call's 600 s (session 38: the synthesis and llama.cpp's CUDA
# build with its runs took 6 of the call's 9.4 minutes, and the limit cut the bench after the
# 70B), so it runs in two calls while the machine stays warm:
#   PART=prep   the synthesis and llama.cpp's build only (kept while the machine stays warm)
#   then PART=all (the default) in the next call: llama.cpp's runs and the bench, both cases,
#   in one call (the build and the files found in place)
# or, splitting the runs from the bench instead (not one call's comparison):
#   PART=llama  the synthesis, llama.cpp's build and its runs (kept in /tmp/llama-out)
#   PART=bench  hybrid_bench.py against those llama.cpp figures (copied into OUTDIR)
# KINDS="torch auto-f16": after the main run (the default CPU kernels), the hybrid 70B case again
# with the CPU share on each of those SLIPSTREAM_HYBRID_KIND values, into OUTDIR/kind-K.
# VARIANTS="SLIPSTREAM_CPU_CHUNKS=1 SLIPSTREAM_HYBRID_KIND=auto-f16,SLIPSTREAM_CPU_CHUNKS=1":
# the same for any environment (comma-separated assignments per variant), into OUTDIR/env-N
# (the 70B; VARIANT_CASES=70b,8b both).
# GIL=1: bench/host_share_gil.py on this host's cores (about a minute), into OUTDIR/gil.
# SHARES="0.55 0.6": the same at each given CPU share (the plan's choice bypassed), into
# OUTDIR/share-S: what the plan's share is worth against its neighbours, in the same call.
# Carry what spec_device.sh says.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
source bench/deadline_arm.sh  # DEADLINE_S: OUTDIR packed at a deadline
[ "${CASES:-70b,8b}" = 8b ] && export SHAPES=8b
[ "${PART:-all}" = bench ] || PART=prep bash bench/spec_device.sh "$OUTDIR"
[ "${PART:-all}" = prep ] && exit 0
source bench/device_setup.sh
W=$SLIPSTREAM_MODELS  # device_setup.sh: /dev/shm where it has room
if [ "${TESTS:-0}" = 1 ]; then
  timeout -s INT -k 20 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_hybrid_gpu.py \
    tests/gpu/test_streaming_gpu.py > "$OUTDIR/pytest-hybrid.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-hybrid.log" | head; tail -1 "$OUTDIR/pytest-hybrid.log"
  timeout -s INT -k 20 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_tier_c_gpu.py \
    tests/gpu/test_engine.py -k "mmap or vram or budget" > "$OUTDIR/pytest-tierc.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUTDIR/pytest-tierc.log" | head; tail -1 "$OUTDIR/pytest-tierc.log"
fi
[ "${PART:-all}" = tests ] && exit 0
# PREFETCH=1: q4vnni's L2 prefetch distances on this host's cores first (CPU only, about a
# minute: bench/cpu_prefetch.sh), into OUTDIR/prefetch
if [ "${PREFETCH:-0}" = 1 ]; then
  FARS=${PREFETCH_FARS:-0 4 16} ROUNDS=${PREFETCH_ROUNDS:-2} THREADS=${PREFETCH_THREADS:-1,8,15} \
    TOKENS=1 timeout 150 \
    bash bench/cpu_prefetch.sh "$OUTDIR/prefetch" 2>&1 | tail -13
fi
if [ "${GIL:-0}" = 1 ]; then
  timeout 150 python3 bench/host_share_gil.py "$OUTDIR/gil/host-share-gil.json" \
    --threads ${GIL_THREADS:-14} --shares 100 --rounds 1 2>&1 | tail -13
fi
# llama.cpp on each shape's file, with the layers on the GPU that slipstream's plan holds at that
# budget (-ngl 46 for the 70B at 24 GiB, 16 for the 8B at 4 GiB), three repetitions at each of
# LLAMA_THREADS; hybrid_bench compares against the best of them
CASES=${CASES:-70b,8b}
LLAMA_ARGS=()
KEPT=/tmp/llama-out  # PART=llama's runs, for PART=bench in the next call
mkdir -p $KEPT
for shape in ${CASES//,/ }; do
  ngl=${NGL:-46}; [ "$shape" = 8b ] && ngl=${NGL_8B:-16}
  LL="$OUTDIR/llamacpp-$shape-ngl$ngl.txt"
  if [ "${PART:-all}" = bench ]; then
    cp "$KEPT/$(basename "$LL")" "$LL" || echo "no llama.cpp run of $shape kept: PART=llama first"
  else
    timeout ${LLAMA_S:-200} bash .anchors/llamacpp_bench.sh $W/$shape-Q4_K.gguf -ngl $ngl \
      -p 512 -n 16 -r ${LLAMA_REPS:-3} -fa 1 -t ${LLAMA_THREADS:-8,12,16} > "$LL" 2>&1
    cp "$LL" $KEPT/
  fi
  grep -E "tg16|max memory" "$LL"
  LLAMA_ARGS+=(--llamacpp "$shape=$LL")
done
[ "${PART:-all}" = llama ] && exit 0
timeout ${BENCH_S:-330} python3 bench/hybrid_bench.py "$OUTDIR" --workdir $W "${LLAMA_ARGS[@]}" \
  --cases "$CASES" ${HYBRID_ARGS:-} > "$OUTDIR/hybrid-bench.log" 2>&1
grep -v "^{" "$OUTDIR/hybrid-bench.log" | tail -12
for kind in ${KINDS:-}; do
  SLIPSTREAM_HYBRID_KIND=$kind timeout ${KIND_S:-150} python3 bench/hybrid_bench.py \
    "$OUTDIR/kind-$kind" --workdir $W "${LLAMA_ARGS[@]}" --cases 70b --skip-off --no-prefill \
    --threads ${KIND_THREADS:-15} > "$OUTDIR/hybrid-bench-$kind.log" 2>&1
  grep -v "^{" "$OUTDIR/hybrid-bench-$kind.log" | tail -2
done
n=0
for variant in ${VARIANTS:-}; do
  n=$((n + 1))
  echo "$variant" > "$OUTDIR/env-$n.txt"
  env ${variant//,/ } timeout ${KIND_S:-150} python3 bench/hybrid_bench.py "$OUTDIR/env-$n" \
    --workdir $W "${LLAMA_ARGS[@]}" --cases ${VARIANT_CASES:-70b} --skip-off --no-prefill \
    --threads ${KIND_THREADS:-15} > "$OUTDIR/hybrid-bench-env-$n.log" 2>&1
  echo "$variant:"; grep -v "^{" "$OUTDIR/hybrid-bench-env-$n.log" | tail -2
done
for share in ${SHARES:-}; do
  timeout ${KIND_S:-150} python3 bench/hybrid_bench.py "$OUTDIR/share-$share" --workdir $W \
    "${LLAMA_ARGS[@]}" --cases 70b --skip-off --no-prefill --threads ${KIND_THREADS:-15} \
    --hybrid $share > "$OUTDIR/hybrid-bench-share-$share.log" 2>&1
  grep -v "^{" "$OUTDIR/hybrid-bench-share-$share.log" | tail -2
done
