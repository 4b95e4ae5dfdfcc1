"""The speculative tree sizer (speculative.sizing): Sequoia's trade-off from measured costs."""

from __future__ import annotations

import random

import pytest

from slipstream.speculative.sizing import (EXPLORE_EVERY, GIVE_UP_MIN_TREES, GIVE_UP_TREES,
                                            NODE_CHOICES, ExpertTouch, TreeSizer,
                                            chance_at_least)


def feed(sizer: TreeSizer, pass_s, level_s: float, accept_rate: float, rounds: int = 200,
         until_given_up: bool = False):
    """Rounds of a model whose pass costs pass_s(nodes), whose levels cost level_s, and whose
    walk descends each depth with probability accept_rate (a seeded generator). Returns the
    next choice; until_given_up: stops where the sizer gives up, returning the tree rounds
    fed by then (None if it never does)."""
    rng = random.Random(0)
    for _ in range(rounds):
        if until_given_up and sizer.gives_up:
            return int(sizer.reached[1])
        nodes, depth = sizer.choose()
        sizer.observe_pass(nodes if depth else 1, pass_s(nodes if depth else 1))
        if depth:
            sizer.observe_levels(depth, depth * level_s)
            accepted = 0
            while accepted < depth and rng.random() < accept_rate:
                accepted += 1
            sizer.observe_walk(depth, accepted)
    return None if until_given_up else sizer.choose()


def test_streamed_target_with_a_good_cheap_draft_grows_wide_and_deep():
    """A streamed 70B: 0.35 s a pass whatever its width, 3 ms a draft level, 80% acceptance."""
    nodes, depth = feed(TreeSizer(), lambda n: 0.35 + 1e-5 * n, 0.003, 0.8)
    assert nodes == NODE_CHOICES[-1]
    assert depth == 8


def test_a_good_draft_goes_past_the_probe_depth_where_levels_are_cheap():
    """As the Speculator sets it up (probe depth 8, at most 16): the first tree goes 8 deep,
    then a streamed pass's flat cost, 3 ms levels and 80% acceptance take the trees past 8 (at
    most depth + 1 tokens come of a pass, so 8 deep caps it at 9); with levels a tenth of the
    pass, as on a CPU, they stay shallower."""
    sizer = TreeSizer(max_depth=16, probe_depth=8)
    assert sizer.choose()[1] == 8
    deep = feed(sizer, lambda n: 0.35 + 1e-5 * n, 0.003, 0.8)[1]
    assert deep >= 12  # the deepest depths are the least sampled, so estimated a little low
    assert feed(TreeSizer(max_depth=16, probe_depth=8), lambda n: 0.05, 0.005, 0.8)[1] < deep


def test_a_useless_draft_is_probed_and_settled_at_the_probe_depth():
    """Trees that explore, or settle whether a draft holding memory stays, go the probe depth
    deep however deep the choice may go: a draft that accepts nothing costs what it did."""
    sizer = TreeSizer(max_depth=16, probe_depth=8, plain_gain=1.3)
    depths = []
    for _ in range(3 * EXPLORE_EVERY):
        nodes, depth = sizer.choose()
        sizer.observe_pass(nodes if depth else 1, 0.44 if depth else 0.21)
        if depth:
            depths.append(depth)
            sizer.observe_levels(depth, depth * 0.011)
            sizer.observe_walk(depth, 0)
    assert depths and max(depths) == 8


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


def _trees_until_given_up(pass_s, level_s: float, accept_rate: float):
    """Tree rounds fed before the sizer gives the draft up (None: it never does)."""
    return feed(TreeSizer(), pass_s, level_s, accept_rate, rounds=400, until_given_up=True)


def hybrid_70b(n: int) -> float:
    """The H200's 70B at 24 GiB beside an 8B draft: passes of up to 2 tokens
    split with the CPU (0.21 s), wider ones copy whole layers (0.34 s at 8, 0.51 s at 512)."""
    return 0.21 if n <= 2 else 0.34 + 0.17 * n / 512


def test_dear_trees_are_given_up_sooner_than_cheap_ones():
    """Where every tree pass costs far more than a plain step, a draft that accepts nothing
    goes after a few rounds; where a tree costs about a plain step, trying is cheap and the
    sizer waits for GIVE_UP_TREES rounds. A draft that pays on the dear pass is kept."""
    dear = _trees_until_given_up(hybrid_70b, 0.02, 0.0)
    cheap = _trees_until_given_up(lambda n: 0.35, 0.003, 0.0)
    assert dear is not None and GIVE_UP_MIN_TREES <= dear < GIVE_UP_TREES
    assert cheap is not None and cheap >= GIVE_UP_TREES
    assert _trees_until_given_up(hybrid_70b, 0.02, 0.85) is None


def test_a_plain_step_is_timed_before_trees_are_weighed_against_it():
    """The first tree's pass is no measure of a plain step's (a hybrid plan splits only the
    narrowest passes): the second round is a plain step."""
    sizer = TreeSizer()
    nodes, depth = sizer.choose()
    assert depth > 0
    sizer.observe_pass(nodes, hybrid_70b(nodes))
    sizer.observe_levels(depth, depth * 0.02)
    sizer.observe_walk(depth, 0)
    assert sizer.choose()[1] == 0
    sizer.observe_pass(1, hybrid_70b(1))
    assert sizer.pass_s(1) == pytest.approx(0.21) and sizer.pass_s(nodes) > 0.34


def test_break_even_rate_is_where_a_tree_matches_a_plain_step():
    sizer = TreeSizer()
    r = sizer.break_even_rate(0.44, 0.21, 0.02)
    best = max((1 - r ** (d + 1)) / (1 - r) / (0.44 + d * 0.02) for d in range(1, 9))
    assert best == pytest.approx(1 / 0.21, rel=1e-6)
    assert sizer.break_even_rate(0.35, 0.35, 0.003) < 0.05  # free trees pay at any rate
    assert sizer.break_even_rate(5.0, 0.21, 0.02) == 1.0  # nothing pays a pass that dear


@pytest.mark.parametrize("rate,successes,trials", [(0.65, 0, 3), (0.3, 2, 10), (0.5, 7, 9)])
def test_chance_at_least_is_the_beta_posterior_tail(rate, successes, trials):
    """Against the posterior integrated numerically (uniform prior, midpoint rule)."""
    failures, steps = trials - successes, 200_000
    xs = [(k + 0.5) / steps for k in range(steps)]
    dens = [x ** successes * (1 - x) ** failures for x in xs]
    tail = sum(d for x, d in zip(xs, dens) if x >= rate) / sum(dens)
    assert chance_at_least(rate, successes, trials) == pytest.approx(tail, abs=1e-4)


def test_a_draft_that_beats_plain_steps_but_not_plain_decode_without_it_is_given_up():
    """Trees that beat a plain step with the draft loaded, but not the plain decode that the
    draft's memory would buy (plain_gain): kept at gain 1, given up at 1.5."""
    def cost(n: int) -> float:
        return 0.2 if n == 1 else 0.25

    kept = TreeSizer()
    assert feed(kept, cost, 0.005, 0.5, rounds=300, until_given_up=True) is None
    assert kept.predicted_tok_s(*kept.choose()) > 1 / 0.2  # faster than a plain step
    gained = TreeSizer(plain_gain=1.5)
    assert kept.predicted_tok_s(*kept.choose()) < 1.5 / 0.2  # slower than plain without it
    assert feed(gained, cost, 0.005, 0.5, rounds=300, until_given_up=True) is not None


def test_a_draft_holding_the_targets_memory_is_settled_with_trees_back_to_back():
    """With plain decode faster once the draft is released (plain_gain > 1), the rounds that
    decide the give-up come at once: a draft that accepts nothing on the H200's 70B is given up
    after its GIVE_UP_MIN_TREES trees and the one timed plain step, not after trees spread one
    in EXPLORE_EVERY plain steps (which a draft holding no memory still gets)."""
    def rounds_until_given_up(gain: float) -> tuple[int, int]:
        sizer = TreeSizer(plain_gain=gain)
        rounds = 0
        while not sizer.gives_up and rounds < 400:
            nodes, depth = sizer.choose()
            sizer.observe_pass(nodes if depth else 1, hybrid_70b(nodes if depth else 1))
            if depth:
                sizer.observe_levels(depth, depth * 0.02)
                sizer.observe_walk(depth, 0)
            rounds += 1
        return rounds, int(sizer.reached[1])

    rounds, trees = rounds_until_given_up(1.35)
    assert trees == GIVE_UP_MIN_TREES and rounds == GIVE_UP_MIN_TREES + 1
    rounds, trees = rounds_until_given_up(1.0)
    assert trees >= GIVE_UP_MIN_TREES and rounds > EXPLORE_EVERY


def test_the_rounds_that_settle_a_draft_holding_memory_take_the_narrowest_trees():
    """While the draft holds the target's memory (plain_gain > 1) the rounds that decide
    whether it stays take the two narrowest tree sizes (a line needs two widths), however flat
    the pass line; a draft that pays then grows as wide as one that holds nothing."""
    flat = lambda n: 0.35 + 1e-5 * n  # noqa: E731 (a streamed 70B's passes)
    sizer = TreeSizer(plain_gain=1.35)
    sizes = []
    while sizer._trees < GIVE_UP_MIN_TREES:
        nodes, depth = sizer.choose()
        if depth:
            sizes.append(nodes)
        sizer.observe_pass(nodes if depth else 1, flat(nodes if depth else 1))
        if depth:
            sizer.observe_levels(depth, depth * 0.003)
            sizer.observe_walk(depth, min(depth, 3))
    assert sizes == [NODE_CHOICES[0], NODE_CHOICES[1]][:GIVE_UP_MIN_TREES]
    assert not sizer.gives_up
    assert feed(sizer, flat, 0.003, 0.8) == feed(TreeSizer(), flat, 0.003, 0.8) \
        == (NODE_CHOICES[-1], 8)
    unheld = TreeSizer()  # no memory to give back: the widths the line wants, at once
    assert unheld.choose()[0] not in NODE_CHOICES[:2]


def test_a_draft_levels_warm_up_does_not_set_their_cost():
    """A round whose growth compiled kernels or captured graphs (23.5 ms a level against 3.6
    on the H200's default-spec) is outvoted: the cheapest while there are fewer than three
    rounds, then the median of the recent ones."""
    sizer = TreeSizer()
    sizer.observe_levels(4, 4 * 0.0235)
    assert sizer.level_s == pytest.approx(0.0235)
    sizer.observe_levels(2, 2 * 0.0036)
    assert sizer.level_s == pytest.approx(0.0036)
    for _ in range(3):
        sizer.observe_levels(8, 8 * 0.0037)
    assert sizer.level_s == pytest.approx(0.0037)


def test_an_unlucky_first_tree_is_tried_again_at_once():
    """A first tree that accepted nothing (the prior's 0.6 falls to 0.4) is followed by
    another tree where one at the prior's rate would pay, not by EXPLORE_EVERY plain steps."""
    sizer = TreeSizer()
    nodes, depth = sizer.choose()
    sizer.observe_pass(nodes, 0.080)
    sizer.observe_levels(depth, depth * 0.0036)
    sizer.observe_walk(depth, 0)
    assert sizer.choose()[1] == 0  # the one plain step that times what trees must beat
    sizer.observe_pass(1, 0.041)
    assert sizer.rate(1) == pytest.approx(0.4)
    assert sizer.choose()[1] > 0


def test_a_flat_tree_line_takes_the_widest_tree_however_cheap_a_plain_step():
    """Trees as dear at 512 nodes as at 16 (a streamed target) take the widest, even where a
    plain step costs half of any tree pass (a hybrid plan splits only the narrowest passes)."""
    sizer = TreeSizer()
    for n, t in ((64, 0.44), (512, 0.445), (16, 0.44), (1, 0.21)):
        sizer.observe_pass(n, t)
    assert sizer.nodes() == NODE_CHOICES[-1]


def test_a_first_use_pass_does_not_set_the_line():
    """A narrow pass that compiled kernels (the H100's 70B: 1.73 s for the first 16-node round,
    0.54 s for the 32-node one after it) costs no more than a wider pass measured cheaper; at
    one width, a spike among its recent passes is outvoted by their median."""
    sizer = TreeSizer()
    sizer.observe_pass(16, 1.73)
    assert sizer.pass_s(16) == pytest.approx(1.73)  # nothing to tell it from yet
    sizer.observe_pass(32, 0.54)
    assert sizer.pass_s(16) == pytest.approx(0.54) and sizer.pass_s(512) == pytest.approx(0.54)
    for t in (0.06, 0.06, 1.0, 0.06):
        sizer.observe_pass(64, t)
    assert sizer.pass_s(64) == pytest.approx(0.06)
    for t in (0.30, 0.31, 0.29):
        sizer.observe_pass(1, t)
    assert sizer.pass_s(1) == pytest.approx(0.30)


def test_a_good_draft_keeps_its_trees_after_a_first_pass_that_compiled():
    """default-spec on the H100: plain steps of 35.5 ms, tree passes of 60 ms at
    any width but the first, which compiled kernels for a second, 4 ms levels, and 75%
    acceptance (its trees gave 4.6 tokens each; there the sizer took plain steps in 17 of 27
    rounds). With that second in a mean over every pass, plain steps took 36 of 40 rounds
    here; now trees win nearly every round."""
    sizer = TreeSizer(plain_gain=1.1)
    first = [True]

    def pass_s(n: int) -> float:
        if n <= 1:
            return 0.0355
        if first[0]:
            first[0] = False
            return 1.0
        return 0.060

    rng = random.Random(1)
    plain = 0
    for _ in range(40):
        nodes, depth = sizer.choose()
        sizer.observe_pass(nodes if depth else 1, pass_s(nodes if depth else 1))
        if not depth:
            plain += 1
            continue
        sizer.observe_levels(depth, depth * 0.004)
        accepted = 0
        while accepted < depth and rng.random() < 0.75:
            accepted += 1
        sizer.observe_walk(depth, accepted)
    assert plain <= 3 and not sizer.gives_up


def test_a_prompt_the_draft_never_agrees_on_gives_it_up_before_any_tree():
    """The prompt's positions are trials of the first drafted token (spec_sizing's
    PROMPT_POSITIONS): none of 16 hits make a 25% rate unlikely (0.75^17 < 5%) and the draft is
    given up before its first tree; fewer trials, or a draft that agrees now and then, or a
    tree size the user fixed, keep it."""
    from slipstream.speculative.sizing import PROMPT_MIN_TRIALS

    s = TreeSizer()
    s.observe_prompt(0, PROMPT_MIN_TRIALS - 1)
    assert not s.gives_up
    s.observe_prompt(0, 1)
    assert s.prompt_says_no and s.gives_up
    some = TreeSizer()
    some.observe_prompt(3, PROMPT_MIN_TRIALS)
    assert not some.prompt_says_no and not some.gives_up
    fixed = TreeSizer(fixed_nodes=64)
    fixed.observe_prompt(0, 64)
    assert not fixed.gives_up
    # the evidence adds up over generations
    later = TreeSizer()
    for _ in range(4):
        later.observe_prompt(0, 4)
    assert later.gives_up


def test_a_mixture_of_experts_pass_is_predicted_by_the_experts_it_reads():
    """Qwen3-30B-A3B's routing (8 of 128 experts): a pass costs a fixed part, a little per
    node, and mostly the experts its nodes' union reads. Fitted on the widths tried, the
    sizer predicts an untried width within 3%, where the line through the same widths in N
    misses by far more; a dense target (no ExpertTouch) keeps the line."""
    touch = ExpertTouch(128, 8)

    def cost(n: int) -> float:
        return 0.004 + 2e-6 * n + 1e-4 * touch.distinct(n)

    moe, dense = TreeSizer(experts=touch), TreeSizer()
    for sizer in (moe, dense):
        sizer.observe_pass(1, cost(1))
        for n in (16, 64, 512):
            sizer.observe_pass(n, cost(n))
    for n in (32, 128, 256):
        assert abs(moe.pass_s(n) / cost(n) - 1) < 0.03, n
    assert max(abs(dense.pass_s(n) / cost(n) - 1) for n in (32, 128)) > 0.1


def test_compute_bound_widths_fall_back_to_the_line():
    """Two widths whose cost rises faster than the union of their experts (a compute-bound
    pass) would give the union fit a negative fixed cost: the line in N is used instead."""
    sizer = TreeSizer(experts=ExpertTouch(128, 8))
    sizer.observe_pass(64, 0.010)
    sizer.observe_pass(512, 0.050)
    assert sizer.pass_s(256) == pytest.approx(0.010 + (256 - 64) * 0.040 / 448)
    assert sizer.pass_s(16) > 0.0


def test_expert_touch_counts_the_union():
    touch = ExpertTouch(128, 8)
    assert touch.distinct(1) == pytest.approx(8)
    assert touch.distinct(10_000) == pytest.approx(128)
    with pytest.raises(ValueError, match="9 of 8"):
        ExpertTouch(8, 9)
