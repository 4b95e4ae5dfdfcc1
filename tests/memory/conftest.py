"""CUDA streams and events faked as already complete, so the CUDA store's bookkeeping runs on
the CPU: copies are then synchronous, so tests check which bytes land where, not the GPU-side
ordering (tests/gpu does that)."""

from __future__ import annotations

import contextlib

import pytest
import torch


class FakeEvent:
    def __init__(self, enable_timing: bool = False):
        self.recorded = 0

    def record(self, stream=None) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.25


class FakeStream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.Event is FakeEvent while this is on."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
