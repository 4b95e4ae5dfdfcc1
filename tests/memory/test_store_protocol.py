"""Every layer store is a LayerStore, so the engine, the CLI and the bench call its members
without probing; close() gives back what the store holds (reader threads, file descriptors,
maps) and is safe to call twice; memory/ never imports runtime/.

The CUDA store runs on the CPU with faked streams and events (conftest.fake_cuda), its images
built from layers that hold only their norms (so no Triton is needed to pack weights)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers import NormsOnly
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory import (
    DiskLayerStore,
    LayerStore,
    MmapLayerStore,
    ResidentLayerStore,
    StoreStats,
)
from slipstream.model.llama import LayerWeights
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.loader import LayerBuilder, TensorSource

N_LAYERS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("protocol")
    path = write_synth(d / "tiny.gguf", "tiny", "Q4_K", n_layers=N_LAYERS, from_floats=True,
                       std=0.08, seed=2)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    return gf, cfg


def _cpu_builder(cfg) -> LayerBuilder:
    cpu = torch.device("cpu")
    return LayerBuilder(cfg, cpu, Precision.of("exact", cpu))


def _cuda_store(tiny, io: str):
    """Layer 0 resident, 1 pinned, 2 and 3 from the image file."""
    from slipstream.memory.cuda_store import CudaLayerStore
    from slipstream.memory.image_file import build_images
    from slipstream.weights.image import to_image

    gf, cfg = tiny
    norms = NormsOnly(_cpu_builder(cfg))
    layers = [norms.build(TensorSource(gf), i) for i in range(N_LAYERS)]
    cpu = torch.device("cpu")
    disk = build_images(gf, cfg, cpu, Precision.of("fast", cpu), [2, 3],
                        [1 << 20] * N_LAYERS, progress=False, builder=norms)
    return CudaLayerStore([layers[0], None, None, None], cpu, None,
                          images={1: to_image(layers[1], pin=False)}, disk=disk, io=io)


def _store(kind: str, tiny):
    gf, cfg = tiny
    builder = _cpu_builder(cfg)
    if kind == "resident":
        return ResidentLayerStore([builder.build(TensorSource(gf), i) for i in range(N_LAYERS)])
    resident = [builder.build(TensorSource(gf), 0), None, None, None]
    if kind == "disk":
        return DiskLayerStore(gf, builder, resident, io="direct")
    if kind == "mmap":
        return MmapLayerStore(gf, builder, resident)
    return _cuda_store(tiny, kind.removeprefix("cuda-"))


def _passes(store, n: int = 2) -> None:
    for _ in range(n):
        for i in range(len(store)):
            assert isinstance(store.acquire(i), LayerWeights)
            store.release(i)


KINDS = ["resident", "disk", "mmap", "cuda-direct", "cuda-buffered", "cuda-mmap"]


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow)
                                  if k in ("disk", "mmap") else k for k in KINDS])
def test_every_store_is_a_layer_store(fake_cuda, tiny, kind):
    store = _store(kind, tiny)
    assert isinstance(store, LayerStore)
    assert isinstance(store.stats, StoreStats) and isinstance(store.note, str)
    assert store.graph_capturable is (kind == "resident")  # streamed weights change per pass
    assert len(store) == N_LAYERS
    # the layers a graph of one layer may freeze (runtime.layer_graphs): the CUDA store's
    # resident layer 0, every layer of the resident store, none of a CPU store that streams
    fixed = [store.fixed(i) for i in range(N_LAYERS)]
    expected = {"resident": [True] * 4, "disk": [False] * 4, "mmap": [False] * 4}
    assert fixed == expected.get(kind, [True, False, False, False]), kind
    store.enable_timing()
    _passes(store)
    store.collect()
    store.enable_timing(False)
    if kind != "resident":
        assert store.stats.layers_streamed == 2 * 3
    with store as s:
        assert s is store
        _passes(store, 1)
    store.close()  # a second close is a no-op


def _held() -> tuple[set[threading.Thread], int]:
    gc.collect()  # an earlier test's store, unreferenced, lets its threads go now
    threads = {t for t in threading.enumerate() if t.name.startswith("slipstream-")}
    return threads, len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("kind", ["disk", "cuda-direct", "cuda-mmap"])
def test_close_gives_back_threads_and_descriptors(fake_cuda, tiny, kind):
    threads, fds = _held()
    store = _store(kind, tiny)
    _passes(store)
    running, open_fds = _held()
    assert open_fds > fds  # the reader's (or the map's) descriptor
    if kind != "cuda-mmap":
        assert running - threads  # reader threads
    store.close()
    assert _held() == (threads, fds)
    store.close()
    assert _held() == (threads, fds)


@pytest.mark.slow
def test_memory_never_imports_runtime():
    """Every slipstream.memory module imports in a fresh interpreter without pulling in
    slipstream.runtime (the package's own __init__, which loads the API, is skipped)."""
    code = """
import importlib, importlib.util, pkgutil, sys, types
spec = importlib.util.find_spec("slipstream")
pkg = types.ModuleType("slipstream")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["slipstream"] = pkg
import slipstream.memory as memory
for m in pkgutil.iter_modules(memory.__path__):
    importlib.import_module("slipstream.memory." + m.name)
bad = sorted(m for m in sys.modules if m.startswith(("slipstream.runtime", "slipstream.api")))
print(" ".join(bad))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
