"""--stats on CUDA: where a forward pass's time went, from CUDA events.

Events are recorded only while stats are on: around each layer's compute on the compute stream
and around each host-to-device copy on the copy stream. Their elapsed times are read back once
per forward pass (one host sync per token, and none at all with stats off), so the fast path
keeps no per-layer host sync.
"""

from __future__ import annotations

import torch


class Timeline:
    def __init__(self) -> None:
        self.compute: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # one pass, in order
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._open: torch.cuda.Event | None = None  # compute start of the current layer

    @staticmethod
    def mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def layer_start(self, stream: torch.cuda.Stream) -> None:
        self._open = self.mark(stream)

    def layer_end(self, stream: torch.cuda.Stream) -> None:
        if self._open is not None:
            self.compute.append((self._open, self.mark(stream)))
            self._open = None

    def copy(self, start: torch.cuda.Event, end: torch.cuda.Event, nbytes: int) -> None:
        self.copies.append((start, end, nbytes))

    def flush(self, stats) -> None:
        """Add this pass's compute, stall and copy times to `stats` (a StoreStats)."""
        events = [e for pair in self.compute for e in pair] + \
            [e for a, b, _ in self.copies for e in (a, b)]
        if not events:
            return
        for e in events:
            e.synchronize()  # the one host wait per pass, only with stats on
        ms = 0.0
        for a, b in self.compute:
            ms += a.elapsed_time(b)
        stats.compute_s += ms / 1e3
        gaps = sum(max(prev[1].elapsed_time(cur[0]), 0.0)
                   for prev, cur in zip(self.compute, self.compute[1:]))
        stats.stall_s += gaps / 1e3
        stats.h2d_s += sum(a.elapsed_time(b) for a, b, _ in self.copies) / 1e3
        self.compute.clear()
        self.copies.clear()
