"""What hybrid decode's CPU share costs besides its two matvecs, on this machine: HostFFN.compute
plus the copy into the pinned output (the worker's path before session 36) against
HostFFN.compute_into (buffers reused, written in place) and the two bare matvecs, for an 8B's
and a 70B's split layer at the shares their H100 runs used, random q4vnni weights (Q4_K's own
scales).

    python bench/host_ffn_overhead.py OUT.json [--threads N] [--rounds 5] [--calls 50]

Prints a table (microseconds a share: the best round's mean) and writes the JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from slipstream.hybrid import plan as hybrid_plan  # noqa: E402
from slipstream.provenance import cpu_name, source_revision  # noqa: E402
from slipstream.hybrid.ffn import HostFFN, HostIO, Scratch  # noqa: E402

SHAPES = {"8b (0.64 of 14336 units)": (4096, 9216), "70b (0.73 of 28672 units)": (8192, 20992)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    print(f"{'layer':>26} {'compute+copy':>12} {'compute_into':>12} {'matvecs':>8}  us a share")
    for name, (hidden, units) in SHAPES.items():
        gate_up = hybrid_plan._q4vnni_weight(2 * units, hidden)
        down = hybrid_plan._q4vnni_weight(hidden, units)
        ffn = HostFFN(gate_up, down, HostIO(torch.device("cpu"), hidden, max_tokens=8))
        h = torch.randn(1, hidden)
        out, scratch = torch.empty(1, hidden), Scratch()
        gu, act = torch.empty(1, 2 * units), torch.zeros(1, units)
        ways = {"compute+copy": lambda: out.copy_(ffn.compute(h)),
                "compute_into": lambda: ffn.compute_into(h, out, scratch),
                "matvecs": lambda: (gate_up.matvec(h, gu), down.matvec(act, out))}
        best = {k: float("inf") for k in ways}
        for _ in range(a.rounds):
            for k, f in ways.items():  # the ways take turns within a round
                for _ in range(3):
                    f()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    f()
                best[k] = min(best[k], (time.perf_counter() - t0) / a.calls * 1e6)
        rows.append({"layer": name, "hidden": hidden, "units": units,
                     **{f"{k}_us": round(v, 1) for k, v in best.items()}})
        print(f"{name:>26} {best['compute+copy']:12.1f} {best['compute_into']:12.1f} "
              f"{best['matvecs']:8.1f}")
    doc = {"bench": "host-ffn-overhead", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": "cpu", "cpu": cpu_name(), "threads": a.threads, **source_revision(ROOT),
           "torch": torch.__version__, "rounds": a.rounds, "calls": a.calls, "rows": rows,
           "note": "one decode row; the best round's mean per share; random q4vnni weights"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
