"""Model.close() and `with slipstream.load(...) as model:` give back what a model holds:
reader threads, file descriptors (the model file's map, the O_DIRECT reader)."""

from __future__ import annotations

import os
import threading

import pytest

import slipstream

from helpers import cpu_budget
from slipstream.synth import write_synth


def _held() -> tuple[int, int]:
    threads = sum(t.name.startswith("slipstream") for t in threading.enumerate())
    return threads, len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_close_releases_threads_and_descriptors(tmp_path):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=6, from_floats=True,
                       std=0.1, seed=3)
    # room for two layers' packed images (precision "fast"): the tail streams from disk
    budget = cpu_budget(path, packed=2)
    before = _held()
    with slipstream.load(path, device="cpu", ctx=64,
                         placement=slipstream.Placement(ram_budget=budget)) as model:
        assert model.plan.tiers == ["packed"] * 2 + ["disk"] * 4
        text = list(model.generate("hello", max_tokens=4, temperature=0))
        assert len(text) >= 1
        during = _held()
        assert during[0] > before[0] and during[1] > before[1]  # reader threads, O_DIRECT fd
    assert model.closed
    assert _held() == before
    model.close()  # a second close does nothing

