"""The codebook 4-bit formats: a 4-bit code picks one of 16 fixed values, scaled per block.

Block layouts (bytes, little-endian):
    MXFP4   e:e8m0 | qs[16]                                32 elements, x = half(e) * K_MX[q]
    IQ4_NL  d:f16 | qs[16]                                 32 elements, x = d * K_NL[q]
    IQ4_XS  d:f16 | scales_h:u16 | scales_l[4] | qs[128]   8 x 32,      x = d * (sc - 32) * K_NL[q]
Nibble byte i of a 16-byte run holds element i (low nibble) and element i + 16 (high), as in
Q4_0. K_MX is the E2M1 (fp4) grid doubled so that it is whole numbers, and half(e) is the e8m0
scale halved to make up for it: 2^(e - 128), built from its float32 bits as ggml does
(ggml_e8m0_to_fp32_half), so e = 0 and 1 give the subnormals 2^-128 and 2^-127. K_NL is the
non-uniform grid llama.cpp fitted to normal-ish weights.

IQ4_XS's 6-bit sub-block scales: the low 4 bits of scale j are nibble j % 2 of scales_l[j // 2],
the top 2 bits are bits 2j, 2j + 1 of scales_h; stored with a +32 bias.

Every result is bit-identical to gguf-py's numpy dequantizers: each product is the same float32
multiply in the same order (IQ4_XS: (d * sc) first, then times the code's value), and most are
exact anyway (an 11-bit f16 mantissa times a 6-bit scale times a 7-bit grid value needs at most
24 bits).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .base import crumbs, f16_field, nibbles, register

# The two grids, in code order (llama.cpp ggml-common.h kvalues_mxfp4 / kvalues_iq4nl).
MXFP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
IQ4NL_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10,
                                 1, 13, 25, 38, 53, 69, 89, 113)

_tables: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def codebook(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The grid as a float32 tensor on `device` (made once per device)."""
    key = (values, device)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return table


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 exponents -> float32 2^(e - 128), bit for bit as ggml builds it.

    e >= 2: the exponent field e - 1 (a normal float); e = 0, 1: the subnormals whose one set
    mantissa bit is 0x00200000 << e. All 256 values are finite (e = 255 gives 2^127)."""
    e32 = e.to(torch.int32)
    sub = torch.bitwise_left_shift(torch.full_like(e32, 0x00200000), e32)
    normal = torch.bitwise_left_shift(e32 - 1, 23)
    return torch.where(e32 < 2, sub, normal).view(torch.float32)


def _lookup(codes: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    return codebook(values, codes.device)[codes.long()]


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = e8m0_half(blocks[:, 0:1])  # (n, 1)
    x = _lookup(nibbles(blocks[:, 1:17]).reshape(n, 32), MXFP4_VALUES)
    return x.mul_(d)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    x = _lookup(nibbles(blocks[:, 2:18]).reshape(n, 32), IQ4NL_VALUES)
    return x.mul_(d)


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The 8 signed sub-block scales of IQ4_XS blocks: (n, 136) uint8 -> (n, 8) int8."""
    n = blocks.shape[0]
    # crumbs: [shift s, byte k] is scale 4k + s; nibbles: [half h, byte i] is scale 2i + h
    high = crumbs(blocks[:, 2:4]).transpose(1, 2).reshape(n, 8)
    low = nibbles(blocks[:, 4:8]).transpose(1, 2).reshape(n, 8)
    return (low | (high << 4)).to(torch.int8) - 32


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    dl = (d * iq4_xs_scales(blocks).float()).reshape(n, 8, 1)
    x = _lookup(nibbles(blocks[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32), IQ4NL_VALUES)
    return x.mul_(dl).reshape(n, 256)


MXFP4 = register(GGMLQuantizationType.MXFP4, _mxfp4)
IQ4_NL = register(GGMLQuantizationType.IQ4_NL, _iq4_nl)
IQ4_XS = register(GGMLQuantizationType.IQ4_XS, _iq4_xs)
