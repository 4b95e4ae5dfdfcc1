"""Numpy encoders for IQ4_NL and IQ4_XS (gguf-py has none): each 32-element group's scale is
fitted, then every element takes the nearest of the 16 grid values (quant.codebook).

The fit: the group's largest-magnitude element lands exactly on the grid's end (-127, the
largest magnitude), then one least-squares refit of the scale given those codes, kept where it
lowers the group's squared error. llama.cpp's quantizer searches more scales (and weighs
elements by an importance matrix); this is for synthesizing test files, and
`dequantize(quantize(x))` tracks x closely (tests/quant/test_encode.py pins the error).
IQ4_XS then quantizes its eight group scales to 6-bit integers against one f16 scale per 256.
"""

from __future__ import annotations

import numpy as np

from .codebook import IQ4NL_VALUES

_F32 = np.float32
_GRID = np.array(IQ4NL_VALUES, dtype=_F32)  # ascending
_MIDPOINTS = (_GRID[1:] + _GRID[:-1]) / _F32(2)


def _inverse(v: np.ndarray) -> np.ndarray:
    """1 / v, with 0 where v == 0 (a zero scale encodes everything as the code nearest 0)."""
    with np.errstate(divide="ignore"):
        return np.where(v != 0, _F32(1) / v, _F32(0)).astype(_F32)


def _nearest(t: np.ndarray) -> np.ndarray:
    """The code of the grid value nearest each element of t, as uint8."""
    return np.searchsorted(_MIDPOINTS, t).astype(np.uint8)


def _codes(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    return _nearest(x * _inverse(d)[..., None])


def _sq_err(x: np.ndarray, d: np.ndarray, q: np.ndarray) -> np.ndarray:
    return np.square(d[..., None] * _GRID[q] - x).sum(axis=-1)


def _fit(x: np.ndarray) -> np.ndarray:
    """x (..., 32) float32 -> the float32 scale (...) of each group."""
    at = np.abs(x).argmax(axis=-1)[..., None]
    d = (np.take_along_axis(x, at, axis=-1)[..., 0] / _F32(-127)).astype(_F32)
    v = _GRID[_codes(x, d)]
    refit = ((v * x).sum(axis=-1) / np.square(v).sum(axis=-1)).astype(_F32)  # no 0 in grid
    better = _sq_err(x, refit, _codes(x, refit)) < _sq_err(x, d, _codes(x, d))
    return np.where(better, refit, d)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(..., 32) codes -> (..., 16) bytes: element i low nibble, element i + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)


def encode_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """(n, 32) float32 -> (n, 18) uint8: d f16 | qs[16]."""
    d16 = _fit(blocks).astype(np.float16)
    q = _codes(blocks, d16.astype(_F32))  # against the scale the dequantizer reads
    out = np.empty((blocks.shape[0], 18), dtype=np.uint8)
    out[:, 0:2] = d16.reshape(-1, 1).view(np.uint8)
    out[:, 2:18] = _pack_nibbles(q)
    return out


def encode_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 136) uint8: d f16 | scales_h u16 | scales_l[4] | qs[128]."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32)
    s = _fit(x)  # (n, 8)
    # the largest-magnitude group scale lands on -32, the 6-bit range's longer end
    at = np.abs(s).argmax(axis=-1)[:, None]
    d16 = (np.take_along_axis(s, at, axis=-1)[:, 0] / _F32(-32)).astype(np.float16)
    d = d16.astype(_F32)
    sc = np.clip(np.rint(s * _inverse(d)[:, None]), -32, 31).astype(np.int16)
    q = _codes(x, d[:, None] * sc.astype(_F32))  # against the scales the dequantizer forms
    u = (sc + 32).astype(np.uint16)  # (n, 8) in [0, 63]
    high = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    low = (u & 15).astype(np.uint8)
    out = np.empty((n, 136), dtype=np.uint8)
    out[:, 0:2] = d16.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = high.astype("<u2").reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    out[:, 8:136] = _pack_nibbles(q).reshape(n, 128)
    return out
