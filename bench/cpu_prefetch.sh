#!/usr/bin/env bash
# q4vnni's Q4_KS loop at each L2 prefetch distance (native/q4_matvec.c's Q4_PREFETCH_FAR_RUNS,
# set at build time through SLIPSTREAM_NATIVE_DEFINES), on a 70B layer's CPU share:
#   bash bench/cpu_prefetch.sh OUTDIR
# FARS="0 4 8 16" (runs of 8 records ahead; 0: the L1 prefetch alone), THREADS (default: 1 and
# all cores), TOKENS ("1,4"), ROUNDS (3). Each distance is its own build and process, and the
# distances take turns within a round, so that a shared host's load falls on all of them.
# Writes OUTDIR/far-F-rR/plane-speed.json and OUTDIR/cpu-prefetch.json (the median
# Gweights/s per distance, threads and tokens), and prints the table. CPU only: no GPU needed.
set -euo pipefail
OUTDIR=${1:?OUTDIR}
cd "$(dirname "$0")/.."
FARS=${FARS:-0 4 8 16}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-1,$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")}
mkdir -p "$OUTDIR"
for r in $(seq 1 "$ROUNDS"); do
  for far in $FARS; do
    SLIPSTREAM_NATIVE_DEFINES="-DQ4_PREFETCH_FAR_RUNS=$far" python3 bench/plane_speed.py \
      "$OUTDIR/far-$far-r$r" --kinds q4vnni --threads "$THREADS" --tokens "${TOKENS:-1,4}" \
      --rounds 1 > "$OUTDIR/far-$far-r$r.log" 2>&1
  done
done
python3 - "$OUTDIR" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
meta = None
for f in sorted(out.glob("far-*-r*/plane-speed.json")):
    doc = json.loads(f.read_text())
    meta = meta or {k: doc.get(k) for k in ("date", "cpu", "cores", "commit", "tree", "torch")}
    far = int(f.parent.name.split("-")[1])
    for row in doc["rows"]:
        runs.setdefault((far, row["threads"], row["tokens"]), []).append(row["gweights_per_s"])
rows = [{"far_runs": far, "threads": t, "tokens": m,
         "gweights_per_s": round(statistics.median(v), 2),
         "rounds": v} for (far, t, m), v in sorted(runs.items())]
print(f"{'far runs':>8} {'threads':>7} {'m':>3} {'Gweights/s':>10}  rounds")
for r in rows:
    print(f"{r['far_runs']:>8} {r['threads']:>7} {r['tokens']:>3} {r['gweights_per_s']:>10}  "
          f"{r['rounds']}")
(out / "cpu-prefetch.json").write_text(json.dumps(
    {"bench": "cpu-prefetch", **(meta or {}), "kind": "q4vnni (Q4_KS)",
     "note": "a 70B layer's 0.6 CPU share; each distance its own build; the median over "
             "rounds of plane_speed's best of 3", "rows": rows}, indent=2) + "\n")
PY
