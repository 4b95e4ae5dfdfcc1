"""`slipstream run --trace FILE`: where each token's time went, as a Chrome trace.

The file is trace-event JSON ({"traceEvents": [...]}, complete "X" events with microsecond
`ts` and `dur`), which ui.perfetto.dev and chrome://tracing open as a timeline. Each kind of
work has a track of its own (one tid per kind, named by "thread_name" metadata events), so that
whether the disk reads and host-to-device copies run under the compute, or the compute waits
for them, is seen at a glance:

  token           one span per generated token (the first one includes the prompt's prefill)
  compute         per layer: the layer's forward (CPU: host time; CUDA: GPU time, from events)
  disk wait       per streamed layer: the engine blocked until its read had finished
  rebuild         per streamed layer: turning its bytes into a layer (CPU dequantization)
  disk read       per streamed layer: a reader thread's read (runs ahead of the compute)
  host-to-device  per streamed layer: the copy into a GPU slot (copy stream; CUDA events)
  launch          CUDA, per layer: the host enqueueing the layer's kernels (perf_counter), so
                  that a GPU waiting on Python shows as compute spans no longer than these
  cpu wait        hybrid decode, per split layer: the CPU worker waiting for the layer's input
  cpu share       hybrid decode, per split layer: the CPU computing its share of the FFN, from
                  the input's arrival to the result's hand-back (the flag the GPU waits on)

Spans are recorded by the layer stores (memory/) only while a tracer is attached, so a run
without --trace does no extra work. Times are time.perf_counter() seconds; CUDA event times are
moved onto that clock by memory.timeline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# track -> tid, in the order the viewers should stack them (they sort by tid)
TRACKS: dict[str, int] = {"token": 1, "compute": 2, "disk wait": 3, "rebuild": 4,
                          "disk read": 5, "host-to-device": 6, "launch": 7, "cpu wait": 8,
                          "cpu share": 9}
PID = 1


class Tracer:
    """Collects spans from any thread; write() saves them as trace-event JSON."""

    def __init__(self, process_name: str = "slipstream") -> None:
        self.process_name = process_name
        self.t0 = time.perf_counter()  # ts 0 in the file
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # reader threads add disk-read spans concurrently

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """One complete event on `track` from `start` to `end` (perf_counter seconds)."""
        ev = {"name": name, "ph": "X", "pid": PID, "tid": TRACKS[track], "cat": track,
              "ts": round((start - self.t0) * 1e6, 3),
              "dur": round(max(end - start, 0.0) * 1e6, 3)}
        if args:
            ev["args"] = args
        with self._lock:
            self._events.append(ev)

    def spans(self, track: str | None = None) -> list[dict[str, Any]]:
        """The spans recorded so far (on `track`), in time order."""
        with self._lock:
            evs = list(self._events)
        return sorted((e for e in evs if track is None or e["cat"] == track),
                      key=lambda e: e["ts"])

    def tokens(self, events: Iterator) -> Iterator:
        """Pass a generation's events through, recording one "token" span per event: from
        asking for it to getting it, so each span holds the forward pass that made the token
        (the first, the prompt's prefill too) and not the caller's printing in between.
        close() reaches the wrapped generator, so stopping early still ends it properly."""
        try:
            k = 0
            while True:
                t0 = time.perf_counter()
                try:
                    ev = next(events)
                except StopIteration:
                    return
                name = "prefill + token 0" if k == 0 else f"token {k}"
                self.span("token", name, t0, time.perf_counter(), id=ev.id, text=ev.text)
                k += 1
                yield ev
        finally:
            events.close()

    def document(self) -> dict[str, Any]:
        meta = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "ts": 0, "dur": 0,
                 "args": {"name": self.process_name}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "ts": 0, "dur": 0,
                  "args": {"name": track}} for track, tid in TRACKS.items()]
        meta += [{"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "ts": 0,
                  "dur": 0, "args": {"sort_index": tid}} for tid in TRACKS.values()]
        return {"traceEvents": meta + self.spans(), "displayTimeUnit": "ms",
                "otherData": {"source": "slipstream run --trace", "clock": "perf_counter"}}

    def write(self, path: str | os.PathLike) -> None:
        """Save the trace (atomically: a viewer never opens half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.document(), separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, path)


def attach(model, tracer: Tracer | None) -> None:
    """Trace the model's layer stores (None: stop tracing them)."""
    stores = {id(st.store): st.store for st in model.engine.stages}
    for store in stores.values():
        store.trace(tracer)
