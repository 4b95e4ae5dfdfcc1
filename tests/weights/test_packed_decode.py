"""precision="fast" on CPU: decode through packed copies of the weights (weights.cpu_packed.
PackedDecodeLinear) where every layer is resident; the accuracy of that path against
transformers is in tests/model/test_vs_transformers.py."""

from __future__ import annotations

import torch

import slipstream
from slipstream.config import ModelConfig
from slipstream.gguf_file import GGUFFile
from slipstream.memory.setup import cpu_load_precision, packed_decode_bytes
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.cpu_packed import PackedDecodeLinear

CPU = torch.device("cpu")


def test_packed_decode_only_where_every_layer_is_resident_and_fits(tmp_path):
    """precision="fast" on CPU packs decode copies for an all-resident plan within its RAM
    budget; a streamed plan, or one whose budget the copies would pass, stays dense."""
    path = write_synth(tmp_path / "t.gguf", "tiny", "Q4_K", n_layers=4, from_floats=True,
                       seed=2)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors))
    fast = Precision.of("fast", CPU)
    with slipstream.load(path, device="cpu", ctx=64) as m:
        plan = m.plan
        assert cpu_load_precision(fast, plan, gf, cfg).cpu_packed_decode
        assert isinstance(m.engine.weights.layers[0].ffn_down, PackedDecodeLinear)
        extra = packed_decode_bytes(gf, cfg)
        assert extra > 0
        held = plan.fixed_bytes + sum(plan.resident_bytes_per_layer)
        plan.budget = held + extra - 1
        assert not cpu_load_precision(fast, plan, gf, cfg).cpu_packed_decode
    budget = plan.fixed_bytes + 2 * max(plan.file_bytes_per_layer) + 1
    with slipstream.load(path, device="cpu", ctx=64, ram_budget=budget) as streamed:
        assert streamed.plan.disk_layers
        assert not isinstance(streamed.engine.weights.output, PackedDecodeLinear)
    gf.close()


def test_decode_goes_packed_and_batches_dense():
    calls = []

    class Spy:
        def __init__(self, name):
            self.name = name

        def __call__(self, x, residual=None):
            calls.append(self.name)
            return x

    made = []
    lin = PackedDecodeLinear(Spy("dense"), lambda: made.append(1) or Spy("packed"), max_rows=8)
    lin(torch.zeros(9, 4))
    assert not made  # prefill needs no packed copy
    lin(torch.zeros(8, 4))
    lin(torch.zeros(1, 4))
    assert calls == ["dense", "packed", "packed"] and made == [1]  # made once
    unpackable = PackedDecodeLinear(Spy("dense"), lambda: None, max_rows=8)
    unpackable(torch.zeros(1, 4))
    assert calls[-1] == "dense"
