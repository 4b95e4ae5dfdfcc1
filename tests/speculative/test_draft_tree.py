"""The draft's tree grown ahead (speculative.tree): while a target pass verifies a snapshot, the
draft keeps growing the same tree; where the walk's outcome is in it, the subtree below is the
next tree, with the draft's cache compacted to match. Lossless whatever was grown ahead, and
the caches hold what fresh forwards write."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.speculative.tree import TreeGrower
from slipstream.runtime.sampler import Sampler, SamplingParams
from slipstream.speculative.rounds import Speculator
from speculative.test_speculative import tiny_models

PREFIX = [3, 17, 99, 250, 7, 42, 300, 12]
ROOT = 77
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target, close draft, wrong draft), as in test_speculative, with room for trees grown
    ahead."""
    models = tiny_models(tmp_path_factory.mktemp("ahead"), ctx=160)
    yield models
    for m in models:
        m.close()


def _fresh_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values a fresh plain forward of ids writes (layers, heads, len(ids), dim)."""
    fresh = slipstream.load(model.path, device="cpu", ctx=160, precision="exact")
    fresh.engine.forward(ids)
    n = len(ids)
    kv = fresh.engine.kv.k[:, :, :n].clone(), fresh.engine.kv.v[:, :, :n].clone()
    fresh.close()
    return kv


def _grown(draft, levels: int) -> TreeGrower:
    draft.engine.reset()
    draft.engine.forward(PREFIX)
    grower = TreeGrower.begin(draft.engine, ROOT, [], top_k=4)
    grower.grow(10, 3, None)
    grower.ahead(lambda: True, width=6, levels=levels)
    return grower


@pytest.mark.slow
def test_snapshot_is_closed_under_ancestors_and_bounded(tiny):
    grower = _grown(tiny[1], levels=3)
    tree = grower.tree
    assert grower.ahead_forwards == 3 and len(tree) > 10
    for nodes, depth in [(10, 3), (6, 2), (40, 5), (200, 64)]:
        keep = grower.snapshot(nodes, depth)
        assert len(keep) <= nodes and keep[0] == 0 and keep == sorted(set(keep))
        inside = set(keep)
        assert all(tree.parents[i] in inside for i in keep[1:])
        assert all(tree.depths[i] <= depth for i in keep)


def test_reroot_keeps_the_subtree_and_its_cache(tiny):
    """The subtree of a node grown ahead becomes a tree of its own: same tokens below it,
    log-probs from it, and the draft's cache holds the path then the subtree, whose nodes that
    ran hold the keys a fresh forward of their context writes."""
    draft = tiny[1]
    grower = _grown(draft, levels=4)
    tree = grower.tree
    # a node that ran, below the root, with a child that ran too
    node = next(i for i in range(1, len(tree))
                if tree.ran[i] and any(tree.ran[c] for c in tree.children[i].values()))
    path = list(tree.paths[tree.parents[node]])
    sub = tree.subtree(node)
    new = grower.reroot(path, tree.tokens[node])
    assert new is not None and new.start == len(PREFIX) + len(path)
    out = new.tree
    assert out.tokens == [tree.tokens[i] for i in sub]
    assert out.ran == [tree.ran[i] for i in sub]
    for j, i in enumerate(sub):
        assert abs(out.logprobs[j] - (tree.logprobs[i] - tree.logprobs[node])) < 1e-9
        assert out.depths[j] == tree.depths[i] - tree.depths[node]
    assert all(0 <= p < len(out) for _, p, _, _ in new.pool)
    assert draft.engine.length == new.start + len(out)
    # the root's and a deeper ran node's cache entries equal a fresh forward of their context
    context = PREFIX + [ROOT] + [tree.tokens[i] for i in path[1:]]
    deep = max((j for j in range(len(out)) if out.ran[j]), key=lambda j: out.depths[j])
    assert out.depths[deep] >= 1
    ids = context + [out.tokens[k] for k in out.paths[deep]]
    k_want, v_want = _fresh_kv(draft, ids)
    eng = draft.engine
    for slot, pos in [(new.start, len(context)), (new.start + deep, len(ids) - 1)]:
        assert torch.allclose(eng.kv.k[:, :, slot], k_want[:, :, pos], atol=1e-4, rtol=1e-4)
        assert torch.allclose(eng.kv.v[:, :, slot], v_want[:, :, pos], atol=1e-4, rtol=1e-4)
    # the path sits in place before it
    n = len(context)
    assert torch.allclose(eng.kv.k[:, :, :n], k_want[:, :, :n], atol=1e-4, rtol=1e-4)
    # a token the tree does not hold below the path's end gives no subtree
    grower = _grown(draft, levels=2)
    absent = next(t for t in range(1000) if t not in grower.tree.children[0])
    assert grower.reroot([0], absent) is None


@pytest.mark.slow
@pytest.mark.parametrize("which", [1, 2])
def test_growing_ahead_is_lossless(tiny, which):
    """Seed for seed, with penalties, a generation whose trees are grown ahead gives plain
    decoding's tokens, with a close draft (whose trees are often grown ahead) and a wrong
    one."""
    target, drafts = tiny[0], tiny
    params = dict(SAMPLING, repeat_penalty=1.3, presence_penalty=0.2, max_tokens=24)
    ahead_trees = 0
    for seed in range(10):
        plain = [e.id for e in target.generate(PREFIX, seed=seed, **params)]
        gen = target.generate(PREFIX, seed=seed, draft=drafts[which], spec_nodes=12,
                              spec_depth=4, spec_ahead=3, **params)
        spec = [e.id for e in gen]
        assert spec == plain, seed
        extra = gen.stats.extra
        ahead_trees += extra["spec_ahead_trees"]
        assert extra["spec_ahead_forwards"] >= 3
    if which == 1:
        assert ahead_trees > 0
    greedy = dict(temperature=0, max_tokens=40)
    plain = [e.id for e in target.generate(PREFIX, **greedy)]
    spec = [e.id for e in target.generate(PREFIX, draft=drafts[which], spec_nodes=16,
                                          spec_depth=5, spec_ahead=4, **greedy)]
    assert spec == plain


@pytest.mark.slow
def test_caches_hold_the_accepted_prefix_with_trees_grown_ahead(tiny):
    """After every round: the target's cache holds prompt + emitted - 1 tokens; the draft's
    either the same less its lag, or (the pending root's tree grown ahead) the same, then the
    root and the subtree; and the keys are a fresh prefill's."""
    target, draft, _ = tiny
    sampler = Sampler(SamplingParams(temperature=0))  # greedy: about a third of the rounds
    spec = Speculator(target.engine, draft.engine, sampler, nodes=10, depth=4, top_k=4,
                      ahead=3)
    emitted = [int(spec.prefill(PREFIX))]
    t, d = target.engine, draft.engine
    grown_rounds = 0
    for _ in range(16):
        emitted += [int(x) for x in spec.round(60)]
        assert t.length == len(PREFIX) + len(emitted) - 1
        assert spec.history.tolist() == PREFIX + emitted
        if spec.grown is None:
            assert d.length + len(spec.lag) == t.length
            assert spec.lag == (PREFIX + emitted)[d.length:t.length]
            continue
        grown_rounds += 1
        assert spec.lag == [] and spec.grown.start == t.length
        assert spec.grown.tree.tokens[0] == emitted[-1]
        assert d.length == t.length + len(spec.grown.tree)
        k_want, _ = _fresh_kv(draft, PREFIX + emitted)  # the root ran at slot t.length
        n = t.length + 1
        assert torch.allclose(d.kv.k[:, :, :n], k_want[:, :, :n], atol=1e-4, rtol=1e-4)
    assert grown_rounds > 0
    k_want, _ = _fresh_kv(target, PREFIX + emitted[:-1])
    assert torch.allclose(t.kv.k[:, :, :t.length], k_want, atol=1e-4, rtol=1e-4)


def test_top_up_grows_a_tree_grown_ahead_to_the_rounds_depth(tiny):
    """A subtree grown ahead beside other outcomes may be shallow: topped up in series (as a
    fresh tree's levels grow, within the budget), its run nodes go deeper, and what the draft
    ran holds a fresh forward's keys; a tree already deep enough gets nothing in series."""
    draft = tiny[1]
    grower = _grown(draft, levels=2)
    tree = grower.tree
    node = next(i for i in range(1, len(tree)) if tree.ran[i] and tree.depths[i] == 1)
    new = grower.reroot([0], tree.tokens[node])
    out = new.tree

    def ran_depth() -> int:
        return max(d for d, r in zip(out.depths, out.ran) if r)

    before, size = ran_depth(), len(out)
    assert before < 4
    forwards = new.top_up(size + 24, 5, None)
    assert forwards >= 1 and ran_depth() > before and len(out) <= size + 24
    assert new.top_up(len(out) + 24, ran_depth() + 1, None) == 0
    last_ran = max(j for j in range(len(out)) if out.ran[j])
    assert new.start + last_ran < draft.engine.length <= new.start + len(out)
    deep = max((j for j in range(len(out)) if out.ran[j]), key=lambda j: out.depths[j])
    ids = PREFIX + [ROOT] + [out.tokens[k] for k in out.paths[deep]]
    k_want, _ = _fresh_kv(draft, ids)
    got = draft.engine.kv.k[:, :, new.start + deep]
    assert torch.allclose(got, k_want[:, :, len(ids) - 1], atol=1e-4, rtol=1e-4)
