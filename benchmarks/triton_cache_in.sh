#!/usr/bin/env bash
# Here, after a device call that ran bench/triton_cache_out.sh: its parts from the call's
# files_at folder into .triton/ (git-ignored), to carry in the next calls (carry ".triton").
#   bash bench/triton_cache_in.sh /work/.device/N
set -eu
FROM=${1:?the files_at folder of the call}
cd "$(dirname "$0")/.."
ls "$FROM"/triton.tgz.part-* >/dev/null
rm -rf .triton && mkdir .triton
cp "$FROM"/triton.tgz.part-* .triton/
du -sh .triton
