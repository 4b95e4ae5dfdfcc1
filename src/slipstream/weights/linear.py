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

    @staticmethod
    def fuse(parts: list["DenseLinear"]) -> tuple["DenseLinear", list["DenseLinear"]]:
        """Concatenate output rows into one layer; the parts become views into it, so the
        fused copy costs no extra memory."""
        weight = torch.cat([p.weight for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias if p.bias is not None else
                          torch.zeros(p.out_features, device=weight.device) for p in parts]
                         ) if has_bias else None
        views, row = [], 0
        for p in parts:
            n = p.out_features
            views.append(DenseLinear(weight[row:row + n],
                                     bias[row:row + n] if bias is not None else None))
            row += n
        return DenseLinear(weight, bias), views

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
