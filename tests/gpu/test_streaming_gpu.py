"""Tier B on CUDA: layers streamed from pinned RAM through GPU slots give bit-identical results
to the resident model, also with random stalls injected into the copy stream."""

from __future__ import annotations

import pytest
import torch

import slipstream
from helpers import streamed_logits, streaming_synth, vram_budget_for
from slipstream.errors import BudgetTooSmall
from slipstream.runtime.build import injected_stream_delay

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    pytest.importorskip("triton")
    return streaming_synth(tmp_path_factory.mktemp("gs"), n_layers=6, seed=4)




@pytest.mark.parametrize("delay", [0, 2_000_000])
def test_pinned_streaming_is_bit_identical(synth, delay):
    resident = slipstream.load(synth, device="cuda", ctx=256)
    budget = vram_budget_for(resident, 2)
    with injected_stream_delay(delay):
        streamed = slipstream.load(synth, device="cuda", ctx=256,
                                   placement=slipstream.Placement(vram_budget=budget))
    # the streamed layers spread between the resident ones (memory.planner._interleave)
    assert streamed.plan.tiers == ["pinned", "vram", "pinned", "pinned", "vram", "pinned"]
    # a streamed plan leaves the embedding table on the host; the logits must not notice
    assert streamed.engine.weights.embed.raw.device.type == "cpu"
    assert resident.engine.weights.embed.raw.device.type == "cuda"
    # its resident layers sit in one buffer each (weights.image.flattened), the model's don't
    assert streamed.plan.flat_layers and not resident.plan.flat_layers
    for i in (1, 4):
        assert len(_storages(streamed.engine.weights.layers[i])) == 1
        assert len(_storages(resident.engine.weights.layers[i])) > 1
    a, b = streamed_logits(resident), streamed_logits(streamed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert streamed.engine.layers.stats.layers_streamed >= 4 * 13


def test_gather_host_rows_reads_pinned_rows_on_the_gpu():
    """kernels.gather_host_rows: the rows device ids name, read by the GPU from a pinned host
    table, equal to the host's own indexing (repeats and the last row included)."""
    from slipstream import kernels

    g = torch.Generator().manual_seed(6)
    table = torch.randint(0, 256, (1000, 210), generator=g, dtype=torch.uint8).pin_memory()
    ids = torch.tensor([5, 999, 0, 5], device="cuda")
    got = kernels.gather_host_rows(table, ids)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), table[ids.cpu()])


def test_a_pinned_embedding_gives_the_host_lookups_bits(synth, monkeypatch):
    """SLIPSTREAM_PINNED_EMBED: a streamed model's host embedding pinned at load and read by
    the GPU gives the logits of the host lookup, bit for bit."""
    resident = slipstream.load(synth, device="cuda", ctx=256)
    budget = vram_budget_for(resident, 2)
    resident.close()
    host = slipstream.load(synth, device="cuda", ctx=256,
                           placement=slipstream.Placement(vram_budget=budget))
    assert not host.engine.weights.embed.pinned
    want = streamed_logits(host)
    host.close()
    monkeypatch.setenv("SLIPSTREAM_PINNED_EMBED", "1")
    pinned = slipstream.load(synth, device="cuda", ctx=256,
                             placement=slipstream.Placement(vram_budget=budget))
    embed = pinned.engine.weights.embed
    assert embed.pinned and embed.raw.device.type == "cpu" and embed.raw.is_pinned()
    got = streamed_logits(pinned)
    pinned.close()
    assert all(torch.equal(x, y) for x, y in zip(want, got))


def test_promoted_layers_take_the_resident_layout_and_bits(synth):
    """Memory given back (a draft released): a pinned layer made resident holds the very
    tensors a resident load builds, the fused scale plane included at precision "fast"
    (weights.image.resident_copy), in one buffer; and the logits stay the resident model's."""
    from slipstream.weights.image import _tensors

    resident = slipstream.load(synth, device="cuda", ctx=256)
    budget = vram_budget_for(resident, 2)
    streamed = slipstream.load(synth, device="cuda", ctx=256,
                               placement=slipstream.Placement(vram_budget=budget))
    pinned = [i for i, t in enumerate(streamed.plan.tiers) if t == "pinned"]
    torch.cuda.set_per_process_memory_fraction(1.0)  # room for the promoted layers
    assert streamed.engine.layers.promote(None) == pinned
    for i in pinned:
        got = dict(_tensors(streamed.engine.weights.layers[i]))
        want = dict(_tensors(resident.engine.weights.layers[i]))
        assert got.keys() == want.keys() and any(k[-1] == "sm" for k in got)
        assert all(torch.equal(got[k], want[k]) for k in want), i
        assert len(_storages(streamed.engine.weights.layers[i])) == 1
    a, b = streamed_logits(resident), streamed_logits(streamed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _storages(layer) -> set[int]:
    from slipstream.weights.image import _tensors

    return {t.untyped_storage().data_ptr() for _, t in _tensors(layer)}


@pytest.mark.gpu_alone
def test_gpu_budget_too_small(synth):
    from slipstream.memory.cuda_context import outside_allocator_bytes

    with pytest.raises(BudgetTooSmall, match="does not cover the CUDA context"):
        slipstream.load(synth, device="cuda", ctx=256,
                        placement=slipstream.Placement(vram_budget="1MiB"))
    context = outside_allocator_bytes(torch.device("cuda"))
    with pytest.raises(BudgetTooSmall, match="cannot run this model on cuda"):
        slipstream.load(synth, device="cuda", ctx=256,
                        placement=slipstream.Placement(vram_budget=context + (1 << 20)))


def test_skipped_layers_are_never_copied_and_streaming_stays_bit_identical(synth):
    """Layer skip (runtime.layer_skip): the ring's copy order leaves the skipped layers out,
    and what is served still gives the resident model's bits."""
    resident = slipstream.load(synth, device="cuda", ctx=256)
    budget = vram_budget_for(resident, 2)
    streamed = slipstream.load(synth, device="cuda", ctx=256,
                               placement=slipstream.Placement(vram_budget=budget))
    assert streamed.plan.tiers == ["pinned", "vram", "pinned", "pinned", "vram", "pinned"]
    ring = streamed.engine.layers.ring
    copied, restarts = [], []
    for src in ring.sources:
        enqueue = src.enqueue
        src.enqueue = lambda r, i, k, f=enqueue: copied.append(i) or f(r, i, k)
    restart = ring.restart
    ring.restart = lambda i: restarts.append(i) or restart(i)
    for model in (resident, streamed):
        model.engine.skip = {2, 3}
    a, b = streamed_logits(resident), streamed_logits(streamed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert set(copied) == {0, 5} and not restarts
    for model in (resident, streamed):  # and back: every streamed layer is copied again
        model.engine.skip = set()
    copied.clear()
    a, b = streamed_logits(resident), streamed_logits(streamed)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert set(copied) == {0, 2, 3, 5}


def test_setting_skip_drops_the_captured_decode_graphs(synth):
    """A captured graph froze the layers it ran: after engine.skip changes, graph decode must
    give what eager decode with the new set gives."""
    model = slipstream.load(synth, device="cuda", ctx=256)
    assert model.engine.use_graphs

    def greedy() -> list[torch.Tensor]:
        model.engine.reset()
        tok = model.engine.forward(list(range(5, 60, 3)))[-1].argmax().view(1)
        out = []
        for _ in range(6):
            logits = model.engine.decode(tok).clone()
            out.append(logits)
            tok = logits[-1].argmax().view(1)
        return out

    full = greedy()  # captures graphs with every layer
    model.engine.skip = {2}
    with_graphs = greedy()
    model.engine.use_graphs = False
    eager = greedy()
    assert all(torch.equal(x, y) for x, y in zip(with_graphs, eager))
    assert not torch.equal(full[0], with_graphs[0])
