"""--stats and --trace on CUDA: where a forward pass's time went, from CUDA events.

Events are recorded only while stats (or a trace) are on: around each layer's compute on the
compute stream and around each host-to-device copy on the copy stream. Their elapsed times are
read back once per forward pass (one host sync per token, and none at all with stats off), so
the fast path keeps no per-layer host sync.

With a tracer the same events become spans (runtime.trace). CUDA events only give times
relative to each other, so the first layer of a trace records an anchor event right after a
device synchronize: the GPU reaches it at once, so its host time is known, and every other
event's host time is the anchor's plus the elapsed time between them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..runtime.trace import Tracer


class Timeline:
    def __init__(self, tracer: "Tracer | None" = None) -> None:
        # one pass, in order: (layer, start, end) on the compute stream
        self.compute: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        # --trace: (layer, host time its enqueueing began, ended), in the same order
        self.launches: list[tuple[int, float, float]] = []
        # (start, end, bytes, layer) on the copy stream; layer -1 where unknown
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event, int, int]] = []
        self._open: tuple[int, torch.cuda.Event] | None = None  # the current layer's start
        self._launch_start = 0.0
        self.tracer = tracer
        # --trace: names the layer a copy being enqueued is for (set by the store, which
        # knows its ring's order); None: copies are traced without a layer
        self.copy_layer: Callable[[], int] | None = None
        self._anchor: tuple[torch.cuda.Event, float] | None = None  # (event, its host time)

    @staticmethod
    def mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def layer_start(self, stream: torch.cuda.Stream, layer: int = -1,
                    launched: float | None = None) -> None:
        """launched: the host time the layer's enqueueing began (the store's acquire), for
        the trace's launch track; now where not given."""
        if self.tracer is not None and self._anchor is None:
            torch.cuda.synchronize(stream.device)  # once per trace: the stream is then empty
            self._anchor = (self.mark(stream), time.perf_counter())
        self._open = (layer, self.mark(stream))
        self._launch_start = time.perf_counter() if launched is None else launched

    def layer_end(self, stream: torch.cuda.Stream) -> None:
        if self._open is not None:
            layer, start = self._open
            self.compute.append((layer, start, self.mark(stream)))
            if self.tracer is not None:
                self.launches.append((layer, self._launch_start, time.perf_counter()))
            self._open = None

    def copy(self, start: torch.cuda.Event, end: torch.cuda.Event, nbytes: int) -> None:
        layer = self.copy_layer() if self.copy_layer is not None else -1
        self.copies.append((start, end, nbytes, layer))

    def flush(self, stats) -> None:
        """Add this pass's compute, stall and copy times to `stats` (a StoreStats), and its
        spans to the tracer."""
        events = [e for _, a, b in self.compute for e in (a, b)] + \
            [e for a, b, _, _ in self.copies for e in (a, b)]
        if not events:
            return
        for e in events:
            e.synchronize()  # the one host wait per pass, only with stats on
        stats.compute_s += sum(a.elapsed_time(b) for _, a, b in self.compute) / 1e3
        gaps = sum(max(prev[2].elapsed_time(cur[1]), 0.0)
                   for prev, cur in zip(self.compute, self.compute[1:]))
        stats.stall_s += gaps / 1e3
        stats.h2d_s += sum(a.elapsed_time(b) for a, b, _, _ in self.copies) / 1e3
        if self.tracer is not None and self._anchor is not None:
            self._trace()
        self.compute.clear()
        self.copies.clear()
        self.launches.clear()

    def _trace(self) -> None:
        anchor, host = self._anchor

        def at(e: torch.cuda.Event) -> float:  # host perf_counter time of a completed event
            return host + anchor.elapsed_time(e) / 1e3

        for layer, a, b in self.compute:
            self.tracer.span("compute", f"L{layer}", at(a), at(b), layer=layer)
        for a, b, n, layer in self.copies:
            self.tracer.span("host-to-device", f"L{layer}", at(a), at(b), layer=layer, bytes=n)
        for layer, begun, ended in self.launches:
            self.tracer.span("launch", f"L{layer}", begun, ended, layer=layer)


class CopyMeter:
    """The copy stream's busy seconds and bytes, kept with stats off: hybrid decode's balance
    (hybrid.balance) judges PCIe by the rate its copies achieve beside the CPU's share,
    which is not the start-up probe's (on the H200: 43.6 GB/s in decode against a probe of
    49.4 beside the CPU kernel, in a hybrid decode benchmark).

    An event pair around each copy; poll() reads back those completed, in the order recorded
    (one stream's events complete in that order), never waiting, and reuses their events.
    Only while `on` (the store's split passes, so that prefill's whole copies, which run
    without the CPU beside them, are not counted)."""

    MAX_PENDING = 4096  # polled at each pass; past this (nobody polling) read back first

    def __init__(self, event: Callable[[], "torch.cuda.Event"] | None = None) -> None:
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()
        self._spare: list[torch.cuda.Event] = []
        self.seconds = 0.0  # totals over the copies read back (running, never reset)
        self.nbytes = 0
        self.on = True

    def _mark(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        e = self._spare.pop() if self._spare else self._event()
        e.record(stream)
        return e

    def start(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return self._mark(stream)

    def end(self, stream: torch.cuda.Stream, start: torch.cuda.Event, nbytes: int) -> None:
        self._pending.append((start, self._mark(stream), nbytes))
        if len(self._pending) > self.MAX_PENDING:
            self.poll()
            while len(self._pending) > self.MAX_PENDING:  # still running: the oldest go
                self._pending.popleft()

    def poll(self) -> tuple[float, int]:
        """The running totals, with every copy completed since the last poll added."""
        while self._pending and self._pending[0][1].query():
            a, b, n = self._pending.popleft()
            self.seconds += a.elapsed_time(b) / 1e3
            self.nbytes += n
            self._spare += (a, b)
        return self.seconds, self.nbytes
