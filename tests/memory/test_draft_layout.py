"""A model planned beside a draft streams, first, the layers it would stream without one
(planner.plan_cuda's stream_first), so that giving the draft up and promoting the rest
restores plain decode's own layout instead of a thinned-out spread of the draft plan's."""

from __future__ import annotations

import pytest

from slipstream.memory.planner import evenly_spaced, plan_cuda

RESERVE = {"kv": 100}
N, LAYER, SLOT = 80, 10, 12


def _plan(room_layers: int, stream_first=None):
    budget = 100 + 2 * SLOT + room_layers * LAYER
    return plan_cuda([LAYER] * N, [SLOT] * N, RESERVE, vram_budget=budget, ram_budget=None,
                     stream_first=stream_first)


def _longest_run(streamed: list[int]) -> int:
    best = run = 0
    for i in range(N):
        run = run + 1 if i in streamed else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize("plain_layers,draft_layers", [(44, 31), (60, 10), (44, 43), (5, 0)])
def test_the_draft_plan_streams_the_plain_plans_layers_and_as_many_as_before(plain_layers,
                                                                            draft_layers):
    plain = _plan(plain_layers)
    assert plain.tiers.count("vram") == plain_layers
    alone = _plan(draft_layers)
    nested = _plan(draft_layers, stream_first=plain.streamed_layers)
    # the same number of layers resident as without the hint, within the same budget
    assert nested.tiers.count("vram") == alone.tiers.count("vram") == draft_layers
    assert set(plain.streamed_layers) <= set(nested.streamed_layers)
    # the extra streamed layers are spread over plain's resident ones, not bunched
    extra = [i for i in nested.streamed_layers if i not in plain.streamed_layers]
    resident = [i for i in range(N) if i not in plain.streamed_layers]
    assert extra == evenly_spaced(resident, len(extra))


def test_promoting_the_rest_gives_the_plain_layout():
    """What Model.release_draft promotes (the draft plan's streamed layers that plain decode
    keeps resident) leaves exactly the plain plan's streamed layers, spread as the planner
    spreads them on its own: no run of streamed layers longer than plain's."""
    plain = _plan(44)
    nested = _plan(31, stream_first=plain.streamed_layers)
    promoted = [i for i in nested.streamed_layers if i not in plain.streamed_layers]
    left = [i for i in nested.streamed_layers if i not in promoted]
    assert left == plain.streamed_layers and len(promoted) == 13
    assert _longest_run(left) == _longest_run(plain.streamed_layers) == 1
    # the spread the release used to make (an even pick of the draft plan's own spread) kept
    # streamed layers side by side
    old = _plan(31).streamed_layers
    kept = [i for i in old if i not in evenly_spaced(old, 13)]
    assert _longest_run(kept) > 1


def test_a_hint_larger_than_the_streamed_count_is_ignored():
    plain = _plan(44)
    more_resident = _plan(60, stream_first=plain.streamed_layers)
    assert more_resident.tiers == _plan(60).tiers


def test_the_release_gain_is_the_no_draft_plans_predicted_speedup():
    """speculative.drafts.release_gain: the no-draft plan's predicted decode rate over the
    loaded plan's, from the loaded plan's measured bandwidths, kept within [1, 2]."""
    from slipstream.speculative.drafts import release_gain

    plain = _plan(44)
    beside = _plan(31, stream_first=plain.streamed_layers)
    beside.bandwidth_gbps.update(vram=3000.0, pinned=50.0)
    gain = release_gain(None, None, beside, plain, "off", None)
    want = plain.predicted_tok_s / beside.predicted_tok_s
    assert gain == pytest.approx(want) and 1.0 < gain < 2.0
    assert plain.bandwidth_gbps["pinned"] == 50.0  # measured once, at load, for both
    resident = _plan(N)
    assert release_gain(None, None, resident, plain, "off", None) == 1.0
