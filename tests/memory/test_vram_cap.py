"""The allocator cap that holds a CUDA VRAM budget (memory.vram_cap), with torch.cuda's three
calls faked: the newest live model's cap applies, and freeing a model brings back the one
before it (the GPU side is tested in tests/gpu/test_tier_c_gpu.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from slipstream.memory import vram_cap

GIB = 1 << 30


class _Owner:
    """Stands in for a Model: vram_cap only needs something weakly referencable."""


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"reserved": 0, "fractions": [], "by_device": {}}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    def set_fraction(fraction, device=None):
        if not isinstance(device, torch.device) or device.index is None:
            raise ValueError("Expected a torch.device with a specified index")  # as torch does
        state["fractions"].append(fraction)
        state["by_device"][device.index] = fraction

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(vram_cap, "_limits", {})
    return state


def test_the_newest_model_sets_the_cap_and_freeing_it_restores_the_older(fake_cuda):
    dev = torch.device("cuda", 0)
    fake_cuda["reserved"] = 10 * GIB  # something else the process already holds
    a = _Owner()
    vram_cap.VramCap(torch.device("cuda"), 24 * GIB).attach(a)  # as api.load passes it
    assert fake_cuda["fractions"][-1] == pytest.approx(0.34)
    fake_cuda["reserved"] = 30 * GIB
    b = _Owner()
    vram_cap.VramCap(dev, None).attach(b)  # no budget: no cap while it lives
    assert fake_cuda["fractions"][-1] == 1.0
    del b
    gc.collect()
    assert fake_cuda["fractions"][-1] == pytest.approx(0.34)
    del a
    gc.collect()
    assert fake_cuda["fractions"][-1] == 1.0


def test_a_failed_load_releases_its_cap(fake_cuda):
    cap = vram_cap.VramCap(torch.device("cuda", 0), 2 * GIB)
    assert fake_cuda["fractions"][-1] == pytest.approx(0.02)
    cap.release()
    cap.release()  # idempotent: the error path and a finalizer may both get here
    assert fake_cuda["fractions"] == [pytest.approx(0.02), 1.0]


def test_a_budget_above_the_device_is_no_cap(fake_cuda):
    cap = vram_cap.VramCap(torch.device("cuda", 0), 500 * GIB)
    assert fake_cuda["fractions"][-1] == 1.0
    cap.release()


def test_each_device_keeps_its_own_cap(fake_cuda):
    on_0, on_1 = _Owner(), _Owner()
    vram_cap.VramCap(torch.device("cuda", 0), 10 * GIB).attach(on_0)
    vram_cap.VramCap(torch.device("cuda", 1), 20 * GIB).attach(on_1)
    assert fake_cuda["by_device"] == {0: pytest.approx(0.1), 1: pytest.approx(0.2)}
    del on_1
    gc.collect()
    assert fake_cuda["by_device"] == {0: pytest.approx(0.1), 1: 1.0}
    del on_0
    gc.collect()


def test_growing_a_cap_raises_it_and_release_still_removes_it(fake_cuda):
    """A draft's headroom given back (Model.release_draft): the cap grows by it, never past
    the device; a released cap no longer grows."""
    fake_cuda["reserved"] = 6 * GIB  # the draft's share, loaded before the model
    cap = vram_cap.VramCap(torch.device("cuda", 0), 18 * GIB)
    assert fake_cuda["fractions"][-1] == pytest.approx(0.24)
    cap.grow(GIB)
    assert fake_cuda["fractions"][-1] == pytest.approx(0.25) and cap.limit == 25 * GIB
    cap.grow(500 * GIB)
    assert fake_cuda["fractions"][-1] == 1.0
    cap.release()
    n = len(fake_cuda["fractions"])
    cap.grow(GIB)
    assert len(fake_cuda["fractions"]) == n and fake_cuda["by_device"][0] == 1.0
