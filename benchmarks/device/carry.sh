#!/usr/bin/env bash
# Here, before a device call: make the ignored folders a call carries (name them in `carry`).
#
#   bash benchmarks/device/carry.sh wheels          .whl/: the gguf wheel the device image lacks
#   bash benchmarks/device/carry.sh model a|b       .model/a/part1 or .model/b/part2: the default
#                                                   model, xz-compressed (98 MB to 90; a call
#                                                   carries 64 MiB, 17 of them tracked files), in
#                                                   two halves, one per call; the compressed file
#                                                   is made once (two minutes) into .model/full.xz
#   bash benchmarks/device/carry.sh llama           .anchors/ (../shared/anchors, which does not
#                                                   travel) and .llama.tar.xz (llama.cpp's source)
#   bash benchmarks/device/carry.sh before COMMIT   .before/: COMMIT's src/ and its hash, for
#                                                   before_after.sh
#   bash benchmarks/device/carry.sh triton DIR      .triton/: the Triton cache parts a call brought
#                                                   back (run.sh with TRITON_OUT=1) from DIR
#
# Each folder is added to .git/info/exclude so that it travels only when carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude() {
  local f; f="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$f")"
  grep -qxF "/$1" "$f" 2>/dev/null || echo "/$1" >> "$f"
}
what=${1:?wheels, model a|b, llama, before COMMIT or triton DIR}
case $what in
  wheels)
    exclude .whl/
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp -d .whl "gguf==${GGUF_VERSION:-0.19.0}"
    ls -la .whl ;;
  model)
    part=${2:?a or b}
    exclude .model/
    m=$(PYTHONPATH=src python3 -m slipstream pull 2>/dev/null | tail -1)
    [ -f "$m" ] || { echo "the default model is not in the cache: slipstream pull"; exit 1; }
    mkdir -p .model
    [ -f .model/full.xz ] || { xz -9e -T2 -c "$m" > .model/full.xz.tmp && mv .model/full.xz.tmp .model/full.xz; }
    half=$(( ($(stat -c %s .model/full.xz) + 1) / 2 ))
    rm -rf ".model/$part" && mkdir -p ".model/$part"
    case $part in
      a) head -c "$half" .model/full.xz > .model/a/part1 ;;
      b) tail -c +$((half + 1)) .model/full.xz > .model/b/part2 ;;
      *) echo "part must be a or b, not $part"; exit 2 ;;
    esac
    du -sh ".model/$part" ;;
  llama)
    exclude .anchors/; exclude .llama/; exclude .llama.tar.xz
    rm -rf .anchors && cp -r ../shared/anchors .anchors
    [ -d .llama ] || bash .anchors/fetch_llamacpp.sh .llama
    tar cJf .llama.tar.xz .llama && rm -rf .llama  # compressed: it travels beside a model part
    du -sh .anchors .llama.tar.xz ;;
  before)
    commit=$(git rev-parse "${2:?COMMIT}")
    exclude .before/
    rm -rf .before && mkdir .before
    git archive "$commit" src pyproject.toml | tar -x -C .before
    # trees before the streamed-plan fix of `bench` (0c6a231 among them) die after timing a
    # streamed plan (weight_bytes_per_token reads a streamed layer, None there): skip those
    # layers in its byte count, which only the printed roofline reads
    b=.before/src/slipstream/runtime/bench.py
    if [ -f "$b" ] && grep -q '^        if i in engine.skip:$' "$b"; then
      sed -i 's/^        if i in engine.skip:$/        if i in engine.skip or layer is None:/' "$b"
      echo "patched $b: streamed layers left out of the byte count"
    fi
    echo "$commit" > .before/COMMIT
    du -sh .before ;;
  triton)
    from=${2:?the folder of the files a call brought back}
    exclude .triton/
    ls "$from"/triton.tgz.part-* >/dev/null
    rm -rf .triton && mkdir .triton && cp "$from"/triton.tgz.part-* .triton/
    du -sh .triton ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
