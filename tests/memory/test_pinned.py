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


def test_pin_ahead_locks_the_next_buffer_of_a_kind_at_its_last_size(runtime):
    n_whole, n_split = pinned.EXACT_FROM + 4096, pinned.EXACT_FROM + 8192
    with pinned.PinAhead(torch.device("cpu")) as ahead:
        first = ahead.alloc("whole")(n_whole)  # no size known yet: made on the spot
        ahead.expect("whole")
        ahead.expect("split")  # no split image made yet: nothing to guess
        assert set(ahead.pending) == {"whole"}
        second = ahead.alloc("whole")(n_whole)  # the one locked ahead
        assert second.numel() == n_whole and second.data_ptr() != first.data_ptr()
        made = [c for c in runtime.calls if c[0] == "register"]
        assert len(made) == 2 and made[1][1] == second.data_ptr()
        ahead.expect("whole")
        odd = ahead.alloc("whole")(n_split)  # a guess of the wrong size is not used
        assert odd.numel() == n_split
        ahead.expect("whole")
    assert not ahead.pending  # left pending at the end: dropped
    gc.collect()
    registered = {c[1] for c in runtime.calls if c[0] == "register"}
    unregistered = {c[1] for c in runtime.calls if c[0] == "unregister"}
    live = {first.data_ptr(), second.data_ptr(), odd.data_ptr()}
    assert registered - unregistered == live  # the dropped guesses were unlocked


def test_pin_ahead_resolves_a_bare_cuda_device_on_the_callers_thread(monkeypatch):
    """torch.cuda.set_device refuses a device without an index ("cuda"): the worker is given
    the caller's current index, read when the PinAhead is made."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    ahead = pinned.PinAhead(torch.device("cuda"))
    assert ahead.index == 3
    assert pinned.PinAhead(torch.device("cuda:1")).index == 1
    assert pinned.PinAhead(torch.device("cpu")).index is None
    ahead.__exit__(None, None, None)
