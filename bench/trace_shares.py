"""Hybrid decode's CPU shares in a --trace file (runtime.trace's Chrome JSON, as hybrid_bench.py
writes it): their length and the cores they kept busy, apart for the shares that ran while the
main thread was enqueueing CUDA work (its "launch" spans overlap 30% of the share or more) and
the others.

    python bench/trace_shares.py TRACE.json[.gz] ...

Prints one table row per file and kind of share."""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

LAUNCH, SHARE = "launch", "cpu share"  # runtime.trace's categories


def spans(path: Path) -> dict[str, list[dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out: dict[str, list[dict]] = {LAUNCH: [], SHARE: []}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in out:
            out[e["cat"]].append(e)
    return out


def overlap(a: dict, spans_: list[dict]) -> float:
    end = a["ts"] + a["dur"]
    return sum(max(0.0, min(end, b["ts"] + b["dur"]) - max(a["ts"], b["ts"])) for b in spans_)


def main() -> None:
    print(f"{'trace':>48} {'shares':>14} {'n':>4} {'ms a share':>10} {'cores busy':>10}")
    for name in sys.argv[1:]:
        s = spans(Path(name))
        groups: dict[str, list[dict]] = {"main launching": [], "main quiet": []}
        for share in s[SHARE]:
            busy = overlap(share, s[LAUNCH]) >= 0.3 * share["dur"]
            groups["main launching" if busy else "main quiet"].append(share)
        for label, group in groups.items():
            if not group:
                continue
            ms = statistics.mean(e["dur"] for e in group) / 1e3
            cores = [e["args"].get("cores") for e in group if e["args"].get("cores")]
            print(f"{Path(name).name[-48:]:>48} {label:>14} {len(group):4d} {ms:10.3f} "
                  f"{statistics.mean(cores) if cores else float('nan'):10.2f}")


if __name__ == "__main__":
    main()
