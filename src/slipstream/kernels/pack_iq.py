"""The i-quant grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) as planes
for the GPU kernels (gemv_iq.py).

These formats exist to be small (1.56 to 3.44 bits per weight), so their planes keep GGUF's
own bit fields and bytes, only cut out of the block records into one row-major plane per
field, each of its natural width (1, 2 or 4 bytes), so a kernel reads any field of any weight
with one aligned load. Sizes equal GGUF's, except IQ1_M (+2 bytes per 256 weights: its f16 d,
spread over four nibbles in GGUF, is stored whole). The fields, per row of K weights ("point":
one grid entry, 8 weights (IQ2, IQ1) or 4 (IQ3)):

    IQ2_XXS lo u8 (K/8) grid index | hi i32 (K/32) 4 x 7-bit sign index, 4-bit scale << 28
    IQ3_XXS lo u8 (K/4) grid index | hi i32 (K/32) as IQ2_XXS
    IQ2_XS  lo i16 (K/8) 9-bit grid index | 7-bit sign index << 9 | sc u8 (K/32) 2 x 4-bit scale
    IQ2_S   lo u8 (K/8) grid index bits 0-7 | mn u8 (K/32) bits 8-9 of 4 points | hi u8 (K/8)
            sign byte | sc u8 (K/32) 2 x 4-bit scale
    IQ3_S   lo u8 (K/4) grid index bits 0-7 | mn u8 (K/32) bit 8 of 8 points | hi u8 (K/8)
            sign byte | sc u8 (K/64) 2 x 4-bit scale
    IQ1_S   lo u8 (K/8) grid index bits 0-7 | sc i16 (K/32) 4 x 3 index bits, 3-bit scale
            << 12, shift sign << 15
    IQ1_M   lo u8 (K/8) grid index bits 0-7 | mn u8 (K/16) 2 x (3 index bits, shift sign)
            | sc i16 (K/64) 4 x 3-bit scale
and d f16 (K/256) for all. A 7-bit sign index stands for the 8-bit pattern of even parity
(ggml's ksigns), which the kernels compute (bit 7 = parity of bits 0-6) instead of reading a
table.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ..quant.iquants import grid as iq_grid

# plane -> bytes per 256 weights, in the order pack_iq_blocks makes them (memory/vram.py sums
# these for the VRAM planner)
IQ_PLANES: dict[T, dict[str, int]] = {
    T.IQ2_XXS: {"lo": 32, "hi": 32, "d": 2},
    T.IQ3_XXS: {"lo": 64, "hi": 32, "d": 2},
    T.IQ2_XS: {"lo": 64, "sc": 8, "d": 2},
    T.IQ2_S: {"lo": 32, "hi": 32, "mn": 8, "sc": 8, "d": 2},
    T.IQ3_S: {"lo": 64, "hi": 32, "mn": 8, "sc": 4, "d": 2},
    T.IQ1_S: {"lo": 32, "sc": 16, "d": 2},
    T.IQ1_M: {"lo": 32, "mn": 16, "sc": 8, "d": 2},
}


def _as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (nb, k) -> (nb, k / size) of dtype, little-endian (a copy: slices of a block are
    not aligned for a wider view)."""
    return b.contiguous().view(dtype)


def _iq1_m_d(scales: torch.Tensor) -> torch.Tensor:
    """IQ1_M's f16 d from its 8 scale bytes: nibble k is the top nibble of 16-bit word k."""
    lo = (scales[:, 1] >> 4) | (scales[:, 3] & 0xF0)
    hi = (scales[:, 5] >> 4) | (scales[:, 7] & 0xF0)
    return torch.stack([lo, hi], dim=1).contiguous().view(torch.float16)


def pack_iq_blocks(qt: T, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """(n_blocks, type_size) uint8 blocks of grid format qt -> its planes, (n_blocks, w) each
    (byte offsets from ggml-common.h's block_iq* structs)."""
    nb = b.shape[0]
    d = _as(b[:, 0:2], torch.float16)
    if qt == T.IQ2_XXS:  # d | 8 x (4 grid index bytes | u32 signs and scale)
        q = b[:, 2:66].reshape(nb, 8, 8)
        return {"lo": q[:, :, 0:4].reshape(nb, 32), "hi": _as(q[:, :, 4:8].reshape(nb, 32),
                                                                torch.int32), "d": d}
    if qt == T.IQ3_XXS:  # d | qs[64] | 8 x u32 signs and scale
        return {"lo": b[:, 2:66], "hi": _as(b[:, 66:98], torch.int32), "d": d}
    if qt == T.IQ2_XS:  # d | qs u16[32] | scales[8]
        return {"lo": _as(b[:, 2:66], torch.int16), "sc": b[:, 66:74], "d": d}
    if qt == T.IQ2_S:  # d | qs[32] | signs[32] | qh[8] | scales[8]
        return {"lo": b[:, 2:34], "hi": b[:, 34:66], "mn": b[:, 66:74], "sc": b[:, 74:82],
                "d": d}
    if qt == T.IQ3_S:  # d | qs[64] | qh[8] | signs[32] | scales[4]
        return {"lo": b[:, 2:66], "hi": b[:, 74:106], "mn": b[:, 66:74], "sc": b[:, 106:110],
                "d": d}
    if qt == T.IQ1_S:  # d | qs[32] | qh u16[8]
        return {"lo": b[:, 2:34], "sc": _as(b[:, 34:50], torch.int16), "d": d}
    if qt == T.IQ1_M:  # qs[32] | qh[16] | scales u16[4] (d in their top nibbles)
        return {"lo": b[:, 0:32], "mn": b[:, 32:48], "sc": _as(b[:, 48:56], torch.int16),
                "d": _iq1_m_d(b[:, 48:56])}
    raise ValueError(f"{qt.name} is not an i-quant grid format")


_grid_words: dict[tuple[T, torch.device], torch.Tensor] = {}


def grid_words(qt: T, device: torch.device) -> torch.Tensor:
    """Format qt's grid as int64 (points,) on `device`, made once per device (pack_weight
    makes it with the first weight, so no launch inside a CUDA graph capture copies it):
    value j of a point in byte j, unsigned (IQ1's -1, 0, 1 stored + 1; IQ2's 8..43 and IQ3's
    1..62 as they are), so a kernel reads a point with one load, not 4 or 8 gathers."""
    key = (qt, device)
    if key not in _grid_words:
        values = iq_grid(qt, torch.device("cpu")).to(torch.int64)  # (points, 4 or 8), exact
        values = values + (1 if qt in (T.IQ1_S, T.IQ1_M) else 0)
        if values.min() < 0 or values.max() > 255:
            raise ValueError(f"{qt.name} grid values {values.min()}..{values.max()} do not fit "
                             f"a byte each")
        shifts = 8 * torch.arange(values.shape[1], dtype=torch.int64)
        _grid_words[key] = (values << shifts).sum(1).to(device)
    return _grid_words[key]
