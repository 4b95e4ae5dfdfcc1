"""Tree speculative decoding on CUDA: the draft's level steps and the decode graphs share a
cache, the verify pass runs masked attention over the fp16 cache; the tokens stay plain
decoding's."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.errors import BudgetTooSmall
from speculative.test_speculative import GREEDY_PROMPTS, PREFIX, SAMPLING, requantize
from slipstream.synth import write_synth

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.fixture(scope="module")
def smollm_spec_gpu(smollm_path, tmp_path_factory):
    pytest.importorskip("triton")
    draft = requantize(smollm_path, tmp_path_factory.mktemp("draft") / "draft-q4_0.gguf")
    model = slipstream.load(smollm_path, device=DEVICE, ctx=512, precision="exact",
                            draft=draft)
    yield model
    model.close()


def test_gpu_greedy_equals_plain_greedy(smollm_spec_gpu):
    """precision "exact": fp32 GEMVs in decode and fp32 matmuls in the tree pass, which still
    round differently over the fp16 cache; a parting is accepted only at a near-tie, and the
    tokens after it are compared too (_greedy_equals_plain)."""
    model = smollm_spec_gpu
    for prompt in GREEDY_PROMPTS:
        ties, extra, _ = _greedy_equals_plain(model, model.tokenize(prompt), 128,
                                              spec_nodes=64, spec_depth=8)
        print(f"{prompt!r}: near-ties (token, top-2 margin) {ties}")
        assert extra["spec_tokens_per_pass"] > 1.5, extra


def test_gpu_seeded_sampling_equals_plain(tmp_path):
    kw = dict(n_layers=2, from_floats=True, std=0.1, seed=5)
    target = slipstream.load(write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", **kw),
                             device=DEVICE, ctx=128, precision="exact")
    draft = slipstream.load(write_synth(tmp_path / "d.gguf", "tiny", "Q4_0", **kw),
                            device=DEVICE, ctx=128, precision="exact")
    params = dict(SAMPLING, repeat_penalty=1.3, max_tokens=24)
    # On CUDA the tree pass (masked attention, batched GEMV) and the decode step (fused
    # kernels) round differently even at "exact", so a draw that lands within rounding of a
    # boundary of the cumulative distribution may flip (measured: seed 1 of 8 on the H200);
    # a broken walk would part on nearly every seed
    parted = []
    for seed in range(16):
        plain = [e.id for e in target.generate(PREFIX, seed=seed, **params)]
        spec = [e.id for e in target.generate(PREFIX, seed=seed, draft=draft, spec_nodes=12,
                                              spec_depth=6, **params)]
        if spec != plain:
            parted.append((seed, next(i for i, (a, b) in enumerate(zip(spec, plain))
                                      if a != b)))
    assert len(parted) <= 3, f"seeds that parted (seed, token): {parted}"
    target.close()
    draft.close()


# On CUDA even "exact" keeps an fp16 KV cache, and a tree pass (dequantize + cuBLAS) and a
# decode step (fused GEMV) round apart: the synthetic "never pays" model, at its give-up,
# parted from plain greedy at token 22 where its top-2 logits lay 1.56e-2 apart on the H200,
# the same token with and without trees grown ahead; the default model's first greedy prompt
# parted at token 60, where its top-2 logits lay 0 apart on the H200 and 3.37e-3 on an H100.
# A difference is accepted only at such a near-tie, after MIN_EQUAL tokens;
# _greedy_equals_plain goes on past it, MAX_TIES times
NEAR_TIE = 0.05
MIN_EQUAL = 16
MAX_TIES = 2


def _parting(model, ids: list[int], spec: list[int], plain: list[int],
             equal_before: int = 0, report: dict | None = None) -> tuple[int, float] | None:
    """Where speculative greedy `spec` parts from plain greedy `plain` (both continuing `ids`,
    after `equal_before` tokens that agreed): None where they agree, else (index, top-2
    margin) if it is a near-tie of the target's logits (margin below NEAR_TIE, after at least
    MIN_EQUAL equal tokens in all); otherwise fail with the margin, which tells batched and
    single-token passes rounding apart from a real fault."""
    if spec == plain:
        return None
    at = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b),
              min(len(spec), len(plain)))
    margin = float("inf")
    if at < min(len(spec), len(plain)):
        top = torch.topk(model.logits(list(ids) + plain[:at])[-1].float(), 2).values
        margin = float(top[0] - top[1])
    if equal_before + at >= MIN_EQUAL and margin < NEAR_TIE:
        return at, margin
    pytest.fail(f"speculative greedy differs from plain greedy at token {equal_before + at} "
                f"({spec[at:at + 1]} against {plain[at:at + 1]}); the top-2 logit margin "
                f"there is {margin:.2e}; {report}")


def _assert_same(model, ids: list[int], spec: list[int], plain: list[int],
                 report: dict | None = None) -> None:
    """Speculative greedy equals plain greedy, or parts from it only at a near-tie
    (_parting). For runs whose state cannot be replayed (a draft given up midway); where it
    can, _greedy_equals_plain also checks the tokens after a tie."""
    _parting(model, ids, spec, plain, report=report)


def _greedy_equals_plain(model, ids: list[int], tokens: int,
                         **spec) -> tuple[list[tuple[int, float]], dict, dict | None]:
    """Greedy decoding of `ids` with the model's draft (`spec`: the tree's options) against
    plain greedy, token for token over `tokens` tokens. At a near-tie (_parting) both go on
    from plain's tokens through the tied one, at most MAX_TIES times, so that a fault after
    a tie still fails. Returns the ties (token index, top-2 margin), the first speculative
    run's figures (GenerationStats.extra) and the last one's speculation."""
    ids, done, ties, first = list(ids), 0, [], None
    while done < tokens:
        plain = [e.id for e in model.generate(ids, max_tokens=tokens - done, temperature=0,
                                              draft=False)]
        gen = model.generate(ids, max_tokens=tokens - done, temperature=0, **spec)
        out = [e.id for e in gen]
        first = dict(gen.stats.extra) if first is None else first
        tie = _parting(model, ids, out, plain, done, gen.speculation)
        if tie is None:
            break
        at, margin = tie
        ties.append((done + at, margin))
        assert len(ties) <= MAX_TIES, f"more than {MAX_TIES} near-ties: {ties}"
        ids += plain[:at + 1]
        done += at + 1
    return ties, first, gen.speculation


def _streamed_with_draft(target, draft, resident: int = 2, ram_budget=None, **kw):
    """The target loaded with `draft` resident and at most `resident` of its own layers in
    VRAM (Placement.vram_layers), the rest streamed from pinned RAM or disk as the RAM budget
    says."""
    place = slipstream.Placement(vram_layers=resident, ram_budget=ram_budget)
    return slipstream.load(target, device=DEVICE, ctx=512, draft=draft, placement=place, **kw)


def _streamed_by_budget(target, draft, ram_budget=None, **kw):
    """As _streamed_with_draft, but by a VRAM budget rather than a cap, so that the VRAM a
    released draft gives back can make layers resident: the draft's own VRAM, plus the least
    budget the target alone plans in, plus steps of 16 MiB (the draft's captured graphs come
    out of the budget too). For a model whose layers outweigh its streaming reserve: a small
    one's budget stepped up from below reaches the all-resident plan first."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with slipstream.load(draft, device=DEVICE, ctx=512):
        draft_vram = torch.cuda.memory_reserved() - before
    torch.cuda.empty_cache()
    least = None
    for mib in range(16, 2048, 16):
        try:
            slipstream.plan(target, device=DEVICE, ctx=512, measure=False,
                            precision=kw.get("precision", "fast"),
                            placement=slipstream.Placement(vram_budget=mib << 20,
                                                           ram_budget=ram_budget))
        except BudgetTooSmall:
            continue
        least = mib
        break
    assert least is not None
    for extra in range(least + 16, least + 1024, 16):
        try:
            place = slipstream.Placement(vram_budget=draft_vram + (extra << 20),
                                         ram_budget=ram_budget)
            return slipstream.load(target, device=DEVICE, ctx=512, draft=draft,
                                   placement=place, **kw)
        except BudgetTooSmall:
            continue
    pytest.fail("no budget up to 1 GiB over the least one holds the target with its draft")


def test_gpu_streamed_target_greedy_equals_plain(smollm_path, tmp_path):
    """The target streams most layers (a small VRAM budget after the resident draft, layers
    from pinned RAM and disk) and the sizer picks the trees: still plain greedy's tokens."""
    pytest.importorskip("triton")
    draft = requantize(smollm_path, tmp_path / "draft-q4_0.gguf")
    model = _streamed_with_draft(smollm_path, draft, precision="exact", ram_budget="24MiB")
    with model:
        assert model.plan.draft is not None and model.plan.streamed_layers
        assert "disk" in model.plan.tiers
        for prompt in GREEDY_PROMPTS[:3]:
            ids = model.tokenize(prompt)
            plain = [e.id for e in model.generate(ids, max_tokens=64, temperature=0,
                                                  draft=False)]
            gen = model.generate(ids, max_tokens=64, temperature=0)
            spec = [e.id for e in gen]
            _assert_same(model, ids, spec, plain, gen.speculation)
            gen = model.generate(ids, max_tokens=64, temperature=0, spec_ahead=AHEAD)
            beside = [e.id for e in gen]
            _assert_same(model, ids, beside, plain, gen.speculation)
            # how many levels fit beside a pass is timing (a small model's pass is bound by
            # the host launching it, which leaves the draft little): none ran in series
            got = gen.speculation
            assert got["ahead_beside"] == got["ahead_forwards"], got
        assert got["target_passes"] > 0


def test_gpu_lowbit_draft_over_a_streamed_target_is_lossless(smollm_path):
    """The low-bit copy of the layers the target streams (2 resident, the rest from pinned RAM
    and disk) drafts from VRAM alone, writing into the target's KV cache: plain greedy's
    tokens."""
    pytest.importorskip("triton")
    with slipstream.load(smollm_path, device=DEVICE, ctx=512, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q2_K"),
                         placement=slipstream.Placement(ram_budget="24MiB",
                                                        vram_layers=2)) as model:
        streamed = model.plan.streamed_layers
        assert len(streamed) == model.config.n_layers - 2 and "disk" in model.plan.tiers
        assert model.plan.draft[0] == f"self: Q2_K copy, {len(streamed)} layers"
        draft = model.draft.engine
        assert draft.shares_kv(model.engine) and draft.use_graphs
        assert sorted(draft.stages[0].store.layers[i] is not None
                      for i in range(model.config.n_layers)) == [True] * model.config.n_layers
        for prompt in GREEDY_PROMPTS[:3]:
            _, _, got = _greedy_equals_plain(model, model.tokenize(prompt), 64, spec_nodes=32,
                                             spec_depth=8)
        assert got["tokens_per_pass"] > 1.5, got


def test_gpu_lowbit_copy_of_a_synthetic_streamed_target_is_lossless(tmp_path):
    """As above without the real model: a synthetic Q8_0 target whose 6 streamed layers (pinned
    RAM and disk) get a Q4_0 copy in VRAM; the draft mixes the copies with the target's 2
    resident layers and writes into the target's KV cache, through captured graphs."""
    pytest.importorskip("triton")
    kw = dict(n_layers=8, from_floats=True, std=0.05, seed=5)
    target = write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", **kw)
    with slipstream.load(target, device=DEVICE, ctx=512, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q4_0"),
                         placement=slipstream.Placement(ram_budget="3MiB",
                                                        vram_layers=2)) as model:
        streamed = model.plan.streamed_layers
        assert len(streamed) == 6 and "disk" in model.plan.tiers, model.plan.tiers
        assert model.plan.draft[0] == "self: Q4_0 copy, 6 layers", model.plan.draft
        draft = model.draft.engine
        assert draft.shares_kv(model.engine) and draft.use_graphs
        _, _, got = _greedy_equals_plain(model, [1, 2, 3, 4], 96, spec_nodes=32, spec_depth=6)
        assert got["tokens_per_pass"] > 1.5, got


def test_gpu_layer_skip_draft_of_a_streamed_target_is_lossless(tmp_path):
    """The layer-skip self-draft of a target that streams 2 of its 8 layers (both skipped) runs
    the resident 6 through captured graphs, writing into the target's KV cache; the target's
    token table stays on the host, so the draft holds a VRAM copy of it (a host lookup cannot
    be captured: a self-draft's first run on a streamed target failed there)."""
    pytest.importorskip("triton")
    kw = dict(n_layers=8, from_floats=True, std=0.05, seed=5)
    target = write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", **kw)
    with slipstream.load(target, device=DEVICE, ctx=512, precision="exact",
                         draft=slipstream.SelfDraft(skip_layers=2),
                         placement=slipstream.Placement(ram_budget="3MiB",
                                                        vram_layers=6)) as model:
        assert len(model.plan.streamed_layers) == 2 and model.plan.embed_on_host
        draft = model.draft.engine
        assert draft.shares_kv(model.engine) and draft.use_graphs
        assert model.engine.weights.embed.raw.device.type == "cpu"
        assert draft.weights.embed.raw.device.type == "cuda"
        _, extra, got = _greedy_equals_plain(model, [1, 2, 3, 4], 96, spec_nodes=32,
                                             spec_depth=6)
        assert got is not None, extra


AHEAD = 64  # levels a tree may grow past its verified nodes, beside the target's pass


def test_gpu_growing_beside_a_streamed_pass_is_lossless(tmp_path):
    """The draft (the target's weights at 4 bits) grows the next tree on its own stream while
    the target's layers stream from pinned RAM and disk: the levels run beside the pass, trees
    grown there are reused, and the tokens stay plain greedy's."""
    pytest.importorskip("triton")
    kw = dict(n_layers=8, from_floats=True, std=0.05, seed=5)
    target = write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", **kw)
    draft = write_synth(tmp_path / "d.gguf", "tiny", "Q4_0", **kw)
    # 0.6 MB images: 3 MiB holds the disk tier's 3 staging buffers and 2 pinned layers (at 4 MiB
    # all 6 streamed layers were pinned)
    model = _streamed_with_draft(target, draft, precision="exact", ram_budget="3MiB")
    with model:
        assert model.plan.draft is not None and "disk" in model.plan.tiers, model.plan.tiers
        prompt = [1, 2, 3, 4]
        plain = [e.id for e in model.generate(prompt, max_tokens=96, temperature=0,
                                              draft=False)]
        gen = model.generate(prompt, max_tokens=96, temperature=0, spec_nodes=32,
                             spec_depth=4, spec_ahead=AHEAD)
        spec = [e.id for e in gen]
        got = gen.speculation
        _assert_same(model, prompt, spec, plain, got)
        assert got["ahead_beside"] == got["ahead_forwards"], got
        print(f"tiers {sorted(set(model.plan.tiers))}: {got}")


def test_tree_level_graphs_match_eager(smollm_path):
    """A draft level through a captured graph (padded to its width bucket) gives the logits
    the eager step gives, for widths inside and past the GEMV's rows."""
    pytest.importorskip("triton")
    from slipstream.model import tree_step

    with slipstream.load(smollm_path, device=DEVICE, ctx=512) as model:
        engine = model.engine
        assert engine.use_graphs
        for n in (1, 3, 8, 13, 40):
            out = {}
            for graphs in (True, False):
                engine.use_graphs = graphs
                engine.reset()
                engine.forward(list(range(10, 50)))
                parents = [-1] + [t // 2 for t in range(n - 1)]
                step = tree_step(parents, 40, 40, engine.device)
                ids = torch.arange(100, 100 + n, device=engine.device)
                out[graphs] = engine.forward(ids, all_logits=True, step=step).clone()
                assert engine.length == 40 + n
            engine.use_graphs = True
            assert out[True].shape == (n, model.config.vocab_size)
            torch.testing.assert_close(out[True], out[False], atol=2e-2, rtol=1e-2)
        assert engine._tree_graphs is not None and engine._tree_graphs.graphs


@pytest.mark.gpu_alone
def test_gpu_a_draft_that_never_pays_gives_its_vram_to_the_target(tmp_path):
    """A draft of other weights (a second seed) inside the budget: the sizer gives it up, the
    VRAM it held makes pinned layers resident, and the output stays plain greedy's."""
    pytest.importorskip("triton")
    kw = dict(n_layers=6, from_floats=True, std=0.05)
    target = write_synth(tmp_path / "t.gguf", "1b", "Q4_K", seed=5, **kw)
    other = write_synth(tmp_path / "o.gguf", "1b", "Q4_K", seed=6, **kw)
    # "exact": random weights give near-ties everywhere, which a 256-node tree pass and a
    # decode step at "fast" round apart (the test failed at token 14 that way)
    model = _streamed_by_budget(target, other, precision="exact")
    with model:
        streamed = list(model.plan.streamed_layers)
        assert streamed and model.plan.draft is not None
        prompt = [1, 2, 3, 4]
        plain = [e.id for e in model.generate(prompt, max_tokens=300, temperature=0,
                                              draft=False)]
        gen = model.generate(prompt, max_tokens=300, temperature=0)
        spec = [e.id for e in gen]
        _assert_same(model, prompt, spec, plain, gen.speculation)
        assert gen.speculation["draft_given_up_at"] is not None
        name, promoted = model.speculation.released.draft, model.speculation.released.promoted
        assert name == "o.gguf" and promoted and set(promoted) <= set(streamed)
        assert len(model.plan.streamed_layers) == len(streamed) - len(promoted)
        # the layout of the same budget without the draft comes back (load streamed those
        # layers first beside the draft)
        plain_streamed = model.speculation.plain_streamed
        assert plain_streamed is not None and set(plain_streamed) <= set(streamed)
        assert model.plan.streamed_layers == plain_streamed
        again = [e.id for e in model.generate(prompt, max_tokens=64, temperature=0)]
        _assert_same(model, prompt, again, plain[:64])
