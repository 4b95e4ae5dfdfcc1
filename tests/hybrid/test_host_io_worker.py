"""hybrid.host_io.HostIO's run-ahead worker thread, as CUDA runs it, on the CPU: its CUDA parts
(the pinned counter the GPU's wait reads, the input's copy-down event) stood in for by a CPU
counter and an event object, the thread, its job queue and its error handling HostIO's own.

A share that raises surfaces as its own exception (chained, its type, layer and traceback in
the message); a share slow to get its input is named, with where its time went, in the
message of a GPU wait that gave up on it; no input event is released by the worker (on CUDA
that is a cudaEventDestroy, which can wait for a GPU that is waiting for the worker)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from slipstream.hybrid.host_io import CpuShareError, EventPool, HostIO

HIDDEN = 8


class _Event:
    """A CUDA event whose query() is True `delay_s` after it was recorded (the input's copy
    down)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.record()

    def record(self) -> None:
        self.ready_at = time.perf_counter() + self.delay_s

    def query(self) -> bool:
        return time.perf_counter() >= self.ready_at


class _Share:
    """A layer's CPU share: out := 2 h, or the exception it is given."""

    def __init__(self, layer: int, error: BaseException | None = None):
        self.layer, self.error, self.slot, self.nbytes = layer, error, 0, 64

    def compute_into(self, h: torch.Tensor, out: torch.Tensor, scratch) -> None:
        if self.error is not None:
            raise self.error
        out.copy_(2 * h)


def _run_ahead(io: HostIO) -> HostIO:
    """io's worker state as on CUDA: a counter in (unpinned) host memory, no shares yet."""
    io._flag = torch.zeros(1, dtype=torch.int64)
    io._failed = torch.zeros(1, dtype=torch.int32)
    io._seq = 0
    io._init_worker()
    return io


def _hand(io: HostIO, share: _Share, delay_s: float = 0.0) -> int:
    """send + finish's hand-off: the input in the pinned buffer, the job to the worker."""
    io._in[0][:1].copy_(torch.full((1, HIDDEN), float(share.layer)))
    io._rows[0] = 1
    io._sent[0] = _Event(delay_s)
    return io._submit(share)


def _drain(io: HostIO) -> None:
    io._stop_worker()


def test_a_failing_share_raises_its_own_exception_with_its_traceback():
    io = _run_ahead(HostIO(torch.device("cpu"), HIDDEN, 1, keep_warm=False))
    # the first share's input lands 0.3 s late, so the worker is still waiting for it when
    # the others are handed over (a failure it had already met would raise at the hand-off)
    seq = [_hand(io, _Share(2), delay_s=0.3),
           _hand(io, _Share(3, KeyError("expert 7 not held"))), _hand(io, _Share(4))]
    _drain(io)
    # every job bumped the counter (the GPU's waits end), the failing one and those after too
    assert int(io._flag[0]) == seq[-1]
    with pytest.raises(CpuShareError) as info:
        io.check()
    err = info.value
    assert isinstance(err.__cause__, KeyError)
    text = str(err)
    assert "KeyError" in text and "expert 7 not held" in text
    assert "layer 3's share, job 2" in text
    assert "in compute_into" in text  # the worker's traceback, down to the raising frame
    io.check()  # raised once


def test_a_share_slow_to_get_its_input_is_named_when_a_wait_gives_up():
    io = _run_ahead(HostIO(torch.device("cpu"), HIDDEN, 1, keep_warm=False))
    _hand(io, _Share(0))
    _hand(io, _Share(1), delay_s=0.2)
    _hand(io, _Share(2))
    _drain(io)
    io.check()  # nothing raised
    slow = io.slowest
    assert slow is not None and slow.layer == 1 and slow.seq == 2
    assert slow.input_s >= 0.15 and slow.compute_s < 0.1  # the event made 0.2 s before
    assert torch.equal(io._out[0][:1], torch.full((1, HIDDEN), 4.0))  # the last share's 2 h
    msg = io.gave_up_message()
    assert "layer 1's share (job 2)" in msg and "waiting for its input's copy down" in msg


def test_the_worker_thread_is_stopped_by_its_drain():
    io = _run_ahead(HostIO(torch.device("cpu"), HIDDEN, 1, keep_warm=False))
    _hand(io, _Share(0))
    worker = io._worker
    assert isinstance(worker, threading.Thread)
    _drain(io)
    assert not worker.is_alive() and io._worker is None


def test_a_stalled_share_dumps_every_threads_stack(monkeypatch, capfd):
    """SLIPSTREAM_STALL_DUMP_S: a share still waiting for its input after that long has the
    stacks of every thread written to stderr, the worker's wait among them."""
    monkeypatch.setenv("SLIPSTREAM_STALL_DUMP_S", "0.1")
    io = _run_ahead(HostIO(torch.device("cpu"), HIDDEN, 1, keep_warm=False))
    _hand(io, _Share(0), delay_s=0.5)
    _drain(io)
    err = capfd.readouterr().err
    assert "Thread" in err and "_await" in err and "_work" in err
    _hand(io, _Share(1))  # a quick share: nothing more is dumped
    _drain(io)
    assert "_await" not in capfd.readouterr().err


class _TrackedEvent(_Event):
    """An event that records the thread that releases it (cudaEventDestroy's, on CUDA)."""

    released: list[str] = []

    def __init__(self):
        super().__init__()
        weakref.finalize(self, lambda: _TrackedEvent.released.append(
            threading.current_thread().name))


def test_no_input_event_is_released_on_the_worker_thread():
    """send's events come from the HostIO's pool and go back to it after their share: none
    is dropped (destroyed) by the worker, which the GPU may be waiting on, and one serves
    every share when each is done before the next is sent."""
    _TrackedEvent.released.clear()
    io = _run_ahead(HostIO(torch.device("cpu"), HIDDEN, 1, keep_warm=False))
    io._events = EventPool(_TrackedEvent)
    io._rows[0] = 1
    for layer in range(6):
        io._send_down(torch.full((1, HIDDEN), float(layer)), 0, fused=False)
        io._submit(_Share(layer))
        deadline = time.perf_counter() + 5.0
        while int(io._flag[0]) < io._seq and time.perf_counter() < deadline:
            time.sleep(0.001)  # the stream's wait for the share, which lets the host go on
    _drain(io)
    io.check()
    assert torch.equal(io._out[0][:1], torch.full((1, HIDDEN), 10.0))  # the last share's 2 h
    assert io._events.made == 1
    assert not _TrackedEvent.released  # (an event made per share: 5 released by the worker)
    del io
    gc.collect()
    assert _TrackedEvent.released == [threading.main_thread().name]
