"""The copy stream's meter (memory.timeline.CopyMeter) that hybrid decode's balance judges PCIe
by: copies read back in order once completed, never waited on, their events reused. Driven with
events whose completion and elapsed time the test sets (the GPU's run in tests/gpu)."""

from __future__ import annotations

from slipstream.memory.timeline import CopyMeter


class FakeEvent:
    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.done = False
        self.at = 0.0  # ms, set by record's caller through the clock below

    def record(self, stream) -> None:
        self.done = False
        self.at = stream.now

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at - self.at


class Clock:
    now = 0.0


def _copy(meter: CopyMeter, clock: Clock, ms: float, nbytes: int):
    start = meter.start(clock)
    clock.now += ms
    meter.end(clock, start, nbytes)
    return start, meter._pending[-1][1]


def test_completed_copies_are_counted_in_order_and_the_rest_wait():
    clock = Clock()
    meter = CopyMeter(event=FakeEvent)
    a = _copy(meter, clock, 10.0, 500)
    b = _copy(meter, clock, 5.0, 300)
    c = _copy(meter, clock, 2.0, 100)
    assert meter.poll() == (0.0, 0)  # none completed yet
    for e in a + b:
        e.done = True
    seconds, nbytes = meter.poll()
    assert nbytes == 800 and abs(seconds - 0.015) < 1e-12
    c[0].done = True  # its end not reached: still pending
    assert meter.poll()[1] == 800
    c[1].done = True
    assert meter.poll()[1] == 900


def test_a_copy_done_after_one_still_running_waits_for_it():
    # one stream's events complete in order; poll never reads past one that is not done
    clock = Clock()
    meter = CopyMeter(event=FakeEvent)
    _copy(meter, clock, 1.0, 10)
    later = _copy(meter, clock, 1.0, 20)
    for e in later:
        e.done = True
    assert meter.poll() == (0.0, 0)


def test_events_are_reused_once_read_back():
    clock = Clock()
    FakeEvent.made = 0
    meter = CopyMeter(event=FakeEvent)
    for _ in range(50):
        for e in _copy(meter, clock, 1.0, 1):
            e.done = True
        meter.poll()
    assert FakeEvent.made == 2 and meter.nbytes == 50


def test_nobody_polling_keeps_the_pending_list_bounded():
    clock = Clock()
    meter = CopyMeter(event=FakeEvent)
    meter.MAX_PENDING = 8
    for _ in range(20):
        _copy(meter, clock, 1.0, 1)  # never completed
    assert len(meter._pending) == 8
