"""A prefill-sized float32 RMSNorm on the CPU in one native pass (model.llama.rms_norm over
native/decode_ops.c's ss_rms_norm_rows_f32), against torch's F.rms_norm and float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream import native
from slipstream.model.llama import NATIVE_NORM_MIN, rms_norm

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no native library (no C compiler, or SLIPSTREAM_NATIVE=0)")


@pytest.mark.parametrize("shape", [(512, 2048), (4096, 128), (3, 8, 2731)])
def test_native_norm_is_the_norm(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    w = torch.randn(shape[-1], generator=g)
    assert x.numel() >= NATIVE_NORM_MIN
    y = rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    torch_norm = F.rms_norm(x, (shape[-1],), w, 1e-6)
    assert not torch.equal(rms_norm(x, w * 1.001, 1e-6), torch_norm)  # negative control
    assert float((y - torch_norm).abs().max() / torch_norm.abs().max()) < 1e-6


def test_small_norms_keep_torchs():
    x = torch.randn(4, 128)
    w = torch.randn(128)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (128,), w, 1e-6))
