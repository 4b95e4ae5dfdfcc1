#!/usr/bin/env bash
# At the end of a device call: Triton's kernel cache (bench/device_setup.sh's TRITON_CACHE_DIR)
# into OUT as triton.tgz.part-aa, -ab, ... of at most 15 MiB each (a call brings back 8 files of
# 16 MiB at most), so that the next session can carry it (bench/triton_cache_in.sh) instead of
# compiling every kernel again. MAX_PARTS (default 3) caps what it takes of the call's files.
#   bash bench/triton_cache_out.sh "$OUT"
set -u
OUT=${1:?OUT}
CACHE=${TRITON_CACHE_DIR:-/tmp/triton-cache}
[ -d "$CACHE" ] || { echo "no Triton cache at $CACHE"; exit 0; }
tmp=$(mktemp -d)
tar czf "$tmp/triton.tgz" --exclude=.unpacked -C "$CACHE" .
size=$(stat -c %s "$tmp/triton.tgz")
if [ "$size" -gt $(( ${MAX_PARTS:-3} * 15 * 1024 * 1024 )) ]; then
  echo "Triton cache: $((size >> 20)) MiB packed, over ${MAX_PARTS:-3} parts: not brought back"
else
  split -b 15M "$tmp/triton.tgz" "$OUT/triton.tgz.part-"
  echo "Triton cache: $((size >> 20)) MiB packed, $(ls "$OUT"/triton.tgz.part-* | wc -l) part(s)"
fi
rm -rf "$tmp"
