"""DequantLinear: exact float32 on the GGUF codes, a reference layout for comparing the packed
ones (kind "dequant", or "dequant-compiled"): the codes as int8 plus float32 per-group scales (and
offsets), dequantized a few rows at a time into an L2-sized buffer and multiplied there. The
weights are bit-identical to slipstream's (and gguf-py's) dequantizer; only the order of the sums
differs from DenseLinear's float32 path.
"""

from __future__ import annotations

import torch

from ..linear import Linear
from .groups import GroupAffine, row_chunks

_DEQUANT_BUFFER_BYTES = 1 << 20  # DequantLinear's scratch: well inside one core's L2
_COMPILED_DOT = None


def _dot_rows(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              x: torch.Tensor) -> torch.Tensor:
    """One activation row against group-affine weights, as one fused reduction: codes (N, B, g)
    int8, scale/offset (N, B), x (B, g) float32 -> (N,). Each group's dot product is formed on
    the codes and then scaled (sum_b s_b (q_b . x_b) + o_b sum(x_b)): the weights' float32
    values are never formed, so the sums differ from DenseLinear's in rounding only."""
    p = (codes.to(torch.float32) * x).sum(-1)
    if offset is None:
        return (p * scale).sum(-1)
    return (p * scale + offset * x.sum(-1)).sum(-1)


def _compiled_dot():
    global _COMPILED_DOT
    if _COMPILED_DOT is None:  # one compilation for every shape (dynamic), at the first call
        _COMPILED_DOT = torch.compile(_dot_rows, dynamic=True)
    return _COMPILED_DOT


class DequantLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) in float32 on the GGUF codes: a few rows at a time are
    dequantized (codes * scale (+ offset), the dequantizer's own float32 operations) into a
    scratch buffer that stays in L2, then multiplied. Exact: the weights are bit-identical to
    slipstream.quant.dequantize; it reads 1 byte per weight plus 4 (or 8) bytes per group.

    compiled=True: a single row (decode) goes through one torch.compile'd reduction on the
    codes instead (`_dot_rows`; ~4x the eager rate here; the first call compiles, ~10-50 s,
    and needs a C++ compiler); more rows stay eager (the compiled loop reads the codes once
    per row)."""

    def __init__(self, ga: GroupAffine, bias: torch.Tensor | None = None,
                 compiled: bool = False):
        self.ga = ga
        self.bias = bias
        self.compiled = compiled
        rows, cols = ga.shape
        self.in_features = cols
        self._rows = max(1, min(rows, _DEQUANT_BUFFER_BYTES // (4 * cols)))
        self._buf = torch.empty(self._rows, cols)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None,
                  compiled: bool = False) -> "DequantLinear":
        """Stack the parts' rows (GGUF bytes; one group size, i.e. all 32 or all Q6_K)."""
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scale = offset = None
        group, lo = None, 0
        for r0, ga in row_chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            if scale is None:
                group = ga.group
                scale = torch.empty(rows, cols // group)
            if ga.group != group:
                raise ValueError("parts of one DequantLinear need one group size")
            if ga.offset is not None and offset is None:
                offset = torch.zeros(rows, cols // group)
            codes[r0:r1], scale[r0:r1] = ga.codes, ga.scale
            if ga.offset is not None:
                offset[r0:r1] = ga.offset
            lo = min(lo, ga.lo)
        return cls(GroupAffine(codes, scale, offset, group, lo), bias, compiled)

    @property
    def kind(self) -> str:
        return "dequant-compiled" if self.compiled else "dequant"

    @property
    def out_features(self) -> int:
        return self.ga.codes.shape[0]

    @property
    def nbytes(self) -> int:
        ga = self.ga
        return ga.codes.numel() + ga.scale.numel() * 4 + (
            ga.offset.numel() * 4 if ga.offset is not None else 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        ga = self.ga
        rows, cols = ga.shape
        per = cols // ga.group
        xf = x.float()
        if self.compiled and x.shape[0] == 1:
            y = _compiled_dot()(ga.codes.view(rows, per, ga.group), ga.scale, ga.offset,
                                xf.view(per, ga.group)).unsqueeze(0)
        else:
            yt = torch.empty(rows, x.shape[0])  # (out, m): each chunk writes contiguous rows
            for r0 in range(0, rows, self._rows):
                r1 = min(rows, r0 + self._rows)
                buf = self._buf[:r1 - r0]
                g = buf.view(r1 - r0, per, ga.group)
                torch.mul(ga.codes[r0:r1].view(r1 - r0, per, ga.group),
                          ga.scale[r0:r1].unsqueeze(-1), out=g)
                if ga.offset is not None:
                    g.add_(ga.offset[r0:r1].unsqueeze(-1))
                torch.mm(buf, xf.t(), out=yt[r0:r1])
            y = yt.t()
            if x.shape[0] > 1:
                y = y.contiguous()
        if self.bias is not None:
            y = y + self.bias
        if residual is not None:
            y = residual + y
        return y.to(x.dtype)
