"""The legacy 32-element formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.

Block layouts (bytes, little-endian):
    Q4_0  d:f16 | qs[16]                  x = d * (q - 8)
    Q4_1  d:f16 | m:f16 | qs[16]          x = d * q + m
    Q5_0  d:f16 | qh[4] | qs[16]          x = d * (q - 16)
    Q5_1  d:f16 | m:f16 | qh[4] | qs[16]  x = d * q + m
    Q8_0  d:f16 | qs[32] (int8)           x = q * d
Nibble byte i holds element i (low) and element i + 16 (high); qh is one 32-bit little-endian
word whose bit j is the fifth bit of element j. The float arithmetic (order of the multiply and
the add, no fused multiply-add) mirrors gguf-py so results are bit-identical to it; the
products and sums are taken in place, in the float32 tensor the codes were widened into (the
same operations in the same order: the same bits, without a new tensor for each step).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .base import bits, f16_field, nibbles, register


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)  # (n, 1)
    x = nibbles(blocks[:, 2:18]).reshape(n, 32).float()
    return x.sub_(8).mul_(d)  # q - 8 is exact in float32, as in int8


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    x = nibbles(blocks[:, 4:20]).reshape(n, 32).float()
    return x.mul_(d).add_(m)


def five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's unsigned five-bit codes, (n, 32) uint8, from their blocks' qh and qs."""
    # qh: (n, 4) bytes of the 32-bit high-bit word; reading it byte by byte (bit b of byte k is
    # bit 8k + b of the word) avoids uint32, which older torch cannot shift.
    n = qh.shape[0]
    high = bits(qh).transpose(1, 2).reshape(n, 32)  # (n, 4, 8) -> element 8k + b
    return nibbles(qs).reshape(n, 32) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    x = five_bit(blocks[:, 2:6], blocks[:, 6:22]).float()
    return x.sub_(16).mul_(d)  # q - 16 is exact in float32, as in int8


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    x = five_bit(blocks[:, 4:8], blocks[:, 8:24]).float()
    return x.mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)
    q = blocks[:, 2:34].contiguous().view(torch.int8)
    return q.float().mul_(d)


Q4_0 = register(GGMLQuantizationType.Q4_0, _q4_0)
Q4_1 = register(GGMLQuantizationType.Q4_1, _q4_1)
Q5_0 = register(GGMLQuantizationType.Q5_0, _q5_0)
Q5_1 = register(GGMLQuantizationType.Q5_1, _q5_1)
Q8_0 = register(GGMLQuantizationType.Q8_0, _q8_0)
