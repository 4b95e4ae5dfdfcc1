"""A CUDA load's layers read from the file into page-locked staging, the next layer's read
going on while the current one is built: the builder's copies to the GPU then come from
locked pages, not from the memory map.

Built from the map, a layer's tensors were copied to the GPU tensor by tensor from pageable
memory: the driver stages such copies itself, and every page of the map is faulted in on the
way. On the device's host a warm load of a 70B at 24 GiB spent 13.4 s building its 42
resident layers (20 GB) and 16.3 s its 38 pinned ones, where llama.cpp loaded its 46 GPU
layers in 9.8 s. Here each layer's span of the file is read with a few parallel preads (16 MiB
each) into one of two locked buffers, and its tensors are views of that buffer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..errors import GGUFError
from ..model.families import file_spec
from ..modelfile.gguf_file import GGUFFile
from ..weights.source import TensorSource, layer_span
from .pinned import pinned_empty

CHUNK = 16 << 20  # bytes per pread: several in flight per layer
READERS = 4  # threads reading one layer's chunks side by side
SPAN_SLACK = 16 << 20  # bytes a layer's span may hold beyond twice its tensors' (`compact`)


class StagedLayers:
    """TensorSources over staged copies of layers' file bytes, in the order asked, each
    valid until the next one is taken: the caller builds layer i from its source, and the
    builder's host-to-device copies from it are done (synchronised here) before its buffer is
    read into again."""

    def __init__(self, gf: GGUFFile, layers: Iterable[int], device: torch.device):
        self.gf, self.device = gf, device
        self.layers = list(layers)
        self.spans = {i: layer_span(gf, i) for i in self.layers}
        size = max((end - start for start, end in self.spans.values()), default=0)
        # locked for a GPU's copies; plain for the CPU's
        alloc = pinned_empty if device.type == "cuda" else \
            (lambda n: torch.empty(n, dtype=torch.uint8))
        self.buffers = [alloc(size) for _ in range(min(2, len(self.layers)))]
        self.pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="slipstream-load")
        self.fd = os.open(gf.path, os.O_RDONLY)

    def _read(self, i: int, buffer: torch.Tensor) -> list[Future]:
        start, end = self.spans[i]
        view = memoryview(buffer.numpy())
        return [self.pool.submit(self._chunk, view, at, min(at + CHUNK, end - start), start)
                for at in range(0, end - start, CHUNK)]

    def _chunk(self, view: memoryview, a: int, b: int, base: int) -> None:
        while a < b:
            got = os.preadv(self.fd, [view[a:b]], base + a)
            if got <= 0:
                raise GGUFError(f"{self.gf.path.name}: the file ends at byte {base + a}, inside "
                                f"a layer's tensors: truncated while loading")
            a += got

    def __iter__(self) -> Iterator[tuple[int, TensorSource]]:
        if not self.layers:
            return
        pending = self._read(self.layers[0], self.buffers[0])
        for k, i in enumerate(self.layers):
            for f in pending:
                f.result()
            if self.device.type == "cuda":
                # the layer before this one was built from the other buffer: its copies done
                torch.cuda.synchronize(self.device)
            if k + 1 < len(self.layers):
                pending = self._read(self.layers[k + 1], self.buffers[(k + 1) % 2])
            start, end = self.spans[i]
            yield i, TensorSource(self.gf, self.buffers[k % 2][:end - start], start)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.buffers = []

    def __enter__(self) -> "StagedLayers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compact(gf: GGUFFile, layers: Iterable[int]) -> bool:
    """Whether each layer's tensors lie together in the file: its span at most twice their
    bytes and SPAN_SLACK. A file that interleaves layers would have every span reach across
    others, and a staging buffer as large; its layers are built from the map instead."""
    for i in layers:
        start, end = layer_span(gf, i)
        held = sum(gf.tensors[n].n_bytes for n in file_spec(gf).names(i, gf.tensors))
        if end - start > 2 * held + SPAN_SLACK:
            return False
    return True


def staged_sources(gf: GGUFFile, layers: Iterable[int], device: torch.device, staged: bool = True
                   ) -> Iterator[tuple[int, TensorSource]]:
    """(i, source) for each of `layers`: staged (StagedLayers) where `staged`, the model is
    dense and the file keeps each layer's tensors together (`compact`), else the
    memory-mapped file's. A mixture of experts' layers stay views of the map: its experts are
    placed from them one by one, some after the build, which a reused buffer would not hold."""
    layers = list(layers)
    if not staged or file_spec(gf).experts is not None or not compact(gf, layers):
        src = TensorSource(gf)
        yield from ((i, src) for i in layers)
        return
    with StagedLayers(gf, layers, device) as reads:
        yield from reads
