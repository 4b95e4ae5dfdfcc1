"""weights.linear.Linear: every linear answers norm_matmul and glu_matmul, and the defaults
give exactly the numbers of the plain composition the block computed before it asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.model.llama import rms_norm
from slipstream.weights.linear import DenseLinear, Linear, QuantLinear


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dense_defaults_are_the_plain_composition(rows, dtype):
    g = torch.Generator().manual_seed(0)
    hidden, ffn = 64, 96
    x = torch.randn(rows, hidden, generator=g)
    norm = 1 + 0.1 * torch.randn(hidden, generator=g)
    qkv = DenseLinear(torch.randn(80, hidden, generator=g).to(dtype),
                      torch.randn(80, generator=g))
    down = DenseLinear(torch.randn(hidden, ffn, generator=g).to(dtype))
    assert torch.equal(qkv.norm_matmul(x, norm, 1e-5), qkv(rms_norm(x, norm, 1e-5)))
    gate_up = torch.randn(rows, 2 * ffn, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    for residual in (None, x):
        assert torch.equal(down.glu_matmul(gate_up, residual=residual),
                           down(F.silu(gate) * up, residual=residual))


def test_every_linear_is_a_linear():
    assert issubclass(DenseLinear, Linear) and issubclass(QuantLinear, Linear)
    with pytest.raises(TypeError):
        Linear()  # __call__ is abstract


def test_a_prefill_widens_into_a_kept_buffer_with_the_same_bits():
    """More than GEMV_MAX_ROWS rows of a float16 weight: the product of weight.to(float32),
    bit for bit, though the widened copy lives in a buffer the thread keeps (linear.upcast);
    weights of other shapes in turn, in and out of inference mode, never see each other's
    values, and a weight past UPCAST_KEPT_MAX is widened into a tensor of its own."""
    from slipstream.weights import linear

    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 64, generator=g)
    big, small = (torch.randn(r, 64, generator=g).half() for r in (96, 40))
    for w in (big, small, big):
        for mode in (torch.inference_mode(), torch.no_grad()):
            with mode:
                got = DenseLinear(w)(x)
            assert torch.equal(got, F.linear(x, w.float()))
    kept = linear.upcast(small, torch.float32)
    assert kept.data_ptr() == linear.upcast(big, torch.float32).data_ptr()  # one buffer
    old = linear.UPCAST_KEPT_MAX
    try:
        linear.UPCAST_KEPT_MAX = small.numel() - 1
        assert linear.upcast(small, torch.float32).data_ptr() != kept.data_ptr()
    finally:
        linear.UPCAST_KEPT_MAX = old
