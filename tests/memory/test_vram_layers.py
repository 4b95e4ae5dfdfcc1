"""The user's cap on layers held in VRAM (load/plan(vram_layers=N), as llama.cpp's -ngl):
a budget that would hold every layer still streams all but N, spread between the resident
ones as the planner spreads them."""

from __future__ import annotations

import pytest

from slipstream.memory.planner import plan_cuda

RESERVE = {"kv": 100}


@pytest.mark.parametrize("cap", [0, 1, 3, 5])
def test_a_cap_streams_what_the_budget_would_hold(cap):
    vram = [10] * 8
    plan = plan_cuda(vram, [12] * 8, RESERVE, vram_budget=10_000, ram_budget=None,
                     vram_layers=cap)
    assert plan.tiers.count("vram") == cap
    assert plan.vram_layers == cap  # kept: promote() after a draft's release honours it
    assert plan.tiers.count("pinned") == 8 - cap
    # uncapped, the same budget holds everything
    assert plan_cuda(vram, [12] * 8, RESERVE, 10_000, None).tiers == ["vram"] * 8


def test_a_cap_above_what_fits_changes_nothing():
    vram = [10] * 8
    tight = plan_cuda(vram, [12] * 8, RESERVE, vram_budget=100 + 2 * 12 + 35, ram_budget=None)
    capped = plan_cuda(vram, [12] * 8, RESERVE, vram_budget=100 + 2 * 12 + 35,
                       ram_budget=None, vram_layers=6)
    assert capped.tiers == tight.tiers and tight.tiers.count("vram") == 3
    assert plan_cuda(vram, [12] * 8, RESERVE, 10_000, None, vram_layers=8).tiers == \
        ["vram"] * 8


def test_load_refuses_a_bad_cap(tmp_path):
    import slipstream
    from slipstream.errors import BadArgument
    from slipstream.synth import write_synth

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(BadArgument, match="vram_layers"):
            slipstream.plan(path, device="cpu", measure=False,
                            placement=slipstream.Placement(vram_layers=bad))
