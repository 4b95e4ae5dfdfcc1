"""The VRAM slot map and its online placement (weights.expert_slots), on the CPU."""

from __future__ import annotations

import random

import pytest

from slipstream.errors import BadArgument
from slipstream.weights.expert_slots import SlotMap, Swap


def test_first_placement_and_map_consistency():
    m = SlotMap(6, 2)
    assert m.expert_in == [0, 1] and m.slot_of == [0, 1, -1, -1, -1, -1]
    assert m.in_vram(1) and not m.in_vram(2)
    with pytest.raises(BadArgument, match="slots=7"):
        SlotMap(6, 7)


def test_hottest_outside_replace_the_coldest_inside_every_so_many_tokens():
    m = SlotMap(6, 2, every=4, most=2, margin=1.25)
    for _ in range(4):
        m.record([4, 5, 0])  # expert 1 never used; 4 and 5 as much as 0
    assert m.due()
    swaps = m.plan_swaps()
    # 4 (hottest outside, lowest id first) takes slot 1 (expert 1, unused); 5 against 0 is a
    # tie: no swap
    assert swaps == [Swap(1, 4, 1)]
    assert not m.due()  # the round reset the token count
    for sw in swaps:
        m.apply(sw)
    assert m.expert_in == [0, 4] and m.slot_of == [0, -1, -1, -1, 1, -1]
    for _ in range(4):
        m.record([5, 5])
    swaps = m.plan_swaps()
    assert swaps == [Swap(0, 5, 0)]  # 5: 12 uses against 0's 4 and 4's 4 (slot 0 first)


def test_margin_keeps_equally_used_experts_in_place():
    m = SlotMap(4, 2, every=1, margin=1.5)
    m.record([0, 1, 2, 2, 3], tokens=1)
    m.record([0, 1, 2], tokens=1)  # 2: 3 uses, 0 and 1: 2 each; 3 / 2 = 1.5 >= margin
    assert [s.new for s in m.plan_swaps()] == [2]
    m2 = SlotMap(4, 2, every=1, margin=1.6)
    m2.record([0, 1, 2, 2, 3])
    m2.record([0, 1, 2])
    assert m2.plan_swaps() == []


def test_no_round_where_every_expert_is_in_vram():
    m = SlotMap(4, 4, every=1)
    m.record([0, 1])
    assert not m.due()


def test_counts_halve_every_decay_pairs():
    m = SlotMap(3, 1, decay=8)
    m.record([1] * 7)
    assert m.uses[1] == 7
    m.record([2])
    assert m.uses == [0, 3, 0]


def test_apply_refuses_a_swap_that_does_not_match():
    m = SlotMap(4, 2)
    with pytest.raises(BadArgument, match="does not match"):
        m.apply(Swap(0, 1, 0))  # 1 is in VRAM already
    with pytest.raises(BadArgument, match="does not match"):
        m.apply(Swap(0, 2, 1))  # slot 0 holds 0


def test_random_rounds_keep_the_map_a_bijection_and_converge_on_the_hot_set():
    """A skewed routing: after a few rounds the slots hold the most used experts."""
    rng = random.Random(0)
    n, slots = 16, 4
    m = SlotMap(n, slots, every=8, most=2)
    hot = [11, 13, 7, 2]
    for _ in range(400):
        ids = [rng.choice(hot) if rng.random() < 0.8 else rng.randrange(n) for _ in range(2)]
        m.record(ids)
        if m.due():
            for sw in m.plan_swaps():
                m.apply(sw)
        assert sorted(m.expert_in) == sorted(e for e in range(n) if m.slot_of[e] >= 0)
        assert all(m.expert_in[m.slot_of[e]] == e for e in m.expert_in)
    assert sorted(m.expert_in) == sorted(hot)
