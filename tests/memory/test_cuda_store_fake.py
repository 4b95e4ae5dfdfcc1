"""The CUDA store's bookkeeping (the slot ring, the staging ring behind it, wrap-around into the
next token, restarts after a pass that stopped part-way, the mmap baseline), driven on the CPU
with CUDA streams and events faked as already complete (conftest.fake_cuda). Copies are then
synchronous, so this checks which bytes land where, not the GPU-side ordering (tests/gpu does
that)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import StreamDelays
from slipstream.precision import Precision
from slipstream.synth import write_synth


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("triton")  # QuantLinear looks the kernels up (never runs them here)
    from slipstream.memory.image_file import build_images
    from slipstream.memory.vram import layer_image_bytes
    from slipstream.weights.image import _tensors, to_image
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder, TensorSource

    d = tmp_path_factory.mktemp("fakecuda")
    path = write_synth(d / "m.gguf", "tiny", "Q4_K_M", n_layers=6, from_floats=True,
                       std=0.08, seed=9)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("fast", cpu), workspace=Workspace(cpu))
    builder.quantized = True
    built = [builder.build(TensorSource(gf), i) for i in range(cfg.n_layers)]
    want = [dict(_tensors(layer)) for layer in built]
    images = {2: to_image(built[2], pin=False)}
    sizes = [layer_image_bytes(gf, cfg, i) for i in range(cfg.n_layers)]
    disk = build_images(gf, cfg, cpu, Precision.of("fast", cpu), [3, 4, 5], sizes,
                        progress=False, builder=builder)
    return built, want, images, disk, builder.workspace


def _check(layer, want) -> None:
    from slipstream.weights.image import _tensors

    got = dict(_tensors(layer))
    assert got.keys() == want.keys()
    for key, t in got.items():
        assert torch.equal(t, want[key]), key


def _store(setup, io, delays=None, n_slots=2):
    from slipstream.memory.cuda_store import CudaLayerStore

    built, _, images, disk, ws = setup
    resident = [built[0], built[1], None, None, None, None]
    # a copy of the images: promote() takes layers out of the dict it is given
    return CudaLayerStore(resident, torch.device("cpu"), ws, images=dict(images), disk=disk,
                          io=io, n_slots=n_slots, n_staging=3, delays=delays)


@pytest.mark.parametrize("io,n_slots", [("direct", 2), ("buffered", 3), ("direct", 1),
                                         ("mmap", 2)])
def test_every_pass_gets_the_right_bytes(fake_cuda, setup, io, n_slots):
    rng = random.Random(3)
    store = _store(setup, io, StreamDelays(reader=lambda: time.sleep(rng.random() / 500)),
                   n_slots)
    want = setup[1]
    store.enable_timing()
    for _ in range(4):
        for i in range(6):
            layer = store.acquire(i)
            if i >= 2:
                _check(layer, want[i])
            store.release(i)
    store.collect()
    s = store.stats
    assert s.layers_streamed == 16 and s.disk_bytes > 0 and s.compute_s > 0
    if io != "mmap":
        assert s.h2d_bytes >= s.disk_bytes and s.h2d_s > 0
    store.close()


def test_a_pass_that_stopped_part_way_restarts_cleanly(fake_cuda, setup):
    store = _store(setup, "direct")
    want = setup[1]
    for i in range(6):
        store.acquire(i)
        store.release(i)
    for i in range(4):  # stops at layer 3 without releasing it (an error mid-forward)
        store.acquire(i)
        if i < 3:
            store.release(i)
    for order in ([0, 1, 2, 3, 4, 5], [0, 1, 4, 5], [0, 1, 2, 3, 4, 5]):  # and a skip
        for i in order:
            layer = store.acquire(i)
            if i >= 2:
                _check(layer, want[i])
            store.release(i)
    store.close()


def test_the_staging_ring_waits_for_each_copy_event(fake_cuda, setup):
    """Each staging buffer is refilled only after the event recorded with its last copy: the
    reader thread calls that event's synchronize first."""
    store = _store(setup, "direct")
    calls = []
    bufs = list(store.staging.free) + [b for _, b, _ in store.staging.reads]
    assert len(bufs) == 3
    for buf in bufs:
        buf.event = type("Ev", (torch.cuda.Event,), {  # FakeEvent, under fake_cuda
            "synchronize": lambda self, b=buf: calls.append(id(b))})()
    for _ in range(3):
        for i in range(6):
            store.acquire(i)
            store.release(i)
    store.close()
    assert len(calls) >= 6  # every refill after the first use of a buffer waited


@pytest.mark.parametrize("io", ["direct", "buffered", "mmap"])
def test_streamed_layers_between_resident_ones(fake_cuda, setup, io):
    """The CUDA planner spreads streamed layers between resident ones (planner._interleave):
    the ring serves layers 1 (pinned), 3 and 5 (disk) around resident 0, 2 and 4."""
    from slipstream.memory.cuda_store import CudaLayerStore
    from slipstream.memory.image_file import build_images
    from slipstream.memory.vram import layer_image_bytes
    from slipstream.weights.image import to_image

    built, want, _, disk_all, ws = setup
    # the model next to its image file (MODEL.slipstream.img)
    gf = GGUFFile(disk_all.path.with_name(disk_all.path.name.removesuffix(".slipstream.img")))
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    sizes = [layer_image_bytes(gf, cfg, i) for i in range(cfg.n_layers)]
    cpu = torch.device("cpu")
    disk = build_images(gf, cfg, cpu, Precision.of("fast", cpu), [3, 5], sizes,
                        progress=False)  # reuses the file built for 3-5
    assert sorted(disk.spans) == [3, 5]
    resident = [built[0], None, built[2], None, built[4], None]
    store = CudaLayerStore(resident, torch.device("cpu"), ws,
                           images={1: to_image(built[1], pin=False)}, disk=disk, io=io,
                           n_slots=2, n_staging=3)
    assert store.ring.order == ([1] if io == "mmap" else [1, 3, 5])
    for _ in range(3):
        for i in range(6):
            layer = store.acquire(i)
            _check(layer, want[i])
            store.release(i)
    assert store.stats.layers_streamed == 9
    store.close()


def _passes(store, want=None, n: int = 1) -> None:
    """n passes over the six layers; with `want`, the streamed ones' bytes are checked."""
    for _ in range(n):
        for i in range(6):
            layer = store.acquire(i)
            if want is not None and i >= 2:
                _check(layer, want[i])
            store.release(i)


def test_promote_makes_pinned_layers_resident(fake_cuda, setup):
    """Memory given back (a draft released): the pinned-tier layer becomes resident, served
    with the same tensors, its pinned image dropped; the disk tier streams on as before."""
    store = _store(setup, "direct")
    want = setup[1]
    _passes(store)  # a pass with copies in flight into the next one
    nbytes = store.images[2].host.numel()
    assert store.promote(nbytes - 1) == []  # too little room: nothing moves
    assert store.promote(1 << 40, most=0) == []  # the user's cap on layers in VRAM holds
    assert store.promote(1 << 40, only=[3, 4]) == []  # only those: not pinned here
    assert store.promote(nbytes) == [2]
    assert 2 not in store.images and 2 not in store.feed and store.layers[2] is not None
    streamed = store.stats.layers_streamed
    _passes(store, want, 2)
    assert store.stats.layers_streamed == streamed + 6  # layers 3-5 only, twice
    assert store.promote(1 << 40) == []  # no pinned layer left (disk layers stay)
    store.close()


def test_a_promotion_the_allocator_cannot_give_keeps_the_layer_streaming(fake_cuda, setup,
                                                                        monkeypatch):
    """The room counted is not there in one piece (the allocator's holes): promote() takes
    nothing it cannot allocate, and the layer goes on streaming with the right bytes."""
    store = _store(setup, "direct")
    want = setup[1]
    _passes(store)
    real_empty = torch.empty

    def no_room(*args, **kw):
        if kw.get("device") is not None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", no_room)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert store.promote(1 << 40) == []
    monkeypatch.setattr(torch, "empty", real_empty)
    assert 2 in store.images and store.layers[2] is None
    streamed = store.stats.layers_streamed
    _passes(store, want, 2)
    assert store.stats.layers_streamed == streamed + 8  # layers 2-5, twice
    assert store.promote(1 << 40) == [2]  # with room it goes as before
    store.close()


def test_promoted_layers_are_spread_over_the_streamed_ones():
    """Taking every other one of 6 streamed layers leaves the rest spread out too, not a run."""
    pytest.importorskip("triton")
    from slipstream.memory.planner import evenly_spaced

    streamed = [1, 3, 5, 7, 9, 11]
    assert evenly_spaced(streamed, 3) == [3, 7, 11]  # leaves 1, 5, 9
    assert evenly_spaced(streamed, 1) == [7]
    assert evenly_spaced(streamed, 6) == streamed and evenly_spaced(streamed, 9) == streamed
    assert evenly_spaced(streamed, 0) == []


def test_waiting_says_when_a_read_has_not_landed(fake_cuda, setup):
    """waiting(i) is True exactly while layer i streams from disk and its read has not
    finished: resident and pinned layers never wait, and once the read lands the layer is
    acquired with its bytes (the engine grows a draft's tree in that gap)."""
    import threading

    gate = threading.Event()
    store = _store(setup, "direct", StreamDelays(reader=gate.wait))
    want = setup[1]
    for i in (0, 1, 2):  # resident, resident, pinned
        assert not store.waiting(i)
        store.release(i) if store.acquire(i) is not None else None
    assert store.waiting(3)  # its read waits at the gate
    assert store.waiting(3)  # asking twice changes nothing
    gate.set()
    deadline = time.monotonic() + 10
    while store.waiting(3):
        assert time.monotonic() < deadline, "the read never landed"
        time.sleep(0.001)
    for i in (3, 4, 5):
        while store.waiting(i):
            time.sleep(0.001)
        layer = store.acquire(i)
        _check(layer, want[i])
        store.release(i)
    store.close()
