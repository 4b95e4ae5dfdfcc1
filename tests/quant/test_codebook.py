"""MXFP4, IQ4_NL and IQ4_XS at their edges, against gguf-py's numpy dequantizers, bit for bit.

The random-block tests in test_dequant.py cover ordinary blocks; these walk every scale byte
and every code, and show that the comparison catches a wrong layout (negative controls).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from slipstream import quant
from slipstream.quant import codebook

from test_dequant import assert_bit_identical, reference


def _codes_0_to_15(n_blocks: int, n_bytes: int) -> np.ndarray:
    # byte i of each 16-byte run: low nibble i, high nibble 15 - i, so every code appears
    i = np.arange(n_bytes, dtype=np.uint8) % 16
    return np.tile(i | ((15 - i) << 4), (n_blocks, 1)).astype(np.uint8)


def test_mxfp4_every_scale_byte_and_code() -> None:
    """All 256 e8m0 bytes (the subnormal 0 and 1, and 253-255, whose largest codes overflow to
    inf in both) with all 16 codes."""
    raw = np.concatenate([np.arange(256, dtype=np.uint8).reshape(-1, 1),
                          _codes_0_to_15(256, 16)], axis=1)
    got = quant.dequantize(torch.from_numpy(raw), T.MXFP4, (256, 32))
    with np.errstate(over="ignore"):  # 12 * 2^127 is meant to overflow
        ref = reference(raw, T.MXFP4)
    assert np.isinf(ref).any() and (ref[0] != 0).any()  # the edges are really exercised
    assert_bit_identical(got, ref)
    assert got[127, :8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]  # E2M1 at scale 2^0
    assert got[0, 1].item() == 2.0 ** -128  # a float32 subnormal


def test_iq4_nl_edge_scales() -> None:
    scales = np.array([0.0, -0.0, 6.0e-8, -6.0e-8, 6.1e-5, 1.0, -1.0, 65504.0, -65504.0],
                      dtype=np.float16)
    raw = np.concatenate([scales.reshape(-1, 1).view(np.uint8),
                          _codes_0_to_15(len(scales), 16)], axis=1)
    assert_bit_identical(quant.dequantize(torch.from_numpy(raw), T.IQ4_NL, (len(scales), 32)),
                         reference(raw, T.IQ4_NL))


def test_iq4_xs_every_sub_block_scale() -> None:
    """Each of the 64 six-bit scales in each of the 8 sub-block slots (8 blocks, the scale of
    slot j in block b being 8b + j + 64k rotated), with f16 scales of both signs."""
    n = 64
    rng = np.random.default_rng(3)
    sc = (np.arange(n).reshape(-1, 1) + 8 * np.arange(8)) % 64  # (n, 8) 6-bit scales
    low = (sc & 0x0F).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)  # (n, 4)
    high = (sc >> 4).astype(np.uint16)
    scales_h = (high << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype("<u2")
    d = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 2, n)).astype(np.float16)
    raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), scales_h.reshape(-1, 1).view(np.uint8),
                          scales_l, rng.integers(0, 256, (n, 128), dtype=np.uint8)], axis=1)
    got_sc = codebook.iq4_xs_scales(torch.from_numpy(raw))
    assert torch.equal(got_sc, torch.from_numpy(sc.astype(np.int8) - 32))
    assert_bit_identical(quant.dequantize(torch.from_numpy(raw), T.IQ4_XS, (n, 256)),
                         reference(raw, T.IQ4_XS))


def _swapped_halves(x: torch.Tensor, n: int, block: int) -> torch.Tensor:
    # element i <-> i + 16 within every 32: the low/high nibble order read the wrong way round
    return x.reshape(n, block // 32, 2, 16).flip(2).reshape(n, block)


def test_negative_controls() -> None:
    """A wrong nibble order, grid or scale order must fail the comparison the tests rely on."""
    rng = np.random.default_rng(5)
    for qtype, block, size in ((T.MXFP4, 32, 17), (T.IQ4_NL, 32, 18), (T.IQ4_XS, 256, 136)):
        raw = rng.integers(0, 256, (8, size), dtype=np.uint8)
        if qtype == T.MXFP4:
            raw[:, 0] = 120
        else:
            raw[:, 0:2] = np.float16(0.01).reshape(1, 1).view(np.uint8)
        ref = torch.from_numpy(reference(raw, qtype))
        got = quant.get_format(qtype).dequantize_blocks(torch.from_numpy(raw))
        assert torch.equal(got, ref)
        assert not torch.equal(_swapped_halves(got, 8, block), ref)
    raw = rng.integers(0, 256, (8, 18), dtype=np.uint8)
    raw[:, 0:2] = np.float16(0.01).reshape(1, 1).view(np.uint8)
    ref = torch.from_numpy(reference(raw, T.IQ4_NL))
    wrong_grid = torch.arange(-8, 8, dtype=torch.float32) * 16  # Q4_0's uniform grid
    codes = torch.from_numpy(raw[:, 2:]).to(torch.int64)
    uniform = wrong_grid[torch.cat([codes & 15, codes >> 4], dim=1)] * 0.01
    assert not torch.allclose(uniform, ref, atol=0.05)
