#!/usr/bin/env bash
# One device call, two trees: the headline cases and the streamed decode breakdown, measured on
# the tree before a change and on this one, on the same synthetic files, in the same call.
#
#   bash bench/before_after.sh OUTDIR BEFORE_TAR BEFORE_COMMIT
#
# BEFORE_TAR: `git archive --prefix=before/ COMMIT src bench tests pyproject.toml` (carried, as
# the device's .git may not hold that commit). Each side runs its own bench/gpu_bench.py (each
# case in a process of its own), then bench/decode_stats.py on the 70B at 24 GiB. The sides
# alternate per case, so drift in the machine's state falls on both.
set -uo pipefail
OUTDIR=$1; TAR=$2; BEFORE=$3
CASES=${CASES:-8b-q4k,70b-q4k-vram24}
cd "$(dirname "$0")/.."
rm -rf /tmp/before && tar -xf "$TAR" -C /tmp
export PYTHONUNBUFFERED=1 COLUMNS=140
SITE=${PYTHONPATH:-}
W=/tmp/slipstream-models
CASEDIR=/tmp/before-after  # one folder per side and case; only the merged files go to OUTDIR
rm -rf "$CASEDIR"; mkdir -p "$W" "$CASEDIR/before" "$CASEDIR/after" "$OUTDIR"
for c in ${CASES//,/ }; do
  SLIPSTREAM_COMMIT=$BEFORE PYTHONPATH=/tmp/before/src${SITE:+:$SITE} \
    python3 /tmp/before/bench/gpu_bench.py "$CASEDIR/before/$c" --cases "$c" --workdir "$W" \
    2>&1 | grep -v "^{" | tail -4
  PYTHONPATH=$PWD/src${SITE:+:$SITE} python3 bench/gpu_bench.py "$CASEDIR/after/$c" \
    --cases "$c" --workdir "$W" 2>&1 | grep -v "^{" | tail -4
done
M70=$W/70b-Q4_K.gguf
if [ -f "$M70" ]; then
  for side in before after; do
    src=$PWD/src; [ $side = before ] && src=/tmp/before/src
    PYTHONPATH=$src${SITE:+:$SITE} python3 bench/decode_stats.py "$M70" --vram-budget 24GiB \
      --label "$side" --json "$OUTDIR/decode-stats.jsonl" 2>&1 | tail -1
  done
fi
# one JSON per side, the cases in order
python3 - "$CASEDIR" "$OUTDIR" <<'PY'
import json, sys
from pathlib import Path
cases, out = Path(sys.argv[1]), Path(sys.argv[2])
for side in ("before", "after"):
    docs = [json.loads(p.read_text()) for p in sorted((cases / side).glob("*/gpu-resident.json"))]
    if docs:
        doc = {**docs[0], "cases": [c for d in docs for c in d["cases"]]}
        (out / f"{side}.json").write_text(json.dumps(doc, indent=2) + "\n")
PY
