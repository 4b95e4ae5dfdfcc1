"""The trees' ranking temperature fitted to the target's draws (runtime.tree_calibration): the
scores against torch's own softmax, the fit recovering a known temperature from draws, and the
fit in a speculative generation (which stays lossless: test_speculative)."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.runtime.draft_tree import TreeGrower, tree_tau
from slipstream.runtime.sampler import Sampler, SamplingParams
from slipstream.runtime.spec_sizing import TreeSizer
from slipstream.runtime.speculative import Speculator
from slipstream.runtime.tree_calibration import (GRID, MIN_OBSERVED, NodeDraws, TauFit,
                                                 logsumexps)
from runtime.test_speculative import tiny_models

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


def test_a_draw_is_scored_at_its_chance_under_the_draft_coarsened_to_its_top_k():
    """In the top k: the draft's softmax at tau; outside: the chance of anything else."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(500, generator=gen) * 3
    k = 8
    fit = TauFit(0.5)
    node = _draws(row, fit.grid, k)
    inside, outside = node.tokens[3], int(torch.argsort(row)[0])
    for token in (inside, outside):
        before = list(fit.loglik)
        fit.observe(node, token)
        for g, tau in enumerate(fit.grid):
            p = torch.softmax(row.double() / tau, -1)
            want = p[token] if token in node.tokens else 1 - p[list(node.tokens)].sum()
            assert math.isclose(fit.loglik[g] - before[g], math.log(want), rel_tol=1e-4,
                                abs_tol=1e-5)
    assert fit.observed == 2


@pytest.mark.parametrize("truth", [0.35, 1.0])
def test_the_fit_finds_the_temperature_the_draws_come_from(truth):
    """Draws from softmax(logits / truth): after enough of them the fit ranks at truth, the
    grid's member; before MIN_OBSERVED it keeps the default it was given."""
    gen = torch.Generator().manual_seed(2)
    fit = TauFit(0.7)
    assert truth in fit.grid
    for i in range(600):
        row = torch.randn(2000, generator=gen) * 2.5
        token = int(torch.multinomial(torch.softmax(row / truth, -1), 1, generator=gen))
        fit.observe(_draws(row, fit.grid, 8), token)
        if i + 1 < MIN_OBSERVED:
            assert fit.tau == 0.7
    assert fit.tau == truth


def test_fixed_keeps_the_default(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TREE_TAU", "fixed")
    fit = TauFit(0.3)
    assert fit.grid == (0.3,)
    node = NodeDraws((1, 2), (5.0, 1.0), (5.0 / 0.3,))
    for _ in range(2 * MIN_OBSERVED):
        fit.observe(node, 2)
    assert fit.tau == 0.3


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
    assert any(v != 0.0 for v in fit.loglik)
    again = Speculator(target.engine, draft.engine, sampler, nodes=24, depth=4, sizer=sizer)
    assert again.fit is fit and again.tau == fit.tau


def test_a_settled_fit_stops_scoring_and_keeps_its_temperature():
    """Past `settled_at` scored nodes the fit stops: trees keep no grid (one pass over the
    vocabulary a level) and further draws change nothing."""
    gen = torch.Generator().manual_seed(3)
    fit = TauFit(0.3, settled_at=200)
    assert fit.grid_to_keep == fit.grid
    while not fit.settled:
        row = torch.randn(1000, generator=gen) * 2.5
        token = int(torch.multinomial(torch.softmax(row / 1.0, -1), 1, generator=gen))
        fit.observe(_draws(row, fit.grid, 8), token)
    assert fit.observed == 200 and fit.grid_to_keep == () and fit.tau == 1.0
    frozen = list(fit.loglik)
    row = torch.randn(1000, generator=gen)
    fit.observe(_draws(row, fit.grid, 8), int(row.argmax()))
    assert fit.loglik == frozen and fit.tau == 1.0
    # a node kept at one temperature only (a tree grown after settling) is never scored
    fresh = TauFit(0.3)
    fresh.observe(_draws(row, (0.3,), 8), int(row.argmax()))
    assert fresh.observed == 0
