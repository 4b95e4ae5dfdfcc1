"""Sliding-window layers' KV rings (model.ring): a windowed layer keeps window + reserve slots.

The files here are Gemma 3 synth files (five windowed layers to one global) written with a
window of 8, and the reserve is cut to 13 slots (RING_TREE 12 + RING_PAD 1), so a ring is 21
slots and prompts of a few dozen tokens wrap it twice. The references: transformers' Gemma 3
on the same file (which reads the window from it), llama.cpp on a float32 copy (its own
sliding-window cache), and this engine with full-context caches (model.ring_size.RING =
False). Ring and full cache add the same terms in another order once
the ring wraps: float32 ("exact") logits agree to 1e-5 relative (measured: below 1e-6 on
these files), and the top-1 tokens are the same.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import slipstream
from helpers import cpu_budget, cpu_stages
from slipstream import synth
from slipstream.errors import BadArgument
from slipstream.model import Step, append_step, device_decode_step, ring_size, tree_step
from slipstream.model.layer_spec import kv_cache_bytes
from slipstream.model.ring import ring_step, window_attention, window_kv
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.runtime.engine import Engine
from slipstream.runtime.kv_cache import KVCache
from slipstream.weights.loader import load_weights

WINDOW = 8
TREE, PAD = 12, 1
RING = WINDOW + TREE + PAD  # 21 slots
IDS = list(range(7, 7 + 3 * 50, 3))  # 50 tokens: past the ring twice
CTX = 128
REL_TOL = 1e-5  # float32 sums in another order (measured < 1e-6)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def small_reserve(monkeypatch):
    monkeypatch.setattr(ring_size, "RING_TREE", TREE)
    monkeypatch.setattr(ring_size, "RING_PAD", PAD)
    monkeypatch.setattr(ring_size, "RING_RESERVE", TREE + PAD)


def write_windowed(path, arch: str = "gemma3", quant: str = "Q8_0", seed: int = 3):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synth, "synth_window", lambda shape: WINDOW)
        return synth.write_synth(path, "tiny", quant, n_layers=6, arch=arch, from_floats=True,
                                 seed=seed, std=0.15)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = write_windowed(tmp_path_factory.mktemp("ring") / "gemma3.gguf")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    assert cfg.sliding_window == WINDOW
    weights = load_weights(gf, cfg, CPU, Precision.of("exact", CPU))
    return path, cfg, weights


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def engine(cfg, weights, ring: bool, chunk: int = 2048) -> Engine:
    ring_size.RING = ring  # read when the caches are made (restored by the caller)
    try:
        return Engine(cfg, weights, cpu_stages(cfg, weights, CTX), prefill_chunk=chunk)
    finally:
        ring_size.RING = True


def prefill_then_decode(e: Engine, n_prompt: int) -> torch.Tensor:
    """Logits of IDS: the first n_prompt as one forward (chunked as the engine chunks),
    then one token at a time."""
    e.reset()
    rows = [e.forward(IDS[:n_prompt], all_logits=True)]
    rows += [e.forward(IDS[i:i + 1]) for i in range(n_prompt, len(IDS))]
    return torch.cat(rows)


# --- the pieces -----------------------------------------------------------------------------

def test_window_kv_reads_the_window_in_linear_order():
    """Slot j of a ring of R holds j at j mod R; the window of every position comes back as
    the linear slots max(0, pos + 1 - window) .. pos, wrapped or not."""
    R, window = 7, 5
    k = torch.full((1, R, 1), -1.0)
    for pos in range(30):
        k[0, pos % R, 0] = pos
        got, _ = window_kv(k, k, pos, window)
        assert got[0, :, 0].tolist() == list(range(max(0, pos + 1 - window), pos + 1)), pos


def test_window_attention_over_a_wrapped_ring():
    """The CPU decode's attention over a ring's window (two slices where it wraps) against
    float64 softmax attention over the same linear slots of a full cache."""
    n_kv, group, d, window, R = 2, 3, 16, 6, 9
    full_k, full_v = torch.randn(n_kv, 40, d), torch.randn(n_kv, 40, d)
    k, v = torch.zeros(n_kv, R, d), torch.zeros(n_kv, R, d)
    q = torch.randn(n_kv, group, d)
    for pos in range(40):
        k[:, pos % R], v[:, pos % R] = full_k[:, pos], full_v[:, pos]
        lo = max(0, pos + 1 - window)
        p = torch.softmax(q.double() @ full_k[:, lo:pos + 1].double().transpose(1, 2) * 0.3,
                          dim=-1)
        want = p @ full_v[:, lo:pos + 1].double()
        got = window_attention(q, k, v, pos, window, 0.3)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["chunk", "tree"])
def test_ring_mask_allows_the_full_cache_masks_slots(kind):
    """A ring step's mask (ring, then the step's keys) allows token t exactly the linear
    slots Step.with_window allows it over a full cache, whatever slot each entry holds."""
    window, ring, group = 6, 9, 2
    for start in range(0, 30, 4):
        if kind == "chunk":
            step = append_step(start, 5, CPU)
        else:  # a tree below slot start - 1, its tokens at depths 0, 1, 1, 2
            step = tree_step([-1, 0, 0, 1], start, start, CPU)
        full = step.with_window(window, group).mask[:step.tokens]  # group 0's rows
        rs = ring_step(step, window, group, ring)
        held = (start - 1 - ((start - 1 - torch.arange(ring)) % ring)).tolist()
        keys = held + step.slots.tolist()
        for t in range(step.tokens):
            want = {j for j in range(step.span) if full[t, j]}
            got = {keys[c] for c in range(ring + step.tokens) if rs.mask[t, c]}
            assert got == want, (start, t)


def test_rollback_past_the_reserve_is_refused(gemma3):
    _, cfg, _ = gemma3
    kv = KVCache(cfg, CTX, CPU, torch.float32)
    assert kv.rings
    kv.length = 40
    kv.truncate(40 - TREE)  # a tree of TREE tokens dropped: the ring still holds the window
    kv.length = 40
    with pytest.raises(ValueError, match=f"from slot 40 to {40 - TREE - 1}"):
        kv.truncate(40 - TREE - 1)
    kv.length = 0  # a reset starts over
    kv.length = 5
    kv.truncate(0)


def test_planned_kv_bytes_shrink_by_the_rings(gemma3):
    """The planner's count (kv_cache_bytes, which `info --plan` and the budgets use) is the
    caches' size, and the windowed layers' share drops from ctx to window + reserve slots."""
    path, cfg, _ = gemma3
    windowed = sum(1 for i in range(cfg.n_layers) if cfg.window_of(i))
    assert windowed == 5
    per_slot = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    ring_size.RING = False
    try:
        full = kv_cache_bytes(cfg, range(cfg.n_layers), CTX, 4)
        full_plan = slipstream.plan(path, device="cpu", ctx=CTX, precision="exact")
    finally:
        ring_size.RING = True
    rings = kv_cache_bytes(cfg, range(cfg.n_layers), CTX, 4)
    assert full - rings == windowed * per_slot * (CTX - RING)
    assert KVCache(cfg, CTX, CPU, torch.float32).nbytes == rings
    plan = slipstream.plan(path, device="cpu", ctx=CTX, precision="exact")
    assert full_plan.fixed_bytes - plan.fixed_bytes == full - rings
    # a stage's share: the global layer 5 alone keeps the whole context
    assert kv_cache_bytes(cfg, range(5, 6), CTX, 4) == per_slot * CTX


# --- whole models ---------------------------------------------------------------------------

@pytest.mark.slow
def test_ring_gives_the_full_cache_logits(gemma3):
    """Prefill in one pass, and in chunks shorter and longer than the window, then decode
    past the ring twice: the full cache's logits within REL_TOL and its top-1 tokens."""
    _, cfg, weights = gemma3
    full = prefill_then_decode(engine(cfg, weights, ring=False), 20)
    for chunk in (2048, 5, 13):
        e = engine(cfg, weights, ring=True, chunk=chunk)
        assert e.kv.layer(0)[0].shape[1] == RING and e.kv.layer(5)[0].shape[1] == CTX
        got = prefill_then_decode(e, 20)
        assert rel_err(got, full) < REL_TOL, chunk
        assert torch.equal(got.argmax(-1), full.argmax(-1)), chunk


@pytest.mark.slow
def test_ring_logits_match_transformers(gemma3):
    """transformers' Gemma 3 on the whole sequence at once (its own sliding-window mask)
    against the ring engine's chunked prefill and decode."""
    transformers = pytest.importorskip("transformers")
    path, cfg, weights = gemma3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, head_dim=64,
        query_pre_attn_scalar=64).eval()
    assert hf.config.sliding_window == WINDOW
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    got = prefill_then_decode(engine(cfg, weights, ring=True, chunk=13), 30)
    assert rel_err(got, ref) < REL_TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_ring_logits_match_llamacpp(gemma3, tmp_path):
    """llama.cpp (its own sliding-window cache) on a float32 copy of the file, the whole
    sequence in one batch, against the ring engine's chunked prefill and decode: within the
    float32 tolerance of tests/model/test_vs_llamacpp.py, the same top-1 where llama.cpp
    decides it."""
    pytest.importorskip("llama_cpp")
    from llamacpp_ref import decisive, llamacpp_logits, unname
    from slipstream.quant.requantize import requantize
    from test_vs_llamacpp import F32_DECISIVE_GAP, F32_REL_TOL

    path, cfg, weights = gemma3
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    unname(copy, "gemma3")
    ref = llamacpp_logits(requantize(copy, tmp_path / "f32.gguf", "F32"), IDS)
    got = prefill_then_decode(engine(cfg, weights, ring=True, chunk=13), 30)
    assert rel_err(got, ref) < F32_REL_TOL
    keep = decisive(ref, F32_DECISIVE_GAP)
    assert keep.float().mean() > 0.5
    assert not ((got.argmax(-1) != ref.argmax(-1)) & keep).any()
    # negative control: a window one position wider is far outside
    wider = dataclasses.replace(cfg, sliding_window=WINDOW + 1)
    assert rel_err(prefill_then_decode(engine(wider, weights, ring=True), 30), ref) \
        > 10 * F32_REL_TOL


@pytest.mark.slow
def test_streamed_from_disk_gives_the_resident_bits_on_rings(gemma3, tmp_path):
    """Resident and streamed layers read the same rings the same way: the same bits."""
    path, _, _ = gemma3
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    resident = slipstream.load(copy, device="cpu", ctx=CTX, precision="exact")
    streamed = slipstream.load(copy, device="cpu", ctx=CTX, precision="exact",
                               placement=slipstream.Placement(
                                   ram_budget=cpu_budget(copy, whole=1, precision="exact",
                                                     ctx=CTX)))
    assert streamed.plan.tiers.count("disk") == 5, streamed.plan.tiers
    assert streamed.engine.kv.layer(0)[0].shape[1] == RING
    for model in (resident, streamed):
        model.engine.prefill_chunk = 13
    assert torch.equal(resident.logits(IDS), streamed.logits(IDS))
    greedy = dict(max_tokens=30, temperature=0)
    assert [e.id for e in resident.generate(IDS[:20], **greedy)] == \
        [e.id for e in streamed.generate(IDS[:20], **greedy)]
    resident.close()
    streamed.close()


@pytest.mark.slow
def test_speculative_decoding_on_rings_gives_the_plain_tokens(gemma3, tmp_path):
    """Trees of up to RING_TREE tokens written past the context and rolled back (truncate
    and compact, in the target's rings and the draft's) lose no key a later token reads:
    greedy and seeded sampling give plain decoding's tokens, past the ring twice."""
    path, _, _ = gemma3
    draft_path = write_windowed(tmp_path / "draft.gguf", quant="Q4_0")  # same weights, rounded
    target = slipstream.load(path, device="cpu", ctx=CTX, precision="exact")
    draft = slipstream.load(draft_path, device="cpu", ctx=CTX, precision="exact")
    assert target.engine.kv.layer(0)[0].shape[1] == RING
    rejected = 0
    for seed, temperature in ((0, 0.0), (1, 0.8), (2, 0.8)):
        params = dict(max_tokens=45, temperature=temperature, seed=seed)
        plain = [e.id for e in target.generate(IDS[:8], **params)]
        gen = target.generate(IDS[:8], draft=draft, spec_nodes=TREE, spec_depth=5, **params)
        assert [e.id for e in gen] == plain, seed
        stats = gen.stats.extra
        assert stats["spec_target_passes"] > 0
        # verified nodes (root included) less the tokens emitted: drafted tokens dropped
        rejected += stats["spec_target_passes"] * (stats["spec_tree_nodes_mean"]
                                                   - stats["spec_tokens_per_pass"])
    assert rejected > 1  # rounds rolled drafted tokens back
    with pytest.raises(BadArgument, match=f"nodes={TREE + 1} is more than"):
        list(target.generate(IDS[:8], max_tokens=4, draft=draft, spec_nodes=TREE + 1))
    target.close()
    draft.close()


@pytest.mark.slow
def test_steps_with_device_positions_read_rings_as_host_steps_do(gemma3):
    """The steps CUDA graphs replay, whose slots only the device knows (runtime.graphs: a
    decode step, a tree level padded with rows that write past its end), on the CPU: the
    logits of the host-known steps, and the padding costs no key a later token reads."""
    _, cfg, weights = gemma3
    host, dev = (engine(cfg, weights, ring=True) for _ in range(2))
    for e in (host, dev):
        e.forward(IDS[:30])
    span = 64  # a graph bucket past the ring
    want = host.forward(IDS[30:31])
    got = dev.run_step(torch.tensor(IDS[30:31]), device_decode_step(torch.tensor([30]), span))
    dev.set_length(31)
    assert rel_err(got, want) < REL_TOL
    # a tree of 3 below slot 30, padded to 4 rows as StepGraphs pads it
    parents, tokens = [-1, 0, 0], IDS[31:34]
    tree = tree_step(parents, 31, 31, CPU)
    want = host.forward(tokens, all_logits=True, step=tree)
    allowed = torch.zeros(4, span, dtype=torch.bool)
    allowed[:3, :tree.span] = tree.allowed
    allowed[3, 0] = True
    padded = Step(torch.cat((tree.positions, torch.zeros(1, dtype=torch.long))),
                  torch.arange(31, 35), span=span, end=span, causal=False, allowed=allowed)
    got = dev.run_step(torch.tensor(tokens + [0]), padded)[:3]
    dev.set_length(tree.end)
    assert rel_err(got, want) < REL_TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for e in (host, dev):
        e.truncate(32)  # the first drafted token accepted
    rest = [torch.cat([e.forward(IDS[i:i + 1]) for i in range(32, 50)]) for e in (host, dev)]
    assert rel_err(rest[1], rest[0]) < REL_TOL
    assert torch.equal(rest[1].argmax(-1), rest[0].argmax(-1))


@pytest.mark.slow
def test_cpu_decode_gives_the_general_paths_bits_on_rings(gemma3, monkeypatch):
    """model.cpu_decode runs the general path's ops on a wrapped ring too: the same bits."""
    from slipstream.model import llama

    _, cfg, weights = gemma3
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(llama, "CPU_DECODE", fast)
        runs.append(prefill_then_decode(engine(cfg, weights, ring=True), 20))
    assert torch.equal(runs[0], runs[1])
