"""Where a load's seconds go: the wall time of each phase of `slipstream.load`, in the order
they ran, for `bench --json` (`load_phases`) and `model.load_phases`.

A 70B at a 24 GiB budget loads in 26-60 s where llama.cpp maps the file and copies its GPU
layers; the phases (planning, the links' probes, pinning the streamed layers, the resident
weights, the CPU's packed image, the store) say which part to overlap or cut. CUDA work is
asynchronous: a phase that ends with kernels queued is charged to the next phase that waits
on them, so the clock synchronises the device at each phase's end (a few microseconds per
phase, a dozen phases per load)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class LoadClock:
    """Seconds per named phase; a phase timed twice adds up."""

    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.phases.items()}


@contextmanager
def maybe(clock: LoadClock | None, name: str) -> Iterator[None]:
    """`clock.phase(name)`, or nothing without a clock (callers outside `load`)."""
    if clock is None:
        yield
    else:
        with clock.phase(name):
            yield
