"""The step contract: tree steps (positions != slots, many tokens per position), KV cache
truncate/compact, and an engine chained from several stages."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_stages
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.model import tree_step
from slipstream.precision import Precision
from slipstream.runtime.engine import Engine
from slipstream.synth import write_synth
from slipstream.weights import load_weights

PREFIX = [3, 17, 99, 250, 7, 42]
# a tree of drafted tokens: node t's parent is PARENTS[t] (-1: a child of the prefix's end)
PARENTS = [-1, 0, 0, 1, -1, 4, 2, 3, 3]
NODES = [11, 500, 8, 77, 300, 5, 61, 19, 400]


@pytest.fixture(scope="module")
def model_parts(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("step") / "m.gguf", "tiny", "Q8_0",
                       n_layers=4, from_floats=True, std=0.1, seed=5)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    # float32 weights: every path below computes in float32, so paths that differ only in
    # batching agree to rounding
    weights = load_weights(gf, cfg, torch.device("cpu"), Precision.of("exact", torch.device("cpu")))
    return cfg, weights


def _engine(parts, ctx: int = 64, cuts: tuple[int, ...] = ()) -> Engine:
    cfg, weights = parts
    return Engine(cfg, weights, cpu_stages(cfg, weights, ctx, cuts))


def _path(t: int) -> list[int]:
    """Node indices from the tree's root down to node t."""
    out = []
    while t >= 0:
        out.append(t)
        t = PARENTS[t]
    return out[::-1]


def _reference(parts, tokens: list[int]) -> torch.Tensor:
    """Logits of the last of `tokens`, fed one at a time into a fresh context."""
    engine = _engine(parts)
    logits = None
    for tok in tokens:
        logits = engine.forward([tok])
    return logits[-1]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).norm() / b.norm()) < 1e-4 and int(a.argmax()) == int(b.argmax())


@pytest.mark.slow
def test_tree_step_matches_token_by_token(model_parts):
    engine = _engine(model_parts)
    engine.forward(PREFIX)
    start = engine.length
    step = tree_step(PARENTS, start, start, torch.device("cpu"))
    # siblings share a position (their depth past the prefix), each has a slot of its own
    assert step.positions.tolist() == [start + len(_path(t)) - 1 for t in range(len(NODES))]
    assert step.slots.tolist() == list(range(start, start + len(NODES)))
    logits = engine.forward(NODES, all_logits=True, step=step)
    assert logits.shape[0] == len(NODES) and engine.length == start + len(NODES)
    for t in range(len(NODES)):
        want = _reference(model_parts, PREFIX + [NODES[j] for j in _path(t)])
        assert _close(logits[t], want), f"node {t}"


@pytest.mark.parametrize("first", [1, 4, 8])
def test_tree_step_grown_level_by_level(model_parts, first):
    """A tree written in two steps (nodes ..first-1, then first.. with `first`, the earlier
    nodes already cached) gives the logits of the tree written at once."""
    whole = _engine(model_parts)
    whole.forward(PREFIX)
    start = whole.length
    want = whole.forward(NODES, all_logits=True,
                         step=tree_step(PARENTS, start, start, torch.device("cpu")))
    engine = _engine(model_parts)
    engine.forward(PREFIX)
    head = engine.forward(NODES[:first], all_logits=True,
                          step=tree_step(PARENTS[:first], start, start, torch.device("cpu")))
    step = tree_step(PARENTS, start, start, torch.device("cpu"), first=first)
    assert step.slots.tolist() == list(range(start + first, start + len(NODES)))
    assert step.start == start + first and step.span == step.end == start + len(NODES)
    assert step.positions.tolist() == \
        [start + len(_path(t)) - 1 for t in range(first, len(NODES))]
    tail = engine.forward(NODES[first:], all_logits=True, step=step)
    assert engine.length == start + len(NODES)
    got = torch.cat((head, tail))
    for t in range(len(NODES)):
        assert _close(got[t], want[t]), f"node {t}"
    with pytest.raises(ValueError, match="first"):
        tree_step(PARENTS, start, start, torch.device("cpu"), first=len(PARENTS))


def test_compact_keeps_an_accepted_branch(model_parts):
    """After a tree pass, keep one branch (compact) and decode on: the same logits as if the
    branch had been decoded token by token, and the other branches leave no trace."""
    engine = _engine(model_parts)
    engine.forward(PREFIX)
    start = engine.length
    engine.forward(NODES, all_logits=True,
                   step=tree_step(PARENTS, start, start, torch.device("cpu")))
    branch = _path(7)  # nodes 0, 1, 3, 7
    engine.compact([start + t for t in branch], start)
    assert engine.length == start + len(branch)
    got = engine.forward([123])[-1]
    want = _reference(model_parts, PREFIX + [NODES[t] for t in branch] + [123])
    assert _close(got, want)


def test_truncate_drops_rejected_tokens(model_parts):
    engine = _engine(model_parts)
    engine.forward(PREFIX + [9, 9, 9])
    engine.truncate(len(PREFIX))
    assert engine.length == len(PREFIX)
    assert _close(engine.forward([5])[-1], _reference(model_parts, PREFIX + [5]))
    with pytest.raises(ValueError):
        engine.truncate(len(PREFIX) + 5)


def test_kv_compact_overlapping_moves():
    """compact gathers before it writes: sources that overlap the destination are safe."""
    from slipstream.runtime.kv_cache import KVCache

    cfg = ModelConfig("llama", n_layers=2, hidden=8, ffn=16, n_heads=2, n_kv_heads=1,
                      head_dim=4, rope_dim=4, vocab_size=10, context_length=16, norm_eps=1e-5,
                      rope_base=1e4, rope_style="normal")
    kv = KVCache(cfg, 16, torch.device("cpu"), torch.float32)
    kv.k.copy_(torch.arange(16.0)[None, None, :, None].expand_as(kv.k))
    kv.v.copy_(-kv.k)
    kv.length = 12
    kv.compact([5, 4, 9, 11], 4)
    assert kv.length == 8
    assert kv.k[0, 0, :8, 0].tolist() == [0, 1, 2, 3, 5, 4, 9, 11]
    assert kv.v[1, 0, :8, 0].tolist() == [-0.0, -1, -2, -3, -5, -4, -9, -11]
    kv.truncate(3)
    assert kv.length == 3


def test_a_large_cpu_cache_is_zeros_until_written():
    """A CPU cache past _MAPPED_MIN_BYTES is an anonymous map (no memset at load): it reads
    as zeros everywhere, takes writes, outlives the map object it was made from, and compacts
    as a torch.zeros one does."""
    import gc

    from slipstream.runtime import kv_cache
    from slipstream.runtime.kv_cache import KVCache

    cfg = ModelConfig("llama", n_layers=3, hidden=64, ffn=16, n_heads=2, n_kv_heads=2,
                      head_dim=32, rope_dim=32, vocab_size=10, context_length=4096,
                      norm_eps=1e-5, rope_base=1e4, rope_style="normal")
    kv = KVCache(cfg, 4096, torch.device("cpu"), torch.float32)
    assert kv.k.nbytes >= kv_cache._MAPPED_MIN_BYTES  # the mapped case, not the memset one
    gc.collect()
    assert kv.k.shape == kv.v.shape == (3, 2, 4096, 32) and kv.k.dtype == torch.float32
    assert not kv.k.any() and not kv.v.any()
    k, v = kv.layer(2)
    k[:, 10] = 1.5
    v[1, 4095] = -2.0
    gc.collect()
    assert kv.k[2, :, 10].eq(1.5).all() and kv.v[2, 1, 4095].eq(-2.0).all()
    assert kv.k.count_nonzero() == 2 * 32 and kv.v.count_nonzero() == 32
    kv.length = 11
    kv.compact([10], 0)
    assert kv.k[2, :, 0].eq(1.5).all() and kv.length == 1
    small = KVCache(cfg, 16, torch.device("cpu"), torch.float32)  # below the bound: zeros
    assert not small.k.any() and small.k.nbytes < kv_cache._MAPPED_MIN_BYTES


def test_tree_step_rejects_bad_parents():
    with pytest.raises(ValueError, match="parent"):
        tree_step([-1, 2, 0], 0, 0, torch.device("cpu"))


@pytest.mark.parametrize("cuts", [(1,), (1, 3)])
def test_stages_give_the_same_logits_as_one(model_parts, cuts):
    one, many = _engine(model_parts), _engine(model_parts, cuts=cuts)
    assert len(many.stages) == len(cuts) + 1
    assert torch.equal(one.forward(PREFIX, all_logits=True), many.forward(PREFIX, all_logits=True))
    tok = torch.tensor([7])
    for _ in range(4):
        a, b = one.decode(tok), many.decode(tok)
        assert torch.equal(a, b)
        tok = a[-1].argmax().view(1)
    # each stage's cache holds only its own layers
    assert [st.kv.k.shape[0] for st in many.stages] == \
        [len(st.layers) for st in many.stages]
