"""Tier B on CUDA: layers streamed from pinned RAM through GPU slots give bit-identical results
to the resident model, also with random stalls injected into the copy stream."""

from __future__ import annotations

import pytest
import torch

import slipstream
from helpers import streamed_logits, streaming_synth
from slipstream.errors import BudgetTooSmall

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    pytest.importorskip("triton")
    return streaming_synth(tmp_path_factory.mktemp("gs"), n_layers=6, seed=4)


def _budget_for(model, resident_layers: int) -> int:
    """A VRAM budget for `resident_layers` in VRAM (a streamed plan reserves no graph pools
    and keeps the embedding on the host)."""
    p = model.plan
    staging = p.staging_buffers * max(p.file_bytes_per_layer)
    fixed = p.fixed_bytes - p.reserve.get("CUDA graph pools", 0) - p.reserve.get("embedding", 0)
    return fixed + staging + sum(p.resident_bytes_per_layer[:resident_layers]) + 1




@pytest.mark.parametrize("delay", [0, 2_000_000])
def test_pinned_streaming_is_bit_identical(synth, delay):
    resident = slipstream.load(synth, device="cuda", ctx=256)
    budget = _budget_for(resident, 2)
    streamed = slipstream.load(synth, device="cuda", ctx=256, vram_budget=budget,
                               stream_delay=delay)
    # the streamed layers spread between the resident ones (memory.planner._interleave)
    assert streamed.plan.tiers == ["pinned", "vram", "pinned", "pinned", "vram", "pinned"]
    # a streamed plan leaves the embedding table on the host; the logits must not notice
    assert streamed.engine.weights.embed.raw.device.type == "cpu"
    assert resident.engine.weights.embed.raw.device.type == "cuda"
    a, b = streamed_logits(resident), streamed_logits(streamed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert streamed.engine.layers.stats.layers_streamed >= 4 * 13


def test_gpu_budget_too_small(synth):
    with pytest.raises(BudgetTooSmall, match="cannot run this model on cuda"):
        slipstream.load(synth, device="cuda", ctx=256, vram_budget="1MiB")
