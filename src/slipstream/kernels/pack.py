"""Repack GGUF quantized blocks once, at load time, into planes the Triton kernels stream.

Why repack: a GGUF block interleaves its scales with its quants in 18..210-byte records whose
sizes are not powers of two, and each format orders its bit-fields differently. The kernels want
every row as a few flat, 16-byte-aligned planes they can read with wide coalesced loads, and one
bit layout shared by all formats so a single kernel body serves them all.

The layout (all planes row-major, one row of the weight per row of the plane):

* Every row of K elements is cut into units of 32 elements. A format's integer code q (unsigned,
  the format's offset added back, B = LO + HI bits) is split into its LO low bits and HI high bits.
* ``lo``: int32 ``(N, K/32 * LO)``. In unit u, element ``u*32 + j*LO + w`` (slot j < 32/LO, lane
  w < LO) keeps its low bits in word ``u*LO + w`` at bits ``[j*LO, j*LO + LO)``. So the LO words
  of a unit are contiguous, and slot j of all lanes covers LO consecutive elements: the kernel
  unpacks a slot with one shift-and-mask and multiplies it by LO consecutive activations.
* ``hi``: int8 (32*HI/LO = 8 bits) or int16 (16 bits) ``(N, K/32 * LO)``: the same (u, w) grid,
  the high bits of slot j at bits ``[j*HI, j*HI + HI)``. Absent when HI == 0.
* Scales. Legacy formats (block 32): ``d`` f16 ``(N, K/32)`` and, for Q4_1/Q5_1, ``m`` f16.
  K-quants (super-block 256): ``d`` (and ``dmin``) f16 ``(N, K/256)``, plus per group of G
  elements the small integer scale ``sc`` (int8, already signed for Q3_K and Q6_K) and min ``mn``
  (uint8), each ``(N, K/G)``. Q2_K keeps its 4-bit scale and min packed in one byte (``sc``),
  as GGUF does, to stay at GGUF's size.

Every format then dequantizes as ``w = s_g * (q - OFF) - t_g`` with fp32-exact ``s_g``, so the
kernels are exact in fp32 up to summation order. The codebook formats (IQ4_NL, IQ4_XS, MXFP4)
instead look their 4-bit code up in a 16-entry grid: ``w = s_g * grid[q]`` (QSpec.grid; the
kernels read the grid as a float32 table, `grid_table`). IQ4_NL keeps ``d`` f16 per 32, IQ4_XS
``d`` per 256 and signed ``sc`` per 32 (as Q6_K), MXFP4 ``d`` as float32 per 32: its e8m0 scale
2^(e - 128) spans 2^-128..2^127, beyond f16 (1 byte per 32 in GGUF, 4 here: +18%).

The i-quant grid formats (IQ2_*, IQ3_*, IQ1_*: QSpec.iq) look 4 or 8 weights up at once in a
grid of hundreds of points; they keep GGUF's bit fields in planes of their own (pack_iq.py)
and have their own kernels (gemv_iq.py).

Sizes against GGUF: equal for legacy formats, Q2_K and Q6_K; +2.8% for Q4_K, +2.3% for Q5_K
and +3.6% for Q3_K (6-bit scales kept as bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ..errors import GGUFError, UnsupportedTensorType
from ..quant.codebook import IQ4NL_VALUES, MXFP4_VALUES, e8m0_half, iq4_xs_scales
from .pack_iq import IQ_PLANES, grid_words, pack_iq_blocks


@dataclass(frozen=True)
class QSpec:
    """How one quantized format maps onto the plane layout (see the module docstring)."""

    lo: int  # low bits per code stored in the int32 plane (2, 4 or 8)
    hi: int  # high bits per code in the hi plane (0, 1 or 2)
    group: int  # elements sharing one scale (16 or 32)
    off: int  # integer subtracted from the unsigned code
    kquant: bool  # scales are d[super-block] * sc[group] (else one f16 d per 32)
    has_min: bool  # a subtracted min term exists (m for legacy, dmin*mn for K-quants)
    packed_scmn: bool = False  # Q2_K: sc = byte & 15, mn = byte >> 4
    grid: tuple[int, ...] | None = None  # codebook formats: w = scale * grid[q] (off = 0)
    f32_scale: bool = False  # d is a float32 plane (MXFP4), not f16
    iq: bool = False  # an i-quant grid format: planes of pack_iq.py, kernels of gemv_iq.py

    @property
    def int_codes(self) -> bool:
        """Integer codes in the lo/hi planes, which the int8-activation GEMV and qgemm read
        (the codebook and grid formats index tables instead)."""
        return self.grid is None and not self.iq


QSPECS: dict[T, QSpec] = {
    T.Q4_0: QSpec(4, 0, 32, 8, False, False),
    T.Q4_1: QSpec(4, 0, 32, 0, False, True),
    T.Q5_0: QSpec(4, 1, 32, 16, False, False),
    T.Q5_1: QSpec(4, 1, 32, 0, False, True),
    T.Q8_0: QSpec(8, 0, 32, 128, False, False),
    T.Q2_K: QSpec(2, 0, 16, 0, True, True, packed_scmn=True),
    T.Q3_K: QSpec(2, 1, 16, 4, True, False),
    T.Q4_K: QSpec(4, 0, 32, 0, True, True),
    T.Q5_K: QSpec(4, 1, 32, 0, True, True),
    T.Q6_K: QSpec(4, 2, 16, 32, True, False),
    T.IQ4_NL: QSpec(4, 0, 32, 0, False, False, grid=IQ4NL_VALUES),
    T.IQ4_XS: QSpec(4, 0, 32, 0, True, False, grid=IQ4NL_VALUES),
    T.MXFP4: QSpec(4, 0, 32, 0, False, False, grid=MXFP4_VALUES, f32_scale=True),
    # lo/hi/group are not read for these: pack_iq.IQ_PLANES gives their planes
    **{qt: QSpec(0, 0, 256, 0, False, False, iq=True) for qt in IQ_PLANES},
}
FLOAT_DTYPES: dict[T, torch.dtype] = {T.F32: torch.float32, T.F16: torch.float16,
                                      T.BF16: torch.bfloat16}
SUPPORTED = tuple(FLOAT_DTYPES) + tuple(QSPECS)

# Pack this many weights at a time (whole rows) so the transient int tensors stay small (the
# vocab matrix of an 8B model would otherwise need ~2 GB of scratch; a 70B's 28672-wide
# ffn_down took 1.4 GB in 2048-row chunks, VRAM that a streamed plan gives to layers).
# memory.vram sizes the load transients by it.
PACK_ELEMENTS = 2048 * 8192


def pack_chunk_rows(rows: int, cols: int) -> int:
    """Rows of a (rows, cols) weight that pack_weight packs at a time."""
    return max(1, min(rows, PACK_ELEMENTS // cols))


@dataclass
class PackedWeight:
    """A weight ready for `gemv`/`matmul`: (rows, cols) logical, planes on the weight's device."""

    qtype: T
    rows: int  # N: output features
    cols: int  # K: input features
    lo: torch.Tensor | None = None  # int32 (N, K/32*LO); for float formats the (N, K) weight
    hi: torch.Tensor | None = None  # int8/int16 (N, K/32*LO)
    d: torch.Tensor | None = None  # f16 (N, K/32) legacy, (N, K/256) K-quants
    m: torch.Tensor | None = None  # f16 (N, K/32) legacy min, or dmin (N, K/256) for K-quants
    sc: torch.Tensor | None = None  # int8/uint8 (N, K/G)
    mn: torch.Tensor | None = None  # uint8 (N, K/G)
    # precision="fast": scales pre-multiplied per group, f16 (N, K/32, P), replacing d/m/sc/mn
    # of the K-quants and Q4_1/Q5_1 (see fuse_scales)
    sm: torch.Tensor | None = None
    gguf_bytes: int = 0  # size of the original GGUF tensor, for bandwidth accounting
    # precision="fast" without fusing (streamed layers, whose bytes cross PCIe every token):
    # the kernels round each group's scale and min to f16 as fuse_scales would, so the layer
    # computes the same as its fused copy (see f16_scales())
    f16_scales: bool = False

    @property
    def spec(self) -> QSpec | None:
        return QSPECS.get(self.qtype)

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def row_slice(self, start: int, end: int) -> "PackedWeight":
        """Rows [start, end) as views: every plane is row-major with whole rows, so a slice
        is the same layout at an offset."""
        planes = {f: getattr(self, f)[start:end] for f in ("lo", "hi", "d", "m", "sc", "mn", "sm")
                  if getattr(self, f) is not None}
        return replace(self, rows=end - start, **planes,
                       gguf_bytes=self.gguf_bytes * (end - start) // max(self.rows, 1))

    @property
    def nbytes(self) -> int:
        """Bytes the kernels stream per full pass over the weight."""
        planes = (self.lo, self.hi, self.d, self.m, self.sc, self.mn, self.sm)
        return sum(p.numel() * p.element_size() for p in planes if p is not None)


def as_qtype(qtype: T | int | str) -> T:
    """GGMLQuantizationType from an enum, its number or its name; UnsupportedTensorType if none."""
    try:
        qt = T[qtype.upper()] if isinstance(qtype, str) else T(int(qtype))
    except (KeyError, ValueError):
        raise UnsupportedTensorType(f"unknown tensor type {qtype!r}") from None
    if qt not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise UnsupportedTensorType(f"tensor type {qt.name} has no GPU kernel; supported: {names}")
    return qt


def pack_weight(raw: torch.Tensor, qtype: T | int | str, rows: int, cols: int) -> PackedWeight:
    """Repack a GGUF tensor's bytes (uint8, 1-D or (rows, row_bytes)) into kernel planes.

    Runs on raw's device (do it on the GPU: it is a few elementwise passes). The raw tensor is not
    kept; float formats are returned as a (rows, cols) view of it.
    """
    qt = as_qtype(qtype)
    block, tsize = GGML_QUANT_SIZES[qt]
    if raw.dtype != torch.uint8:
        raise GGUFError(f"{qt.name} weight bytes must be uint8, got {raw.dtype}")
    if rows <= 0 or cols <= 0 or cols % block != 0:
        raise GGUFError(f"{qt.name} weight shape ({rows}, {cols}) is not a whole number of "
                        f"{block}-element blocks per row")
    nbytes = rows * cols // block * tsize
    if raw.numel() != nbytes:
        raise GGUFError(f"{qt.name} weight ({rows}, {cols}) needs {nbytes} bytes, got {raw.numel()}")
    raw = raw.reshape(rows, cols // block * tsize)
    if qt in FLOAT_DTYPES:
        w = raw.contiguous().view(FLOAT_DTYPES[qt])  # (N, K)
        return PackedWeight(qt, rows, cols, lo=w, gguf_bytes=nbytes)

    spec = QSPECS[qt]
    if spec.iq:
        grid_words(qt, raw.device)  # the kernels' grid table, made now (see grid_words)
    parts: list[dict[str, torch.Tensor]] = []
    step = pack_chunk_rows(rows, cols)
    for r0 in range(0, rows, step):
        chunk = raw[r0:r0 + step]
        blocks = chunk.reshape(-1, tsize)  # (n_blocks, type_size)
        n = chunk.shape[0]
        if spec.iq:  # the block's fields cut into planes as they are (pack_iq.py)
            parts.append({k: v.reshape(n, -1).contiguous()
                          for k, v in pack_iq_blocks(qt, blocks).items()})
            continue
        codes, meta = _DECODE[qt](blocks)  # codes: (n_blocks, block) uint8/int32, unsigned
        planes = _bitplanes(codes.reshape(n, cols), spec)
        # contiguous: with one block per row a plane sliced out of the blocks stays a strided
        # view (row stride = block size), and the kernels assume dense rows
        planes.update({k: v.reshape(n, -1).contiguous() for k, v in meta.items()})
        parts.append(planes)
    cat = {k: torch.cat([p[k] for p in parts]) if len(parts) > 1 else parts[0][k]
           for k in parts[0]}
    return PackedWeight(qt, rows, cols, gguf_bytes=nbytes, **cat)


_grid_tables: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def grid_table(spec: QSpec, device: torch.device) -> torch.Tensor | None:
    """A codebook format's 16 grid values as float32 on `device` (made once per device), the
    table its kernels gather from; None for the other formats."""
    if spec.grid is None:
        return None
    key = (spec.grid, device)
    if key not in _grid_tables:
        _grid_tables[key] = torch.tensor(spec.grid, dtype=torch.float32, device=device)
    return _grid_tables[key]


def sm_width(spec: QSpec) -> int:
    """Entries per unit of 32 in the fused-scale plane: a scale per group, then a min per group
    when the format has one (0: the format keeps its plain per-unit `d`)."""
    if not spec.kquant and not spec.has_min:
        return 0
    spu = 32 // spec.group
    return spu * (2 if spec.has_min else 1)


def fuse_scales(packed: PackedWeight) -> PackedWeight:
    """precision="fast": each group's scale s = d*sc and min t = dmin*mn (or Q4_1/Q5_1's d and
    -m) precomputed and interleaved per unit, as f16: sm (N, K/32, P) = (s_0..s_{G-1}, t_0..).

    Why: a decode GEMV otherwise gathers d, dmin, sc and mn with four small loads per row and
    unit of 32 codes, and its speed is set by such instructions, not by HBM. One 4-byte load
    replaces them. Cost: s and t are rounded to f16 (relative 2^-11, far below the int8
    rounding of the activations this mode also makes), and Q4_K grows from 4.5 to 5 bits per
    weight. Formats without a min and with one scale per 32 (Q4_0, Q5_0, Q8_0) are unchanged."""
    spec = packed.spec
    if spec is None or packed.sm is not None or sm_width(spec) == 0:
        return packed
    n, nut = packed.rows, packed.cols // 32
    spu = 32 // spec.group
    if not spec.kquant:  # Q4_1 / Q5_1: w = d*q + m
        sm = torch.stack([packed.d, -packed.m], dim=-1)
    else:
        d = packed.d.float().repeat_interleave(8, dim=1)[:, :, None]  # (N, NUT, 1)
        sc = packed.sc.view(n, nut, spu)
        if spec.packed_scmn:
            sci = sc.to(torch.int32) & 0xFF
            scale, mn = d * (sci & 15).float(), sci >> 4
        else:
            scale, mn = d * sc.float(), packed.mn.view(n, nut, spu) if spec.has_min else None
        parts = [scale]
        if spec.has_min:
            parts.append(packed.m.float().repeat_interleave(8, dim=1)[:, :, None] * mn.float())
        sm = torch.cat(parts, dim=-1)
    return PackedWeight(packed.qtype, n, packed.cols, lo=packed.lo, hi=packed.hi,
                        d=None if spec.kquant or spec.has_min else packed.d,
                        sm=sm.to(torch.float16).contiguous(), gguf_bytes=packed.gguf_bytes)


def f16_scales(packed: PackedWeight) -> PackedWeight:
    """precision="fast" for a weight that stays in the GGUF layout (4.5 bits per Q4_K weight
    instead of fuse_scales' 5): the same numbers as fuse_scales(packed), computed in the
    kernels (gemv_q8, dequantize), at the cost of the scale gathers fusing saves. For layers
    whose speed is set by bytes moved, not by instructions: the streamed ones."""
    spec = packed.spec
    if spec is None or packed.sm is not None or sm_width(spec) == 0:
        return packed
    return replace(packed, f16_scales=True)


def _bitplanes(codes: torch.Tensor, spec: QSpec) -> dict[str, torch.Tensor]:
    """(n, K) unsigned codes -> the lo (int32) and hi (int8/int16) planes of the module docstring."""
    n, k = codes.shape
    lo_bits, hi_bits = spec.lo, spec.hi
    nj = 32 // lo_bits
    # (n, K/32, slot j, lane w) -> (n, K/32, w, j) so the slots of one word are last
    q = codes.to(torch.int64).reshape(n, k // 32, nj, lo_bits).transpose(2, 3)
    shifts = torch.arange(nj, device=codes.device, dtype=torch.int64)
    lo = ((q & ((1 << lo_bits) - 1)) << (shifts * lo_bits)).sum(-1)  # disjoint bits: sum == or
    out = {"lo": _wrap(lo, 32).reshape(n, -1)}
    if hi_bits:
        hi = ((q >> lo_bits) << (shifts * hi_bits)).sum(-1)
        out["hi"] = _wrap(hi, nj * hi_bits).reshape(n, -1)
    return out


def _wrap(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned int64 values of `bits` bits -> the signed int8/16/32 with the same bit pattern."""
    dtype = {8: torch.int8, 16: torch.int16, 32: torch.int32}[bits]
    return torch.where(v >= (1 << (bits - 1)), v - (1 << bits), v).to(dtype)


# --- per-format decoders: (n_blocks, type_size) uint8 -> codes (n_blocks, block), meta planes ---
# Element orders follow gguf-py's dequantize_blocks (the oracle); comments give the byte layout.

def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    return blocks[:, off:off + 2].contiguous().view(torch.float16)  # (n, 1)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: element i < 16 is byte i's low nibble, i >= 16 byte i-16's high one."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _bits_le(b: torch.Tensor, n: int) -> torch.Tensor:
    """(nb, n/8) bytes -> (nb, n) bits, little-endian within each byte (bit i of the whole)."""
    sh = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b[:, :, None] >> sh) & 1).reshape(b.shape[0], n)


def _q4_0(b):  # d f16 | qs[16]
    return _nibbles32(b[:, 2:18]), {"d": _f16(b, 0)}


def _q4_1(b):  # d f16 | m f16 | qs[16]
    return _nibbles32(b[:, 4:20]), {"d": _f16(b, 0), "m": _f16(b, 2)}


def _q5_0(b):  # d f16 | qh u32 (bit i = high bit of element i) | qs[16]
    return _nibbles32(b[:, 6:22]) | (_bits_le(b[:, 2:6], 32) << 4), {"d": _f16(b, 0)}


def _q5_1(b):  # d f16 | m f16 | qh u32 | qs[16]
    codes = _nibbles32(b[:, 8:24]) | (_bits_le(b[:, 4:8], 32) << 4)
    return codes, {"d": _f16(b, 0), "m": _f16(b, 2)}


def _q8_0(b):  # d f16 | qs int8[32]; xor 0x80 makes the code unsigned (q + 128)
    return b[:, 2:34] ^ 0x80, {"d": _f16(b, 0)}


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K low bits: 64 bytes -> 256 2-bit codes; element h*128 + s*32 + l is bits 2s..2s+1
    of byte h*32 + l."""
    nb = qs.shape[0]
    sh = torch.tensor([0, 2, 4, 6], device=qs.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(nb, 2, 1, 32) >> sh) & 3).reshape(nb, 256)


def _q2_k(b):  # scales[16] (low nibble sc, high nibble min) | qs[64] | d f16 | dmin f16
    return _crumbs(b[:, 16:80]), {"sc": b[:, 0:16], "d": _f16(b, 80), "m": _f16(b, 82)}


def _q3_k(b):  # hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16
    nb = b.shape[0]
    hbit = _bits_le(b[:, 0:32], 256).reshape(nb, 32, 8).transpose(1, 2).reshape(nb, 256)
    codes = _crumbs(b[:, 32:96]) | (hbit << 2)  # value = code - 4
    s = b[:, 96:108]
    low = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], dim=1)  # (nb, 16)
    sh = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(1, 4, 1)
    high = ((s[:, 8:12].reshape(nb, 1, 4) >> sh) & 3).reshape(nb, 16)
    sc = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)
    return codes, {"sc": sc, "d": _f16(b, 108)}


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py get_scale_min)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _nibbles64(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low bits: 128 bytes -> 256 codes; element c*64 + s*32 + l is nibble s of byte
    c*32 + l."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(nb, 256)


def _q4_k(b):  # d f16 | dmin f16 | scales[12] | qs[128]
    sc, mn = _scale_min_k4(b[:, 4:16])
    return _nibbles64(b[:, 16:144]), {"d": _f16(b, 0), "m": _f16(b, 2), "sc": sc, "mn": mn}


def _q5_k(b):  # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    hbit = _bits_le(b[:, 16:48], 256).reshape(nb, 32, 8).transpose(1, 2).reshape(nb, 256)
    codes = _nibbles64(b[:, 48:176]) | (hbit << 4)
    return codes, {"d": _f16(b, 0), "m": _f16(b, 2), "sc": sc, "mn": mn}


def _q6_k(b):  # ql[128] | qh[64] | scales int8[16] | d f16
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(nb, 256)  # e = h*128 + s*64 + l
    high = _crumbs(b[:, 128:192])  # e = h*128 + s*32 + l: bits 2s of byte h*32 + l
    codes = low | (high << 4)  # value = code - 32
    return codes, {"sc": b[:, 192:208].view(torch.int8), "d": _f16(b, 208)}


def _iq4_nl(b):  # d f16 | qs[16]; codes index the grid
    return _nibbles32(b[:, 2:18]), {"d": _f16(b, 0)}


def _iq4_xs(b):  # d f16 | scales_h u16 | scales_l[4] | qs[128]: 8 runs of 16 bytes as IQ4_NL
    nb = b.shape[0]
    codes = _nibbles32(b[:, 8:136].reshape(nb * 8, 16)).reshape(nb, 256)
    return codes, {"sc": iq4_xs_scales(b), "d": _f16(b, 0)}


def _mxfp4(b):  # e8m0 e | qs[16]; d = 2^(e - 128) as float32, the grid doubled E2M1
    return _nibbles32(b[:, 1:17]), {"d": e8m0_half(b[:, 0:1])}


_DECODE = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
           T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
           T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs, T.MXFP4: _mxfp4}
