"""Layer skip in the streaming stores: after `store.skip(layers)` a skipped layer is never read
from disk nor copied into a slot, the rings run ahead across it without restarting, and every
layer served still gets its own bytes.

The CUDA store runs on the CPU with faked streams and events (conftest.fake_cuda), its images
built from layers that hold only their norms (helpers.NormsOnly: no Triton needed)."""

from __future__ import annotations

import pytest
import torch

from helpers import NormsOnly
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import DiskLayerStore
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.image import _tensors
from slipstream.weights.loader import LayerBuilder, TensorSource

N_LAYERS = 7  # 0 and 6 resident, 1 and 2 pinned, 3, 4 and 5 from the image file (CUDA)
PINNED, DISK = (1, 2), (3, 4, 5)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("storeskip")
    path = write_synth(d / "m.gguf", "tiny", "Q4_K", n_layers=N_LAYERS, from_floats=True,
                       std=0.08, seed=6)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    cpu = torch.device("cpu")
    norms = NormsOnly(LayerBuilder(cfg, cpu, Precision.of("exact", cpu)))
    layers = [norms.build(TensorSource(gf), i) for i in range(N_LAYERS)]
    return gf, cfg, norms, layers


def _same(got, want) -> bool:
    a, b = dict(_tensors(got)), dict(_tensors(want))
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cuda_store(model, io: str, n_slots: int):
    from slipstream.memory.cuda_store import CudaLayerStore
    from slipstream.memory.image_file import build_images
    from slipstream.weights.image import to_image

    gf, cfg, norms, layers = model
    cpu = torch.device("cpu")
    disk = build_images(gf, cfg, cpu, Precision.of("fast", cpu), list(DISK),
                        [1 << 20] * N_LAYERS, progress=False, builder=norms)
    resident = [layers[i] if i not in PINNED + DISK else None for i in range(N_LAYERS)]
    return CudaLayerStore(resident, cpu, None,
                          images={i: to_image(layers[i], pin=False) for i in PINNED},
                          disk=disk, io=io, n_slots=n_slots, n_staging=3)


class Recorder:
    """What a store moves: layers brought into a slot (ring copies, or the mmap source's own
    copy), file spans read into staging buffers, and restarts of either ring."""

    def __init__(self, store):
        self.brought: list[int] = []
        self.reads: list[tuple[int, int]] = []
        self.restarts = 0
        for src in getattr(store, "sources", []):  # the CUDA store's
            if src.own_slot:
                src.acquire = _before(src.acquire, lambda i, *a: self.brought.append(i))
            else:
                src.enqueue = _before(src.enqueue, lambda ring, i, k: self.brought.append(i))
        if getattr(store, "ring", None) is not None:
            store.ring.restart = _before(store.ring.restart, self._restarted)
        if store.staging is not None:  # both disk stores read through one
            store.staging.restart = _before(store.staging.restart, self._restarted)
            reader = store.staging.reader
            reader.read_span = _before(reader.read_span,
                                       lambda buf, s, e, *a: self.reads.append((s, e)))

    def _restarted(self, *args) -> None:
        self.restarts += 1

    def read_layers(self, spans: dict[int, tuple[int, int]]) -> set[int]:
        return {i for i, span in spans.items() if span in self.reads}

    def clear(self) -> None:
        self.brought.clear()
        self.reads.clear()
        self.restarts = 0


def _before(fn, note):
    """fn, calling note with the same arguments first."""
    def wrapped(*args, **kwargs):
        note(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapped


def _passes(store, layers, skip, n: int = 3) -> None:
    for _ in range(n):
        for i in range(N_LAYERS):
            if i in skip:
                continue
            assert _same(store.acquire(i), layers[i]), i
            store.release(i)


@pytest.mark.parametrize("io,n_slots", [("direct", 2), ("buffered", 3), ("direct", 1),
                                         ("mmap", 2)])
@pytest.mark.parametrize("skip", [{2, 4}, {1, 2, 3, 4}, set(PINNED + DISK), {3}])
def test_the_cuda_store_never_moves_a_skipped_layer(fake_cuda, model, io, n_slots, skip):
    layers = model[3]
    store = _cuda_store(model, io, n_slots)
    rec = Recorder(store)
    _passes(store, layers, set())  # a pass or more with every layer, then skip
    store.skip(frozenset(skip))
    rec.clear()
    _passes(store, layers, skip)
    served = [i for i in PINNED + DISK if i not in skip]
    assert set(rec.brought) == set(served) and rec.restarts == 0
    assert len(rec.brought) <= 3 * len(served) + n_slots  # ahead into the next pass at most
    skipped_spans = [store.disk.spans[i] for i in DISK if i in skip]
    assert all(e <= s0 or s >= e0 for s, e in rec.reads for s0, e0 in skipped_spans)
    if io != "mmap":  # (mmap reads through the page cache, outside the staging ring)
        assert rec.read_layers(store.disk.spans) == {i for i in DISK if i not in skip}
    for i in skip:
        with pytest.raises(ValueError, match="skipped"):
            store.acquire(i)
    store.skip(frozenset())  # and back: every layer streams again
    rec.clear()
    _passes(store, layers, set())
    assert set(rec.brought) == set(PINNED + DISK)
    store.close()


@pytest.mark.slow
def test_the_cpu_disk_store_reads_only_the_layers_served(model):
    gf, cfg, _, _ = model
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("exact", cpu))
    full = [builder.build(TensorSource(gf), i) for i in range(N_LAYERS)]
    resident = [full[0], None, None, full[3], None, None, full[6]]
    store = DiskLayerStore(gf, builder, resident, n_buffers=2, io="direct")
    rec = Recorder(store)

    def passes(skip):
        for _ in range(3):
            for i in range(N_LAYERS):
                if i not in skip:
                    got = store.acquire(i)
                    assert torch.equal(got.attn_norm, full[i].attn_norm)
                    assert torch.equal(got.ffn_norm, full[i].ffn_norm)
                    store.release(i)

    passes(set())
    for skip in ({2, 5}, {1, 2, 4, 5}, {3, 4}):  # {3, 4}: a resident one too
        store.skip(frozenset(skip))
        rec.clear()
        passes(skip)
        assert rec.read_layers(store.spans) == {i for i in (1, 2, 4, 5) if i not in skip}
        assert all(span not in rec.reads for i, span in store.spans.items() if i in skip)
        assert rec.restarts == 0
        for i in skip - {3}:
            with pytest.raises(ValueError, match="skipped"):
                store.acquire(i)
    store.close()
