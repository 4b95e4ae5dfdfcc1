"""Where a streamed layer's image comes from on CUDA, and how its bytes reach a GPU slot.

A source serves the layers of one tier (their layouts, from weights.image). The slot ring
(slots.py) asks it, per layer: are the bytes there (`ready`), put them into slot k (`enqueue`,
ordered after the slot's `freed` event), and make compute wait for them (`arrive`).
- PinnedSource: tier B, a pinned image per layer; one copy on the copy stream.
- StagedDiskSource: tier C, the image file (image_file.py) read by reader threads with O_DIRECT
  into a ring of pinned staging buffers (staging.py), then one copy on the copy stream. A
  staging buffer is refilled only after its copy's event completed (the reader thread waits).
- KvikioSource: tier C through KvikIO, which reads the file straight into the slot (GPUDirect
  Storage, or its compat mode's own bounce buffers). It writes outside stream order, so its
  thread waits for the slot's `freed` event on the host first, and compute waits for the read.
- MmapSource: the naive baseline (--io mmap), outside the ring: when a layer is needed, one
  positional read through the page cache (not a map, whatever the name: see
  store.PageCacheReads) into a pageable buffer, then one pageable copy on the compute stream
  into a slot of its own; nothing ahead.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable

import torch

from ..weights.image import LayerImage, LayerLayout
from .disk import DirectReader, DiskReadError
from .image_file import ImageFile
from .kvikio_io import bypass_page_cache, gds_enabled, require_kvikio
from .protocol import StoreStats
from .staging import StagingBuffer, StagingRing, io_timeout_s
from .store import PageCacheReads

if TYPE_CHECKING:
    from .slots import SlotRing


class Source:
    """The layers of one tier, as the slot ring sees them. The defaults fit a source whose
    bytes are always there and reach the slot by a copy on the ring's copy stream."""

    note = ""  # what the user should know about this I/O path
    own_slot = False  # True: outside the ring, with acquire/release of its own (mmap)

    def __init__(self, layouts: dict[int, LayerLayout], stats: StoreStats):
        self.layouts = layouts  # layer -> where its tensors sit in its image
        self.stats = stats  # the store's

    def ready(self, i: int) -> bool:
        """Enqueueing layer i now would not block on a read."""
        return True

    def enqueue(self, ring: SlotRing, i: int, k: int) -> None:
        """Start layer i's bytes on their way into slot k, after the slot's last reader."""
        raise NotImplementedError

    def arrive(self, ring: SlotRing, i: int, k: int, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait until slot k holds layer i."""
        stream.wait_event(ring.copied[k])

    def restart(self, ahead: list[int]) -> None:
        """The ring restarts at ahead[0] and serves `ahead` in order: drop or settle the work
        queued for the old order (on return, nothing may still write into a slot)."""

    def skip(self, layers: frozenset[int]) -> None:
        """The ring will not ask for `layers` any more (layer skip): leave them out of any
        read-ahead, and settle the work queued for the old order, as restart does."""

    def enable_timing(self, on: bool) -> None:
        pass

    def collect(self) -> None:
        """Fold timing into stats (end of a --stats run)."""

    def close(self) -> None:
        pass


class PinnedSource(Source):
    """Tier B: each layer's image in pinned RAM (memory.setup.pin_streamed_layers)."""

    def __init__(self, images: dict[int, LayerImage], stats: StoreStats):
        super().__init__({i: im.layout for i, im in images.items()}, stats)
        self.images = images
        # layer -> bytes to copy when less than the whole image (hybrid decode leaves the
        # CPU's share, the image's tail, on the host)
        self.upto: dict[int, int] = {}

    def enqueue(self, ring: SlotRing, i: int, k: int) -> None:
        host = self.images[i].host
        n = self.upto.get(i)
        ring.copy_in(k, host[:n] if n is not None else host)

    def close(self) -> None:
        self.images = {}  # the pinned images go with the store


class StagedDiskSource(Source):
    """Tier C: O_DIRECT (or buffered) reads into pinned staging buffers, then one copy."""

    def __init__(self, disk: ImageFile, stats: StoreStats, slot_bytes: int, io: str,
                 n_staging: int, threads: int, delay: Callable[[], None] | None,
                 pinned: bool):
        super().__init__(disk.layouts, stats)
        reader = DirectReader(disk.path, threads=threads, io=io, delay=delay)
        buffers = [StagingBuffer(slot_bytes + 4096, pinned) for _ in range(max(1, n_staging))]
        for b in buffers:
            b.event = torch.cuda.Event()
        order = sorted(disk.spans)
        self.staging = StagingRing(reader, buffers, order, disk.spans)
        self.staging.ready(order[0])  # start reading the first token's disk layers now

    @property
    def note(self) -> str:
        return self.staging.reader.note  # an O_DIRECT fallback, say

    def ready(self, i: int) -> bool:
        return self.staging.ready(i)

    def enqueue(self, ring: SlotRing, i: int, k: int) -> None:
        n = self.layouts[i].nbytes
        t0 = time.perf_counter()
        buf, skew = self.staging.take(i)
        self.stats.disk_wait_s += time.perf_counter() - t0
        self.stats.disk_bytes += n
        ring.copy_in(k, buf.tensor[skew:skew + n], done=buf.event)
        self.staging.give_back(buf, buf.event)  # its reader waits on the event

    def restart(self, ahead: list[int]) -> None:
        self.staging.restart(next(x for x in ahead if x in self.layouts))

    def skip(self, layers: frozenset[int]) -> None:
        self.staging.reorder([i for i in sorted(self.layouts) if i not in layers])

    def enable_timing(self, on: bool) -> None:
        self.staging.reader.timing = on

    def collect(self) -> None:
        self.stats.disk_read_s += self.staging.reader.busy_seconds()

    def close(self) -> None:
        self.staging.close()  # idempotent: drains the reads, joins the reader threads


class KvikioSource(Source):
    """Tier C through KvikIO: reads land in the slot itself, on a thread pool of ours."""

    def __init__(self, disk: ImageFile, stats: StoreStats, threads: int,
                 delay: Callable[[], None] | None):
        super().__init__(disk.layouts, stats)
        kvikio = require_kvikio()
        bypass_page_cache()
        self.path = disk.path
        self.spans = disk.spans
        self.delay = delay
        self.file = kvikio.CuFile(str(disk.path), "r")
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                       thread_name_prefix="slipstream-kvikio")
        self.reads: dict[int, Future] = {}
        mode = "GPUDirect Storage" if gds_enabled() else "compat mode (POSIX reads)"
        self.note = f"kvikio: {mode}"

    def enqueue(self, ring: SlotRing, i: int, k: int) -> None:
        n = self.layouts[i].nbytes
        self.reads[i] = self.pool.submit(self._read, ring.freed[k], ring.slots[k], n,
                                         self.spans[i][0])
        self.stats.disk_bytes += n  # straight into the slot: no host-to-device copy

    def _read(self, freed: torch.cuda.Event, slot: torch.Tensor, n: int, start: int) -> None:
        """In a kvikio thread: KvikIO writes the slot outside stream order, so wait on the host
        until the kernels that last read the slot are done."""
        freed.synchronize()
        if self.delay is not None:
            self.delay()
        got = self.file.pread(slot[:n], n, start).get()
        if got != n:
            raise DiskReadError(f"{self.path.name}: kvikio read {got} of {n} bytes at "
                                f"byte {start}: the file was truncated or replaced")

    def arrive(self, ring: SlotRing, i: int, k: int, stream: torch.cuda.Stream) -> None:
        t0 = time.perf_counter()
        timeout_s = io_timeout_s()
        try:
            self.reads.pop(i).result(timeout=timeout_s)
        except FutureTimeout:
            raise DiskReadError(f"kvikio read of layer {i} did not finish in "
                                f"{timeout_s:.0f} s") from None
        except (RuntimeError, OSError) as e:  # kvikio reports I/O errors as RuntimeError
            raise DiskReadError(f"kvikio read of layer {i} from {self.path.name} "
                                f"failed: {e}") from None
        self.stats.disk_wait_s += time.perf_counter() - t0

    def restart(self, ahead: list[int]) -> None:
        timeout_s = io_timeout_s()
        for fut in self.reads.values():  # a stale read must not land in a reused slot
            try:
                fut.result(timeout=timeout_s)
            except BaseException:
                pass
        self.reads.clear()

    def skip(self, layers: frozenset[int]) -> None:
        self.restart([])  # reads start only when the ring enqueues: settle those in flight

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.file.close()
            self.pool = None


class MmapSource(Source):
    """The baseline, outside the ring: when the layer is needed, a positional read of its image
    through the page cache into a pageable buffer (store.PageCacheReads: a file changed or
    truncated under it is a FileChanged, where a map's read was a SIGBUS), then a pageable copy
    into a slot of its own, on the compute stream."""

    own_slot = True

    def __init__(self, disk: ImageFile, stats: StoreStats, slot_bytes: int,
                 device: torch.device, drop_cache: bool):
        super().__init__(disk.layouts, stats)
        self.spans = disk.spans
        self.layers = sorted(disk.spans)  # in use order; the first one starts a pass
        self.drop_cache = drop_cache
        self.reads = PageCacheReads(disk.path, slot_bytes)
        self.slot = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
        self.note = ("mmap: page-cache reads and pageable copies, no prefetch (baseline)"
                     + ("; the file's pages are dropped from the page cache each pass, as "
                        "if RAM could not hold them" if drop_cache else ""))

    def acquire(self, i: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """The slot, holding layer i's image."""
        if self.drop_cache and i == self.layers[0]:
            self._drop_page_cache()
        start, end = self.spans[i]
        t0 = time.perf_counter()
        data = self.reads.read(start, end)  # a changed file raises here, before the slot
        # Pageable: torch stages the copy, ordered after the kernels that last read the slot,
        # and the host waits until the buffer is copied out, so the next read may reuse it.
        self.slot[:end - start].copy_(data)
        self.stats.disk_wait_s += time.perf_counter() - t0
        self.stats.disk_bytes += end - start
        self.stats.h2d_bytes += end - start
        return self.slot

    def release(self, i: int, stream: torch.cuda.Stream) -> None:
        pass  # the next acquire's copy is ordered after this layer's kernels by the stream

    def skip(self, layers: frozenset[int]) -> None:
        # the page cache is dropped when a pass reaches its first layer: one it still reads
        self.layers = [i for i in sorted(self.spans) if i not in layers]

    def _drop_page_cache(self) -> None:
        """Ask the kernel to drop the file's cached pages: emulates RAM too small to cache the
        streamed layers (the reads then come from the disk)."""
        if hasattr(os, "posix_fadvise"):
            lo = min(s for s, _ in self.spans.values())
            hi = max(e for _, e in self.spans.values())
            os.posix_fadvise(self.reads.reader.fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.reads is None:
            return
        self.reads.close()
        self.reads = None
        self.slot = None
