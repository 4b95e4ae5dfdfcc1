"""The low-bit copy self-draft (load(draft=SelfDraft(lowbit=TYPE)), speculative.lowbit): the
copy's bytes against gguf-py's reference decoder, lossless speculation through it, and the KV
cache it shares with the target (speculative.rounds's invariant for a shared cache)."""

from __future__ import annotations

from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import slipstream
from slipstream.errors import BadArgument, BudgetTooSmall
from slipstream.memory.setup import layer_resident_bytes
from slipstream.model import tree_step
from slipstream.speculative.tree import grow_tree
from slipstream.runtime.sampler import Sampler, SamplingParams
from slipstream.speculative.rounds import Speculator
from slipstream.synth import write_synth
from slipstream.speculative.lowbit import RequantizedSource, RetypedFile, copy_type

PREFIX = [3, 17, 99, 250, 7, 42, 300, 12]
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_synth(tmp_path_factory.mktemp("lowbit") / "t.gguf", "tiny", "Q8_0", seed=5,
                       n_layers=2, from_floats=True, std=0.1)


@pytest.fixture(scope="module")
def tiny_lowbit(tiny_path):
    with slipstream.load(tiny_path, device="cpu", ctx=128, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q4_0")) as model:
        yield model


# --- the copy's bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("qtype, bound", [(Q.Q4_0, 0.2), (Q.Q2_K, 0.5)])
def test_copy_decodes_close_to_the_source_by_the_reference_decoder(smollm_path, qtype, bound):
    """Each matrix of a layer, read through RequantizedSource, is `qtype` (or the Q4_0
    fallback for 576-wide rows, which no K-quant block divides) and decodes by gguf-py's own
    dequantizer to within the type's rounding of the source's decoded weights; the sizes the
    planner reads (RetypedFile) are the bytes the source hands out; norms are the source's."""
    gf = slipstream.modelfile.gguf_file.GGUFFile(smollm_path)
    src = RequantizedSource(gf, qtype)
    view = RetypedFile(gf, qtype, [3])
    seen = set()
    for name in [n for n in gf.tensors if n.startswith("blk.3.")]:
        info = gf.tensors[name]
        raw = src.raw(name, tuple(info.shape))
        if len(info.shape) == 1:
            assert src.type_of(name) == info.ggml_type
            assert np.array_equal(raw.numpy().ravel(), np.asarray(gf.tensor_bytes(name)))
            continue
        to = src.type_of(name)
        want = qtype if info.shape[1] % 256 == 0 or qtype == Q.Q4_0 else Q.Q4_0
        assert to == want == copy_type(info, qtype), name
        seen.add(to)
        assert raw.numel() == view.tensors[name].n_bytes and view.tensors[name].ggml_type == to
        got = gguf.quants.dequantize(raw.numpy(), to).reshape(info.shape)
        ref = gguf.quants.dequantize(np.asarray(gf.tensor_bytes(name)).reshape(
            info.shape[0], -1), info.ggml_type).reshape(info.shape)
        err = np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
        assert 0 < err < bound, (name, to.name, err)
    assert qtype in seen
    gf.close()


# --- speculation through the copy --------------------------------------------------------------

@pytest.mark.slow
def test_lowbit_draft_is_lossless_and_shares_the_model(smollm_path):
    """Greedy speculative output equals plain greedy output (precision "exact"); the draft
    shares the model's weights object and KV cache, runs no prefill of its own, and its
    copy's bytes (every layer on the CPU) came out of the RAM budget."""
    with slipstream.load(smollm_path, device="cpu", ctx=256, precision="exact",
                         draft=slipstream.SelfDraft(lowbit="Q2_K")) as model:
        draft = model.draft
        assert draft.engine.weights is model.engine.weights
        assert draft.engine.shares_kv(model.engine) and draft.engine.kv is model.engine.kv
        n = model.config.n_layers
        view = RetypedFile(model.gguf, Q.Q2_K, range(n))
        held = sum(layer_resident_bytes(view, i, slipstream.precision.Precision.of(
            "exact", torch.device("cpu"))) for i in range(n))
        assert model.plan.draft == (f"self: Q2_K copy, {n} layers", held)
        # the copy's layers are its own; the target's are untouched
        store = draft.engine.stages[0].store
        assert all(store.acquire(i) is not model.engine.layers.acquire(i) for i in range(n))
        tokens = passes = 0
        for prompt in ("Photosynthesis is the process by which", "def fibonacci(n):"):
            ids = model.tokenize(prompt)
            plain = [e.id for e in model.generate(ids, max_tokens=40, temperature=0,
                                                  draft=False)]
            gen = model.generate(ids, max_tokens=40, temperature=0, spec_nodes=16,
                                 spec_depth=8)
            spec = [e.id for e in gen]
            assert spec == plain, prompt
            extra = gen.stats.extra
            assert extra["spec_draft_prefill_s"] == 0.0
            passes += extra["spec_target_passes"]
            tokens += round(extra["spec_tokens_per_pass"] * extra["spec_target_passes"])
        assert tokens / passes > 1.5, (tokens, passes)
    assert draft.engine is None  # closed with the model


@pytest.mark.slow
def test_verify_pass_ignores_what_the_draft_wrote(tiny_path, tiny_lowbit):
    """The draft grows its tree into the target's cache; the target's verify pass over that
    tree gives the same logits, bit for bit, as over a cache the draft never touched."""
    model = tiny_lowbit
    t, d = model.engine, model.draft.engine
    t.reset()
    t.forward(PREFIX)
    start = t.length
    tree = grow_tree(d, 77, [], 24, 4, 8)
    assert d.length is not None and start < t.length <= start + len(tree)  # one length
    step = tree_step(tree.parents, start, start, t.device)
    got = t.forward(tree.tokens, all_logits=True, step=step)
    with slipstream.load(tiny_path, device="cpu", ctx=128, precision="exact") as fresh:
        fresh.engine.forward(PREFIX)
        want = fresh.engine.forward(tree.tokens, all_logits=True, step=step)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_shared_cache_holds_the_accepted_prefix(tiny_path, tiny_lowbit):
    """After every round the one cache holds prompt + emitted - 1 tokens, with the keys a
    fresh prefill of them writes, and there is never a lag."""
    model = tiny_lowbit
    sampler = Sampler(SamplingParams(seed=3, **SAMPLING))
    spec = Speculator(model.engine, model.draft.engine, sampler, nodes=10, depth=4, top_k=4)
    emitted = [int(spec.prefill(PREFIX))]
    for _ in range(10):
        emitted += [int(x) for x in spec.round(50)]
        assert model.engine.length == len(PREFIX) + len(emitted) - 1
        assert spec.lag == [] and spec.grown is None
    assert sum(spec.stats.accepted[1:]) > 0
    context = PREFIX + emitted[:-1]
    with slipstream.load(tiny_path, device="cpu", ctx=128, precision="exact") as fresh:
        fresh.engine.forward(context)
        n = len(context)
        for got, want in ((model.engine.kv.k, fresh.engine.kv.k),
                          (model.engine.kv.v, fresh.engine.kv.v)):
            assert torch.allclose(got[:, :, :n], want[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_seeded_sampling_equals_plain(tiny_lowbit):
    """A seeded generation through the low-bit draft draws plain decoding's tokens, penalties
    included."""
    model = tiny_lowbit
    params = dict(SAMPLING, repeat_penalty=1.3, presence_penalty=0.2, max_tokens=24)
    passes = 0
    for seed in range(8):
        plain = [e.id for e in model.generate(PREFIX, seed=seed, draft=False, **params)]
        gen = model.generate(PREFIX, seed=seed, spec_nodes=12, spec_depth=6, **params)
        spec = [e.id for e in gen]
        assert spec == plain, seed
        passes += gen.stats.extra["spec_target_passes"]
    assert passes > 0


# --- arguments and budgets ---------------------------------------------------------------------

def test_lowbit_arguments(tiny_path, tiny_lowbit):
    with pytest.raises(BadArgument, match=r"low-bit copy in 'Q9_X'.*Q2_K"):
        slipstream.load(tiny_path, device="cpu", draft=slipstream.SelfDraft(lowbit="Q9_X"))
    with pytest.raises(BadArgument, match="two drafts"):
        slipstream.SelfDraft(skip_layers=1, lowbit="Q2_K")
    with pytest.raises(BadArgument, match="names no draft"):
        slipstream.SelfDraft()
    with pytest.raises(BadArgument, match=r"draft=3 is invalid.*SelfDraft"):
        slipstream.load(tiny_path, device="cpu", draft=3)
    with pytest.raises(BadArgument, match=r"ahead=2 does not combine"):
        Speculator(tiny_lowbit.engine, tiny_lowbit.draft.engine,
                   Sampler(SamplingParams(temperature=0)), ahead=2)


def test_a_budget_the_copy_fills_is_refused(tiny_path):
    plan = slipstream.plan(tiny_path, device="cpu", ctx=128, precision="exact", measure=False)
    gf = slipstream.modelfile.gguf_file.GGUFFile(tiny_path)
    view = RetypedFile(gf, Q.Q2_K, range(2))
    held = sum(layer_resident_bytes(view, i, slipstream.precision.Precision.of(
        "exact", torch.device("cpu"))) for i in range(2))
    gf.close()
    assert held > 0 and plan.budget > held
    with pytest.raises(BudgetTooSmall, match=r"Q2_K copy of 2 layers takes .*--ram-budget"):
        slipstream.load(tiny_path, device="cpu", ctx=128, precision="exact",
                        draft=slipstream.SelfDraft(lowbit="Q2_K"),
                        placement=slipstream.Placement(ram_budget=held))


@pytest.mark.slow
def test_worker_processes_encode_the_same_bytes(tiny_path):
    """The copy encoded by worker processes (a 70B's path) equals the one encoded in-process."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.modelfile.config import ModelConfig
    from slipstream.precision import Precision
    from slipstream.speculative.lowbit import build_lowbit_layers

    gf = GGUFFile(tiny_path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    prec = Precision.of("exact", torch.device("cpu"))
    kw = dict(gf=gf, cfg=cfg, device=torch.device("cpu"), precision=prec, qtype=Q.Q4_0,
              layers=[0, 1])
    alone = build_lowbit_layers(**kw, workers=0)
    pooled = build_lowbit_layers(**kw, workers=2)
    for i in (0, 1):
        for field in ("ffn_down", "attn_output"):
            a, b = getattr(alone[i], field), getattr(pooled[i], field)
            assert torch.equal(a.weight, b.weight), (i, field)
    gf.close()


def test_cuda_sizing_covers_what_the_smaller_budget_streams(tmp_path, monkeypatch):
    """On CUDA the copy holds the layers the model streams once the copy's bytes have left its
    budget: planned again until that set is covered; BudgetTooSmall where the copy alone
    fills the budget. A stand-in planner: 1 MiB a layer, 1 MiB of reserve; the copy 0.5 MiB a
    layer."""
    import slipstream.speculative.self_draft as self_draft
    from slipstream.modelfile.config import ModelConfig
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.memory.planner import Plan

    path = write_synth(tmp_path / "six.gguf", "tiny", "Q8_0", n_layers=6)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    mib, n = 1 << 20, 6
    monkeypatch.setattr(self_draft, "layer_vram_bytes",
                        lambda view, c, i, fused=False: mib // 2)
    budgets = []

    def fake_plan(gf_, cfg_, dev, prec, ctx, ram, vram, *rest, stream_first=None, stage=None):
        budgets.append(vram)
        resident = max(0, min(n, int(vram / mib - 1)))
        return Plan("cuda", ["vram"] * resident + ["pinned"] * (n - resident), [mib] * n,
                    [mib] * n, 0, None, 1)

    monkeypatch.setattr(self_draft, "plan_model", fake_plan)
    # the draft's graphs and its VRAM copy of the token table (Engine.self_draft): 0.25 MiB
    monkeypatch.setattr(self_draft, "self_draft_vram", lambda gf_, streamed: mib // 4)
    prec = slipstream.precision.Precision.of("exact", torch.device("cpu"))
    dev = torch.device("cuda")
    # 6 MiB: plain decode streams layer 5; its copy and the table leave 5.25 MiB, which
    # streams 4 and 5; their copy leaves 4.75 MiB, which streams 3 to 5; theirs 4.25 MiB, the
    # same three
    copied, held = self_draft.size_lowbit(gf, cfg, dev, prec, 128, None, 6 * mib, "direct", 2,
                                          None, Q.Q2_K, [5])
    assert (copied, held) == ([3, 4, 5], 1.75 * mib)
    assert budgets == [5.25 * mib, 4.75 * mib, 4.25 * mib]
    # 2 MiB: every round streams more, until the copy of all six takes 3 MiB of the 2
    with pytest.raises(BudgetTooSmall, match=r"Q2_K copy of the \d layers the model would "
                                             r"stream takes"):
        self_draft.size_lowbit(gf, cfg, dev, prec, 128, None, 2 * mib, "direct", 2, None,
                               Q.Q2_K, [1, 2, 3, 4, 5])
    gf.close()
