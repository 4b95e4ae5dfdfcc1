"""Streaming layers through the GPU: tier B (pinned RAM) and tier C (disk) into a ring of slots.

Each streamed layer's image (gpu_stream.py) reaches one of `n_slots` GPU slots per use, and the
layer is rebuilt as views into the slot. Where the image comes from:
- "pinned": tier B, a pinned host buffer; one copy on the copy stream.
- "disk": tier C, the image file (image_file.py) read by reader threads with O_DIRECT into a
  ring of pinned staging buffers (staging.py), then one copy on the copy stream.
- "kvikio": tier C through KvikIO, which reads the file straight into the slot (GPUDirect
  Storage, or its compat mode's own bounce buffers).
- "mmap": the naive baseline, outside the ring: the image file memory-mapped, one pageable copy
  on the compute stream into a slot of its own when the layer is needed, nothing ahead.

Ordering is on the GPU, with no host sync per layer:
- compute waits on the event recorded after its slot's copy;
- a copy into a slot waits on the event recorded after the last kernel that read the slot, so a
  slot is never overwritten while a kernel may still read it (the reference engine's race);
- a staging buffer is refilled only after its copy's event completed (the reader thread waits).
KvikIO writes outside stream order, so its thread waits for the slot's event on the host first,
and compute waits for the read's future.

Copies run ahead of compute in layer order, cycling into the next token: the copy into a slot
is enqueued as soon as the slot is released and the bytes are there, so the main thread only
blocks on a disk read when the layer it needs next has not arrived.
"""

from __future__ import annotations

import mmap
import os
import random
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from ..model.llama import LayerWeights
from .disk import DirectReader, DiskReadError
from .gpu_stream import LayerImage, LayerLayout, from_image
from .image_file import ImageFile
from .staging import IO_TIMEOUT_S, StagingBuffer, StagingRing
from .store import StoreStats, StreamDelays
from .timeline import Timeline

_KIND_OF_IO = {"direct": "disk", "buffered": "disk", "kvikio": "kvikio", "mmap": "mmap"}


class CudaLayerStore:
    def __init__(self, resident: list[LayerWeights | None], device: torch.device, workspace,
                 images: dict[int, LayerImage] | None = None, disk: ImageFile | None = None,
                 io: str = "direct", n_slots: int = 2, n_staging: int = 3, threads: int = 2,
                 delays: StreamDelays | None = None, seed: int = 0,
                 drop_cache: bool = True):
        self.layers = resident
        self.device = device
        self.workspace = workspace
        self.images = images or {}
        self.delays = delays or StreamDelays()
        self.rng = random.Random(seed)
        self.kind: dict[int, str] = {i: "pinned" for i in self.images}
        self.layouts: dict[int, LayerLayout] = {i: im.layout for i, im in self.images.items()}
        if disk is not None:
            for i in disk.spans:
                self.kind[i] = _KIND_OF_IO[io]
            self.layouts.update(disk.layouts)
        self.disk = disk
        # the slot ring serves every streamed layer except the mmap baseline's
        self.order = sorted(i for i, k in self.kind.items() if k != "mmap")
        size = max((lay.nbytes for lay in self.layouts.values()), default=256)
        n_slots = max(1, min(n_slots, len(self.order))) if self.order else 0
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device)
                      for _ in range(n_slots)]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(n_slots)]
        self.freed = [torch.cuda.Event() for _ in range(n_slots)]
        self.slot_of: dict[int, int] = {}  # layer enqueued, not yet acquired -> its slot
        self.in_use: dict[int, int] = {}  # layer acquired, not yet released -> its slot
        self.slot_next = 0  # the slot the next enqueued copy uses
        # Positions count copies in ring order (layer order[pos % len(order)]). A copy may run
        # at most n_slots positions ahead of the releases: its slot is the one freed then.
        self.pos = 0
        self.released = 0
        self.stats = StoreStats()
        self.timeline: Timeline | None = None  # set by enable_timing (--stats)
        self._note = ""
        self.staging: StagingRing | None = None
        self.kvikio_file = None
        self.kvikio_pool: ThreadPoolExecutor | None = None
        self.kvikio_reads: dict[int, Future] = {}
        self.mmap_layers = sorted(i for i, k in self.kind.items() if k == "mmap")
        self.drop_cache = drop_cache
        if disk is not None:
            self._open_disk(disk, io, n_staging, threads, size)

    def _open_disk(self, disk: ImageFile, io: str, n_staging: int, threads: int,
                   size: int) -> None:
        disk_order = sorted(disk.spans)
        if io in ("direct", "buffered"):
            reader = DirectReader(disk.path, threads=threads, io=io, delay=self.delays.reader)
            pinned = self.device.type == "cuda"  # (tests drive this store on the CPU)
            buffers = [StagingBuffer(size + 4096, pinned) for _ in range(max(1, n_staging))]
            for b in buffers:
                b.event = torch.cuda.Event()
            self.staging = StagingRing(reader, buffers, disk_order, disk.spans)
            self.staging.ready(disk_order[0])  # start reading the first token's disk layers now
        elif io == "kvikio":
            from .kvikio_io import require_kvikio

            kvikio = require_kvikio()
            _kvikio_bypass_page_cache()
            self.kvikio_file = kvikio.CuFile(str(disk.path), "r")
            self.kvikio_pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                                  thread_name_prefix="slipstream-kvikio")
            mode = "GPUDirect Storage" if _kvikio_gds() else "compat mode (POSIX reads)"
            self._note = f"kvikio: {mode}"
        else:  # mmap baseline
            self.mmap_fd = os.open(disk.path, os.O_RDONLY)
            self.mm = mmap.mmap(self.mmap_fd, 0, prot=mmap.PROT_READ)
            with warnings.catch_warnings():  # read-only map; nothing writes through it
                warnings.simplefilter("ignore", UserWarning)
                self.mm_tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
            self.mmap_slot = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._note = ("mmap: page-cache reads and pageable copies, no prefetch (baseline)"
                         + ("; the file's pages are dropped from the page cache each pass, as "
                            "if RAM could not hold them" if self.drop_cache else ""))

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def note(self) -> str:
        """What the user should know about the I/O path (an O_DIRECT fallback, say)."""
        return self.staging.reader.note if self.staging is not None else self._note

    def enable_timing(self, on: bool = True) -> None:
        """--stats: time compute, stalls and copies with CUDA events (one host sync per pass)."""
        self.timeline = Timeline() if on else None
        if self.staging is not None:
            self.staging.reader.timing = on

    # --- the ring -----------------------------------------------------------------------

    def _ready(self, i: int) -> bool:
        kind = self.kind[i]
        return kind != "disk" or self.staging.ready(i)

    def _pump(self, until: int | None = None) -> None:
        """Enqueue copies in ring order while a slot is free. Stops at a disk layer whose read
        is not done, unless it is at or before `until`, which must be enqueued on return."""
        n = len(self.order)
        while self.pos < self.released + len(self.slots):
            i = self.order[self.pos % n]
            if until is None and not self._ready(i):
                return
            self._enqueue(i)
            if i == until:
                until = None

    def _enqueue(self, i: int) -> None:
        k = self.slot_next
        layout = self.layouts[i]
        n = layout.nbytes
        kind = self.kind[i]
        if kind == "kvikio":
            start = self.disk.spans[i][0]
            self.kvikio_reads[i] = self.kvikio_pool.submit(self._kvikio_read, k, n, start)
            self.stats.disk_bytes += n  # straight into the slot: no host-to-device copy
        else:
            if kind == "pinned":
                src, buf = self.images[i].host, None
            else:
                t0 = time.perf_counter()
                buf, skew = self.staging.take(i)
                self.stats.disk_wait_s += time.perf_counter() - t0
                self.stats.disk_bytes += n
                src = buf.tensor[skew:skew + n]
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.freed[k])  # the slot's last reader is done
                if self.delays.copy_cycles:
                    torch.cuda._sleep(self.rng.randrange(self.delays.copy_cycles))
                t = self.timeline
                start_ev = t.mark(self.copy_stream) if t is not None else None
                self.slots[k][:n].copy_(src, non_blocking=True)
                if t is not None:
                    t.copy(start_ev, t.mark(self.copy_stream), n)
                self.copied[k].record(self.copy_stream)
                if buf is not None:
                    buf.event.record(self.copy_stream)
            self.stats.h2d_bytes += n
            if buf is not None:
                self.staging.give_back(buf, buf.event)  # its reader waits on the event
        self.slot_of[i] = k
        self.slot_next = (k + 1) % len(self.slots)
        self.pos += 1

    def _kvikio_read(self, k: int, n: int, start: int) -> None:
        """In a kvikio thread: KvikIO writes the slot outside stream order, so wait on the host
        until the kernels that last read the slot are done."""
        self.freed[k].synchronize()
        if self.delays.reader is not None:
            self.delays.reader()
        got = self.kvikio_file.pread(self.slots[k][:n], n, start).get()
        if got != n:
            raise DiskReadError(f"{self.disk.path.name}: kvikio read {got} of {n} bytes at "
                                f"byte {start}: the file was truncated or replaced")

    def _restart(self, i: int) -> None:
        """An out-of-order request (a forward pass that stopped part-way, say): settle what is
        in flight (host waits, but only here) and restart the ring at layer i."""
        for k in self.in_use.values():
            self.freed[k].record(torch.cuda.current_stream(self.device))
        self.in_use.clear()
        for fut in self.kvikio_reads.values():
            try:
                fut.result(timeout=IO_TIMEOUT_S)
            except BaseException:
                pass
        self.kvikio_reads.clear()
        self.copy_stream.synchronize()  # stale copies must not land after kvikio writes
        self.slot_of.clear()
        self.pos = self.released = self.order.index(i)
        if self.staging is not None:
            n = len(self.order)
            ahead = [self.order[(self.pos + j) % n] for j in range(n)]
            self.staging.restart(next(x for x in ahead if self.kind[x] == "disk"))

    # --- the engine's side ----------------------------------------------------------------

    def acquire(self, i: int) -> LayerWeights:
        stream = torch.cuda.current_stream(self.device)
        if i == 0 and self.timeline is not None:
            self.timeline.flush(self.stats)  # a new pass: read the last one's events back
        layer = self.layers[i]
        if layer is None:
            if self.kind[i] == "mmap":
                layer = self._acquire_mmap(i)
            else:
                layer = self._acquire_ring(i, stream)
            self.stats.layers_streamed += 1
        if self.timeline is not None:
            self.timeline.layer_start(stream)
        return layer

    def _acquire_ring(self, i: int, stream: torch.cuda.Stream) -> LayerWeights:
        if i not in self.slot_of:
            n = len(self.order)
            if self.order[self.pos % n] != i or self.pos >= self.released + len(self.slots):
                self._restart(i)
            self._pump(until=i)
        k = self.slot_of.pop(i)
        if self.kind[i] == "kvikio":
            t0 = time.perf_counter()
            try:
                self.kvikio_reads.pop(i).result(timeout=IO_TIMEOUT_S)
            except FutureTimeout:
                raise DiskReadError(f"kvikio read of layer {i} did not finish in "
                                    f"{IO_TIMEOUT_S:.0f} s") from None
            except (RuntimeError, OSError) as e:  # kvikio reports I/O errors as RuntimeError
                raise DiskReadError(f"kvikio read of layer {i} from {self.disk.path.name} "
                                    f"failed: {e}") from None
            self.stats.disk_wait_s += time.perf_counter() - t0
        else:
            stream.wait_event(self.copied[k])
        self.in_use[i] = k
        return from_image(self.layouts[i], self.slots[k], self.workspace)

    def _acquire_mmap(self, i: int) -> LayerWeights:
        if self.drop_cache and i == self.mmap_layers[0]:
            self._drop_page_cache()
        start, end = self.disk.spans[i]
        t0 = time.perf_counter()
        # Pageable: torch stages the copy, ordered after the kernels that last read the slot,
        # and the host waits for it. Page faults read the file.
        self.mmap_slot[:end - start].copy_(self.mm_tensor[start:end])
        self.stats.disk_wait_s += time.perf_counter() - t0
        self.stats.disk_bytes += end - start
        self.stats.h2d_bytes += end - start
        return from_image(self.layouts[i], self.mmap_slot, self.workspace)

    def _drop_page_cache(self) -> None:
        """Unmap our pages, then ask the kernel to drop the file's cached pages (mapped pages
        are not dropped, hence both). Emulates RAM too small to cache the streamed layers."""
        lo = min(self.disk.spans[i][0] for i in self.mmap_layers)
        hi = max(self.disk.spans[i][1] for i in self.mmap_layers)
        lo -= lo % mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED"):
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.mmap_fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def release(self, i: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        if self.timeline is not None:
            self.timeline.layer_end(stream)
        k = self.in_use.pop(i, None)
        if k is None:
            return
        self.freed[k].record(stream)
        self.released += 1
        self._pump()  # refill the slot just released, if its layer's bytes are there

    def collect(self) -> None:
        """Fold the timing of the pass still open into stats (end of a --stats run)."""
        if self.timeline is not None:
            self.timeline.flush(self.stats)
            if self.staging is not None:
                self.stats.disk_read_s += self.staging.reader.busy_seconds()

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.kvikio_pool is not None:
            self.kvikio_pool.shutdown(wait=True)
            self.kvikio_file.close()
            self.kvikio_pool = None
        if getattr(self, "mm", None) is not None:
            del self.mm_tensor
            try:
                self.mm.close()
            except BufferError:  # a tensor still views the map; it closes when that goes
                pass
            os.close(self.mmap_fd)
            self.mm = None


def _kvikio_gds() -> bool:
    """Whether KvikIO will use GPUDirect Storage (the API moved between releases; the answer
    only goes into the note, so any failure reads as compat mode)."""
    try:
        import kvikio.defaults as d  # a submodule the package does not import itself

        if hasattr(d, "is_compat_mode_preferred"):
            return not d.is_compat_mode_preferred()
        return not bool(d.compat_mode())
    except Exception:
        return False


def _kvikio_bypass_page_cache() -> None:
    """Tier C reads bypass the page cache, KvikIO's too: in compat mode it would otherwise read
    through it, and a RAM large enough to cache the file would stand in for the disk. Set for
    the process (the reads run later, on KvikIO's threads); KvikIO releases without the
    setting read as they always did."""
    try:
        import kvikio.defaults as d

        d.set("auto_direct_io_read", True)
    except Exception:  # a release without the setting (or without defaults.set)
        pass
