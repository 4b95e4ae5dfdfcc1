"""Reading spans of a model file into page-aligned buffers, bypassing the page cache.

O_DIRECT needs the file offset, the length and the buffer address aligned to the device's
block size; anonymous mmap memory is page-aligned, and spans are widened to 4 KiB boundaries.
Where the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the reader falls back to
buffered reads and says so once.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..errors import SlipstreamError

ALIGN = 4096
CHUNK = 16 << 20  # one preadv per 16 MiB keeps several requests in flight per span


class DiskReadError(SlipstreamError):
    """Reading weights from the model file failed (I/O error, file truncated or removed)."""


class AlignedBuffer:
    """Page-aligned host memory (anonymous mmap) usable for O_DIRECT reads."""

    def __init__(self, nbytes: int):
        self.nbytes = _round_up(max(nbytes, ALIGN), ALIGN)
        self.mm = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        self.mm.close()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class DirectReader:
    def __init__(self, path: str | Path, threads: int = 2, io: str = "direct",
                 delay: Callable[[], None] | None = None):
        self.path = Path(path)
        self.delay = delay  # test hook: called in the reader thread before each read
        self.mode = "buffered"
        self.note = ""
        self.fd = -1
        if io == "direct" and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                self.mode = "direct"
            except OSError as e:
                self.note = f"O_DIRECT refused ({e.strerror}); using buffered reads"
        elif io == "direct":
            self.note = "this OS has no O_DIRECT; using buffered reads"
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slipstream-io")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.timing = False  # record each read's interval (for --stats)
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each read

    def read_span(self, buf, start: int, end: int,
                  before: Callable[[], None] | None = None) -> Future:
        """Read file bytes [start, end) into buf (anything with a writable, page-aligned
        memoryview `.view` and `.nbytes`); the future's result is the offset of `start` inside
        buf (the span is widened down to an aligned offset). `before` runs in the reader thread
        first: the CUDA tier waits there until the buffer's last host-to-device copy is done."""
        base = start // ALIGN * ALIGN
        length = _round_up(end - base, ALIGN)
        if length > buf.nbytes:
            raise ValueError(f"span of {length} bytes does not fit a {buf.nbytes}-byte buffer")
        return self.pool.submit(self._read, buf, base, length, end - base, start - base, before)

    def _read(self, buf, base: int, length: int, needed: int, skew: int,
              before: Callable[[], None] | None = None) -> int:
        if before is not None:
            before()
        done = 0
        t0 = time.perf_counter()
        try:
            if self.delay is not None:
                self.delay()
            while done < length:
                n = min(CHUNK, length - done)
                got = os.preadv(self.fd, [buf.view[done:done + n]], base + done)
                if got == 0:
                    break
                done += got
                if got < n:  # end of file inside this chunk
                    break
        except OSError as e:
            if self.mode == "direct" and e.errno == 22 and done == 0:  # EINVAL: no O_DIRECT here
                self._fall_back(e)
                return self._read(buf, base, length, needed, skew)
            raise DiskReadError(f"reading {self.path.name} at byte {base + done} failed: "
                                f"{e.strerror}; check the disk, or keep more layers in RAM "
                                f"(--ram-budget)") from None
        if done < needed:
            raise DiskReadError(f"{self.path.name} ended at byte {base + done} while reading "
                                f"weights up to byte {base + needed}: the file was truncated "
                                f"or replaced while running")
        with self._lock:
            self.bytes_read += needed - skew
            if self.timing:
                self.intervals.append((t0, time.perf_counter()))
        return skew

    def busy_seconds(self) -> float:
        """Wall time during which at least one read was running, since the last call (the
        union of the reads' intervals: two threads reading at once count once)."""
        with self._lock:
            spans, self.intervals = sorted(self.intervals), []
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    def _fall_back(self, err: OSError) -> None:
        with self._lock:
            if self.mode != "direct":
                return
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_RDONLY)
            self.mode = "buffered"
            self.note = f"O_DIRECT reads refused ({err.strerror}); using buffered reads"

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
