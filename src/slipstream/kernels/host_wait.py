"""A stream waits for the host: `wait_host_flag(flag, target)` enqueues a one-program kernel that
spins until a pinned host counter reaches `target`, so that work queued behind it on the stream
starts once the host says so, without the host waiting to enqueue it.

Hybrid decode needs this (weights.hybrid.HostIO): the GPU's next layer depends on the CPU's
share of the last one. With CUDA events alone, the host would have to wait for the CPU's result
before enqueueing anything after it (an event recorded later cannot be waited on earlier), and
the Python launching the next layers would sit on the critical path of every split layer.

The counter lives in pinned host memory, which the GPU reads over PCIe (unified addressing);
each load is volatile so that it goes to memory every time. A spin that outlasts `timeout_s`
by the GPU's own clock (%globaltimer: a host thread that died) gives up and sets `failed[0]`,
so a stuck host shows up as an error rather than a GPU that never finishes. The bound is a time,
not a count of loads: on the H200, work behind a spin of 2^24 loads ran before a host that bumped
the flag 0.2 s later (session 18), where the spin was meant to last tens of seconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TIMEOUT_S = 60.0  # far beyond any CPU share of a layer (milliseconds), short of a hang


@triton.jit
def _now_ns():
    """The GPU's global nanosecond clock."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _wait_kernel(flag_ptr, target, failed_ptr, timeout_ns):
    start = _now_ns()
    waited = start - start  # an int64 zero, as the loop reassigns it
    seen = tl.load(flag_ptr, volatile=True)
    while (seen < target) & (waited < timeout_ns):
        seen = tl.load(flag_ptr, volatile=True)
        waited = _now_ns() - start
    if seen < target:
        tl.store(failed_ptr, 1)


def wait_host_flag(flag: torch.Tensor, target: int, failed: torch.Tensor,
                   timeout_s: float = TIMEOUT_S) -> None:
    """Enqueue on the current stream: spin until flag[0] (int64, pinned host) >= target;
    failed (int32, on the device) is set to 1 if that takes longer than timeout_s."""
    _wait_kernel[(1,)](flag, target, failed, int(timeout_s * 1e9), num_warps=1)
