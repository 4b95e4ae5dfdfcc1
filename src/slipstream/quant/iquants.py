"""The i-quant grid formats: 256-element super-blocks whose weights are looked up, 4 or 8 at
a time, in a fixed grid of points, with a sign pattern and a small scale per sub-block.

Block layouts (bytes, little-endian; QK_K = 256; ggml-common.h):
    IQ2_XXS d:f16 | 8 x (grid idx[4] | w:u32)              w: 4 x 7-bit sign idx | 4-bit scale
    IQ2_XS  d:f16 | qs[32]:u16 | scales[8]                 qs: 9-bit grid idx | 7-bit sign idx
    IQ2_S   d:f16 | qs[32] | signs[32] | qh[8] | scales[8] grid idx: qs | 2 bits of qh
    IQ3_XXS d:f16 | qs[64] | 8 x w:u32                     w: 4 x 7-bit sign idx | 4-bit scale
    IQ3_S   d:f16 | qs[64] | qh[8] | signs[32] | scales[4] grid idx: qs | 1 bit of qh
    IQ1_S   d:f16 | qs[32] | qh[8]:u16                     qh: 4 x 3 idx bits | scale | sign
    IQ1_M   qs[32] | qh[16] | scales[8]:4 x u16            d: the scales' top nibbles
The IQ2 grids hold 8 weights a point (values 8, 25, 43), the IQ3 grids 4 (IQ3_XXS: 4 to 62,
IQ3_S: odd, 1 to 15) and the IQ1 grid 8 (-1, 0, 1, shifted by +-1/8: one shift per 32 weights
in IQ1_S, per 8 in IQ1_M). A 7-bit sign index picks
an 8-bit pattern of even parity (ksigns: the 8th bit makes the count of minus signs even).

The grids and ksigns are not copied here: they are read from gguf-py (gguf.quants), which
carries them for its own dequantizers (`grid_hex`, unpacked by `init_grid` into a float32
array of shape (1, 1, points, width); `IQ2_XXS.ksigns`), and turned into torch tensors once,
on first use, per device. The float arithmetic follows gguf-py's order (the same multiplies in
the same order, each rounded to float32), so the results are bit-identical to it.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from .base import bits, f16_field, register

_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table on `device`, built on first use: gguf-py's grid of format `name` as
    float32 (points, width); "ksigns": gguf-py's sign patterns, uint8 (128,); "signs": the
    +-1 of each bit of every byte, float32 (256, 8); "ksign_rows": the same of each ksigns
    pattern, float32 (128, 8). Rows of +-1 gathered beat unpacking 8 bits per byte per call."""
    key = (name, device)
    table = _tables.get(key)
    if table is None:
        import gguf.quants  # imported here: a load of a K-quant file never needs the grids

        if name == "ksigns":
            table = torch.from_numpy(
                np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()).to(device)
        elif name == "signs":
            every = torch.arange(256, dtype=torch.uint8, device=device)
            table = 1.0 - 2.0 * bits(every.unsqueeze(-1)).squeeze(-1).float()  # bit j: [b, j]
        elif name == "ksign_rows":
            table = _table("signs", device)[_table("ksigns", device).long()]
        else:
            cls = getattr(gguf.quants, name)
            cls.init_grid()
            arr = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
            table = torch.from_numpy(arr.copy()).to(device)
        _tables[key] = table
    return table


def grid(qtype: T, device: torch.device) -> torch.Tensor:
    """Format qtype's grid, float32 (points, width) on `device`, made once per device (the
    GPU kernels gather point p's value j at p * width + j)."""
    return _table(qtype.name, device)


def _rows(name: str, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` (int64, any shape) of table `name`: (*idx.shape, width)."""
    table = _table(name, idx.device)
    return table.index_select(0, idx.reshape(-1)).reshape(*idx.shape, table.shape[1])


def _words(fields: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 4k) -> int64 (..., k): little-endian 32-bit words (int64, so every shift
    and mask works on any torch; uint32 shifts do not on older ones)."""
    b = fields.reshape(*fields.shape[:-1], -1, 4).long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _halves(fields: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 2k) -> int64 (..., k): little-endian 16-bit words."""
    b = fields.reshape(*fields.shape[:-1], -1, 2).long()
    return b[..., 0] | (b[..., 1] << 8)


def _signs(pattern: torch.Tensor) -> torch.Tensor:
    """uint8 sign bytes (...) -> float32 (..., 8): bit j set makes weight j negative."""
    return _rows("signs", pattern.long())


def _ksign(idx: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (int64, ...) -> float32 (..., 8) through the even-parity table."""
    return _rows("ksign_rows", idx)


def _four_bit_scales(scales: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) float32: low nibble first (sub-block 2i), then high (2i + 1)."""
    n = scales.shape[0]
    return torch.stack([scales & 0x0F, scales >> 4], dim=-1).reshape(n, -1).float()


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)  # (n, 1)
    q = blocks[:, 2:66].reshape(n, 8, 8)  # 8 sub-blocks of 32 weights
    idx = q[:, :, 0:4].long()  # (n, 8, 4): a grid point per 8 weights
    word = _words(q[:, :, 4:8]).squeeze(-1)  # (n, 8)
    db = d * (0.5 + (word >> 28).float()) * 0.25
    shifts = torch.tensor([0, 7, 14, 21], device=blocks.device)
    sign = _ksign((word.unsqueeze(-1) >> shifts) & 0x7F)  # (n, 8, 4, 8)
    grid = _rows("IQ2_XXS", idx)  # (n, 8, 4, 8)
    return (db.reshape(n, 8, 1, 1) * grid * sign).reshape(n, 256)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = _halves(blocks[:, 2:66])  # (n, 32): 9-bit grid index | 7-bit sign index << 9
    db = d * (0.5 + _four_bit_scales(blocks[:, 66:74])) * 0.25  # (n, 16): one per 16 weights
    sign = _ksign(qs >> 9)  # (n, 32, 8)
    grid = _rows("IQ2_XS", qs & 511)  # (n, 32, 8)
    return (db.reshape(n, 16, 1, 1) * grid.reshape(n, 16, 2, 8)
            * sign.reshape(n, 16, 2, 8)).reshape(n, 256)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs, signs = blocks[:, 2:34], blocks[:, 34:66]
    qh, scales = blocks[:, 66:74], blocks[:, 74:82]
    db = d * (0.5 + _four_bit_scales(scales)) * 0.25  # (n, 16)
    # qh byte i carries bits 8-9 of grid indices 4i .. 4i + 3, two bits each from the bottom
    high = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-1).reshape(n, 32)
    idx = qs.long() | (high.long() << 8)
    grid = _rows("IQ2_S", idx)  # (n, 32, 8)
    sign = _signs(signs)  # (n, 32, 8): one plain sign byte per grid point
    return (db.reshape(n, 16, 1, 1) * grid.reshape(n, 16, 2, 8)
            * sign.reshape(n, 16, 2, 8)).reshape(n, 256)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    idx = blocks[:, 2:66].long()  # (n, 64): a grid point per 4 weights
    word = _words(blocks[:, 66:98])  # (n, 8): one per 32 weights
    db = d * (0.5 + (word >> 28).float()) * 0.5
    shifts = torch.tensor([0, 7, 14, 21], device=blocks.device)
    sign = _ksign((word.unsqueeze(-1) >> shifts) & 0x7F)  # (n, 8, 4, 8)
    grid = _rows("IQ3_XXS", idx).reshape(n, 8, 4, 8)
    return (db.reshape(n, 8, 1, 1) * grid * sign).reshape(n, 256)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs, qh = blocks[:, 2:66], blocks[:, 66:74]
    signs, scales = blocks[:, 74:106], blocks[:, 106:110]
    db = d * (1.0 + 2.0 * _four_bit_scales(scales))  # (n, 8); 1 + 2s is exact in float32
    high = bits(qh).transpose(1, 2).reshape(n, 64)  # bit b of qh byte i: 9th bit of index 8i + b
    idx = qs.long() | (high.long() << 8)
    grid = _rows("IQ3_S", idx).reshape(n, 8, 4, 8)
    sign = _signs(signs).reshape(n, 8, 4, 8)
    return (db.reshape(n, 8, 1, 1) * grid * sign).reshape(n, 256)


# IQ1S_DELTA: the grid's shift, added to or taken from each point's (-1, 0, 1) values
_IQ1_DELTA = 0.125


def _iq1_idx(qs: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """11-bit IQ1 grid indices: the byte of qs and 3 high bits."""
    return qs.long() | ((high.long() & 7) << 8)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = blocks[:, 2:34]
    qh = _halves(blocks[:, 34:50])  # (n, 8): 4 x 3 index bits | 3-bit scale << 12 | sign << 15
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()  # (n, 8)
    delta = torch.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA).float()
    shifts = torch.tensor([0, 3, 6, 9], device=blocks.device)
    idx = _iq1_idx(qs, ((qh.unsqueeze(-1) >> shifts)).reshape(n, 32))
    grid = _rows("IQ1_S", idx).reshape(n, 8, 4, 8)
    return (dl.reshape(n, 8, 1, 1) * (grid + delta.reshape(n, 8, 1, 1))).reshape(n, 256)


def _iq1_m_scale(scales: torch.Tensor) -> torch.Tensor:
    """The super-block's f16 d of IQ1_M: nibble k of it is the top nibble of scale word k
    (the high byte of word k is byte 2k + 1). -> float32 (n, 1)."""
    lo = (scales[:, 1] >> 4) | (scales[:, 3] & 0xF0)
    hi = (scales[:, 5] >> 4) | (scales[:, 7] & 0xF0)
    return torch.stack([lo, hi], dim=1).view(torch.float16).float()


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs, qh, scales = blocks[:, 0:32], blocks[:, 32:48], blocks[:, 48:56]
    d = _iq1_m_scale(scales)
    words = _halves(scales)  # (n, 4): four 3-bit scales at shifts 0, 3, 6, 9 each
    shifts = torch.tensor([0, 3, 6, 9], device=blocks.device)
    sc = ((words.unsqueeze(-1) >> shifts) & 7).reshape(n, 16)  # one per 16 weights
    dl = d * (2 * sc + 1).float()
    # qh byte i: low nibble for grid point 2i, high for 2i + 1; 3 index bits and a sign bit
    nib = torch.stack([qh & 0x0F, qh >> 4], dim=-1).reshape(n, 32)
    delta = torch.where((nib & 0x08) != 0, -_IQ1_DELTA, _IQ1_DELTA).float()
    grid = _rows("IQ1_M", _iq1_idx(qs, nib))  # (n, 32, 8)
    return (dl.reshape(n, 16, 1, 1) * (grid.reshape(n, 16, 2, 8)
                                       + delta.reshape(n, 16, 2, 1))).reshape(n, 256)


IQ2_XXS = register(T.IQ2_XXS, _iq2_xxs)
IQ2_XS = register(T.IQ2_XS, _iq2_xs)
IQ2_S = register(T.IQ2_S, _iq2_s)
IQ3_XXS = register(T.IQ3_XXS, _iq3_xxs)
IQ3_S = register(T.IQ3_S, _iq3_s)
IQ1_S = register(T.IQ1_S, _iq1_s)
IQ1_M = register(T.IQ1_M, _iq1_m)
