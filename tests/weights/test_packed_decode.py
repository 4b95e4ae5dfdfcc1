"""precision="fast" on CPU: decode through packed copies of the weights (weights.cpu.
PackedDecodeLinear), resident and streamed layers alike; the accuracy of that path against
transformers is in tests/model/test_vs_transformers.py."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.memory.setup import layer_resident_bytes
from slipstream.precision import Precision
from slipstream.synth import write_synth
from slipstream.weights.cpu import PackedDecodeLinear, packed_nbytes

CPU = torch.device("cpu")


@pytest.mark.slow
def test_the_plan_counts_the_packed_copies_and_streams_packed(tmp_path):
    """precision="fast" on CPU packs decode copies for every plan: a resident layer's RAM is
    its dense weights plus those copies, so a budget that holds the dense layers but not the
    copies streams some layers, which decode from packed images, as does every layer of a
    plan that streams."""
    path = write_synth(tmp_path / "t.gguf", "tiny", "Q4_K", n_layers=4, from_floats=True,
                       seed=2)
    gf = GGUFFile(path)
    fast, exact = Precision.of("fast", CPU), Precision.of("exact", CPU)
    names = [n for n in gf.tensors if n.startswith("blk.0.")]
    copies = sum(packed_nbytes(gf.tensors[n].ggml_type, tuple(int(d) for d in
                                                             gf.tensors[n].shape)) or 0
                 for n in names if len(gf.tensors[n].shape) == 2)
    dense = layer_resident_bytes(gf, 0, exact) // 2  # float32 at exact, float16 at fast
    norms = sum(gf.tensors[n].n_bytes for n in names if len(gf.tensors[n].shape) == 1)
    assert copies > 0
    assert layer_resident_bytes(gf, 0, fast) == pytest.approx(dense + norms // 2 + copies)
    with slipstream.load(path, device="cpu", ctx=64) as m:
        plan = m.plan
        assert set(plan.tiers) == {"ram"} and plan.cpu_images  # decode reads images' bytes
        assert isinstance(m.engine.weights.layers[0].ffn_down, PackedDecodeLinear)
        assert isinstance(m.engine.weights.output, PackedDecodeLinear)
    # the dense layers fit, their copies do not: the plan keeps every layer's packed image
    # and as many of them whole as the rest holds, whose decode is packed too
    held_dense = plan.fixed_bytes + sum(plan.resident_bytes_per_layer) - 4 * copies
    budget = held_dense + 2 * max(plan.file_bytes_per_layer) + plan.prefill_staging + 1
    with slipstream.load(path, device="cpu", ctx=64,
                         placement=slipstream.Placement(ram_budget=budget)) as streamed:
        tiers = streamed.plan.tiers
        assert "packed" in tiers and "ram" in tiers and "disk" not in tiers
        assert isinstance(streamed.engine.weights.output, PackedDecodeLinear)
        for i, w in enumerate(streamed.engine.weights.layers):
            assert (w is None) == (tiers[i] == "packed")
            got = w or streamed.engine.layers.packed[i]
            assert isinstance(got.ffn_down, PackedDecodeLinear)
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


def test_an_on_demand_dense_linear_gives_the_dense_linears_bits(tmp_path):
    """A streamed plan's head keeps its GGUF bytes and dequantizes them per call of more than
    8 rows (linear.OnDemandDenseLinear): the bits of DenseLinear over the weight the loader
    makes from the same bytes, for any row count, with bias and residual."""
    from slipstream.weights.linear import DenseLinear, OnDemandDenseLinear
    from slipstream.weights.loader import TensorSource, raw_tensor

    path = write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", n_layers=1, from_floats=True,
                       seed=4)
    gf = GGUFFile(path)
    name = "blk.0.ffn_down.weight"
    shape = rows, cols = tuple(int(d) for d in gf.tensors[name].shape)  # as the loader reads it
    raw = raw_tensor(gf, name, shape).clone()
    bias = torch.randn(rows)
    dense = DenseLinear(TensorSource(gf).dense(name, shape, torch.float16, CPU), bias)
    lazy = OnDemandDenseLinear(raw, gf.tensors[name].ggml_type, shape, torch.float16, bias)
    assert lazy.out_features == dense.out_features == rows
    for t in (1, 5, 12):
        x, r = torch.randn(t, cols), torch.randn(t, rows)
        assert torch.equal(lazy(x), dense(x))
        assert torch.equal(lazy(x, residual=r), dense(x, residual=r))
    gf.close()
