"""The K-quants: 256-element super-blocks made of 16 or 32-element sub-blocks.

Block layouts (bytes, little-endian; QK_K = 256):
    Q2_K  scales[16] | qs[64] | d:f16 | dmin:f16              16 x 16, x = d*sc*q - dmin*m
    Q3_K  hmask[32] | qs[64] | scales[12] | d:f16             16 x 16, x = d*(sc-32)*(q-4)
    Q4_K  d:f16 | dmin:f16 | scales[12] | qs[128]             8 x 32,  x = d*sc*q - dmin*m
    Q5_K  d:f16 | dmin:f16 | scales[12] | qh[32] | qs[128]    8 x 32,  x = d*sc*q - dmin*m
    Q6_K  ql[128] | qh[64] | scales[16]:int8 | d:f16          16 x 16, x = d*sc*(q-32)
The packings are spelled out next to each unpacking below. As in legacy.py, the float arithmetic
follows gguf-py's order so the results are bit-identical to it.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .base import bits, crumbs, f16_field, nibbles, register


def _two_bit_codes(qs: torch.Tensor) -> torch.Tensor:
    # qs: (n, 64). Two 128-element halves of 32 bytes each; within a half, the 2-bit field at
    # shift 2s of byte l is element 32s + l. -> (n, 16, 16) uint8, one row per sub-block.
    n = qs.shape[0]
    return crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]  # low nibble: scale, high nibble: min, one byte per sub-block
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _two_bit_codes(blocks[:, 16:80]).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    # 16 six-bit scales in 12 bytes: bytes 0-7 hold the low four bits (scales 0-7 in the low
    # nibbles, 8-15 in the high ones); bytes 8-11 hold the top two bits, scale j at byte
    # 8 + j % 4, shift 2 * (j // 4). Stored with a +32 bias. -> (n, 16) int8 in [-32, 31].
    n = packed.shape[0]
    low = nibbles(packed[:, 0:8]).reshape(n, 16)
    high = crumbs(packed[:, 8:12]).reshape(n, 16)
    return (low | (high << 4)).to(torch.int8) - 32


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs = blocks[:, 0:32], blocks[:, 32:96]
    d = f16_field(blocks, 108)
    dl = (d * _q3_k_scales(blocks[:, 96:108]).float()).reshape(n, 16, 1)
    low = _two_bit_codes(qs)
    # Bit b of hmask byte l is the third bit of element 32b + l. A *clear* bit subtracts 4,
    # so a set bit means the 2-bit value stands as it is: q = low - 4 * (1 - bit).
    high = bits(hmask).reshape(n, 16, 16) ^ 1
    q = low.to(torch.int8) - (high << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, 256)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # 8 six-bit scales and 8 six-bit mins in 12 bytes (Q4_K and Q5_K):
    #   bytes 0-3:  scale j (low 6 bits) | top 2 bits of scale j + 4
    #   bytes 4-7:  min j   (low 6 bits) | top 2 bits of min j + 4
    #   bytes 8-11: low 4 bits of scale j + 4 | low 4 bits of min j + 4 << 4
    # -> two (n, 8) uint8 tensors.
    sc_lo, m_lo, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (mix & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)
    m = torch.cat([m_lo & 0x3F, (mix >> 4) | ((m_lo >> 2) & 0x30)], dim=1)
    return sc, m


def _affine_k(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # Shared tail of Q4_K and Q5_K: q is (n, 8, 32) uint8 codes.
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, m = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * m.float()).reshape(n, 8, 1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q4_k_codes(qs: torch.Tensor) -> torch.Tensor:
    # qs: (n, 128) as four 32-byte groups; group g holds sub-block 2g in its low nibbles and
    # sub-block 2g + 1 in its high nibbles. -> (n, 8, 32).
    n = qs.shape[0]
    return nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _affine_k(blocks, _q4_k_codes(blocks[:, 16:144]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _q4_k_codes(blocks[:, 48:176])
    high = bits(blocks[:, 16:48]).reshape(n, 8, 32)  # bit b of byte l: fifth bit of element 32b + l
    return _affine_k(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8)  # one signed scale per sub-block
    d = f16_field(blocks, 208)
    dl = (d * scales.float()).reshape(n, 16, 1)
    # Two 128-element halves. Low 4 bits: 64 bytes per half, element 64s + k of the half in
    # nibble s of byte k. High 2 bits: 32 bytes per half, element 32s + l at shift 2s of byte l.
    low = nibbles(ql.reshape(n, 2, 64)).reshape(n, 256)
    high = crumbs(qh.reshape(n, 2, 32)).reshape(n, 256)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, 256)


Q2_K = register(GGMLQuantizationType.Q2_K, _q2_k)
Q3_K = register(GGMLQuantizationType.Q3_K, _q3_k)
Q4_K = register(GGMLQuantizationType.Q4_K, _q4_k)
Q5_K = register(GGMLQuantizationType.Q5_K, _q5_k)
Q6_K = register(GGMLQuantizationType.Q6_K, _q6_k)
