# Sourced at the start of every device command, from the project's root (run.sh and
# before_after.sh do it): makes the lent GPU machine ready from what the call carried.
#
#   .whl/*.whl          wheels the image lacks (gguf), installed once into /tmp/site
#   .whl/kvikio/*.whl   KvikIO for --io kvikio, installed once into /tmp/site-kvikio
#   .triton/            Triton's kernel cache brought back by an earlier call (carry.sh triton)
#   .model/a, .model/b  the default model, xz-compressed, in two halves (a call carries 64 MiB):
#                       each half is parked in /tmp/slipstream-cache, and the file is joined
#                       and unpacked once both have come (two calls while the machine stays warm)
#   .anchors/, .llama.tar.xz   llama.cpp's scripts and source (carry.sh llama); llama_build
#                       below builds llama-bench into /tmp/lbuild once per machine
#
# Exports PYTHONPATH (src/ and the wheels), BENCH_MODELS (the synthetic files: /dev/shm
# where it holds them, so ~45 GB are written at memory speed with no writeback under the first
# timed runs), SLIPSTREAM_CACHE, MODEL (the default model's path, when joined), OUTDIR
# (default $OUT), and writes OUTDIR/host.txt (lscpu, NUMA nodes, memory) once.
# DEADLINE_S=N packs OUTDIR into $OUT/call-partial.tgz after N seconds, so that a command cut
# by the call's limit still brings back what it wrote.
OUTDIR=${OUTDIR:-${OUT:-/tmp/slipstream-out}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 COLUMNS=140
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
fi
[ -f /tmp/site/.installed ] && SITE=/tmp/site || SITE=
if ls .whl/kvikio/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site-kvikio ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-kvikio .whl/kvikio/*.whl
fi
[ -d /tmp/site-kvikio ] && SITE=${SITE:+$SITE:}/tmp/site-kvikio
export SITE PYTHONPATH=$PWD/src${SITE:+:$SITE}
# a fresh machine compiles every Triton kernel (the kernel tests alone took over 4 minutes cold)
export TRITON_CACHE_DIR=/tmp/triton-cache
if ls .triton/triton.tgz.part-* >/dev/null 2>&1 && [ ! -f "$TRITON_CACHE_DIR/.unpacked" ]; then
  mkdir -p "$TRITON_CACHE_DIR"
  cat .triton/triton.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.unpacked"
fi
if [ -z "${BENCH_MODELS:-}" ]; then
  if [ -d /dev/shm/slipstream-models ] || \
     [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 50 ] 2>/dev/null; then
    BENCH_MODELS=/dev/shm/slipstream-models
  else
    BENCH_MODELS=/tmp/slipstream-models
  fi
fi
export BENCH_MODELS SLIPSTREAM_CACHE=/tmp/slipstream-cache
mkdir -p "$BENCH_MODELS" "$SLIPSTREAM_CACHE"
for part in .model/a/part1 .model/b/part2; do
  [ -f "$part" ] && cp "$part" "$SLIPSTREAM_CACHE/"
done
MODEL=$SLIPSTREAM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ] && ls "$SLIPSTREAM_CACHE"/part{1,2} >/dev/null 2>&1; then
  cat "$SLIPSTREAM_CACHE"/part{1,2} | python3 -c \
    "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    > "$MODEL.tmp" && mv "$MODEL.tmp" "$MODEL"
fi
export MODEL
if [ ! -f "$OUTDIR/host.txt" ]; then
  { lscpu; echo; for n in /sys/devices/system/node/node*; do
      [ -d "$n" ] && echo "$(basename "$n"): cpus $(cat "$n/cpulist") $(grep MemTotal "$n/meminfo")"
    done; echo; nproc; free -g
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; } > "$OUTDIR/host.txt" 2>&1
fi
if [ -n "${DEADLINE_S:-}" ] && [ -n "${OUT:-}" ] && [ -z "${DEADLINE_ARMED:-}" ]; then
  export DEADLINE_ARMED=1
  # the sleep is a child waited on, so that the EXIT trap's TERM ends it too: a sleeper left
  # holding the call's stdout once kept a finished call running for five more minutes
  ( sleep "$DEADLINE_S" & s=$!; trap 'kill $s 2>/dev/null; exit 0' TERM; wait $s
    tar czf "$OUT/call-partial.tgz" -C "$OUTDIR" . 2>/dev/null ) >/dev/null 2>&1 &
  DEADLINE_PID=$!
  trap 'kill $DEADLINE_PID 2>/dev/null' EXIT
fi

# llama_build: llama.cpp's llama-bench (CUDA, sm_90; about a minute on 16 cores) from the
# carried source into /tmp/lbuild, once per machine; prints the build folder.
llama_build() {
  if [ ! -x /tmp/lbuild/bin/llama-bench ]; then
    [ -f .llama.tar.xz ] && [ ! -d /tmp/llama-src/.llama ] && mkdir -p /tmp/llama-src \
      && tar xJf .llama.tar.xz -C /tmp/llama-src
    [ -d .llama ] && [ ! -d /tmp/llama-src/.llama ] && mkdir -p /tmp/llama-src && cp -r .llama /tmp/llama-src/
    LLAMA_SRC=/tmp/llama-src/.llama bash .anchors/llamacpp_bench.sh /dev/null >/dev/null 2>&1
  fi
  [ -x /tmp/lbuild/bin/llama-bench ] && echo /tmp/lbuild
}

# triton_out: Triton's kernel cache into $OUT as triton.tgz.part-aa, -ab, ... of 15 MiB each
# (a call brings back 8 files of 16 MiB at most), at most MAX_PARTS (3) of them, for carry.sh.
triton_out() {
  [ -d "$TRITON_CACHE_DIR" ] && [ -n "${OUT:-}" ] || return 0
  local tmp; tmp=$(mktemp -d)
  tar czf "$tmp/triton.tgz" --exclude=.unpacked -C "$TRITON_CACHE_DIR" .
  if [ "$(stat -c %s "$tmp/triton.tgz")" -le $(( ${MAX_PARTS:-3} * 15 << 20 )) ]; then
    split -b 15M "$tmp/triton.tgz" "$OUT/triton.tgz.part-"
  else
    echo "Triton cache over ${MAX_PARTS:-3} parts: not brought back"
  fi
  rm -rf "$tmp"
}
