"""Exactly sized page-locked buffers (memory.pinned): the CUDA runtime's register and unregister
stood in for, so that the sizes, the zeroed pages and the lifetime are checked on any machine
(tests/gpu/test_pinned_gpu.py pins for real)."""

from __future__ import annotations

import gc

import pytest
import torch

from slipstream.memory import pinned


class FakeRuntime:
    def __init__(self, register_result: int = 0):
        self.calls: list[tuple] = []
        self.register_result = register_result

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, nbytes))
        return self.register_result

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def runtime(monkeypatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    return fake


def test_a_large_buffer_is_its_exact_size_zeroed_and_registered(runtime):
    n = pinned.EXACT_FROM + 12345  # torch's allocator would pin 2 * EXACT_FROM
    host = pinned.pinned_empty(n)
    assert host.dtype == torch.uint8 and host.numel() == n
    assert int(host.count_nonzero()) == 0
    assert runtime.calls == [("register", host.data_ptr(), n)]


def test_it_is_unregistered_once_after_its_last_view(runtime):
    host = pinned.pinned_empty(pinned.EXACT_FROM)
    ptr = host.data_ptr()
    view = host[4096:8192]
    del host
    gc.collect()
    assert ("unregister", ptr) not in runtime.calls  # the view still reads the pages
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096
    del view
    gc.collect()
    assert runtime.calls.count(("unregister", ptr)) == 1


def test_a_failed_registration_falls_back_to_torchs_allocator(monkeypatch):
    fake = FakeRuntime(register_result=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    cleared, made = [], []
    monkeypatch.setattr(pinned, "_clear_last_error", lambda: cleared.append(True))

    def torch_pinned(n, dtype, pin_memory):
        made.append((n, pin_memory))
        return torch.zeros(n, dtype=dtype)

    monkeypatch.setattr(pinned.torch, "empty", torch_pinned)
    host = pinned.pinned_empty(pinned.EXACT_FROM)
    assert made == [(pinned.EXACT_FROM, True)] and host.numel() == pinned.EXACT_FROM
    assert cleared == [True]  # the runtime's last error reset, or torch would raise it later
    gc.collect()
    assert not any(c[0] == "unregister" for c in fake.calls)  # nothing was registered
