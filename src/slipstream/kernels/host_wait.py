"""A stream waits for the host: `wait_host_flag(flag, target)` enqueues a one-program kernel that
spins until a pinned host counter reaches `target`, so that work queued behind it on the stream
starts once the host says so, without the host waiting to enqueue it.

Hybrid decode needs this (hybrid.host_io.HostIO): the GPU's next layer depends on the CPU's
share of the last one. With CUDA events alone, the host would have to wait for the CPU's result
before enqueueing anything after it (an event recorded later cannot be waited on earlier), and
the Python launching the next layers would sit on the critical path of every split layer.

The counter lives in pinned host memory, which the GPU reads over PCIe (unified addressing);
each load is volatile so that it goes to memory every time. A spin that outlasts `timeout_s`
by the GPU's own clock (%globaltimer: a host thread that died) gives up and sets `failed[0]`,
so a stuck host shows up as an error rather than a GPU that never finishes. The bound is a time,
not a count of loads: on the H200, work behind a spin of 2^24 loads ran before a host that bumped
the flag 0.2 s later, where the spin was meant to last tens of seconds.

`send_to_host(src, dst, flag, seq)` is the other direction: the input written into pinned host
memory and a flag raised after it, in stream order, for a host thread polling in native code.

`wait_host_add(flag, target, failed, host, partial)` is the same wait fused with what hybrid
decode does after it: the kernel reads the host's result straight from pinned memory and adds it
to the GPU's partial sum. Without it a small host-to-device copy sits between the wait and the
add, on a link the ring's layer copies keep busy, and every split layer pays for it on the
critical path (hybrid.host_io.HostIO).
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
def _spin(flag_ptr, target, timeout_ns):
    """Spin until flag >= target or timeout_ns pass by the GPU's clock; the flag's last value."""
    start = _now_ns()
    waited = start - start  # an int64 zero, as the loop reassigns it
    seen = tl.load(flag_ptr, volatile=True)
    while (seen < target) & (waited < timeout_ns):
        seen = tl.load(flag_ptr, volatile=True)
        waited = _now_ns() - start
    return seen


@triton.jit
def _wait_kernel(flag_ptr, target, failed_ptr, timeout_ns):
    if _spin(flag_ptr, target, timeout_ns) < target:
        tl.store(failed_ptr, 1)


@triton.jit
def _wait_add_kernel(flag_ptr, target, failed_ptr, timeout_ns, host_ptr, part_ptr, out_ptr, n,
                     BLOCK: tl.constexpr):
    # every program spins on the flag itself: no program may read the host's buffer before
    # the host has finished writing it
    if _spin(flag_ptr, target, timeout_ns) < target:
        tl.store(failed_ptr, 1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # volatile: the host rewrites this buffer every token, and the GPU must not serve a line
    # it read before
    h = tl.load(host_ptr + offs, mask=mask, volatile=True)
    p = tl.load(part_ptr + offs, mask=mask)
    # torch's `partial + host.to(partial.dtype)`: the host's value rounded to partial's type,
    # the sum taken in float32 and rounded once
    y = p.to(tl.float32) + h.to(p.dtype).to(tl.float32)
    tl.store(out_ptr + offs, y.to(p.dtype), mask=mask)


def wait_host_flag(flag: torch.Tensor, target: int, failed: torch.Tensor,
                   timeout_s: float = TIMEOUT_S) -> None:
    """Enqueue on the current stream: spin until flag[0] (int64, pinned host) >= target;
    failed (int32, on the device) is set to 1 if that takes longer than timeout_s."""
    _wait_kernel[(1,)](flag, target, failed, int(timeout_s * 1e9), num_warps=1)


ADD_BLOCK = 2048
SEND_BLOCK = 2048


@triton.jit
def _fence_sys():
    """This thread's earlier stores performed for the whole system (the host included) before
    its later ones (PTX membar.sys)."""
    return tl.inline_asm_elementwise("membar.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _send_kernel(src_ptr, dst_ptr, n, flag_ptr, seq, BLOCK: tl.constexpr):
    # one program: every thread stores its part, fences, and only after the barrier that
    # follows does the flag go out, so the host never sees the flag before the values
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        o = start + offs
        m = o < n
        x = tl.load(src_ptr + o, mask=m)
        tl.store(dst_ptr + o, x.to(tl.float32), mask=m)
    _fence_sys()
    tl.debug_barrier()
    tl.store(flag_ptr, seq)


def send_to_host(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor, seq: int) -> None:
    """Enqueue on the current stream: dst (float32, pinned host, contiguous) = src as float32,
    then flag[0] (int64, pinned host) = seq, the flag written only once every value is in host
    memory. The host's side polls the flag (native ss_q4_ffn_on_signal) instead of querying a
    CUDA event behind a copy, which needs Python (SLIPSTREAM_HOST_SIGNAL=1)."""
    if dst.shape != src.shape or dst.dtype != torch.float32 or not dst.is_contiguous():
        raise ValueError(f"the host's buffer must be float32, contiguous and of the input's "
                         f"shape {tuple(src.shape)}, not {dst.dtype} {tuple(dst.shape)}")
    src = src.contiguous()
    _send_kernel[(1,)](src, dst, src.numel(), flag, seq, BLOCK=SEND_BLOCK, num_warps=4)


def wait_host_add(flag: torch.Tensor, target: int, failed: torch.Tensor, host: torch.Tensor,
                  partial: torch.Tensor, timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    """Enqueue on the current stream: wait as wait_host_flag does, then return
    partial + host.to(partial.dtype), reading host (float32, pinned, contiguous, partial's
    shape) straight from host memory once the flag says it is written."""
    if host.shape != partial.shape or host.dtype != torch.float32 or not host.is_contiguous():
        raise ValueError(f"the host's buffer must be float32, contiguous and of the partial "
                         f"sum's shape {tuple(partial.shape)}, not {host.dtype} "
                         f"{tuple(host.shape)}")
    partial = partial.contiguous()
    out = torch.empty_like(partial)
    n = partial.numel()
    _wait_add_kernel[(triton.cdiv(n, ADD_BLOCK),)](flag, target, failed, int(timeout_s * 1e9),
                                                   host, partial, out, n, BLOCK=ADD_BLOCK,
                                                   num_warps=4)
    return out
