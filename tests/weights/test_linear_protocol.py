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
