"""Page-locked host buffers of exactly the size asked.

torch's pinned allocations (`pin_memory=True`) go through its caching host allocator, which
rounds every request up to the next power of two before cudaHostAlloc
(ATen/core/CachingHostAllocator.h: `PowerOf2Ceil(size)`): a 70B layer's 472 MiB image pins
512 MiB, and a buffer just past a power of two nearly twice its size, so the pinned tier held
more RAM than the plan counted, and pinning it took as much longer. cudaHostAlloc also faults in and
zeroes every page on one thread inside the driver.

A large buffer here is anonymous memory of its exact size (mmap), its pages first touched by
torch's threads (a parallel fill), then locked with cudaHostRegister; the GPU copies from it
asynchronously and reads it in place as from any pinned buffer (torch counts it as pinned:
cudaPointerGetAttributes says host memory). It is unlocked when the last tensor over it is
freed: the tensor holds the mapping through the buffer protocol, and the mapping unregisters
itself before it is unmapped. Small buffers keep torch's allocator, whose rounding costs little
there and which recycles them.
"""

from __future__ import annotations

import ctypes
import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

# Below this the caching allocator's rounding wastes at most this much per buffer. Low enough
# that the small test models' layer images (1-3 MiB: the default model's) are registered too,
# so the GPU suite's streaming tests run this path and not only the large models.
EXACT_FROM = 1 << 20


def _cudart():
    """torch's CUDA runtime bindings (a function, so that tests can stand in for them)."""
    return torch.cuda.cudart()


class _LockedMapping(mmap.mmap):
    """Anonymous memory page-locked by cudaHostRegister while `locked_at` is set."""

    locked_at: int | None = None

    def __del__(self) -> None:
        # runs when the last tensor over the mapping is gone, before the mapping is unmapped
        if self.locked_at is not None:
            try:
                _cudart().cudaHostUnregister(self.locked_at)
            except Exception:  # the CUDA runtime may be unloading at interpreter exit
                pass
            self.locked_at = None


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error after a failed registration: torch checks it after
    each kernel launch (cudaGetLastError), and would raise the stale error there. torch binds
    no cudaGetLastError, so it is called in the runtime library this process has loaded."""
    try:
        with open("/proc/self/maps") as maps:
            lib = next(line.split()[-1] for line in maps if "libcudart.so" in line)
        ctypes.CDLL(lib).cudaGetLastError()
    except (OSError, StopIteration):
        pass


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` bytes, page-locked for CUDA copies (see the module
    doc); torch's pinned allocator where registering fails (a locked-memory limit, say)."""
    if nbytes < EXACT_FROM:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mapping = _LockedMapping(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where the kernel has them to give: a 472 MiB image is 236 faults and
        # entries to lock rather than 120,000 (a 4 KiB fault each where it has not)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    host.zero_()  # the page faults on torch's threads, not in the driver's one
    if int(_cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)) != 0:
        _clear_last_error()
        del host
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mapping.locked_at = host.data_ptr()
    return host


class PinAhead:
    """Locks the next buffer while the caller builds what goes into it: one thread of its own
    runs pinned_empty (touching pages and registering them: host work, which the GPU's build of
    the next layer and the file reads it waits on do not need), for a buffer of `kind` sized as
    the last one of that kind (a model's streamed layers come in one or two sizes: whole, and
    split with the CPU). A guess of the wrong size is dropped and the buffer made on the spot."""

    def __init__(self, device: torch.device):
        self.device = device
        # the index, resolved on the caller's thread: torch.cuda.set_device refuses a bare
        # "cuda", and a new thread's current device is the first, not the caller's
        self.index = (device.index if device.index is not None else torch.cuda.current_device()
                      ) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-pin")
        self.sizes: dict[object, int] = {}
        self.pending: dict[object, tuple[int, Future]] = {}

    def _lock(self, nbytes: int) -> torch.Tensor:
        if self.index is not None:
            torch.cuda.set_device(self.index)
        return pinned_empty(nbytes)

    def expect(self, kind: object) -> None:
        """Start locking a buffer for the next image of `kind`, where one has been made."""
        n = self.sizes.get(kind)
        if n is not None and kind not in self.pending:
            self.pending[kind] = (n, self.pool.submit(self._lock, n))

    def alloc(self, kind: object) -> Callable[[int], torch.Tensor]:
        """The buffer maker for an image of `kind` (weights.image.to_image's `alloc`)."""
        def make(nbytes: int) -> torch.Tensor:
            self.sizes[kind] = nbytes
            ahead = self.pending.pop(kind, None)
            if ahead is not None:
                size, done = ahead
                host = done.result()
                if size == nbytes:
                    return host
            return pinned_empty(nbytes)
        return make

    def __enter__(self) -> "PinAhead":
        return self

    def __exit__(self, *exc) -> None:
        for _, done in self.pending.values():
            done.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)
