#!/usr/bin/env bash
# q4vnni's Q4_KS loop under each value of a build-time setting of native/q4_matvec.c (through
# SLIPSTREAM_NATIVE_DEFINES), on a 70B layer's CPU share:
#   bash bench/cpu_prefetch.sh OUTDIR
# DEFINE (default Q4_PREFETCH_FAR_RUNS, the L2 prefetch distance in runs of 8 records; 0: the L1
# prefetch alone) and VALUES (default "0 4 8 16", or FARS for the distance), e.g.
#   DEFINE=Q4_TILE_BYTES VALUES="0 196608" TOKENS=1,8,16 bash bench/cpu_prefetch.sh OUTDIR
# THREADS (default: 1 and all cores), TOKENS ("1,4"), ROUNDS (3). Each value is its own build and
# process, and the values take turns within a round, so that a shared host's load falls on all
# of them. Writes OUTDIR/v-V-rR/plane-speed.json and OUTDIR/cpu-prefetch.json (the median
# Gweights/s per value, threads and tokens), and prints the table. CPU only: no GPU needed.
set -euo pipefail
OUTDIR=${1:?OUTDIR}
cd "$(dirname "$0")/.."
DEFINE=${DEFINE:-Q4_PREFETCH_FAR_RUNS}
VALUES=${VALUES:-${FARS:-0 4 8 16}}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1,$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")}
mkdir -p "$OUTDIR"
for r in $(seq 1 "$ROUNDS"); do
  for v in $VALUES; do
    SLIPSTREAM_NATIVE_DEFINES="-D$DEFINE=$v" python3 bench/plane_speed.py \
      "$OUTDIR/v-$v-r$r" --kinds q4vnni --threads "$THREADS" --tokens "${TOKENS:-1,4}" \
      --rounds 1 > "$OUTDIR/v-$v-r$r.log" 2>&1
  done
done
python3 - "$OUTDIR" "$DEFINE" <<'PY'
import json, statistics, sys
from pathlib import Path
out, define = Path(sys.argv[1]), sys.argv[2]
runs = {}
meta = None
for f in sorted(out.glob("v-*-r*/plane-speed.json")):
    doc = json.loads(f.read_text())
    meta = meta or {k: doc.get(k) for k in ("date", "cpu", "cores", "commit", "tree", "torch")}
    value = int(f.parent.name.split("-")[1])
    for row in doc["rows"]:
        runs.setdefault((value, row["threads"], row["tokens"]), []).append(row["gweights_per_s"])
rows = [{"define": define, "value": v, "threads": t, "tokens": m,
         "gweights_per_s": round(statistics.median(g), 2),
         "rounds": g} for (v, t, m), g in sorted(runs.items())]
print(f"{define:>20} {'threads':>7} {'m':>3} {'Gweights/s':>10}  rounds")
for r in rows:
    print(f"{r['value']:>20} {r['threads']:>7} {r['tokens']:>3} {r['gweights_per_s']:>10}  "
          f"{r['rounds']}")
(out / "cpu-prefetch.json").write_text(json.dumps(
    {"bench": "cpu-prefetch", **(meta or {}), "kind": "q4vnni (Q4_KS)", "define": define,
     "note": "a 70B layer's 0.6 CPU share; each value its own build; the median over "
             "rounds of plane_speed's best of 3; Gweights/s counts each weight once per "
             "call, whatever its tokens", "rows": rows}, indent=2) + "\n")
PY
