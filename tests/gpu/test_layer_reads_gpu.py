"""A CUDA build from staged bytes (memory.layer_reads) on the GPU: the same packed layer as
one built from the memory map, from locked buffers."""

from __future__ import annotations

import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.image import to_image
from slipstream.memory.layer_reads import staged_sources
from slipstream.weights.loader import LayerBuilder
from slipstream.weights.source import TensorSource

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0"])
def test_a_layer_built_on_the_gpu_from_staged_bytes_has_the_maps_image(tmp_path, quant):
    path = write_synth(tmp_path / "m.gguf", "tiny", quant, n_layers=3, seed=5)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    dev = torch.device("cuda")
    builder = LayerBuilder(cfg, dev, Precision.of("fast", dev), fuse_scales=False)
    for i, src in staged_sources(gf, range(cfg.n_layers), dev, staged=True):
        assert src.buffer.is_pinned()
        staged = to_image(builder.build(src, i), pin=False)
        mapped = to_image(builder.build(TensorSource(gf), i), pin=False)
        assert staged.layout == mapped.layout
        assert torch.equal(staged.host, mapped.host), i
