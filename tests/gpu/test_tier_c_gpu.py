"""Tier C on CUDA (disk -> pinned staging -> GPU slots), the mmap baseline and KvikIO give
bit-identical results to the resident model, also with random delays injected into the reader
threads and the copy stream; file errors end in a clear error; --stats breaks a token down;
the planner's sizes match what loading allocates; a streamed model stays under its VRAM budget.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import threading
import time

import pytest
import torch

import slipstream
from helpers import streamed_logits, streaming_synth, vram_budget_for
from slipstream.memory import LayerStore, StreamDelays
from slipstream.memory.disk import DiskReadError
from slipstream.runtime.build import injected_stream_delay

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    pytest.importorskip("triton")
    # 8 layers: with 3 staging buffers in the RAM budget, a pinned layer and a disk tier need
    # more than 4 streamed layers
    return streaming_synth(tmp_path_factory.mktemp("tc"), n_layers=8, seed=5)


@pytest.fixture(scope="module")
def resident_out(synth):
    model = slipstream.load(synth, device="cuda", ctx=256)
    out = streamed_logits(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _budgets(model, vram_layers: int, pinned_layers: int) -> tuple[int, int]:
    """(vram, ram) budgets that keep `vram_layers` in VRAM, `pinned_layers` in pinned RAM and
    put the rest on disk (the streamed plan has no CUDA graph pools in its reserve, and keeps
    the embedding on the host)."""
    p = model.plan
    slot = max(p.file_bytes_per_layer)
    vram = vram_budget_for(model, vram_layers)
    first = vram_layers
    ram = 3 * slot + sum(p.file_bytes_per_layer[first:first + pinned_layers]) + 1
    return vram, ram




def _load_tiered(synth, io="direct", delays=None, path=None, vram_layers=2, pinned_layers=1):
    probe = slipstream.load(synth, device="cuda", ctx=256)
    vram, ram = _budgets(probe, vram_layers, pinned_layers)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    with injected_stream_delay(delays):
        return slipstream.load(path or synth, device="cuda", ctx=256,
                               placement=slipstream.Placement(vram_budget=vram, ram_budget=ram,
                                                              io=io))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_disk_tier_is_bit_identical(synth, resident_out, io):
    model = _load_tiered(synth, io)
    # streamed layers spread between the resident ones; the first streamed one pinned
    assert model.plan.tiers == ["pinned", "disk", "vram", "disk", "disk", "disk", "vram", "disk"]
    assert _same(resident_out, streamed_logits(model))
    stats = model.engine.layers.stats
    assert stats.layers_streamed >= 6 * 13 and stats.disk_bytes > 0
    model.engine.layers.close()


def test_disk_tier_is_bit_identical_under_random_delays(synth, resident_out):
    rng = random.Random(7)
    delays = StreamDelays(reader=lambda: time.sleep(rng.random() / 50), copy_cycles=2_000_000)
    model = _load_tiered(synth, delays=delays, vram_layers=1, pinned_layers=1)
    assert model.plan.tiers == ["pinned", "disk", "disk", "disk", "disk", "disk", "vram", "disk"]
    assert _same(resident_out, streamed_logits(model))
    model.engine.layers.close()


def test_all_layers_from_disk(synth, resident_out):
    model = _load_tiered(synth, vram_layers=0, pinned_layers=0)
    assert model.plan.tiers == ["disk"] * 8
    assert _same(resident_out, streamed_logits(model))
    model.engine.layers.close()


def test_mmap_baseline_is_bit_identical(synth, resident_out):
    model = _load_tiered(synth, io="mmap")
    assert "disk" in model.plan.tiers
    assert _same(resident_out, streamed_logits(model))
    model.engine.layers.close()


def test_kvikio_is_bit_identical(synth, resident_out):
    pytest.importorskip("kvikio")
    model = _load_tiered(synth, io="kvikio", delays=StreamDelays(
        reader=lambda: time.sleep(random.random() / 100)))
    assert _same(resident_out, streamed_logits(model))
    model.engine.layers.close()


def test_truncated_image_file_mid_run_is_a_clear_error(synth, tmp_path):
    path = tmp_path / "m.gguf"
    shutil.copy(synth, path)
    model = _load_tiered(synth, path=path)
    streamed_logits(model, steps=1)
    image = model.engine.layers.disk.path
    os.truncate(image, 4096)
    with pytest.raises(DiskReadError, match="truncated or replaced while running"):
        streamed_logits(model, steps=2)
    model.engine.layers.close()


def test_deleted_files_mid_run_keep_working(synth, resident_out, tmp_path):
    """POSIX keeps an open file until it is closed: deleting the model and its image file
    mid-run changes nothing, no hang and no wrong bytes."""
    path = tmp_path / "m.gguf"
    shutil.copy(synth, path)
    model = _load_tiered(synth, path=path)
    streamed_logits(model, steps=1)
    image = model.engine.layers.disk.path
    path.unlink()
    image.unlink()
    assert _same(resident_out, streamed_logits(model))
    model.engine.layers.close()


def test_reader_io_error_is_a_clear_error(synth):
    state = {"fail": False}

    def reader():
        if state["fail"]:
            raise OSError(5, "Input/output error")

    model = _load_tiered(synth, delays=StreamDelays(reader=reader))
    streamed_logits(model, steps=1)
    state["fail"] = True
    with pytest.raises(DiskReadError, match="Input/output error"):
        streamed_logits(model, steps=2)
    model.engine.layers.close()


def test_stats_break_a_token_down(synth):
    model = _load_tiered(synth)
    store = model.engine.layers
    store.enable_timing()
    streamed_logits(model, steps=4)
    store.collect()
    s = store.stats
    assert s.compute_s > 0 and s.h2d_s > 0 and s.disk_read_s > 0 and s.stall_s >= 0
    assert s.h2d_bytes >= s.disk_bytes > 0
    store.close()


def _held(prefix: str) -> tuple[set[threading.Thread], int]:
    """The streaming reader threads alive, and the descriptors open on files whose path
    starts with `prefix`."""
    gc.collect()
    threads = {t for t in threading.enumerate() if t.name.startswith("slipstream-")}
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.path.realpath(f"/proc/self/fd/{fd}").startswith(prefix)
        except OSError:
            pass  # closed while listing
    return threads, fds


@pytest.mark.parametrize("io", ["direct", "mmap"])
def test_close_gives_back_threads_descriptors_and_slots(synth, io):
    """close() joins the reader threads, closes the image file and drops the GPU slots (and
    the pinned images); a second close is a no-op."""
    from slipstream.memory.image_file import image_paths

    image = str(synth.resolve()) + ".slipstream."  # every plan's image file of the model
    before = _held(image)
    model = _load_tiered(synth, io=io)
    store = model.engine.layers
    assert isinstance(store, LayerStore) and not store.graph_capturable
    assert store.disk.path == image_paths(synth, layers=model.plan.disk_layers)[0]
    streamed_logits(model, steps=1)
    assert _held(image)[1] > before[1]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    store.close()
    store.close()
    assert _held(image) == before
    slot = max(model.plan.file_bytes_per_layer)
    assert torch.cuda.memory_allocated() <= allocated - slot  # at least one slot went


def test_planned_sizes_match_what_loading_builds(synth):
    from slipstream.memory.vram import layer_image_bytes

    model = _load_tiered(synth)
    store = model.engine.layers
    assert store.images and store.disk.layouts
    for i, image in store.images.items():  # streamed layers keep the GGUF layout
        assert image.nbytes == layer_image_bytes(model.gguf, model.config, i)
        assert all(v[4] for v in image.linears.values())  # fast: scales rounded as if fused
    for i, layout in store.disk.layouts.items():
        assert layout.nbytes == model.plan.file_bytes_per_layer[i]
    scratch = model.engine.weights.output.workspace.buffer
    assert 0 < scratch.numel() * scratch.element_size() <= model.plan.reserve["prefill workspace"]
    store.close()


@pytest.mark.gpu_alone
def test_streamed_model_stays_under_its_vram_budget(synth):
    probe = slipstream.load(synth, device="cuda", ctx=256)
    vram, ram = _budgets(probe, 2, 1)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    model = slipstream.load(synth, device="cuda", ctx=256,
                            placement=slipstream.Placement(vram_budget=vram, ram_budget=ram))
    streamed_logits(model, steps=4)
    peak = torch.cuda.max_memory_reserved() - base
    # the budget is what the driver counts: the allocator gets it less the CUDA context
    from slipstream.memory.cuda_context import outside_allocator_bytes

    allocator = vram - outside_allocator_bytes(torch.device("cuda"))
    assert peak <= allocator, f"peak {peak} over the allocator's share {allocator} of {vram}"
    model.engine.layers.close()
    del model
    gc.collect()
    # the allocator's cap lives as long as the model: afterwards the process may use more
    extra = torch.empty(base + 2 * vram, dtype=torch.uint8, device="cuda")
    del extra
    torch.cuda.empty_cache()


@pytest.mark.gpu_alone
def test_a_load_that_outgrows_its_plan_stops_at_the_budget(synth, monkeypatch):
    """The VRAM budget is held by the allocator, not only by the planner's arithmetic: a load
    that allocates past its plan (here a budget-sized tensor taken in the middle of loading)
    ends in BudgetTooSmall instead of reserving past the budget, and the cap goes with it."""
    from slipstream.errors import BudgetTooSmall
    from slipstream.runtime import build

    probe = slipstream.load(synth, device="cuda", ctx=256)
    vram, ram = _budgets(probe, 2, 1)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    real = build.load_weights_with_progress

    def outgrowing(*args, **kwargs):
        hog = torch.empty(vram, dtype=torch.uint8, device="cuda")
        return real(*args, **kwargs), hog

    monkeypatch.setattr(build, "load_weights_with_progress", outgrowing)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    with pytest.raises(BudgetTooSmall, match="raise --vram-budget"):
        slipstream.load(synth, device="cuda", ctx=256,
                        placement=slipstream.Placement(vram_budget=vram, ram_budget=ram))
    assert torch.cuda.max_memory_reserved() - base <= vram
    gc.collect()
    extra = torch.empty(base + 2 * vram, dtype=torch.uint8, device="cuda")  # cap released
    del extra
    torch.cuda.empty_cache()
