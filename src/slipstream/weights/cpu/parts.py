"""PartsLinear: a linear group whose parts pack into different layouts (q/k/v of a Q4_K_M file,
which ships attn_v as Q6_K beside Q4_K q and k), as one linear over its packed parts.

Without it such a group had no packed copy and decoded through its dense float16 weight: on
the 2-core EPYC that is ~3.5x the bytes of Q4_K for the group's rows, about 10% of a real
Q4_K_M file's decode token. Each part computes through its own kernel into its columns of the
output, so a row's bits are the parts' own, whatever else is in the call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..linear import Linear
from .groups import finish


class PartsLinear(Linear):
    """Packed parts (each a weights.cpu layout of the same input width) with their output rows
    concatenated in order: x (m, in) -> (m, sum of the parts' rows)."""

    kind = "parts"

    def __init__(self, parts: Sequence[Linear]):
        if not parts:
            raise ValueError("a PartsLinear needs at least one part")
        widths = {p.in_features for p in parts}
        if len(widths) != 1:
            raise ValueError(f"the parts' input widths differ: {sorted(widths)}")
        self.parts = list(parts)
        self.in_features = widths.pop()
        self._out = sum(p.out_features for p in parts)
        biases = [p.bias for p in parts]
        # the bare products (kernel, matvec) leave the bias to the caller, as the layouts do
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.out_features)
             for b, p in zip(biases, parts)])

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 (or float32) x (m, in): bfloat16 (m, out), no bias."""
        return torch.cat([p.kernel(xb) for p in self.parts], dim=1)

    def matvec(self, x: torch.Tensor, out: torch.Tensor, threads: int | None = None
               ) -> torch.Tensor:
        """out (m, out) = x (m, in) @ W^T, no bias: each part's matvec into its columns (a
        buffer of its own where out's columns are not contiguous, m > 1)."""
        r0 = 0
        for p in self.parts:
            r1 = r0 + p.out_features
            if out.shape[0] == 1:
                p.matvec(x, out[:, r0:r1], threads)
            else:
                out[:, r0:r1] = p.matvec(x, torch.empty(x.shape[0], p.out_features,
                                                        dtype=out.dtype), threads)
            r0 = r1
        return out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = self.matvec(x, torch.empty(x.shape[0], self._out))
        return finish(y, x.dtype, self.bias, residual)
