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

import bisect
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


def split_timing(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Where hybrid decode's serial path went, from a trace's spans (Tracer.spans()): the
    compute track's GPU layers, the launch track's host enqueueing and the CPU worker's
    wait and share spans, all in microseconds. Per split layer (one with a "cpu share"
    span), matched to the compute span of the same layer that began last before it:

      gpu_to_cpu  the layer's GPU start to the CPU seeing its input: the GPU's attention and
                  the input's copy down, and the worker noticing it
      cpu         the CPU's share
      cpu_to_gpu  the CPU's hand-back to the layer's GPU end: the wait kernel seeing the
                  flag, reading the result and adding it, and the rest of the layer

    and the process's cores busy during the shares where the worker recorded them; and over
    all layers: GPU compute of the layers that ran no share (resident or whole),
    the gaps between consecutive compute spans, and the part of those gaps where the host
    had not yet begun enqueueing the next layer when the GPU finished the last (host-bound);
    and the host's enqueueing (the launch track) per split and per other layer, and its sum a
    pass: near the token's time, the host bounds it even without gaps (session 39's 8B, where
    the enqueue of a split layer's attention was most of gpu_to_cpu).
    Means are per traced split layer; totals are per decode pass (spans of one pass per
    run of layer indices that does not go back)."""
    by_track: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(spans, key=lambda e: e["ts"]):
        by_track.setdefault(e["cat"], []).append(e)
    compute = by_track.get("compute", [])
    shares = by_track.get("cpu share", [])
    if not compute:
        return {}
    passes = 1 + sum(1 for a, b in zip(compute, compute[1:])
                     if b["args"]["layer"] <= a["args"]["layer"])
    compute_of, launch_of = _by_layer(compute), _by_layer(by_track.get("launch", []))
    split_parts = {"gpu_to_cpu": [], "cpu": [], "cpu_to_gpu": []}
    split_spans = set()
    for s in shares:
        c = _last_begun(compute_of, s["args"]["layer"], s["ts"])
        if c is None:
            continue
        split_spans.add(id(c))
        split_parts["gpu_to_cpu"].append(s["ts"] - c["ts"])
        split_parts["cpu"].append(s["dur"])
        split_parts["cpu_to_gpu"].append(c["ts"] + c["dur"] - s["ts"] - s["dur"])
    gaps = host_bound = 0.0
    for a, b in zip(compute, compute[1:]):
        if b["args"]["layer"] <= a["args"]["layer"]:
            continue  # between passes: the host samples the token
        gap = max(b["ts"] - (a["ts"] + a["dur"]), 0.0)
        gaps += gap
        # the launch of b: the last one of b's layer begun before b's GPU start
        la = _last_begun(launch_of, b["args"]["layer"], b["ts"])
        if la is not None and gap:
            host_bound += min(gap, max(la["ts"] - (a["ts"] + a["dur"]), 0.0))
    other = [c["dur"] for c in compute if id(c) not in split_spans]
    n_split = len(split_parts["cpu"])
    split_layers = {s["args"]["layer"] for s in shares}
    launches = by_track.get("launch", [])
    launch_split = [e["dur"] for e in launches if e["args"]["layer"] in split_layers]
    launch_other = [e["dur"] for e in launches if e["args"]["layer"] not in split_layers]

    def mean(v: list[float]) -> float:
        return round(sum(v) / len(v), 1) if v else 0.0

    out: dict[str, Any] = {"passes": passes, "split_layers_traced": n_split}
    out.update({f"{k}_us": mean(v) for k, v in split_parts.items()})
    # the process's cores busy while a share ran (its threads' CPU time over the share's
    # wall time: the worker's team and the main thread), where the worker recorded it
    cores = [s["args"]["cores"] for s in shares if s.get("args", {}).get("cores") is not None]
    if cores:
        out["cores_busy_during_shares"] = round(sum(cores) / len(cores), 2)
    out["other_layer_gpu_us"] = mean(other)
    out["launch_split_us"] = mean(launch_split)
    out["launch_other_us"] = mean(launch_other)
    out["per_pass_ms"] = {
        "split_gpu_to_cpu": round(sum(split_parts["gpu_to_cpu"]) / passes / 1e3, 2),
        "split_cpu": round(sum(split_parts["cpu"]) / passes / 1e3, 2),
        "split_cpu_to_gpu": round(sum(split_parts["cpu_to_gpu"]) / passes / 1e3, 2),
        "other_layers_gpu": round(sum(other) / passes / 1e3, 2),
        "gaps": round(gaps / passes / 1e3, 2),
        "gaps_host_bound": round(host_bound / passes / 1e3, 2),
        "launch": round(sum(e["dur"] for e in launches) / passes / 1e3, 2),
    }
    return out


def _by_layer(spans: list[dict[str, Any]]) -> dict[int, tuple[list[float], list[dict]]]:
    """Spans (in time order) by their layer: (their start times, the spans)."""
    out: dict[int, tuple[list[float], list[dict]]] = {}
    for e in spans:
        starts, evs = out.setdefault(e["args"]["layer"], ([], []))
        starts.append(e["ts"])
        evs.append(e)
    return out


def _last_begun(index: dict[int, tuple[list[float], list[dict]]], layer: int,
                ts: float) -> dict[str, Any] | None:
    """The span of `layer` that began last at or before `ts`, if any."""
    starts, evs = index.get(layer, ([], []))
    k = bisect.bisect_right(starts, ts)
    return evs[k - 1] if k else None
