"""Bandwidth probes: what the links weights cross do on this machine now.

The planner predicts a streamed model's speed from these (memory.setup.measure_bandwidths), and
the benchmarks report achieved rates against them. Memory read (a sum on CPU, a device copy on
CUDA), pinned host-to-device copies, and sequential reads of file spans through the streaming
reader (O_DIRECT, so a file just written is read from the disk, not the page cache).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from .disk import AlignedBuffer, DirectReader


def memory_read_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Read bandwidth of the memory the weights live in: a sum over a buffer larger than cache
    on CPU, a device-to-device copy (bytes read + written) on CUDA."""
    a = torch.ones(nbytes // 4, device=device)
    if device.type == "cuda":
        b = torch.empty_like(a)
        t = min(_timed_fn(device, lambda: b.copy_(a)) for _ in range(5))
        del a, b
        torch.cuda.empty_cache()
        return 2 * nbytes / t / 1e9
    t = min(_timed_fn(device, lambda: a.sum()) for _ in range(5))
    return nbytes / t / 1e9


def h2d_pinned_gbps(nbytes: int = 256 << 20, reps: int = 4) -> float:
    """Pinned host-to-device copy bandwidth (CUDA), the tier-B streaming link."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")

    def copies() -> None:
        for _ in range(reps):
            dev.copy_(host, non_blocking=True)

    dev.copy_(host, non_blocking=True)  # warm-up
    t = _timed_fn(torch.device("cuda"), copies)
    host = dev = None
    torch.cuda.empty_cache()  # probe buffers must not stay reserved under a VRAM budget
    return reps * nbytes / t / 1e9


def span_read_gbps(path, spans: list[tuple[int, int]], io: str = "direct",
                   limit: int | None = None) -> tuple[float, str]:
    """GB/s of reading `spans` of a file in order, one read at a time (whole spans, until
    `limit` bytes), through the streaming reader: O_DIRECT bypasses the page cache, so it
    measures the disk even when the file was just written. Returns (GB/s, the read mode:
    "direct", or "buffered" where asked for or where the filesystem refused O_DIRECT)."""
    reader = DirectReader(path, threads=1, io=io)
    buf = AlignedBuffer(max(e - s for s, e in spans) + 8192)
    try:
        total, t0 = 0, time.perf_counter()
        for s, e in spans:
            reader.read_span(buf, s, e).result()
            total += e - s
            if limit is not None and total >= limit:
                break
        return total / (time.perf_counter() - t0) / 1e9, reader.mode
    finally:
        reader.close()
        buf.close()


def disk_read_gbps(path, nbytes: int = 4 << 30, block: int = 256 << 20) -> tuple[float, str]:
    """O_DIRECT sequential read bandwidth over a file's first `nbytes`, in `block`-sized reads
    (each issued as the reader's 16 MiB preadv chunks, like dd on one thread)."""
    size = min(nbytes, os.path.getsize(path))
    return span_read_gbps(path, [(s, min(s + block, size)) for s in range(0, size, block)])


def _timed_fn(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
