"""A stream waits for the host: `wait_host_flag(flag, target)` enqueues a one-program kernel that
spins until a pinned host counter reaches `target`, so that work queued behind it on the stream
starts once the host says so, without the host waiting to enqueue it.

Hybrid decode needs this (weights.hybrid.HostIO): the GPU's next layer depends on the CPU's
share of the last one. With CUDA events alone, the host would have to wait for the CPU's result
before enqueueing anything after it (an event recorded later cannot be waited on earlier), and
the Python launching the next layers would sit on the critical path of every split layer.

The counter lives in pinned host memory, which the GPU reads over PCIe (unified addressing);
each load is volatile so that it goes to memory every time. A spin that outlasts `max_spins`
loads (seconds: a host thread that died) gives up and sets `failed[0]`, so a stuck host shows up
as an error rather than a GPU that never finishes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPINS = 1 << 24  # volatile loads over PCIe (about a microsecond each): tens of seconds


@triton.jit
def _wait_kernel(flag_ptr, target, failed_ptr, max_spins):
    seen = tl.load(flag_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < max_spins):
        seen = tl.load(flag_ptr, volatile=True)
        spins += 1
    if seen < target:
        tl.store(failed_ptr, 1)


def wait_host_flag(flag: torch.Tensor, target: int, failed: torch.Tensor,
                   max_spins: int = MAX_SPINS) -> None:
    """Enqueue on the current stream: spin until flag[0] (int64, pinned host) >= target;
    failed (int32, on the device) is set to 1 if it gives up."""
    _wait_kernel[(1,)](flag, target, failed, max_spins, num_warps=1)
