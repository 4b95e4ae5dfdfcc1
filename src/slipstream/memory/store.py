"""Layer stores on the CPU: the engine asks for layer i, computes, and gives it back.

The resident store hands out layers built at load time. The disk store builds streamed layers
on the fly from staging buffers that reader threads fill ahead of the engine (staging.py's
read-ahead ring, the one CUDA's tier C reads through too), so the next layers' reads overlap
this layer's compute. A staging buffer returns to the ring only after the layer built from it
no longer needs it, so no read ever lands in a buffer still being consumed.

Where resident layers decode through packed copies (precision "fast"), a streamed layer has two
sources, chosen per forward pass (begin_pass), as PackedDecodeLinear chooses per call:
- passes of up to GEMV_MAX_ROWS tokens (decode, short prompts, small speculation trees) read
  the layer's packed image (weights.cpu_image; image_file.build_cpu_images writes them at
  load) and compute on views into the staging buffer: nothing is dequantized or repacked, and
  the buffer goes back to the ring when the engine releases the layer. Longer passes
  (prefill) do the same where the resident layer's prefill multiplies those packed copies
  too (weights.cpu_image.prefills_from_image: packed prefill, SLIPSTREAM_PACKED_PREFILL);
- other longer passes read the layer's GGUF span and rebuild the layer as a resident one is
  built (a private copy of the span, from which the linears make their dense weights, or
  the packed copies of those that prefill packed, at their first call), or with its dense
  weights alone at "exact" and with packed prefill off (copied out of the buffer by
  dequantizing, the buffer given back right after the build).
Each source has its own ring, so passes of both kinds can alternate without draining reads;
the GGUF ring holds only the layers that prefill from the GGUF file.
A "packed" layer (memory.setup._plan_cpu) keeps its image in RAM: decode passes, and prefill
passes where the image serves them, compute on views of it, made once, and read nothing;
other prefill passes rebuild it from the GGUF file.
The --io mmap store reads each layer when it is asked for, nothing ahead (PageCacheReads),
from the same sources. The CUDA store is in cuda_store.
"""

from __future__ import annotations

import ctypes
import platform
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..model.llama import LayerWeights
from ..weights.cpu_image import decode_layer, prefills_from_image
from ..weights.linear import GEMV_MAX_ROWS
from ..weights.loader import LayerBuilder, TensorSource, layer_span
from .disk import ALIGN, DirectReader, DiskReadError
from .image_file import ImageFile
from .protocol import StoreBase, StoreStats
from .staging import StagingBuffer, StagingRing, io_timeout_s

if TYPE_CHECKING:
    from ..runtime.trace import Tracer

__all__ = ["DiskLayerStore", "MmapLayerStore", "ResidentLayerStore", "StoreStats",
           "StreamDelays"]


@dataclass
class StreamDelays:
    """Test hooks that shake out ordering bugs: `reader` is called in a reader thread before
    each read (sleep, or raise OSError to fake a failing disk); the copy stream stalls for a
    random number of GPU cycles below `copy_cycles` before each host-to-device copy."""

    reader: Callable[[], None] | None = None
    copy_cycles: int = 0

    @classmethod
    def of(cls, x: "StreamDelays | Callable[[], None] | int | None") -> "StreamDelays":
        """Also accepts the short forms: a callable (reader) or an int (copy_cycles)."""
        if x is None or isinstance(x, StreamDelays):
            return x or cls()
        if callable(x):
            return cls(reader=x)
        return cls(copy_cycles=int(x))


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
INT_MAX = 2**31 - 1


def steady_heap(span_bytes: int) -> bool:
    """Let a CPU store rebuild streamed layers from memory the process already holds.

    Every token, each streamed layer allocates its dense weights and the dequantizing
    transients, and frees them a layer later. glibc's malloc by default moves its thresholds
    with what the process did before: depending on that history it returns the freed blocks
    to the OS (munmap, or trimming the heap's top) and takes fresh zeroed pages on the next
    build, which cost the default model's 2.2 MB layers 1.3-2x their build time (thousands of
    page faults per layer, measured). Fixed thresholds keep blocks up to 32 MiB in the heap and
    the heap's free top in place up to 16x a layer's span, so a build reuses the last one's
    memory: the peak RSS is the same, it is only kept. Blocks over 32 MiB (a large model's
    transients) are mapped either way. Process-wide; a no-op (False) outside glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    trim = min(max(64 << 20, 16 * span_bytes), INT_MAX)
    return bool(mallopt(M_TRIM_THRESHOLD, trim)) and bool(mallopt(M_MMAP_THRESHOLD,
                                                                   MMAP_THRESHOLD_MAX))


def gguf_source(gf, builder: LayerBuilder, data: torch.Tensor, start: int) -> TensorSource:
    """The source a streamed layer is rebuilt from: file bytes [start, start + len(data))
    in a buffer about to be reused. Where the builder makes packed CPU copies (packed
    prefill), a private copy of the bytes, held by the layer: its linears make their dense
    weights or packed copies at their first call (a copy of a span costs a memcpy; building
    the dense weights of linears that prefill packed would cost a dequantization), as a
    resident layer's do from the same bytes."""
    if builder.precision.cpu_packed_decode:
        return TensorSource(gf, buffer=data.clone(), base=start, held=True)
    return TensorSource(gf, buffer=data, base=start)


def image_prefill_layers(images: ImageFile | None, disk: list[int],
                         packed: dict[int, tuple] | None) -> frozenset[int]:
    """The streamed layers whose prefill passes compute on their packed images (disk layers
    from `images`, "packed" layers from theirs in RAM): weights.cpu_image.prefills_from_image."""
    layouts = {i: layout for i, (_, layout) in (packed or {}).items()}
    if images is not None:
        layouts.update({i: images.layouts[i] for i in disk})
    return frozenset(i for i, layout in layouts.items() if prefills_from_image(layout))


class HostTraced:
    """--trace on the CPU stores: a layer's compute is host time from acquire's return to its
    release (the engine computes in between). Stores check `tracer` only; off, nothing runs."""

    tracer: "Tracer | None" = None
    _computing: float = 0.0  # when the layer being computed was handed out

    def trace(self, tracer: "Tracer | None") -> None:
        self.tracer = tracer

    def _compute_starts(self) -> None:
        self._computing = time.perf_counter()

    def _compute_ends(self, i: int) -> None:
        self.tracer.span("compute", f"L{i}", self._computing, time.perf_counter(), layer=i)


class ResidentLayerStore(HostTraced, StoreBase):
    graph_capturable = True  # the same layers on every pass

    def __init__(self, layers: list[LayerWeights]):
        self.layers = layers
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self.layers)

    def trace(self, tracer: "Tracer | None") -> None:
        # On CUDA a resident layer's host time is its kernels' launch, not their run, and
        # decode replays CUDA graphs that never come here: trace only token spans there.
        on_cuda = bool(self.layers) and self.layers[0].is_cuda
        self.tracer = None if on_cuda else tracer

    def acquire(self, i: int) -> LayerWeights:
        if self.tracer is not None:
            self._compute_starts()
        return self.layers[i]

    def release(self, i: int) -> None:
        if self.tracer is not None:
            self._compute_ends(i)


class DiskLayerStore(HostTraced, StoreBase):
    """Resident layers from `resident`, the rest streamed from disk each time: from `images`
    (packed CPU images) in passes of up to GEMV_MAX_ROWS tokens where given, and in longer
    ones for the layers in `image_prefill`, else from the GGUF file (rebuilt).

    On the CPU the staging buffer is the "slot": a layer is built (dequantized) straight from
    it, or made as views into it, so there is no copy to order and no GPU slot ring, only the
    read-ahead rings. `gguf_buffers`: the GGUF ring's buffers (default `n_buffers`); with
    images, prefill alone reads it, whose passes are long enough to hide one read each."""

    def __init__(self, gf, builder: LayerBuilder, resident: list[LayerWeights | None],
                 n_buffers: int = 2, threads: int = 2, io: str = "direct",
                 delay: Callable[[], None] | None = None, images: ImageFile | None = None,
                 gguf_buffers: int | None = None, packed: dict[int, tuple] | None = None):
        """`packed`: the "packed" layers' images in RAM, {layer: (uint8 image, layout)}
        (weights.cpu_image.cpu_image_of); `images`: the disk layers' image file."""
        self.gf = gf
        self.builder = builder
        self.layers = resident
        order = [i for i, layer in enumerate(resident) if layer is None]
        self.spans = {i: layer_span(gf, i) for i in order}
        self.skipped: frozenset[int] = frozenset()
        self.stats = StoreStats()
        self.staging: StagingRing | None = None  # the GGUF spans
        self.decode_staging: StagingRing | None = None  # the disk layers' packed images
        # decode layers of the "packed" layers: views into their images, made once
        self.packed = {i: decode_layer(layout, host) for i, (host, layout) in
                       (packed or {}).items()}
        disk = [i for i in order if i not in self.packed]
        self.images = images if disk else None
        # layers whose prefill passes read their images too: the GGUF ring reads the others
        self.image_prefill = image_prefill_layers(self.images, disk, packed)
        self._tokens = 1  # the pass's (begin_pass)
        self._held: dict[int, StagingBuffer] = {}  # image layers' buffers, until release
        rebuilt = [i for i in order if i not in self.image_prefill]
        if rebuilt:
            spans = {i: self.spans[i] for i in rebuilt}
            self.staging = self._ring(gf.path, spans, rebuilt,
                                      gguf_buffers or n_buffers, threads, io, delay)
            steady_heap(max(e - s for s, e in spans.values()))
        if self.images is not None:
            spans = {i: self.images.spans[i] for i in disk}
            self.decode_staging = self._ring(self.images.path, spans, disk, n_buffers,
                                             threads, io, delay)
            for i, crc in self.images.fingerprints.items():
                if i in spans:
                    self.decode_staging.reader.expect(*spans[i], crc)

    @staticmethod
    def _ring(path, spans, order, n_buffers, threads, io, delay) -> StagingRing:
        size = max(e - s for s, e in spans.values()) + 2 * 4096
        # no more buffers than layers: each read ahead is a different layer
        buffers = [StagingBuffer(size, pinned=False)
                   for _ in range(max(1, min(n_buffers, len(order))))]
        reader = DirectReader(path, threads=threads, io=io, delay=delay)
        return StagingRing(reader, buffers, order, spans)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def note(self) -> str:
        return self.staging.reader.note if self.staging is not None else ""

    def _rings(self) -> list[StagingRing]:
        return [r for r in (self.staging, self.decode_staging) if r is not None]

    def trace(self, tracer: "Tracer | None") -> None:
        """--trace: disk wait, rebuild and compute spans per layer, and the reader threads'
        reads on a track of their own."""
        self.tracer = tracer
        for ring in self._rings():
            ring.trace(tracer)

    def skip(self, layers: frozenset[int]) -> None:
        """Read ahead only the streamed layers the engine will ask for."""
        self.skipped = frozenset(layers)
        for ring in self._rings():
            ring.reorder([i for i in sorted(ring.spans) if i not in self.skipped])

    def begin_pass(self, tokens: int) -> None:
        self._tokens = tokens
        for buf in self._held.values():  # a pass that ended in an error left them out
            self.decode_staging.give_back(buf, None)
        self._held.clear()

    def acquire(self, i: int) -> LayerWeights:
        layer = self.layers[i]
        if layer is not None:
            if self.tracer is not None:
                self._compute_starts()
            return layer
        if i in self.skipped:
            raise ValueError(f"layer {i} is skipped: the store no longer reads it")
        image = self._tokens <= GEMV_MAX_ROWS or i in self.image_prefill
        if image and i in self.packed:
            if self.tracer is not None:
                self._compute_starts()
            return self.packed[i]
        packed = self.decode_staging is not None and image
        ring = self.decode_staging if packed else self.staging
        t0 = time.perf_counter()
        buf, skew = ring.take(i)  # restarts the read-ahead at i when out of order
        t1 = time.perf_counter()
        start, end = ring.spans[i]
        data = buf.tensor[skew:skew + end - start]
        if packed:
            try:
                layer = decode_layer(self.images.layouts[i], data)
            except BaseException:
                ring.give_back(buf, None)
                raise
            self._held[i] = buf  # the layer is views into it: back to the ring at release
        else:
            try:
                layer = self.builder.build(gguf_source(self.gf, self.builder, data, start), i)
            finally:
                ring.give_back(buf, None)  # the build copied everything out of the buffer
        t2 = time.perf_counter()
        self.stats.disk_wait_s += t1 - t0
        self.stats.build_s += t2 - t1
        self.stats.disk_bytes += end - start
        self.stats.layers_streamed += 1
        if self.tracer is not None:  # the same instants as the stats, so the two agree
            self.tracer.span("disk wait", f"L{i}", t0, t1, layer=i)
            self.tracer.span("rebuild", f"L{i}", t1, t2, layer=i, bytes=end - start)
            self._compute_starts()
        return layer

    def release(self, i: int) -> None:
        # streamed layers are dropped by the engine; a rebuilt one's buffer was given back at
        # its build, a decode layer's (views into it) goes back now
        buf = self._held.pop(i, None)
        if buf is not None:
            self.decode_staging.give_back(buf, None)
        if self.tracer is not None:
            self._compute_ends(i)

    def close(self) -> None:
        for buf in self._held.values():  # a pass that ended in an error left them out
            self.decode_staging.give_back(buf, None)
        self._held.clear()
        for ring in self._rings():
            ring.close()  # waits for the reads in flight, joins the reader threads
        self.staging = self.decode_staging = None


class PageCacheReads:
    """--io mmap's reads (both devices): a span of the file read when asked for, nothing ahead,
    by positional reads through the page cache into one reused buffer.

    Not through a memory map, as the mode's name once meant: a map read past the end of a file
    truncated under it is a SIGBUS that kills the process, and no check before the read can
    close the window. A positional read of a shrunk file just comes back short; the reader
    (disk.DirectReader, buffered) checks the file after every read (size and modification
    time, sampled checksums) and raises FileChanged, naming the file, for that or any change."""

    def __init__(self, path: str | Path, max_span: int):
        # One reader thread, waited for at once: the reader's checks and a stall timeout, and
        # no read-ahead. With one thread, a read that timed out finishes before the next one
        # starts, so the buffer is never written by two reads at once.
        self.reader = DirectReader(path, threads=1, io="buffered")
        self.buf = StagingBuffer(max_span + 2 * ALIGN, pinned=False)  # spans widen to pages

    def read(self, start: int, end: int) -> torch.Tensor:
        """File bytes [start, end), in the reused buffer (valid until the next read)."""
        timeout_s = io_timeout_s()
        try:
            skew = self.reader.read_span(self.buf, start, end).result(timeout=timeout_s)
        except FutureTimeout:
            raise DiskReadError(
                f"reading bytes {start}..{end} of {self.reader.path.name} did not finish in "
                f"{timeout_s:.0f} s; the disk stalled (SLIPSTREAM_IO_TIMEOUT_S sets the "
                f"limit)") from None
        return self.buf.tensor[skew:skew + end - start]

    def close(self) -> None:
        self.reader.close()  # joins its thread, closes the file


class MmapLayerStore(HostTraced, StoreBase):
    """The naive baseline (--io mmap): each streamed layer read from the file through the page
    cache when the engine asks for it (PageCacheReads: positional reads, not a map), then
    built; no prefetch. With `images`, passes of up to GEMV_MAX_ROWS tokens read the packed
    image instead and compute on views of the read buffer, as DiskLayerStore does."""

    note = "mmap: page-cache reads, no prefetch (baseline)"

    def __init__(self, gf, builder: LayerBuilder, resident: list[LayerWeights | None],
                 images: ImageFile | None = None, packed: dict[int, tuple] | None = None):
        self.gf = gf
        self.builder = builder
        self.layers = resident
        self.spans = {i: layer_span(gf, i) for i, layer in enumerate(resident) if layer is None}
        self.stats = StoreStats()
        self._tokens = 1
        self.reads = (PageCacheReads(gf.path, max(e - s for s, e in self.spans.values()))
                      if self.spans else None)
        self.packed = {i: decode_layer(layout, host) for i, (host, layout) in
                       (packed or {}).items()}  # as DiskLayerStore's
        disk = [i for i in self.spans if i not in self.packed]
        self.images = images if disk else None
        # as DiskLayerStore's
        self.image_prefill = image_prefill_layers(self.images, disk, packed)
        self.image_reads = None
        if self.images is not None:
            spans = [self.images.spans[i] for i in disk]
            self.image_reads = PageCacheReads(self.images.path,
                                              max(e - s for s, e in spans))
            for i in disk:
                if i in self.images.fingerprints:
                    self.image_reads.reader.expect(*self.images.spans[i],
                                                   self.images.fingerprints[i])

    def __len__(self) -> int:
        return len(self.layers)

    def begin_pass(self, tokens: int) -> None:
        self._tokens = tokens

    def acquire(self, i: int) -> LayerWeights:
        layer = self.layers[i]
        image = self._tokens <= GEMV_MAX_ROWS or i in self.image_prefill
        if layer is None and image:
            layer = self.packed.get(i)
        if layer is None:
            packed = self.image_reads is not None and image
            start, end = self.images.spans[i] if packed else self.spans[i]
            t0 = time.perf_counter()
            # FileChanged if the file changed under us
            data = (self.image_reads if packed else self.reads).read(start, end)
            t1 = time.perf_counter()
            if packed:  # views into the reused buffer: valid until the next layer's read
                layer = decode_layer(self.images.layouts[i], data)
            else:  # the build copies everything out of the buffer, which the next read reuses
                layer = self.builder.build(gguf_source(self.gf, self.builder, data, start), i)
            t2 = time.perf_counter()
            self.stats.disk_wait_s += t1 - t0
            self.stats.build_s += t2 - t1
            self.stats.disk_bytes += end - start
            self.stats.layers_streamed += 1
            if self.tracer is not None:
                self.tracer.span("disk wait", f"L{i}", t0, t1, layer=i)
                self.tracer.span("rebuild", f"L{i}", t1, t2, layer=i, bytes=end - start)
        if self.tracer is not None:
            self._compute_starts()
        return layer

    def release(self, i: int) -> None:
        if self.tracer is not None:
            self._compute_ends(i)

    def close(self) -> None:
        for reads in (self.reads, self.image_reads):
            if reads is not None:
                reads.close()
        self.reads = self.image_reads = None
