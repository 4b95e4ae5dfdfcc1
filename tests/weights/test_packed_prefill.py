"""A CPU prefill (more than 8 rows) through the packed native copies (PackedDecodeLinear's
packed_prefill: q4vnni, q8vnni, q6vnni) instead of dense float32 weights.

Oracles: gguf-py's dequantization of the same bytes in float64 times the rows (the kernels'
16-bit activations keep the error far under 1e-3), and the kernels' own one-row calls, whose
bits every row of a long call must have (the rows in tiles of 128 and quantized by the
threads past 64 rows). A linear without packed_prefill still takes its dense weight."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native, quant
from slipstream.weights.cpu import PackedDecodeLinear, pack_linear, prefills_packed
from slipstream.weights.cpu.q6vnni import q6vnni_available
from slipstream.weights.linear import DenseLinear
from quant_oracle import make_raw

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")

FORMATS = [Q.Q4_K, Q.Q8_0, Q.Q6_K]


@pytest.fixture(autouse=True)
def _packed_prefill_on(monkeypatch):
    """These tests are of packed prefill (the default) whatever the environment says."""
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "1")


def _linear(qtype, rows: int, cols: int, packed_prefill: bool, bias=None):
    if qtype == Q.Q6_K and not q6vnni_available():
        pytest.skip("no q6vnni here (its VNNI loop)")
    raw = make_raw(qtype, rows, cols, 3)
    dense = DenseLinear(quant.dequantize_as(raw, qtype, (rows, cols), torch.float16), bias)
    lin = PackedDecodeLinear(dense, lambda: pack_linear(raw, qtype, (rows, cols), bias), 8,
                             packed_prefill=packed_prefill)
    exact = gguf.quants.dequantize(raw.numpy(), qtype).astype(np.float64).reshape(rows, cols)
    return lin, torch.from_numpy(exact)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_many_rows_take_the_packed_kernel(qtype):
    rows, cols, m = 70, 512, 300
    lin, exact = _linear(qtype, rows, cols, True)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(1))
    y = lin(x)
    ref = x.double() @ exact.t()
    assert y.dtype == torch.float32 and y.shape == (m, rows)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-4
    packed = lin.packed
    for r in (0, 63, 64, 127, 128, 299):  # each row the bits of a call of its own
        assert torch.equal(y[r:r + 1], packed.matvec(x[r:r + 1], torch.empty(1, rows))), r
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), y)
    finally:
        torch.set_num_threads(threads)
    # negative control: the dense float16 weight is a different product
    assert not torch.equal(lin.dense(x), y)


def test_bias_and_residual():
    rows, cols, m = 40, 256, 20
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    lin, exact = _linear(Q.Q4_K, rows, cols, True, bias)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(3))
    res = torch.randn(m, rows, generator=torch.Generator().manual_seed(4))
    y = lin(x, residual=res)
    ref = res.double() + bias.double() + x.double() @ exact.t()
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-4
    assert torch.equal(y, res + lin(x))


def test_without_packed_prefill_the_dense_weight_serves():
    lin, _ = _linear(Q.Q4_K, 40, 256, False)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(lin(x), lin.dense(x))


def test_the_choice(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_PACKED_PREFILL")  # the default: on
    assert prefills_packed([Q.Q4_K, Q.Q4_K]) and prefills_packed([Q.Q8_0])
    assert not prefills_packed([Q.F16])  # no layout reads it
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "0")
    assert not prefills_packed([Q.Q4_K])
    monkeypatch.setenv("SLIPSTREAM_Q4VNNI", "0")  # torch's int4 layout: dense prefill
    monkeypatch.setenv("SLIPSTREAM_PACKED_PREFILL", "1")
    assert not prefills_packed([Q.Q4_K])
