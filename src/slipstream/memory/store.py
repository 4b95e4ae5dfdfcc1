"""Layer stores: the engine asks for layer i, computes, and gives it back.

The resident store hands out layers built at load time. The disk store builds streamed layers
on the fly from staging buffers that reader threads fill ahead of the engine, so the next
layers' reads overlap this layer's compute. A staging buffer returns to the pool only after the
layer built from it no longer needs it; on CPU that is right after the build (dequantizing
copies the bytes out), so no read ever lands in a buffer still being consumed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Callable

import torch

from ..model.llama import LayerWeights
from ..weights.loader import LayerBuilder, TensorSource, layer_span
from .disk import AlignedBuffer, DirectReader


@dataclass
class StoreStats:
    disk_wait_s: float = 0.0  # time the engine (main thread) waited for reads to finish
    build_s: float = 0.0  # time turning streamed bytes into layers (dequantize)
    layers_streamed: int = 0
    disk_bytes: int = 0  # bytes of streamed layers read from disk (or mmap)
    h2d_bytes: int = 0  # bytes copied host-to-device into the GPU slots
    # Measured only while stats are on (CUDA events, read back once per forward pass):
    compute_s: float = 0.0  # GPU busy on the layers (compute stream)
    stall_s: float = 0.0  # GPU idle between layers: waiting for a copy, or for the host
    h2d_s: float = 0.0  # copy stream busy (overlaps compute)
    disk_read_s: float = 0.0  # wall time with at least one read running (overlaps compute)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


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


class ResidentLayerStore:
    def __init__(self, layers: list[LayerWeights]):
        self.layers = layers
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self.layers)

    def acquire(self, i: int) -> LayerWeights:
        return self.layers[i]

    def release(self, i: int) -> None:
        pass

    def close(self) -> None:
        pass


class DiskLayerStore:
    """Resident layers from `resident`, the rest streamed from the GGUF file each time."""

    def __init__(self, gf, builder: LayerBuilder, resident: list[LayerWeights | None],
                 n_buffers: int = 2, threads: int = 2, io: str = "direct",
                 delay: Callable[[], None] | None = None):
        self.gf = gf
        self.builder = builder
        self.layers = resident
        self.order = [i for i, layer in enumerate(resident) if layer is None]
        self.spans = {i: layer_span(gf, i) for i in self.order}
        size = max((e - s for s, e in self.spans.values()), default=0) + 2 * 4096
        self.free = [AlignedBuffer(size) for _ in range(min(n_buffers, max(len(self.order), 1)))]
        self.reader = DirectReader(gf.path, threads=threads, io=io, delay=delay)
        self.pending: dict[int, tuple[AlignedBuffer, Future]] = {}
        self.next = 0  # index into self.order of the next layer to prefetch
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def note(self) -> str:
        return self.reader.note

    def _top_up(self) -> None:
        while self.free and self.order:
            i = self.order[self.next % len(self.order)]
            if i in self.pending:
                break
            buf = self.free.pop()
            start, end = self.spans[i]
            self.pending[i] = (buf, self.reader.read_span(buf, start, end))
            self.next += 1

    def acquire(self, i: int) -> LayerWeights:
        layer = self.layers[i]
        if layer is not None:
            return layer
        if i not in self.pending:
            # Out-of-order request (a new forward started mid-pipeline): drain and restart
            # the prefetch at this layer.
            self._drain()
            self.next = self.order.index(i)
        self._top_up()
        buf, fut = self.pending.pop(i)
        t0 = time.perf_counter()
        try:
            skew = fut.result()
        except BaseException:
            self.free.append(buf)
            raise
        t1 = time.perf_counter()
        start, end = self.spans[i]
        data = torch.frombuffer(buf.mm, dtype=torch.uint8, count=end - start, offset=skew)
        layer = self.builder.build(TensorSource(self.gf, buffer=data, base=start), i)
        self.free.append(buf)  # the build copied everything out of the buffer
        self._top_up()
        self.stats.disk_wait_s += t1 - t0
        self.stats.build_s += time.perf_counter() - t1
        self.stats.disk_bytes += end - start
        self.stats.layers_streamed += 1
        return layer

    def release(self, i: int) -> None:
        pass  # streamed layers are dropped by the engine; their buffers were freed at build

    def _drain(self) -> None:
        for buf, fut in self.pending.values():
            try:
                fut.result()
            except BaseException:
                pass
            self.free.append(buf)
        self.pending.clear()

    def close(self) -> None:
        self._drain()
        self.reader.close()


class MmapLayerStore:
    """The naive baseline: streamed layers are built straight from the memory-mapped file,
    through the page cache, with no prefetch."""

    def __init__(self, gf, builder: LayerBuilder, resident: list[LayerWeights | None]):
        self.gf = gf
        self.builder = builder
        self.layers = resident
        self.stats = StoreStats()
        self.note = "mmap: page-cache reads, no prefetch (baseline)"

    def __len__(self) -> int:
        return len(self.layers)

    def acquire(self, i: int) -> LayerWeights:
        layer = self.layers[i]
        if layer is not None:
            return layer
        t0 = time.perf_counter()
        layer = self.builder.build(TensorSource(self.gf), i)
        self.stats.build_s += time.perf_counter() - t0
        self.stats.layers_streamed += 1
        return layer

    def release(self, i: int) -> None:
        pass

    def close(self) -> None:
        pass
