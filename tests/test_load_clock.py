"""The load's phase clock: each phase's wall time, in the order the phases ran, a phase timed
twice added up, and the phases of a real load within its wall time."""

from __future__ import annotations

import time

import pytest
import torch

import slipstream
from slipstream.load_clock import LoadClock, maybe
from slipstream.synth import write_synth


def test_phases_add_up_in_order():
    clock = LoadClock(torch.device("cpu"))
    with clock.phase("b"):
        time.sleep(0.02)
    with clock.phase("a"):
        pass
    with clock.phase("b"):
        time.sleep(0.01)
    assert list(clock.phases) == ["b", "a"]
    assert clock.phases["b"] >= 0.03 and clock.phases["a"] < clock.phases["b"]


def test_a_failing_phase_is_still_timed():
    clock = LoadClock()
    with pytest.raises(ValueError):
        with clock.phase("x"):
            raise ValueError("bad")
    assert "x" in clock.phases


def test_no_clock_times_nothing():
    with maybe(None, "x"):
        pass  # callers outside load() pass no clock


def test_a_load_reports_its_phases(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2)
    t0 = time.perf_counter()
    with slipstream.load(path, device="cpu", ctx=32) as m:
        wall = time.perf_counter() - t0
        phases = m.load_phases
    assert list(phases)[:3] == ["open", "tokenizer", "plan"]
    assert "resident weights" in phases and "store and stages" in phases
    assert 0 < sum(phases.values()) <= wall + 1e-3
