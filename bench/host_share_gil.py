"""What a thread holding Python's GIL costs hybrid decode's CPU share: an 8B's share (random
q4vnni weights, the 0.64 share of session 36's H100 runs) timed in a worker thread, as
hybrid.ffn.HostIO runs it, with the main thread idle or busy in pure Python (never letting
go of the GIL, as a run of Triton launches), fused into one native call (HOST_FUSED) or as
four calls, at several GIL switch intervals.

    python bench/host_share_gil.py OUT.json [--threads N] [--shares 150] [--rounds 2]

Prints a table (microseconds a share: median and mean) and writes the JSON (OUT.txt beside it
holds the table)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.hybrid import plan as hybrid_plan  # noqa: E402
from slipstream.provenance import cpu_name, source_revision  # noqa: E402
from slipstream.hybrid import ffn as hybrid  # noqa: E402
from slipstream.hybrid.ffn import HostFFN, HostIO, Scratch  # noqa: E402

HIDDEN, UNITS = 4096, 9216  # an 8B's split layer at a 0.64 share
INTERVALS = (0.005, 0.0005, 0.0001)


def time_shares(ffn: HostFFN, threads: int, shares: int) -> list[float]:
    """Seconds of each of `shares` shares, computed in a thread of their own (the worker)."""
    h, out, scratch = torch.randn(1, HIDDEN), torch.empty(1, HIDDEN), Scratch()
    times: list[float] = []

    def work() -> None:
        torch.set_num_threads(threads)
        for _ in range(3):
            ffn.compute_into(h, out, scratch)
        for _ in range(shares):
            t0 = time.perf_counter()
            ffn.compute_into(h, out, scratch)
            times.append(time.perf_counter() - t0)
            time.sleep(0.0003)  # the GPU's part of a layer between two shares

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shares", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ffn = HostFFN(hybrid_plan._q4vnni_weight(2 * UNITS, HIDDEN),
                  hybrid_plan._q4vnni_weight(HIDDEN, UNITS),
                  HostIO(torch.device("cpu"), HIDDEN, max_tokens=8))
    if ffn._fused() is None:
        sys.exit("no fused share here (no native library, or SLIPSTREAM_HOST_FUSED=0)")
    before = sys.getswitchinterval()
    rows, lines = [], []
    head = f"{'switch s':>9} {'share':>6} {'main':>5} {'median us':>10} {'mean us':>9}"
    print(head)
    lines.append(head)
    for rnd in range(a.rounds):
        for interval in INTERVALS:
            sys.setswitchinterval(interval)
            for fused in (True, False):
                for main_busy in (False, True):
                    hybrid.HOST_FUSED = fused
                    stop = threading.Event()

                    def busy() -> None:
                        while not stop.is_set():
                            sum(i * i for i in range(2000))

                    spinner = threading.Thread(target=busy) if main_busy else None
                    if spinner is not None:
                        spinner.start()
                    try:
                        times = time_shares(ffn, a.threads, a.shares)
                    finally:
                        stop.set()
                        if spinner is not None:
                            spinner.join()
                    row = {"round": rnd, "switch_interval_s": interval,
                           "share": "fused" if fused else "four calls",
                           "main_thread": "busy" if main_busy else "idle",
                           "median_us": round(statistics.median(times) * 1e6, 1),
                           "mean_us": round(statistics.mean(times) * 1e6, 1)}
                    rows.append(row)
                    line = (f"{interval:9.4f} {row['share'][:6]:>6} {row['main_thread']:>5} "
                            f"{row['median_us']:10.1f} {row['mean_us']:9.1f}")
                    print(line, flush=True)
                    lines.append(line)
    hybrid.HOST_FUSED = True
    sys.setswitchinterval(before)
    doc = {"bench": "host-share-gil", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": "cpu", "cpu": cpu_name(), "threads": a.threads, **source_revision(ROOT),
           "torch": torch.__version__, "shares": a.shares, "hidden": HIDDEN, "units": UNITS,
           "rows": rows,
           "note": "one decode row a share, computed in a worker thread; main 'busy': a thread "
                   "in pure Python beside it, which lets go of the GIL only when forced"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    a.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
