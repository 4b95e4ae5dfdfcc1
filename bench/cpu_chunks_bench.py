"""Static shares against chunks in the CPU's q4vnni matvec (native/q4_matvec.c, q4_parallel),
on this machine: a 70B-sized hybrid CPU share (gate_up of 2 x 17152 rows and down of 8192 rows,
q4vnni records of random codes) at every core's thread, alone and beside a neighbour process
that keeps one core busy (the GPU hosts' main thread, driver threads and other tenants do the
same to the CPU worker's team). Alternating rounds, median GB/s of each.

    python bench/cpu_chunks_bench.py [--rounds 5] [--out bench/results/DATE-sNN-cpu-chunks.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.hybrid.plan import _q4vnni_weight  # noqa: E402
from slipstream.provenance import source_revision  # noqa: E402


def spin(stop) -> None:
    """A neighbour: one core busy until told to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def share_gbps(gate_up, down, threads: int, static: bool, reps: int) -> float:
    x = torch.randn(1, gate_up.in_features)
    h = torch.randn(1, down.in_features)
    y1 = torch.empty(1, gate_up.out_features)
    y2 = torch.empty(1, down.out_features)
    gate_up.matvec(x, y1, threads=threads, chunks=not static)
    t0 = time.perf_counter()
    for _ in range(reps):
        gate_up.matvec(x, y1, threads=threads, chunks=not static)
        down.matvec(h, y2, threads=threads, chunks=not static)
    return reps * (gate_up.nbytes + down.nbytes) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--units", type=int, default=17152, help="the CPU share's FFN units")
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gate_up = _q4vnni_weight(2 * a.units, a.hidden)
    _q4vnni_weight.cache_clear()
    down = _q4vnni_weight(a.hidden, a.units)
    runs: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for neighbour in (False, True):
            stop = mp.Event()
            proc = mp.Process(target=spin, args=(stop,)) if neighbour else None
            if proc is not None:
                proc.start()
                time.sleep(0.2)
            try:
                for static in ((True, False) if r % 2 == 0 else (False, True)):
                    key = f"{'static' if static else 'chunks'}{'-neighbour' if neighbour else ''}"
                    runs.setdefault(key, []).append(
                        round(share_gbps(gate_up, down, a.threads, static, a.reps), 2))
            finally:
                if proc is not None:
                    stop.set()
                    proc.join()
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc = {"what": "q4vnni matvec of a 70B-sized hybrid CPU share, static shares vs chunks",
           "cpu": os.uname().machine, "cores": len(os.sched_getaffinity(0)),
           "threads": a.threads, "share_bytes": gate_up.nbytes + down.nbytes,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_revision(),
           "torch": torch.__version__, "gbps_median": med, "gbps_runs": runs,
           "chunks_over_static": round(med["chunks"] / med["static"], 3),
           "chunks_over_static_beside_neighbour":
               round(med["chunks-neighbour"] / med["static-neighbour"], 3)}
    print(f"{'layout':22s} {'GB/s (median)':>14s}  runs")
    for k, v in runs.items():
        print(f"{k:22s} {med[k]:14.2f}  {v}")
    print(f"chunks / static: alone {doc['chunks_over_static']}, beside a busy core "
          f"{doc['chunks_over_static_beside_neighbour']}")
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
