"""The speculative tree sizer (runtime.spec_sizing): Sequoia's trade-off from measured costs."""

from __future__ import annotations

import random

import pytest

from slipstream.runtime.spec_sizing import EXPLORE_EVERY, NODE_CHOICES, TreeSizer


def feed(sizer: TreeSizer, pass_s, level_s: float, accept_rate: float, rounds: int = 200):
    """Rounds of a model whose pass costs pass_s(nodes), whose levels cost level_s, and whose
    walk descends each depth with probability accept_rate (a seeded generator)."""
    rng = random.Random(0)
    for _ in range(rounds):
        nodes, depth = sizer.choose()
        sizer.observe_pass(nodes if depth else 1, pass_s(nodes if depth else 1))
        if depth:
            sizer.observe_levels(depth, depth * level_s)
            accepted = 0
            while accepted < depth and rng.random() < accept_rate:
                accepted += 1
            sizer.observe_walk(depth, accepted)
    return sizer.choose()


def test_streamed_target_with_a_good_cheap_draft_grows_wide_and_deep():
    """A streamed 70B: 0.35 s a pass whatever its width, 3 ms a draft level, 80% acceptance."""
    nodes, depth = feed(TreeSizer(), lambda n: 0.35 + 1e-5 * n, 0.003, 0.8)
    assert nodes == NODE_CHOICES[-1]
    assert depth == 8


def test_resident_target_keeps_trees_narrow():
    """A pass whose cost grows with its width (a resident target): the widest tree within the
    slack of a one-node pass."""
    nodes, depth = feed(TreeSizer(), lambda n: 0.01 + 0.0005 * n, 0.001, 0.8)
    assert nodes == 16  # 0.018 s against 0.0105 s is more than 10 % over: the smallest choice
    assert depth >= 1


def test_a_draft_that_is_never_right_gives_plain_steps_and_keeps_measuring():
    sizer = TreeSizer()
    feed(sizer, lambda n: 0.35, 0.003, 0.0)
    chosen = [sizer.choose()[1] for _ in range(EXPLORE_EVERY * 2)]
    assert chosen.count(0) >= len(chosen) - 2  # plain steps ...
    assert any(d > 0 for d in chosen)  # ... but a tree now and then, to keep measuring


def test_a_draft_as_slow_as_the_target_does_not_pay():
    """On a CPU with a draft as large as the target a level costs a pass: plain steps win
    unless nearly every token is accepted."""
    assert feed(TreeSizer(), lambda n: 0.05, 0.05, 0.5)[1] == 0


def test_fixed_nodes_and_depth_are_kept():
    sizer = TreeSizer(fixed_nodes=24, fixed_depth=3)
    assert feed(sizer, lambda n: 0.35, 0.003, 0.0) == (24, 3)


@pytest.mark.parametrize("rate", [0.3, 0.9])
def test_acceptance_estimate_tracks_the_walks(rate):
    sizer = TreeSizer(fixed_nodes=64, fixed_depth=8)
    feed(sizer, lambda n: 0.35, 0.003, rate, rounds=2000)
    assert sizer.rate(1) == pytest.approx(rate, abs=0.05)
    assert sizer.expected_tokens(2) == pytest.approx(1 + sizer.rate(1) + sizer.rate(1)
                                                     * sizer.rate(2))


def test_gives_up_only_on_a_draft_that_never_pays():
    bad = TreeSizer()
    feed(bad, lambda n: 0.35, 0.01, 0.0, rounds=400)
    assert bad.gives_up
    good = TreeSizer()
    feed(good, lambda n: 0.35, 0.01, 0.6, rounds=400)
    assert not good.gives_up
    early = TreeSizer()
    feed(early, lambda n: 0.35, 0.01, 0.0, rounds=3)  # too few trees to tell
    assert not early.gives_up
