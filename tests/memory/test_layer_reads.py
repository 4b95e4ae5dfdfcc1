"""memory.layer_reads: a CUDA load's layers read into staging buffers, the next one's read
beside the current build. Each layer's tensors from the staged bytes are the map's bytes, a
layer built from them (with the CUDA builder's packing, driven on the CPU as
tests/weights/test_flat_layers.py does) has the same image as one built from the map, the
buffers alternate so a layer's bytes stay put while it is built, and a file cut short while
loading is a GGUFError naming it. tests/gpu/test_layer_reads_gpu.py builds on a GPU."""

from __future__ import annotations

import pytest
import torch

from slipstream.errors import GGUFError
from slipstream.model.families import file_spec
from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.memory import layer_reads
from slipstream.memory.layer_reads import StagedLayers, staged_sources
from slipstream.weights.source import TensorSource, layer_span

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_synth(tmp_path_factory.mktemp("reads") / "m.gguf", "tiny", "Q4_K_M",
                       n_layers=3, seed=4)
    gf = GGUFFile(path)
    return gf, ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)


def test_every_tensor_of_a_staged_layer_is_the_maps_bytes(model, monkeypatch):
    gf, cfg = model
    monkeypatch.setattr(layer_reads, "CHUNK", 4096 * 3)  # many chunks, a ragged last one
    mapped = TensorSource(gf)
    order = [2, 0, 1]
    seen = []
    for i, src in staged_sources(gf, order, CPU, staged=True):
        seen.append(i)
        for name in file_spec(gf).names(i, gf.tensors):
            shape = gf.tensors[name].shape
            got, want = src.raw(name, shape), mapped.raw(name, shape)
            assert torch.equal(got, want), name
            assert src.buffer.data_ptr() <= got.data_ptr() < \
                src.buffer.data_ptr() + src.buffer.numel()  # a view of the staging buffer
    assert seen == order


def test_the_two_buffers_alternate_and_the_next_read_waits_for_the_current_build(model):
    gf, _ = model
    with StagedLayers(gf, [0, 1, 2], CPU) as reads:
        it = iter(reads)
        i0, s0 = next(it)
        first = s0.buffer.clone()
        i1, s1 = next(it)  # layer 2's read now goes into layer 0's buffer ...
        assert s1.buffer.data_ptr() != s0.buffer.data_ptr()
        i2, s2 = next(it)  # ... which layer 0's build had given back by now
        assert s2.buffer.data_ptr() == s0.buffer.data_ptr()
    assert (i0, i1, i2) == (0, 1, 2)
    start, end = layer_span(gf, 0)
    assert torch.equal(first, torch.frombuffer(bytearray(gf.path.read_bytes()[start:end]),
                                               dtype=torch.uint8))


def test_a_layer_built_from_staged_bytes_has_the_maps_image(model):
    pytest.importorskip("triton")  # QuantLinear looks the kernels up (never runs them here)
    from slipstream.weights.image import to_image
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder

    gf, cfg = model
    builder = LayerBuilder(cfg, CPU, Precision.of("fast", CPU), workspace=Workspace(CPU),
                           fuse_scales=False)
    builder.quantized = True  # the CUDA builder's packing, on the CPU
    for i, src in staged_sources(gf, range(cfg.n_layers), CPU, staged=True):
        staged = to_image(builder.build(src, i), pin=False)
        mapped = to_image(builder.build(TensorSource(gf), i), pin=False)
        assert staged.layout == mapped.layout
        assert torch.equal(staged.host, mapped.host), i


def test_a_file_cut_short_while_loading_is_named(model, tmp_path):
    gf, _ = model
    copy = tmp_path / "cut.gguf"
    copy.write_bytes(gf.path.read_bytes())
    cut = GGUFFile(copy)
    start, _ = layer_span(cut, 2)
    with open(copy, "r+b") as f:
        f.truncate(start + 100)
    with pytest.raises(GGUFError, match="cut.gguf.*truncated while loading"):
        for _ in staged_sources(cut, [0, 1, 2], CPU, staged=True):
            pass


def test_load_weights_from_staged_sources_builds_the_same_layers(model):
    """load_weights' `layer_sources` (a CUDA load's staging) gives the layers built from the
    map: on the CPU, with dense weights, every tensor equal."""
    import dataclasses

    from slipstream.weights.loader import load_weights

    gf, cfg = model
    prec = Precision.of("exact", CPU)
    asked = []

    def sources(layers):
        asked.append(list(layers))
        return staged_sources(gf, layers, CPU)

    staged = load_weights(gf, cfg, CPU, prec, private=False, resident_layers={0, 2},
                          layer_sources=sources)
    mapped = load_weights(gf, cfg, CPU, prec, private=False, resident_layers={0, 2})
    assert asked == [[0, 2]] and staged.layers[1] is None
    compared = 0
    for i in (0, 2):
        for f in dataclasses.fields(staged.layers[i]):
            a, b = getattr(staged.layers[i], f.name), getattr(mapped.layers[i], f.name)
            a, b = getattr(a, "weight", a), getattr(b, "weight", b)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (i, f.name)
                compared += 1
    assert compared >= 2 * 7  # q/k/v or qkv, output, gate/up, down, two norms a layer


def test_a_file_that_interleaves_layers_is_read_from_the_map(model, tmp_path, monkeypatch):
    """Tensors laid out in another order (the fuzzer's relayout) put other layers' bytes inside
    each layer's span: staging would read most of the file per layer, so the layers come from
    the map, the same bytes."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
    from gguf_doc import parse, relayout, serialize

    gf, cfg = model
    doc = parse(gf.path.read_bytes())
    names = [t.name.decode() for t in doc.tensors]
    rng = random.Random(1)
    while True:  # an order where layer 0's tensors are not one run
        rng.shuffle(doc.tensors)
        order = [t.name.decode() for t in doc.tensors]
        at = [k for k, n in enumerate(order) if n.startswith("blk.0.")]
        if at[-1] - at[0] + 1 > len(at):
            break
    relayout(doc, rng)  # the data section laid out in that order, each tensor's own bytes
    shuffled = tmp_path / "shuffled.gguf"
    shuffled.write_bytes(serialize(doc))
    other = GGUFFile(shuffled)
    assert sorted(other.tensors) == sorted(names)
    monkeypatch.setattr(layer_reads, "SPAN_SLACK", 0)  # the tiny model's spans are KiBs
    assert layer_reads.compact(gf, range(cfg.n_layers))
    assert not layer_reads.compact(other, range(cfg.n_layers))
    mapped = TensorSource(gf)
    for i, src in staged_sources(other, range(cfg.n_layers), CPU):
        assert src.buffer is None  # the map's
        for name in file_spec(other).names(i, other.tensors):
            shape = other.tensors[name].shape
            assert torch.equal(src.raw(name, shape), mapped.raw(name, shape))


def test_a_mixture_of_experts_is_read_from_the_map(tmp_path):
    """Its experts are placed from the layer's bytes one by one, some after the build: a
    reused staging buffer would not hold them, so its layers stay views of the map."""
    path = write_synth(tmp_path / "moe.gguf", "tiny", "Q8_0", n_layers=2, arch="qwen3moe",
                       seed=2)
    gf = GGUFFile(path)
    assert layer_reads.compact(gf, range(2))
    assert all(src.buffer is None for _, src in staged_sources(gf, range(2), CPU))
