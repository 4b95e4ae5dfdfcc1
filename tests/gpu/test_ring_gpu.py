"""Sliding-window rings (model.ring) in the CUDA engine: a Gemma 3 file with a window of 8 and
the ring's reserve cut to 20 slots (a ring of 28), so the prompts here wrap it.

The GPU engine at "exact" against the CPU engine at "exact" (fused decode kernels addressing
slot mod ring, masked prefill over the ring plus the chunk), graph-captured decode against
eager, streamed from pinned RAM bit-identical to resident, and speculative decoding (trees
written past the context and rolled back, the draft's levels through captured step graphs
with their padding rows) against plain decoding."""

from __future__ import annotations

import pytest
import torch

import slipstream
from helpers import rel64, STREAM_PROMPT, streamed_logits, vram_budget_for
from slipstream import synth
from slipstream.model import ring_size

pytestmark = pytest.mark.gpu

WINDOW, TREE, PAD = 8, 12, 8  # a 12-node tree's widest level (11) pads to 16: 5 rows
RING = WINDOW + TREE + PAD
EXACT_REL_TOL = 1e-2  # fp32 GEMVs and an fp16 cache against the CPU (tests/gpu/test_engine)


@pytest.fixture(autouse=True)
def small_reserve(monkeypatch):
    monkeypatch.setattr(ring_size, "RING_TREE", TREE)
    monkeypatch.setattr(ring_size, "RING_PAD", PAD)
    monkeypatch.setattr(ring_size, "RING_RESERVE", TREE + PAD)


def _write(path, quant: str):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synth, "synth_window", lambda shape: WINDOW)
        return synth.write_synth(path, "tiny", quant, n_layers=6, arch="gemma3",
                                 from_floats=True, std=0.08, seed=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    pytest.importorskip("triton")
    d = tmp_path_factory.mktemp("ring")
    return _write(d / "t.gguf", "Q4_K_M"), _write(d / "d.gguf", "Q4_0")



def test_cuda_rings_match_the_cpu(files):
    path, _ = files
    cpu = slipstream.load(path, device="cpu", ctx=256, precision="exact")
    gpu = slipstream.load(path, device="cuda", ctx=256, precision="exact")
    assert gpu.engine.kv.layer(0)[0].shape[1] == RING and len(STREAM_PROMPT) > RING
    for model in (cpu, gpu):
        model.engine.prefill_chunk = 13  # chunks longer than the window
    for x, y in zip(streamed_logits(cpu, steps=40), streamed_logits(gpu, steps=40)):
        assert rel64(y, x) < EXACT_REL_TOL
    cpu.close()
    gpu.close()


def test_graph_decode_on_rings_matches_eager(files):
    path, _ = files
    with slipstream.load(path, device="cuda", ctx=256) as m:
        assert m.engine.use_graphs
        graphed = [e.id for e in m.generate(STREAM_PROMPT, max_tokens=60, temperature=0)]
        m.engine.use_graphs = False
        eager = [e.id for e in m.generate(STREAM_PROMPT, max_tokens=60, temperature=0)]
    assert graphed == eager


def test_streamed_rings_give_the_resident_bits(files):
    path, _ = files
    resident = slipstream.load(path, device="cuda", ctx=256)
    streamed = slipstream.load(path, device="cuda", ctx=256, placement=slipstream.Placement(
        vram_budget=vram_budget_for(resident, 2), hybrid="off"))
    assert streamed.plan.tiers.count("pinned") == 4, streamed.plan.tiers
    a, b = streamed_logits(resident, steps=40), streamed_logits(streamed, steps=40)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    resident.close()
    streamed.close()


def test_speculative_decoding_on_rings_gives_the_plain_tokens(files):
    """Greedy at "exact": a tree pass and a decode step round differently on CUDA, so a near
    tie may part (tests/gpu/test_speculative_gpu.py); a lost key would part nearly always."""
    path, draft_path = files
    target = slipstream.load(path, device="cuda", ctx=256, precision="exact")
    draft = slipstream.load(draft_path, device="cuda", ctx=256, precision="exact")
    parted = 0
    for prompt in (STREAM_PROMPT[:8], STREAM_PROMPT[:20], STREAM_PROMPT):
        plain = [e.id for e in target.generate(prompt, max_tokens=60, temperature=0)]
        spec = [e.id for e in target.generate(prompt, max_tokens=60, temperature=0,
                                              draft=draft, spec_nodes=TREE, spec_depth=5)]
        parted += spec != plain
    assert parted <= 1
    target.close()
    draft.close()
