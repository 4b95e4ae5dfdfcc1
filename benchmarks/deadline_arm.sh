# Sourced by the device scripts after `cd` to the project root, with OUTDIR set:
# DEADLINE_S packs OUTDIR into $OUT/call-partial.tgz after that many seconds, so that a call
# cut by its limit still brings back what it wrote (bench/deadline_tar.sh). Armed once per
# call (hybrid_device.sh runs spec_device.sh too). The packer's output is detached and the
# sourcing script's exit ends it: a sleeper left holding the call's stdout kept session 39's
# call 2 running for 316 s after its work had finished.
if [ -n "${DEADLINE_S:-}" ] && [ -n "${OUT:-}" ] && [ -z "${DEADLINE_ARMED:-}" ]; then
  export DEADLINE_ARMED=1
  bash bench/deadline_tar.sh "$DEADLINE_S" "$OUTDIR" "$OUT/call.tgz" >/dev/null 2>&1 &
  DEADLINE_PID=$!
  trap 'kill $DEADLINE_PID 2>/dev/null' EXIT
fi
