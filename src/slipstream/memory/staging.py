"""The read-ahead ring: host buffers that reader threads fill from disk, ahead of use.

Both disk stores read through it: CUDA's tier C (pinned buffers, each then copied into a GPU
slot, slots.py) and the CPU's (pageable buffers a layer is built from, store.py).

A buffer cycles: read from disk (a reader thread), copied to the GPU (the copy stream), read
again. The reference engine refilled a buffer while its copy could still be in flight. Here the
reader thread that is about to refill a buffer first waits on the event recorded after the
buffer's last copy (on CPU there is none: the buffer comes back once the layer is built), so:
- the main thread hands a buffer back as soon as its copy is *enqueued*, and never waits on a
  copy itself (no host sync on the compute path);
- a read never lands in a buffer a copy is still reading.

Reads are queued in the order the layers will be used, cycling over the disk layers, so the
next token's first reads start while this token's last layers compute. Every wait on a read has
a timeout, and a reader's error surfaces in the main thread as a DiskReadError.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import torch

from .. import envs
from .disk import ALIGN, DirectReader, DiskReadError
from .pinned import pinned_empty

if TYPE_CHECKING:
    from ..runtime.trace import Tracer


def io_timeout_s() -> float:
    """Seconds after which a read that has not finished is reported as an error rather than
    waited on for ever (a 0.5 GB layer takes 0.2 s at 2.3 GB/s; a stalled disk takes for
    ever): SLIPSTREAM_IO_TIMEOUT_S, 60 by default."""
    return envs.get("SLIPSTREAM_IO_TIMEOUT_S")


class StagingBuffer:
    """Page-aligned host memory (pinned for the GPU) that O_DIRECT reads can target."""

    def __init__(self, nbytes: int, pinned: bool = True):
        self.nbytes = (max(nbytes, ALIGN) + ALIGN - 1) // ALIGN * ALIGN
        raw = (pinned_empty(self.nbytes + ALIGN) if pinned
               else torch.empty(self.nbytes + ALIGN, dtype=torch.uint8))
        skew = (-raw.data_ptr()) % ALIGN  # O_DIRECT wants the address aligned too
        self.tensor = raw[skew:skew + self.nbytes]
        self.view = memoryview(self.tensor.numpy())
        # Completes once the last copy out of this buffer is done; .synchronize() waits for it.
        # None until the buffer is first copied from. Set by whoever enqueues the copy.
        self.copied = None
        self.event = None  # the CUDA event the store records after each copy out of it


class StagingRing:
    """Reads `order` (layer ids, cyclically) from `reader`'s file into `buffers`, ahead of use.

    take(i) -> (buffer, offset of layer i's bytes in it), blocking on the read;
    give_back(buffer, event) once the copy out of it is enqueued (event completes with it)."""

    def __init__(self, reader: DirectReader, buffers: list[StagingBuffer], order: list[int],
                 spans: dict[int, tuple[int, int]], timeout_s: float | None = None):
        if not order or not buffers:
            raise ValueError("a staging ring needs at least one layer and one buffer")
        self.reader = reader
        self.free = deque(buffers)
        self.order = order
        self.spans = spans
        self.timeout_s = io_timeout_s() if timeout_s is None else timeout_s
        self.reads: deque[tuple[int, StagingBuffer, Future]] = deque()
        self.next = 0  # index into order of the next layer to read

    def _top_up(self) -> None:
        while self.free and self.order:  # an empty order (every layer skipped) reads nothing
            i = self.order[self.next % len(self.order)]
            buf = self.free.popleft()
            start, end = self.spans[i]
            before = buf.copied.synchronize if buf.copied is not None else None
            self.reads.append((i, buf, self.reader.read_span(buf, start, end, before)))
            self.next += 1

    def ready(self, i: int) -> bool:
        """Layer i is the next to be taken and its read is done (never blocks)."""
        self._top_up()
        return bool(self.reads) and self.reads[0][0] == i and self.reads[0][2].done()

    def take(self, i: int) -> tuple[StagingBuffer, int]:
        if not self.reads or self.reads[0][0] != i:
            self.restart(i)  # an out-of-order request: read i next
        self._top_up()
        if not self.reads:
            raise DiskReadError(f"no staging buffer is left to read layer {i} into: earlier "
                                f"reads from {self.reader.path.name} never finished")
        layer, buf, fut = self.reads.popleft()
        try:
            skew = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.reads.appendleft((layer, buf, fut))  # still in flight: not free
            raise DiskReadError(
                f"reading layer {i} from {self.reader.path.name} did not finish in "
                f"{self.timeout_s:.0f} s; the disk stalled (SLIPSTREAM_IO_TIMEOUT_S sets the "
                f"limit)") from None
        except BaseException:
            self.free.append(buf)  # the read failed, the buffer holds nothing anyone needs
            raise
        return buf, skew

    def give_back(self, buf: StagingBuffer, copied) -> None:
        buf.copied = copied
        self.free.append(buf)
        self._top_up()

    def restart(self, i: int) -> None:
        """Drop the queued reads and read from layer i on."""
        self.drain()
        self.next = self.order.index(i)

    def reorder(self, order: list[int]) -> None:
        """Read `order` from now on (layer skip leaves layers out): the queued reads are
        drained, and reading starts again at order[0]."""
        self.drain()
        self.order = list(order)
        self.next = 0
        self._top_up()

    def trace(self, tracer: "Tracer | None") -> None:
        """--trace: each read becomes a "disk read" span named by its layer (the reader
        reports file offsets; the spans map them back)."""
        if tracer is None:
            self.reader.on_read = None
            return
        layer_at = {start: i for i, (start, _) in self.spans.items()}

        def on_read(start: int, end: int, t0: float, t1: float) -> None:
            i = layer_at.get(start, -1)
            tracer.span("disk read", f"L{i}", t0, t1, layer=i, bytes=end - start)

        self.reader.on_read = on_read

    def drain(self) -> None:
        while self.reads:
            _, buf, fut = self.reads.popleft()
            try:
                fut.result(timeout=self.timeout_s)
            except FutureTimeout:
                continue  # a hung read may still write into buf some day: never reuse it
            except BaseException:
                pass  # nobody wants this read; its error resurfaces if the layer is re-read
            self.free.append(buf)

    def close(self) -> None:
        self.drain()
        self.reader.close()
