"""Where a case's VRAM peak comes from: the CUDA caching allocator's event history, replayed.

    with MemTrace() as trace:      # records allocator events (torch.cuda.memory history)
        ...load, prefill, decode...
    summary = trace.summary()      # the moment reserved memory peaked, and what was live then

The summary names, for the moment `max_memory_reserved` was reached, the bytes allocated against
the bytes reserved (the difference is the allocator's cache and fragmentation) and the live
allocations grouped by the innermost slipstream frame that made them, so a budget overshoot
points at a line of code. gpu_bench.py records it when SLIPSTREAM_MEMTRACE=1.
"""

from __future__ import annotations

from collections import defaultdict

import torch

GIB = 2**30


class MemTrace:
    def __init__(self, max_entries: int = 2_000_000):
        self.max_entries = max_entries
        self.events: list[dict] = []

    def __enter__(self) -> "MemTrace":
        # python stacks only: C++ ones cost far more per allocation and name nothing of ours
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=self.max_entries)
        return self

    def __exit__(self, *exc) -> None:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.events = [e for trace in snap.get("device_traces", []) for e in trace]

    def summary(self, top: int = 12) -> dict:
        return replay(self.events, top)


def origin(frames: list[dict]) -> str:
    """The innermost frame in slipstream's code (or the bench's), as file:line function."""
    for f in frames or []:
        name = f.get("filename", "")
        if "slipstream" in name or "/bench/" in name:
            short = name.split("/src/")[-1] if "/src/" in name else name.rsplit("/", 2)[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no slipstream frame)"


def replay(events: list[dict], top: int = 12) -> dict:
    """Replay allocator events; return the peak of reserved memory and what was live then."""
    reserved = allocated = 0
    live: dict[int, tuple[int, str]] = {}
    best = {"reserved": -1}
    for e in events:
        action, size, addr = e.get("action"), int(e.get("size", 0)), e.get("addr")
        if action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "alloc":
            allocated += size
            live[addr] = (size, origin(e.get("frames")))
        elif action == "free_completed":
            allocated -= size
            live.pop(addr, None)
        else:
            continue
        if reserved > best["reserved"]:
            best = {"reserved": reserved, "allocated": allocated, "live": dict(live)}
    if best["reserved"] < 0:
        return {"events": len(events), "error": "no allocator events were recorded"}
    by_origin: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in best["live"].values():
        by_origin[where][0] += size
        by_origin[where][1] += 1
    rows = sorted(by_origin.items(), key=lambda kv: -kv[1][0])
    return {
        "events": len(events),
        "peak_reserved_gib": round(best["reserved"] / GIB, 3),
        "allocated_at_peak_gib": round(best["allocated"] / GIB, 3),
        "live_at_peak": [{"where": w, "gib": round(b / GIB, 4), "tensors": n}
                         for w, (b, n) in rows[:top]],
    }
