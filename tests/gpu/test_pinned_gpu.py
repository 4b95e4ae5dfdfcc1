"""Exactly sized page-locked buffers on a GPU: torch counts them as pinned, and copies to and
from them asynchronously give the bytes back (their lifetime: tests/memory/test_pinned.py)."""

from __future__ import annotations

import pytest
import torch

from slipstream.memory.pinned import EXACT_FROM, pinned_empty

pytestmark = pytest.mark.gpu


def test_registered_buffer_is_pinned_and_copies_asynchronously():
    n = EXACT_FROM + 4096 * 3 + 17
    host = pinned_empty(n)
    assert host.is_pinned() and host.numel() == n
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
