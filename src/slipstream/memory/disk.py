"""Reading spans of a model file into page-aligned buffers, bypassing the page cache.

O_DIRECT needs the file offset, the length and the buffer address aligned to the device's
block size; anonymous mmap memory is page-aligned, and spans are widened to 4 KiB boundaries.
Where the filesystem refuses O_DIRECT (tmpfs, some overlay filesystems) the reader falls back to
buffered reads and says so once.

The file must not change under a running model: a streamed layer read from a file that was
overwritten in place would silently compute with other weights. So every read is followed by an
fstat of the open descriptor (size and modification time must be those seen at open), and a
CRC-32 of a few sampled pages of each span is compared with the one of the span's first read
(which catches a same-size rewrite on a filesystem whose timestamps are too coarse to show it).
Either mismatch raises `FileChanged`, naming the file. A file deleted (unlinked) while open is
not a change: the descriptor still reads the same bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ..errors import SlipstreamError

ALIGN = 4096
CHUNK = 16 << 20  # one preadv per 16 MiB keeps several requests in flight per span


class DiskReadError(SlipstreamError):
    """Reading weights from the model file failed (I/O error, file truncated or removed)."""


class FileChanged(DiskReadError):
    """The file a model streams its weights from changed on disk while the model was running."""


SAMPLE = 4096  # bytes per sampled page of a span's fingerprint
SAMPLES = 3  # pages per span: its first, middle and last


def file_identity(st: os.stat_result) -> tuple[int, int]:
    """What must not change while a model reads a file: its size and modification time."""
    return st.st_size, st.st_mtime_ns


class FileWatch:
    """The identity of an open file at open time, checked again on demand (one fstat)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.identity = file_identity(os.fstat(fd))

    def check(self, fd: int) -> None:
        now = file_identity(os.fstat(fd))
        if now == self.identity:
            return
        (size0, mtime0), (size1, mtime1) = self.identity, now
        what = (f"was truncated or replaced while running: its size went from {size0} to "
                f"{size1} bytes" if size1 != size0 else
                f"was rewritten while running: modified at {_stamp(mtime1)}, not "
                f"{_stamp(mtime0)} as when it was opened")
        raise FileChanged(f"{self.path} {what}. The model's weights can no longer be trusted: "
                          f"reload it (restart the command or server). To replace a model "
                          f"file, write a new file and rename it over the old one, which "
                          f"running models do not see")


def fingerprint(view: memoryview, start: int, n: int) -> int:
    """CRC-32 of SAMPLES pages of view[start:start + n] (microseconds, whatever n is)."""
    crc = 0
    for k in range(SAMPLES):
        at = start + (n - SAMPLE) * k // max(SAMPLES - 1, 1) if n > SAMPLE else start
        crc = zlib.crc32(view[at:at + min(SAMPLE, n)], crc)
    return crc


class AlignedBuffer:
    """Page-aligned host memory (anonymous mmap) usable for O_DIRECT reads."""

    def __init__(self, nbytes: int):
        self.nbytes = _round_up(max(nbytes, ALIGN), ALIGN)
        self.mm = mmap.mmap(-1, self.nbytes)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        self.mm.close()


def _stamp(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 10**9:09d}Z"


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
        self.watch = FileWatch(self.path, self.fd)  # see FileChanged
        self.fingerprints: dict[tuple[int, int], int] = {}  # (start, n) -> first read's CRC
        self.written: set[tuple[int, int]] = set()  # spans whose CRC came from `expect`
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slipstream-io")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.timing = False  # record each read's interval (for --stats)
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each read
        # --trace: called in the reader thread after each read with (file start, file end,
        # t0, t1) of the bytes asked for; None (the default) costs nothing
        self.on_read: Callable[[int, int, float, float], None] | None = None

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
        self.check_unchanged()  # after the read: a change before or during it shows
        if done < needed:
            raise DiskReadError(f"{self.path.name} ended at byte {base + done} while reading "
                                f"weights up to byte {base + needed}: the file was truncated "
                                f"or replaced while running")
        self._check_fingerprint(buf, base + skew, skew, needed - skew)
        t1 = time.perf_counter()
        with self._lock:
            self.bytes_read += needed - skew
            if self.timing:
                self.intervals.append((t0, t1))
        if self.on_read is not None:
            self.on_read(base + skew, base + needed, t0, t1)
        return skew

    def expect(self, start: int, end: int, crc: int) -> None:
        """Check the first read of file bytes [start, end) too: against `crc`, their
        fingerprint when the file was written (an image file's index records it)."""
        with self._lock:
            self.fingerprints[(start, end - start)] = crc
            self.written.add((start, end - start))

    def check_unchanged(self) -> None:
        """Raise FileChanged if the open file's size or modification time moved since open."""
        self.watch.check(self.fd)

    def _check_fingerprint(self, buf, start: int, at: int, n: int) -> None:
        crc = fingerprint(buf.view, at, n)
        with self._lock:
            first = self.fingerprints.setdefault((start, n), crc)
        if crc != first:
            if (start, n) in self.written:
                raise FileChanged(f"{self.path} changed on disk: bytes {start}..{start + n} "
                                  f"differ from what was written there (same size and "
                                  f"modification time); its weights can no longer be trusted. "
                                  f"Delete it (it is rebuilt at the next load) and reload")
            raise FileChanged(f"{self.path} changed on disk while the model was running: bytes "
                              f"{start}..{start + n} differ from their first read (same size "
                              f"and modification time); its weights can no longer be trusted. "
                              f"Reload the model")

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
