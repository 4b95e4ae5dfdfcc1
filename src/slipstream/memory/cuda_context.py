"""Device memory a process holds outside the CUDA caching allocator.

The CUDA context, the modules of the kernels it loads (torch's, cuBLAS's, Triton's) and the
driver's own buffers are counted for the process by the driver (nvidia-smi, and so llama.cpp's
"max memory used") but not by `torch.cuda.memory_reserved`. A `--vram-budget` is what the
process holds on the device as the driver counts it, so this comes out of it before anything is
planned: on an H100 host a 70B loaded at 24 GiB reserved 23.33 GiB and the driver
counted 24.10 GiB, 0.77 GiB of context over the budget.

The context grows after planning, as kernels load on first use, so a measurement before the
first model loads is a lower bound: CONTEXT_FLOOR is what the H100 host held at the end of a
70B decode (0.77 GiB in each of two loads), with a little room.
"""

from __future__ import annotations

import torch

CONTEXT_FLOOR = 820 << 20  # bytes: 0.80 GiB (0.77 GiB measured at the end of a decode)
# more than this outside the allocator is other processes' memory on a shared device
CONTEXT_CEILING = 3 << 30


_measured: dict[int, int] = {}  # device index: bytes, once per process


def outside_allocator_bytes(device: torch.device) -> int:
    """Bytes the driver will count for this process beyond what its allocator reserves: the
    larger of what the device holds outside the allocator when first asked and CONTEXT_FLOOR.
    Measured once per device and process, so that every budget of a process (a draft's, the
    model's, a test's or benchmark's budget for a given plan) is cut by the same amount.

    The device's use is this process's only while it is alone there: the driver tells no
    process's own use without NVML, and NVML numbers devices otherwise than CUDA does under
    CUDA_VISIBLE_DEVICES."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _measured:
        free, total = torch.cuda.mem_get_info(torch.device("cuda", index))
        measured = total - free - torch.cuda.memory_reserved(torch.device("cuda", index))
        if measured > CONTEXT_CEILING:  # other processes' memory, not this context's
            measured = 0
        _measured[index] = max(measured, CONTEXT_FLOOR)
    return _measured[index]
