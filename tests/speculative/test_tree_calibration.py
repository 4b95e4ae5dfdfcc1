"""The trees' ranking temperature fitted to the target's walks (speculative.calibration): the
distributions kept against torch's own softmax, the walk score by hand, and the fit in a
speculative generation (which stays lossless: test_speculative)."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.speculative.tree import DraftTree, TreeGrower, tree_tau
from slipstream.runtime.sampler import Sampler, SamplingParams
from slipstream.speculative.sizing import TreeSizer
from slipstream.speculative.rounds import Speculator
from slipstream.speculative.calibration import (GRID, MIN_OBSERVED, NodeDraws, TauFit,
                                                 logsumexps, reranked_acceptance)
from speculative.test_speculative import tiny_models

PREFIX = [3, 17, 99, 250, 7, 42, 300, 12]
ROOT = 77


def _draws(row: torch.Tensor, grid, k: int) -> NodeDraws:
    top, ids = torch.topk(row, k)
    lse = logsumexps(row[None], grid)[0]
    return NodeDraws(tuple(ids.tolist()), tuple(top.tolist()), tuple(lse.tolist()))


def test_logsumexps_equal_torchs_at_every_temperature():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3000, generator=gen) * 6 + 40  # large offsets: the shift matters
    taus = (0.1, 0.3, 1.0, 2.5)
    got = logsumexps(logits, taus)
    for j, tau in enumerate(taus):
        want = torch.logsumexp(logits.double() / tau, dim=-1)
        assert torch.allclose(got[:, j].double(), want, rtol=1e-6, atol=1e-4)


def test_the_walk_counts_the_nodes_kept_at_every_temperature():
    """A node the walk passed through counts towards MIN_OBSERVED where the draft's
    distribution there was kept at every tau of the grid; one kept at fewer does not."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(500, generator=gen) * 3
    fit = TauFit(0.5)
    fit.observe_walk({0: _draws(row, fit.grid, 8), 2: _draws(row, (0.5,), 8)}, [0, 1, 2])
    assert fit.observed == 1


def test_the_default_joins_the_grid():
    fit = TauFit(tree_tau(0.8))
    assert 0.8 in fit.grid and set(GRID) <= set(fit.grid)
    assert fit.grid == tuple(sorted(fit.grid))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    models = tiny_models(tmp_path_factory.mktemp("calib"), ctx=160)
    yield models
    for m in models:
        m.close()


def _grown(draft, ahead_levels: int) -> TreeGrower:
    """A tree of the draft after PREFIX, ranked at 0.5, grown ahead `ahead_levels` levels."""
    draft.engine.reset()
    draft.engine.forward(PREFIX)
    grower = TreeGrower.begin(draft.engine, ROOT, [], top_k=4, tau=0.5, grid=GRID)
    grower.grow(12, 3, None)
    grower.ahead(lambda: True, width=6, levels=ahead_levels)
    return grower


def test_grown_trees_keep_each_ran_nodes_draws_and_reroot_carries_them(tiny):
    draft = tiny[1]
    grower = _grown(draft, 2)
    tree = grower.tree
    assert sorted(tree.draws) == [i for i in range(len(tree)) if tree.ran[i]]
    # the root's draws are the draft's logits after PREFIX + ROOT, in a fresh context
    draft.engine.reset()
    want = draft.engine.forward(PREFIX + [ROOT])[-1].float()
    root = tree.draws[0]
    assert list(root.tokens) == torch.topk(want, 4).indices.tolist()
    g = grower.grid.index(0.5)
    assert math.isclose(root.lse[g], float(torch.logsumexp(want.double() / 0.5, -1)),
                        rel_tol=1e-5)
    # a child's log-prob is its ranking: the draft's softmax at 0.5
    child = tree.children[0][root.tokens[0]]
    assert math.isclose(tree.logprobs[child], root.logits[0] / 0.5 - root.lse[g],
                        rel_tol=1e-6)
    # reroot below a node that ran and has a child that ran
    grower = _grown(draft, 3)
    tree = grower.tree
    node = next(i for i in range(1, len(tree))
                if tree.ran[i] and any(tree.ran[c] for c in tree.children[i].values()))
    sub = tree.subtree(node)
    new = grower.reroot(list(tree.paths[tree.parents[node]]), tree.tokens[node])
    assert new is not None and new.grid == grower.grid
    assert {j: new.tree.draws[j] for j in new.tree.draws} == \
        {j: tree.draws[i] for j, i in enumerate(sub) if i in tree.draws}


@pytest.mark.slow
def test_a_generation_fits_and_ranks_its_trees_at_the_fit(tiny):
    """The walks feed the sizer's fit for the sampling temperature; the fit's temperature ranks
    the trees grown once it has seen enough; another generation goes on from it."""
    target, draft = tiny[0], tiny[1]
    sizer = TreeSizer()
    sampler = Sampler(SamplingParams(temperature=0.0), device=target.engine.device)
    spec = Speculator(target.engine, draft.engine, sampler, nodes=24, depth=4, sizer=sizer)
    fit = sizer.tau_fits[0.0]
    assert spec.tau == fit.default == tree_tau(0.0)
    spec.prefill(PREFIX)
    ranked = []
    grow = TreeGrower.begin.__func__

    def spy(cls, *args, **kw):
        grower = grow(cls, *args, **kw)
        ranked.append(grower.tau)
        return grower

    TreeGrower.begin = classmethod(spy)
    expected = []
    try:
        emitted = 0
        while fit.observed < MIN_OBSERVED + 8 and emitted < 120:
            expected.append(fit.tau)
            emitted += len(spec.round(8))
    finally:
        TreeGrower.begin = classmethod(grow)
    assert fit.observed >= MIN_OBSERVED
    # each round's tree was ranked at the fit's temperature after the round before it
    assert ranked == expected and ranked[0] == tree_tau(0.0)
    again = Speculator(target.engine, draft.engine, sampler, nodes=24, depth=4, sizer=sizer)
    assert again.fit is fit and again.tau == fit.tau


@pytest.mark.slow
def test_a_settled_fit_stops_scoring_and_keeps_its_temperature():
    """Past `settled_at` counted nodes the fit stops: trees keep no grid (one pass over the
    vocabulary a level) and further walks change nothing."""
    gen = torch.Generator().manual_seed(3)
    fit = TauFit(0.3, settled_at=200)
    fit.walked[fit.grid.index(1.0)] = 5.0
    assert fit.grid_to_keep == fit.grid
    row = torch.randn(1000, generator=gen) * 2.5
    node = _draws(row, fit.grid, 8)
    while not fit.settled:
        fit.observe(node)
    assert fit.observed == 200 and fit.grid_to_keep == () and fit.tau == 1.0
    fit.observe(node)
    tree = DraftTree(0)
    tree.add(5, 0, 0.0)
    fit.observe_tree(tree, [0, 1], [0, 1])
    assert fit.observed == 200 and fit.walked[fit.grid.index(1.0)] == 5.0 and fit.tau == 1.0
    # a node kept at one temperature only (a tree grown after settling) is never counted
    fresh = TauFit(0.3)
    fresh.observe(_draws(row, (0.3,), 8))
    assert fresh.observed == 0


def test_reranked_acceptance_keeps_the_best_half_at_each_temperature():
    """A root whose draft leans to 9 over 4 (logits 2.0 and 1.8 among 40 others at 0); below 9
    a chain 9 -> 5 -> 6 it is fairly sure of (logit 3 against 40 at 0), below 4 a guess 7. The
    target walked 9, 5, 6. Kept to half of the tree's 6 nodes (3 with the root), a sharp
    ranking (0.25) keeps the chain's first two nodes and accepts 2; a soft one (1) ranks 4
    above 5 and accepts 1."""
    tree = DraftTree(0)
    b = tree.add(9, 0, 0.0)
    a = tree.add(4, 0, 0.0)
    c = tree.add(5, b, 0.0)
    d = tree.add(6, c, 0.0)
    e = tree.add(7, a, 0.0)
    grid = (0.25, 1.0)

    def draws(tokens, logits, vocab_rest=40, rest_logit=0.0):
        lse = tuple(math.log(sum(math.exp(v / t) for v in logits) + vocab_rest *
                             math.exp(rest_logit / t)) for t in grid)
        return NodeDraws(tuple(tokens), tuple(logits), lse)

    tree.draws = {0: draws([9, 4], [2.0, 1.8]), a: draws([7], [0.5]),
                  b: draws([5], [3.0]), c: draws([6], [3.0]), d: draws([1], [0.0])}
    verify = [0, b, a, c, d, e]
    path = [0, b, c, d]
    sharp, soft = reranked_acceptance(tree, verify, path, grid)
    # by hand: cumulative log-probabilities at each tau, the best 3 of 6 nodes kept
    for tau, got in zip(grid, (sharp, soft)):
        cum = {0: 0.0}
        for node in verify[1:]:
            par = tree.parents[node]
            dr = tree.draws[par]
            g = grid.index(tau)
            cum[node] = cum[par] + dr.logits[dr.tokens.index(tree.tokens[node])] / tau - dr.lse[g]
        kept = sorted(verify, key=lambda v: (-cum[v], v))[:3]
        want = 0
        for node in path[1:]:
            if node not in kept:
                break
            want += 1
        assert got == want
    assert (sharp, soft) == (2, 1)
    # a verified node whose parent kept no draws at every tau: no score
    tree.draws[b] = NodeDraws((5,), (3.0,), (1.0,))
    assert reranked_acceptance(tree, verify, path, grid) is None


def test_the_walk_score_ranks_once_enough_nodes_are_counted():
    fit = TauFit(0.3)
    fit.walked[fit.grid.index(1.0)] = 5.0
    assert fit.tau == 0.3  # fewer than MIN_OBSERVED nodes: the default
    fit.observed = MIN_OBSERVED
    assert fit.tau == 1.0
