"""Numpy quantizers, used to synthesize GGUF test models.

The float and legacy types and MXFP4 delegate to gguf-py; IQ4_NL and IQ4_XS, which gguf-py
cannot encode, are quant.encode_codebook's. gguf-py has no K-quant quantizer, so those are our
own: a per-sub-block min/max (or max-magnitude) fit, one least-squares refinement of each
sub-block's scale and offset given its codes, and the sub-block parameters quantized into the
packed 4/6/8-bit scale fields against f16 super-block scales. They are not llama.cpp's
search-based quantizers and do not match them bit for bit, but `dequantize(quantize(x))` tracks
x closely (the tests pin the error per format).

Everything is vectorized over all blocks of a chunk of rows; chunks are kept small enough to stay
in cache because each step makes a full pass over the chunk.
"""

from __future__ import annotations

from typing import Callable

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import GGUFError, UnsupportedTensorType
from . import get_format, row_bytes
from .encode_codebook import encode_iq4_nl, encode_iq4_xs

_CHUNK_ELEMENTS = 1 << 16  # 256 KiB of float32 per step: fits L2, amortizes numpy call overhead
# Least-squares refits after the min/max fit. One costs ~1.5-2x the time and cuts the error by
# 3% (Q4_K) to 12% (Q2_K); more steps gain little.
_REFINE_STEPS = 1

# (n_blocks, block_size) float32 -> (n_blocks, type_size) uint8
BlockEncoder = Callable[[np.ndarray], np.ndarray]

_F32 = np.float32
# (d16, dmin16, sc, m, q) and (d16, sc, biased q): see _affine_fit and _symmetric_fit
_AffinePacked = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_SymmetricPacked = tuple[np.ndarray, np.ndarray, np.ndarray]


def quantize(data: np.ndarray, qtype: GGMLQuantizationType | int) -> np.ndarray:
    """float32 (..., cols) -> uint8 (..., row_bytes) in `qtype`'s on-disk layout."""
    fmt = get_format(qtype)
    encoder = _ENCODERS.get(fmt.qtype)
    if encoder is None:
        names = ", ".join(t.name for t in encodable_types())
        raise UnsupportedTensorType(f"quantizing to {fmt.name} is not supported; "
                                    f"supported: {names}")
    data = np.asarray(data, dtype=_F32)
    if data.ndim == 0:
        raise GGUFError("cannot quantize a 0-d array; give it at least one dimension")
    n_cols = data.shape[-1]
    n_bytes = row_bytes(fmt.qtype, n_cols)
    rows = data.reshape(-1, n_cols)
    out = np.empty((rows.shape[0], n_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMENTS // max(n_cols, 1))
    for start in range(0, rows.shape[0] if n_cols else 0, step):
        chunk = np.ascontiguousarray(rows[start:start + step])
        blocks = chunk.reshape(-1, fmt.block_size)
        out[start:start + step] = encoder(blocks).reshape(chunk.shape[0], n_bytes)
    return out.reshape(*data.shape[:-1], n_bytes)


def encodable_types() -> list[GGMLQuantizationType]:
    return sorted(_ENCODERS, key=int)


# --- delegated to gguf-py -----------------------------------------------------------------------

def _gguf_encoder(qtype: GGMLQuantizationType) -> BlockEncoder:
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]

    def encode(blocks: np.ndarray) -> np.ndarray:
        # One long row: gguf-py vectorizes over groups of rows, and blocks are independent, so
        # this makes the whole chunk one numpy pass instead of many small ones.
        raw = gguf.quants.quantize(blocks.reshape(1, -1), qtype)
        return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, type_size)

    return encode


# --- shared K-quant machinery -------------------------------------------------------------------

def _inverse(v: np.ndarray) -> np.ndarray:
    """1 / v, with 0 where v == 0 (a zero scale encodes everything as code 0)."""
    with np.errstate(divide="ignore"):
        return np.where(v != 0, _F32(1) / v, _F32(0)).astype(_F32)


def _to_f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round to f16; returns (f16 values to store, the float32 the dequantizer will read)."""
    h = v.astype(np.float16)
    return h, h.astype(_F32)


def _round_codes(t: np.ndarray, hi: int) -> np.ndarray:
    """In place: round t >= 0-ish to the nearest integer in [0, hi], as uint8 (half rounds up)."""
    t += _F32(0.5)
    np.clip(t, 0, hi, out=t)
    return t.astype(np.uint8)  # truncation of a non-negative value is floor


def _affine_fit(x: np.ndarray, nmax: int, sub_max: int,
                refine: int = _REFINE_STEPS) -> _AffinePacked:
    """Fit x ~ d*sc*q - dmin*m for Q2_K/Q4_K/Q5_K.

    x: (nb, ns, L) float32 sub-blocks; codes q in [0, nmax]; sub-block scale sc and min m are
    unsigned `sub_max`-bounded integers against the f16 super-block scales d and dmin.
    Returns (d16 (nb,), dmin16 (nb,), sc (nb, ns) uint8, m (nb, ns) uint8, q (nb, ns, L) uint8).
    """
    hi = x.max(axis=-1)
    # m is stored unsigned and subtracted, so the offset can only pull values down: a sub-block
    # that is all positive still has to reach 0 from its lowest code.
    lo = np.minimum(x.min(axis=-1), 0)
    scale = (hi - lo) / _F32(nmax)  # (nb, ns)
    offset = -lo
    packed = _pack_affine(x, scale, offset, nmax, sub_max)
    if refine:
        sx = x.sum(axis=-1)
        for _ in range(refine):
            scale, offset = _affine_least_squares(x, packed[4], sx, scale, offset)
            packed = _pack_affine(x, scale, offset, nmax, sub_max)
    return packed


def _pack_affine(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, nmax: int,
                 sub_max: int) -> _AffinePacked:
    d16, d = _to_f16(scale.max(axis=-1) / _F32(sub_max))
    dmin16, dmin = _to_f16(offset.max(axis=-1) / _F32(sub_max))
    sc = _round_codes(scale * _inverse(d)[:, None], sub_max)
    m = _round_codes(offset * _inverse(dmin)[:, None], sub_max)
    # Exactly the products the dequantizer forms, so codes are chosen against the real grid.
    eff_scale = d[:, None] * sc.astype(_F32)
    eff_offset = dmin[:, None] * m.astype(_F32)
    t = x + eff_offset[..., None]
    t *= _inverse(eff_scale)[..., None]
    return d16, dmin16, sc, m, _round_codes(t, nmax)


def _affine_least_squares(x: np.ndarray, q: np.ndarray, sx: np.ndarray, scale: np.ndarray,
                          offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block, the (scale, offset) minimizing |x - (scale*q - offset)|^2 for fixed q."""
    n = _F32(x.shape[-1])
    qf = q.astype(_F32)
    sq = qf.sum(axis=-1)
    sqq = np.einsum("bsl,bsl->bs", qf, qf)
    sxq = np.einsum("bsl,bsl->bs", x, qf)
    den = n * sqq - sq * sq
    with np.errstate(divide="ignore", invalid="ignore"):
        a = (n * sxq - sq * sx) / den
        b = (a * sq - sx) / n
        # The offset must stay >= 0; where the free fit wants a negative one, fit the scale alone.
        a_pinned = sxq / sqq
    pinned = b < 0
    a = np.where(pinned, a_pinned, a)
    b = np.where(pinned, 0, b)
    ok = (den > 0) & (a > 0) & np.isfinite(a)  # all-equal codes: no information, keep the old fit
    return np.where(ok, a, scale).astype(_F32), np.where(ok, b, offset).astype(_F32)


def _symmetric_fit(x: np.ndarray, qmin: int, qmax: int, smin: int, smax: int,
                   refine: int = _REFINE_STEPS) -> _SymmetricPacked:
    """Fit x ~ d*sc*q for Q3_K/Q6_K.

    Codes q in [qmin, qmax] (e.g. [-32, 31]) are returned biased by -qmin as uint8; the signed
    sub-block scales sc in [smin, smax] are returned as float32 integers.
    Returns (d16 (nb,), sc (nb, ns) float32, u (nb, ns, L) uint8 = q - qmin).
    """
    hi, lo = x.max(axis=-1), x.min(axis=-1)
    extreme = np.where(-lo > hi, lo, hi)  # the signed value of largest magnitude
    # Map it to qmin, the side of the code range with the extra step (as llama.cpp does); the
    # scale's sign absorbs which side of zero it was on.
    scale = extreme / _F32(qmin)
    packed = _pack_symmetric(x, scale, qmin, qmax, smin, smax)
    for _ in range(refine):
        q = packed[2].astype(_F32) + _F32(qmin)
        sqq = np.einsum("bsl,bsl->bs", q, q)
        sxq = np.einsum("bsl,bsl->bs", x, q)
        with np.errstate(divide="ignore", invalid="ignore"):
            fitted = sxq / sqq
        scale = np.where(sqq > 0, fitted, scale).astype(_F32)
        packed = _pack_symmetric(x, scale, qmin, qmax, smin, smax)
    return packed


def _pack_symmetric(x: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, smin: int,
                    smax: int) -> _SymmetricPacked:
    # The super-block scale maps the sub-block scale of largest magnitude to smin, again the
    # side with the extra step.
    idx = np.abs(scale).argmax(axis=-1)[:, None]
    d16, d = _to_f16(np.take_along_axis(scale, idx, axis=-1)[:, 0] / _F32(smin))
    sc = np.rint(scale * _inverse(d)[:, None])
    np.clip(sc, smin, smax, out=sc)
    eff = d[:, None] * sc  # (nb, ns), the dequantizer's d * sc
    t = x * _inverse(eff)[..., None]
    t -= _F32(qmin)
    return d16, sc, _round_codes(t, qmax - qmin)


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    return h.reshape(-1, 1).view(np.uint8)  # (nb, 2), little-endian like the file


def _pack_crumbs(v: np.ndarray) -> np.ndarray:
    """uint8 2-bit values (nb, g, 4, k) -> (nb, g, k) bytes: field s at shift 2s."""
    return v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)


def _pack_nibbles(v: np.ndarray) -> np.ndarray:
    """uint8 4-bit values (nb, g, 2, k) -> (nb, g, k) bytes: first half in the low nibbles."""
    return v[:, :, 0] | (v[:, :, 1] << 4)


def _pack_bits(v: np.ndarray) -> np.ndarray:
    """uint8 0/1 values (nb, 8, k) -> (nb, k) bytes: row b becomes bit b."""
    return np.packbits(v.transpose(0, 2, 1), axis=-1, bitorder="little")[..., 0]


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (nb, 8) -> the 12-byte Q4_K/Q5_K field (see kquants.py)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


# --- the K-quant block encoders -----------------------------------------------------------------

def _encode_q2_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d16, dmin16, sc, m, q = _affine_fit(blocks.reshape(nb, 16, 16), nmax=3, sub_max=15)
    out = np.empty((nb, 84), dtype=np.uint8)
    out[:, 0:16] = sc | (m << 4)
    out[:, 16:80] = _pack_crumbs(q.reshape(nb, 2, 4, 32)).reshape(nb, 64)
    out[:, 80:82] = _f16_bytes(d16)
    out[:, 82:84] = _f16_bytes(dmin16)
    return out


def _encode_q3_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d16, sc, u = _symmetric_fit(blocks.reshape(nb, 16, 16), -4, 3, -32, 31)
    u = u.reshape(nb, 8, 32)  # u = q + 4 in [0, 7]
    biased = (sc + 32).astype(np.uint8)  # (nb, 16) in [0, 63]
    out = np.empty((nb, 110), dtype=np.uint8)
    out[:, 0:32] = _pack_bits(u >> 2)  # a set bit means "no -4"
    out[:, 32:96] = _pack_crumbs((u & 0x03).reshape(nb, 2, 4, 32)).reshape(nb, 64)
    out[:, 96:104] = (biased[:, 0:8] & 0x0F) | ((biased[:, 8:16] & 0x0F) << 4)
    out[:, 104:108] = _pack_crumbs((biased >> 4).reshape(nb, 1, 4, 4)).reshape(nb, 4)
    out[:, 108:110] = _f16_bytes(d16)
    return out


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d16, dmin16, sc, m, q = _affine_fit(blocks.reshape(nb, 8, 32), nmax=15, sub_max=63)
    out = np.empty((nb, 144), dtype=np.uint8)
    out[:, 0:2] = _f16_bytes(d16)
    out[:, 2:4] = _f16_bytes(dmin16)
    out[:, 4:16] = _pack_k_scales(sc, m)
    out[:, 16:144] = _pack_nibbles(q.reshape(nb, 4, 2, 32)).reshape(nb, 128)
    return out


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d16, dmin16, sc, m, q = _affine_fit(blocks.reshape(nb, 8, 32), nmax=31, sub_max=63)
    out = np.empty((nb, 176), dtype=np.uint8)
    out[:, 0:2] = _f16_bytes(d16)
    out[:, 2:4] = _f16_bytes(dmin16)
    out[:, 4:16] = _pack_k_scales(sc, m)
    out[:, 16:48] = _pack_bits(q >> 4)
    out[:, 48:176] = _pack_nibbles((q & 0x0F).reshape(nb, 4, 2, 32)).reshape(nb, 128)
    return out


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    d16, sc, u = _symmetric_fit(blocks.reshape(nb, 16, 16), -32, 31, -128, 127)
    u = u.reshape(nb, 256)  # u = q + 32 in [0, 63]
    out = np.empty((nb, 210), dtype=np.uint8)
    out[:, 0:128] = _pack_nibbles((u & 0x0F).reshape(nb, 2, 2, 64)).reshape(nb, 128)
    out[:, 128:192] = _pack_crumbs((u >> 4).reshape(nb, 2, 4, 32)).reshape(nb, 64)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = _f16_bytes(d16)
    return out


_T = GGMLQuantizationType
_ENCODERS: dict[GGMLQuantizationType, BlockEncoder] = {
    **{t: _gguf_encoder(t) for t in (_T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0,
                                      _T.Q5_1, _T.Q8_0, _T.MXFP4)},
    _T.Q2_K: _encode_q2_k,
    _T.Q3_K: _encode_q3_k,
    _T.Q4_K: _encode_q4_k,
    _T.Q5_K: _encode_q5_k,
    _T.Q6_K: _encode_q6_k,
    _T.IQ4_NL: encode_iq4_nl,
    _T.IQ4_XS: encode_iq4_xs,
}
