"""A streamed CUDA plan gives VRAM to layers (memory.setup._plan_cuda): its resident layers keep
the GGUF scale layout, its prefill scratch and prefill chunk are capped, and the reserve counts
what the engine will then hold; the engine runs prompts in the plan's chunks. Planned here
without a GPU: only the free-memory query is faked."""

from __future__ import annotations

import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.errors import BudgetTooSmall
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import setup
from slipstream.memory.planner import StagePlan, plan_cuda
from slipstream.memory.vram import (activation_bytes, layer_flat_bytes, layer_vram_bytes,
                                   vram_reserve)
from slipstream.precision import Precision
from slipstream.synth import write_synth
from helpers import cpu_engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("sp") / "m.gguf", "tiny", "Q4_K", n_layers=8)
    gf = GGUFFile(path)
    return path, gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors))


def _plan(gf, cfg, budget, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    prec = Precision.of("fast", torch.device("cuda"))
    stage = StagePlan("cuda", range(cfg.n_layers))
    return setup._plan_cuda(gf, cfg, stage, torch.device("cuda"), prec, 4096, None, budget,
                            "direct", 2, 2048, 256)


def test_a_streamed_plan_caps_chunk_and_scratch_and_counts_them(model, monkeypatch):
    _, gf, cfg = model
    streamed = vram_reserve(gf, cfg, 4096, 2, 512, False, False, embed_on_host=True,
                            graph_bucket=256, scratch_cap=setup.STREAMED_SCRATCH_ELEMENTS)
    layer = layer_flat_bytes(gf, cfg, 0)
    streamed["allocator slack"] = int(setup.STREAMED_SLACK_LAYERS * layer)
    budget = sum(streamed.values()) + 6 * layer  # two slots and four resident layers
    plan = _plan(gf, cfg, budget, monkeypatch)
    assert plan.tiers.count("vram") == 4 and plan.fuse_scales is False and plan.flat_layers
    assert plan.prefill_chunk == setup.STREAMED_PREFILL_CHUNK
    assert plan.scratch_elements == setup.STREAMED_SCRATCH_ELEMENTS
    assert plan.reserve["activations"] == activation_bytes(cfg, 512, 4096)
    assert plan.reserve["allocator slack"] == streamed["allocator slack"] > 0
    # each resident layer in one buffer of its image (weights.image.flattened)
    assert plan.resident_bytes_per_layer == [layer_flat_bytes(gf, cfg, i)
                                             for i in range(cfg.n_layers)]
    # the same budget with the resident plan's accounting (fused scales, 2048-token chunks)
    # holds fewer layers, or cannot run at all
    try:
        old = plan_cuda([layer_vram_bytes(gf, cfg, i, True) for i in range(cfg.n_layers)],
                        plan.file_bytes_per_layer,
                        vram_reserve(gf, cfg, 4096, 2, 2048, False, True, embed_on_host=True,
                                     graph_bucket=256), budget, None)
        assert old.tiers.count("vram") < 4
    except BudgetTooSmall:
        pass


def test_a_resident_plan_keeps_its_defaults(model, monkeypatch):
    _, gf, cfg = model
    plan = _plan(gf, cfg, None, monkeypatch)
    assert not plan.streamed_layers
    assert plan.prefill_chunk is None and plan.fuse_scales and plan.scratch_elements is None
    assert not plan.flat_layers


@pytest.mark.slow
def test_the_engine_runs_prompts_in_its_chunks(model):
    path, _, _ = model
    engine = cpu_engine(path, ctx=64, precision="exact")
    ref = engine.forward(list(range(3, 23)), all_logits=True)
    engine.reset()
    engine.prefill_chunk = 6
    seen = []
    hidden = engine._hidden
    engine._hidden = lambda ids, step, *rest: (seen.append(int(ids.shape[0])),
                                                hidden(ids, step, *rest))[1]
    got = engine.forward(list(range(3, 23)), all_logits=True)
    assert seen == [6, 6, 6, 2] and engine.length == 20
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
