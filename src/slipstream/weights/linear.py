"""Linear layers and the embedding, as callables the model math uses without knowing formats."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant

# Row counts up to this go through the storage dtype directly (a memory-bound GEMV, where
# fewer bytes win); larger batches upcast the weight to the activation dtype once per call,
# because half-precision GEMM on CPU is far slower than float32 GEMM.
GEMV_MAX_ROWS = 8


class DenseLinear:
    """y = x @ W^T (+ b) with W held dense in `weight.dtype`.

    On CPU the weight is stored as float16: dequantized GGUF values round to it with a relative
    error near 5e-4, it halves the bytes each decode step streams from RAM against float32, and
    torch's CPU fp16 GEMV accumulates in float32. Prefill upcasts to float32 for MKL's SGEMM.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # (out, in)
        self.bias = bias  # (out,) float32 or None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS or self.weight.device.type != "cpu":
            y = F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


class QuantEmbedding:
    """Token embedding kept in its GGUF format: a lookup dequantizes only the rows it gathers."""

    def __init__(self, raw: torch.Tensor, ggml_type: int, hidden: int, out_dtype: torch.dtype):
        self.raw = raw  # (vocab, row_bytes) uint8
        self.ggml_type = ggml_type
        self.hidden = hidden
        self.out_dtype = out_dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw[ids.to(self.raw.device)]
        return quant.dequantize(rows, self.ggml_type, (ids.shape[0], self.hidden)).to(
            self.out_dtype)
