"""weights.image.flattened: a built layer moved into one buffer laid out as its image holds the
same bytes, every tensor a view into that buffer. Driven on the CPU with the CUDA builder's
packing (as tests/memory/test_cuda_store_fake.py does); tests/gpu checks a streamed load."""

from __future__ import annotations

import pytest
import torch

from slipstream.modelfile.config import ModelConfig
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory.vram import layer_flat_bytes, layer_image_bytes
from slipstream.precision import Precision
from slipstream.synth import write_synth


# the codebook formats: MXFP4's float32 scale plane, IQ4_XS's K-quant-like scales
@pytest.fixture(scope="module", params=["Q4_K_M", "MXFP4", "IQ4_XS"])
def built(tmp_path_factory, request):
    pytest.importorskip("triton")  # QuantLinear looks the kernels up (never runs them here)
    from slipstream.weights.linear import Workspace
    from slipstream.weights.loader import LayerBuilder, TensorSource

    path = write_synth(tmp_path_factory.mktemp("flat") / "m.gguf", "tiny", request.param,
                       n_layers=2, seed=3)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    cpu = torch.device("cpu")
    builder = LayerBuilder(cfg, cpu, Precision.of("fast", cpu), workspace=Workspace(cpu),
                           fuse_scales=False)
    builder.quantized = True
    return gf, cfg, builder, [builder.build(TensorSource(gf), i) for i in range(2)]


def test_a_flattened_layer_holds_the_same_bytes_in_one_buffer(built):
    from slipstream.weights.image import _tensors, flattened, layout_of

    gf, cfg, builder, layers = built
    for i, layer in enumerate(layers):
        want = dict(_tensors(layer))
        flat = flattened(layer, builder.workspace)
        got = dict(_tensors(flat))
        assert got.keys() == want.keys() and len(got) > 5
        for key, t in got.items():
            assert t.dtype == want[key].dtype and torch.equal(t, want[key]), key
        storages = {t.untyped_storage().data_ptr() for t in got.values()}
        assert len(storages) == 1
        nbytes = next(iter(got.values())).untyped_storage().nbytes()
        # the planner's sizes: the image's (memory.vram), one allocation
        assert nbytes == layout_of(layer).nbytes == layer_image_bytes(gf, cfg, i)
        assert layer_flat_bytes(gf, cfg, i) >= nbytes
        # the linears keep their packed formats: the layer computes as the built one
        for name, lin in vars(layer).items():
            if hasattr(lin, "packed"):
                a, b = lin.packed, getattr(flat, name).packed
                assert (a.qtype, a.rows, a.cols, a.f16_scales) == \
                    (b.qtype, b.rows, b.cols, b.f16_scales)
