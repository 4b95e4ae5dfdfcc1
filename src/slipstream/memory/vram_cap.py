"""A VRAM budget kept by the CUDA caching allocator itself.

The planner sizes everything a model allocates, but the allocator may keep freed blocks cached
next to new ones: on the H200 a 70B loaded at a 24 GiB budget allocated at most 22.7 GiB and
still reserved 24.02 GiB. A per-process memory fraction makes the allocator give its cache back
and retry before it would grow past the budget, so the budget holds for reserved memory, which is
what `torch.cuda.max_memory_reserved` reports and what other processes cannot use.

The fraction is per device and process-wide. The newest live model on a device sets it: what the process held before that
model loaded plus its budget, or no cap when it was loaded without a budget. When it is freed,
the cap of the model loaded before it (if any still lives) comes back.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_limits: dict[int, tuple[int, int]] = {}  # live models' (device index, cap on reserved bytes)
_keys = itertools.count()


class VramCap:
    """The cap of one model being loaded; `attach` ties it to the model's lifetime."""

    def __init__(self, device: torch.device, budget: int | None):
        # the fraction is set per device and torch wants its index ("cuda" alone is refused)
        index = torch.cuda.current_device() if device.index is None else device.index
        device = self.device = torch.device("cuda", index)
        total = torch.cuda.mem_get_info(device)[1]
        self.total = total
        self.limit = total if budget is None else \
            min(total, torch.cuda.memory_reserved(device) + budget)
        self.key = next(_keys)
        _limits[self.key] = (index, self.limit)
        _apply(device, total)

    def attach(self, owner: object) -> None:
        weakref.finalize(owner, _release, self.key, self.device, self.total)

    def grow(self, extra: int) -> None:
        """Let the model reserve `extra` bytes more (a draft's headroom, once the draft is
        gone: the cap then equals the model's own budget)."""
        if self.key not in _limits:
            return
        self.limit = min(self.total, self.limit + extra)
        _limits[self.key] = (self.device.index, self.limit)
        _apply(self.device, self.total)

    def release(self) -> None:
        _release(self.key, self.device, self.total)


def _release(key: int, device: torch.device, total: int) -> None:
    if _limits.pop(key, None) is not None:
        _apply(device, total)


def _apply(device: torch.device, total: int) -> None:
    # the newest live model's cap on this device: its base already counts what older ones hold
    mine = [key for key, (index, _) in _limits.items() if index == device.index]
    limit = _limits[max(mine)][1] if mine else total
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
