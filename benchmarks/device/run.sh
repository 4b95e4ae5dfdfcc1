#!/usr/bin/env bash
# Run one benchmark tool on the lent GPU machine, its JSON into $OUT:
#
#   bash benchmarks/device/run.sh TOOL [ARGS...]
#   e.g. bash benchmarks/device/run.sh throughput --case 70b-q4k-vram24-hybrid --llamacpp
#        bash benchmarks/device/run.sh spec --case default-spec
#        bash benchmarks/device/run.sh kernels --quick
#
# TOOL is a file of benchmarks/ without .py. A bare --llamacpp builds llama.cpp's llama-bench
# first (setup.sh's llama_build: carry .anchors and .llama.tar.xz) and passes its folder;
# --results defaults to $OUT. TRITON_OUT=1 also brings Triton's kernel cache back.
# Carry .whl (the gguf wheel) always; what else a case needs is in setup.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device/setup.sh
TOOL=${1:?which tool: a file of benchmarks/ without .py}; shift
ARGS=()
HAS_RESULTS=0
while [ $# -gt 0 ]; do
  case $1 in
    --llamacpp)
      if [ $# -gt 1 ] && [ "${2#--}" = "$2" ]; then ARGS+=(--llamacpp "$2"); shift
      else
        B=$(llama_build) || { echo "llama.cpp did not build: carry .anchors and .llama.tar.xz"; exit 1; }
        ARGS+=(--llamacpp "$B")
      fi ;;
    --results) HAS_RESULTS=1; ARGS+=("$1") ;;
    *) ARGS+=("$1") ;;
  esac
  shift
done
[ "$HAS_RESULTS" = 1 ] || ARGS+=(--results "$OUTDIR")
python3 "benchmarks/$TOOL.py" "${ARGS[@]}" 2>&1 | tee "$OUTDIR/$TOOL.log" | grep -v '^{'
rc=${PIPESTATUS[0]}
[ "${TRITON_OUT:-0}" = 1 ] && triton_out
exit "$rc"
