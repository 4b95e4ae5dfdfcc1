"""The CUDA-graph decode body (position only on the device, fixed attention span, masked) must
compute what the eager decode computes. It runs eagerly on CPU here, so CI checks its math."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_engine
from slipstream.runtime.graphs import DecodeGraphs
from slipstream.synth import write_synth


@pytest.mark.slow
def test_static_decode_body_matches_eager_decode(tmp_path, monkeypatch):
    """(The eager CPU decode through the torch ops: the native ones, model.cpu_native, serve
    only CPU decode and round their norms' sums in another order, so the keys they cache
    differ in the last bits; tests/model/test_cpu_native.py holds them to the torch ops.)"""
    from slipstream.model import llama

    monkeypatch.setattr(llama, "CPU_NATIVE", False)
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", from_floats=True, std=0.1, seed=5)
    eager = cpu_engine(path, ctx=64)
    static = cpu_engine(path, ctx=64)
    prompt = [3, 17, 99, 250, 7]
    eager.forward(prompt)
    static.forward(prompt)
    graphs = DecodeGraphs(static)
    for tok in [11, 42, 500, 8]:
        want = eager.forward([tok])
        graphs.token.fill_(tok)
        graphs.pos.fill_(static.length)
        got = graphs.body(span=32)  # span past the position: masking must hide it
        static.set_length(static.length + 1)
        # the two paths reach attention through different kernels (SDPA with a mask, bmm);
        # the head rounds logits to float16, so agreement is to float16 resolution
        assert float((got - want).norm() / want.norm()) < 1e-3
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(eager.kv.k[:, :, :9], static.kv.k[:, :, :9])


@pytest.mark.slow
def test_weight_bytes_count_the_packed_cpu_copies(tmp_path):
    """`slipstream bench`'s roofline divides by the bytes a decode token reads: on CPU at
    precision fast that is the packed copies (weights.cpu), about the GGUF bytes of the
    linears (4-bit codes plus bfloat16 scale and zero per 32 against Q4_0's fp16 scale per 32),
    not the dense copies and not nothing."""
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.runtime.bench import weight_bytes_per_token

    path = write_synth(tmp_path / "q4.gguf", "tiny", "Q4_0", n_layers=2)
    tensors = GGUFFile(path).tensors
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    gguf = head.n_bytes + sum(t.n_bytes for n, t in tensors.items()
                              if n.startswith("blk.") and n.endswith(".weight")
                              and "norm" not in n)
    fast = weight_bytes_per_token(cpu_engine(path, precision="fast"))
    exact = weight_bytes_per_token(cpu_engine(path, precision="exact"))  # float32 dense
    assert gguf < fast < 1.3 * gguf
    assert exact > 4 * gguf  # 32-bit weights against ~4.5-bit codes


def test_captured_weights_hold_the_token_table_where_rows_are_returned(tmp_path):
    """A self-draft captured in CUDA graphs cannot look rows up in a host table (the lookup
    copies ids to the host): captured_weights copies the table to its rows' device (here
    "meta" stands in for CUDA) and leaves everything else, and a table already there, as is."""
    import dataclasses

    from slipstream.runtime.engine import captured_weights
    from slipstream.weights.linear import QuantEmbedding

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=2)
    weights = cpu_engine(path, ctx=64).weights
    assert captured_weights(weights) is weights  # a CPU table returning CPU rows
    host = weights.embed
    split = dataclasses.replace(weights, embed=QuantEmbedding(
        host.raw, host.ggml_type, host.hidden, host.out_dtype, torch.device("meta")))
    moved = captured_weights(split)
    assert moved.embed.raw.device.type == "meta" and moved.embed.device.type == "meta"
    assert moved.embed.raw.shape == host.raw.shape and moved.embed.ggml_type == host.ggml_type
    assert split.embed.raw.device.type == "cpu"  # the target's own table stays on the host
    assert moved.layers is weights.layers and moved.output is weights.output
