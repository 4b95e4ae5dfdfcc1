"""tests/routing_replay.py, the comparison of two engines on one routing, checked on the CPU:
a run whose router inputs carry noise of one part in a thousand (the size of the GPU's
differences from the CPU at "exact") picks other experts at a few near-tied rows, which moves
the logits by percents; replaying the clean run's routing brings it back under 1e-2, and its
own choices still agree wherever the clean run's were decisive."""

from __future__ import annotations

import pytest
import torch

import slipstream
import slipstream.model.moe as moe
from helpers import rel64, streamed_logits
from routing_replay import (RoutingCall, assert_same_decisive_choices, recorded_routing,
                            replayed_routing)
from slipstream.synth import write_synth


@pytest.fixture
def noisy_router(monkeypatch):
    """model.moe._route on router inputs times (1 + 1e-3 * noise), seeded."""
    real = moe._route
    g = torch.Generator().manual_seed(0)

    def noisy(h, *a):
        return real(h * (1 + 1e-3 * torch.randn(h.shape, generator=g)), *a)

    return lambda: monkeypatch.setattr(moe, "_route", noisy)


@pytest.mark.slow
def test_replay_removes_the_flips_and_keeps_the_decisive_choices(tmp_path, noisy_router):
    path = write_synth(tmp_path / "mixtral.gguf", "tiny", "Q4_K_M", n_layers=4, arch="mixtral",
                       from_floats=True, std=0.08, seed=4)
    with slipstream.load(path, device="cpu", ctx=256, precision="exact") as m:
        with recorded_routing() as calls:
            clean = streamed_logits(m, steps=4)
        noisy_router()
        noisy = streamed_logits(m, steps=4)
        with replayed_routing(calls) as own:
            replayed = streamed_logits(m, steps=4)
    # the noise alone flips a near tie somewhere: the reason the replay exists
    assert max(rel64(y, x) for x, y in zip(clean, noisy)) > 1e-2
    assert max(rel64(y, x) for x, y in zip(clean, replayed)) < 1e-2
    ties = assert_same_decisive_choices(calls, own)
    assert ties < sum(len(c.ids) for c in calls) // 10  # most rows decisive
    # a wrong choice is caught: the replaying run's own ids shifted by one expert
    wrong = RoutingCall(own[0].weights, (own[0].ids + 1) % 8, own[0].margin)
    with pytest.raises(AssertionError):
        assert_same_decisive_choices(calls[:1], [wrong], tau=-1.0)
