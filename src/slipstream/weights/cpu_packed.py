"""CPU linear layers that compute on quantized weights, packed once at load time.

Today the CPU engine multiplies dense float16/float32 copies of the weights (DenseLinear). The
classes here keep the weights quantized instead, in one of these layouts:

``Q4VnniLinear``    Q4_0, Q4_1 and Q4_K through slipstream's own kernel (native/q4_matvec.c; the
    4-bit formats' choice wherever the native library builds): each activation row is
    quantized per block of 32 (one float scale) and multiplied by the 4-bit codes as integers
    (AVX-512 VNNI where the CPU has it, else AVX2, else plain C: the same bits from all three),
    each group's scale and zero applied once, as
    llama.cpp does. The weights are exact (w = s u + z with s, z float16 for Q4_0/Q4_1,
    float32 for Q4_K). The activations' rounding is the error: with the default 16 bits (two
    int8 digits) less than bfloat16's; with 8 (llama.cpp's; SLIPSTREAM_Q4VNNI_BITS=8, ~1.1x
    faster on the default model) ~0.5% of a matvec's output, twice int4pack's error.
``Q8VnniLinear``    Q8_0 on the same kernel (codes q + 128, 8.5 bits a weight, exact weights):
    the format's choice, the default model's tied head included, where the library builds.
``Int4PackLinear``  torch's int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``, group 32):
    Q4_0, Q4_1 and Q4_K. Every group of 32 weights of one output row is w = (u - 8) * s + z
    with u in [0, 15]. The GGUF formats are that exactly (see `group_affine` and `_int4_params`):

        Q4_0  x = d * (q - 8)           ->  u = q, s = d,      z = 0
        Q4_1  x = d * q + m             ->  u = q, s = d,      z = 8 d + m
        Q4_K  x = d*sc_j * q - dmin*m_j ->  u = q, s = d*sc_j, z = 8 d*sc_j - dmin*m_j
                                            (j: the 32-element sub-block; sc_j, m_j 6-bit)

    The kernel is fast only in bfloat16 (float32/float16 inputs take a scalar loop ~40x slower
    in torch 2.13), and then s, z, x and the output are all bfloat16: s and z are rounded to
    nearest from their exact values, which is the mapping's only weight error.
``Int4PairLinear``  Q8_0 on the same int4 kernel, each code split in two nibbles: q = 16 h + l,
    h in [-8, 7], l in [0, 15]. The matrix becomes (out, 2 in): the high nibbles with scale
    16 d and zero 0, then the low ones with scale d and zero 8 d, and x is fed twice. Each
    block keeps its own scale, rounded to bfloat16 (16 and 8 are powers of two, so every
    weight is exactly bf16(d) q): on the default model's Q8_0 requantization it costs 16x
    less KL divergence than int8pack's per-row requantization (+0.6% perplexity there), for
    10 bits a weight read instead of 8 (bench/results/*cpu-packed-ppl*).
``Int8PackLinear``  torch's int8 CPU kernel (``aten._weight_int8pack_mm``): one scale per
    output row, so the per-block scales of Q8_0 (32) and Q6_K (16) cannot be kept. Each row is
    requantized: s_n = the smallest bfloat16 >= max_k |w_nk| / 127, c = round(w / s_n), which
    errs by at most s_n / 2 per weight (exact only where a row's blocks share one scale that
    bfloat16 holds). Also bfloat16 only, like int4.
``DequantLinear``   exact float32: the GGUF codes as int8 plus float32 per-group scales (and
    offsets), dequantized a few rows at a time into an L2-sized buffer and multiplied there. The
    weights are bit-identical to slipstream's (and gguf-py's) dequantizer; only the order of
    the sums differs from DenseLinear's float32 path. compiled=True adds a torch.compile'd
    reduction for single rows.

All of them answer the Linear protocol (x (m, in) -> (m, out), `residual=`, `out_features`) for
any m; the packed kernels are meant for decode (m <= 8) and small speculation trees. Build them
with `pack_linear` (one GGUF matrix) or `pack_group` (the parts of one LinearGroup, fused).

None of these layouts is the GGUF byte layout, so a CPU copy costs RAM next to any pinned GGUF
copy of the same rows; `nbytes` (or `packed_nbytes` before building) says how much: q4vnni
4 + 1 bits a weight for Q4_0/Q4_1, 4 + 2 for Q4_K; int4pack 4 + 1 bits a weight (bfloat16
scale and zero per 32) against Q4_K's 4.5 and Q4_1's 5; q8vnni 8.5, int4pair 10 bits against
Q8_0's 8.5; int8pack 8 bits + 2 bytes a row. torch's int4 layout depends on the
CPU's vector width (blocks of 64 rows with AVX-512, 32 with AVX2), so packed bytes are made on
the machine that runs them.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from ..quant import get_format
from ..quant.base import crumbs, f16_field, nibbles
from .linear import Linear

Q = GGMLQuantizationType

INT4_GROUP = 32  # torch's int4 CPU kernel takes groups of 32, 64, 128 or 256; GGUF's are 32
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significant bits: |round(v) - v| <= 2^-8 |v|
INT4_FORMATS = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
INT8_FORMATS = frozenset({Q.Q8_0, Q.Q6_K})  # the int8pack formats (any format can go)
UNPACKED_FORMATS = INT4_FORMATS | INT8_FORMATS  # the formats `group_affine` reads
PAIR_FORMATS = frozenset({Q.Q8_0})  # 8-bit codes in groups of 32: two int4 halves
KINDS = ("q4vnni", "q4vnni-f16", "q8vnni", "int4pack", "int4pair", "int8pack", "dequant",
         "dequant-compiled")
AUTO_KINDS = ("auto", "torch", "auto-f16")  # kind_for's choices among KINDS
# Load-time work goes a slice of rows at a time, ~256K weights (1 MiB of float32 transients),
# so each unpacking step reads and writes L2 rather than RAM.
_CHUNK_WEIGHTS = 1 << 18
_DEQUANT_BUFFER_BYTES = 1 << 20  # DequantLinear's scratch: well inside one core's L2
# The packed kernels as torch functions: torch.ops.aten's Python dispatch costs ~1.5 us a call,
# which a decode step pays ~120 times (looked up at the call where torch lacks the function).
_INT4_MM = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or (
    lambda *args: torch.ops.aten._weight_int4pack_mm_for_cpu(*args))
_INT8_MM = getattr(torch, "_weight_int8pack_mm", None) or (
    lambda *args: torch.ops.aten._weight_int8pack_mm(*args))


# --- GGUF blocks -> codes and per-group scale/offset -------------------------------------------

@dataclass
class GroupAffine:
    """A quantized matrix as w[n, k] = codes[n, k] * scale[n, k // group] (+ offset[...]).

    codes: (rows, cols) int8; scale, offset: (rows, cols // group) float32, offset None where
    the format has none. `lo` is the smallest code the format can hold (codes - lo >= 0).
    Every product and sum the GGUF dequantizer forms is reproduced in the same float32 order,
    so dequantize() is bit-identical to slipstream.quant.dequantize (and to gguf-py)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    lo: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        g = self.codes.view(rows, cols // self.group, self.group).float()
        w = g * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(rows, cols)

    def exact(self) -> torch.Tensor:
        """The weights in float64, without the dequantizer's float32 roundings (none for the
        4- and 8-bit formats, whose products fit 24 bits; Q6_K's d*sc*q can take 25)."""
        rows, cols = self.shape
        w = self.codes.view(rows, cols // self.group, self.group).double() * \
            self.scale.double().unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.double().unsqueeze(-1)
        return w.view(rows, cols)


def _blocks(raw: torch.Tensor, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    fmt = get_format(qtype)
    if raw.dtype != torch.uint8 or raw.numel() != rows * fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name} tensor of shape {(rows, cols)} needs "
                         f"{rows * fmt.row_bytes(cols)} uint8 bytes, got {raw.numel()} "
                         f"{raw.dtype}")
    return raw.reshape(-1, fmt.type_size)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K's 8 six-bit scales and mins in 12 bytes (see quant/kquants.py for the layout)
    sc_lo, m_lo, mix = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([sc_lo & 0x3F, (mix & 0x0F) | ((sc_lo >> 2) & 0x30)], dim=1)
    m = torch.cat([m_lo & 0x3F, (mix >> 4) | ((m_lo >> 2) & 0x30)], dim=1)
    return sc, m


def group_affine(raw: torch.Tensor, qtype: GGMLQuantizationType | int,
                 shape: tuple[int, int]) -> GroupAffine:
    """Unpack a GGUF matrix (uint8 bytes, rows x row_bytes) of a format in UNPACKED_FORMATS."""
    qtype = Q(int(qtype))
    rows, cols = (int(s) for s in shape)
    b = _blocks(raw, qtype, rows, cols)
    n = b.shape[0]
    if qtype == Q.Q4_0:  # d | qs[16]; byte i: element i (low nibble), i + 16 (high)
        codes = nibbles(b[:, 2:18]).reshape(n, 32).to(torch.int8) - 8
        scale, offset, group, lo = f16_field(b, 0), None, 32, -8
    elif qtype == Q.Q4_1:  # d | m | qs[16]
        codes = nibbles(b[:, 4:20]).reshape(n, 32).to(torch.int8)
        scale, offset, group, lo = f16_field(b, 0), f16_field(b, 2), 32, 0
    elif qtype == Q.Q8_0:  # d | qs[32] int8
        codes = b[:, 2:34].contiguous().view(torch.int8)
        scale, offset, group, lo = f16_field(b, 0), None, 32, -128
    elif qtype == Q.Q4_K:  # d | dmin | scales[12] | qs[128]: 8 sub-blocks of 32
        d, dmin = f16_field(b, 0), f16_field(b, 2)
        sc, m = _k_scale_min(b[:, 4:16])
        # four 32-byte groups; group g: sub-block 2g in the low nibbles, 2g + 1 in the high
        codes = nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 256).to(torch.int8)
        scale = d * sc.float()  # exact: an f16 times a 6-bit integer
        offset = -(dmin * m.float())  # the dequantizer's "- dmin*m", exact likewise
        group, lo = 32, 0
    elif qtype == Q.Q6_K:  # ql[128] | qh[64] | scales[16] int8 | d: 16 sub-blocks of 16
        ql, qh = b[:, 0:128], b[:, 128:192]
        low = nibbles(ql.reshape(n, 2, 64)).reshape(n, 256)
        high = crumbs(qh.reshape(n, 2, 32)).reshape(n, 256)
        codes = (low | (high << 4)).to(torch.int8) - 32
        sc = b[:, 192:208].contiguous().view(torch.int8)
        scale = f16_field(b, 208) * sc.float()  # exact: an f16 times an 8-bit integer
        offset, group, lo = None, 16, -32
    else:
        raise ValueError(f"no packed CPU layout reads {qtype.name}; "
                         f"these do: {', '.join(t.name for t in sorted(UNPACKED_FORMATS))}")
    per_row = cols // group
    scale = scale.reshape(rows, per_row)
    if offset is not None:
        offset = offset.reshape(rows, per_row)
    return GroupAffine(codes.reshape(rows, cols).contiguous(), scale.contiguous(),
                       None if offset is None else offset.contiguous(), group, lo)


# --- rounding to bfloat16 ----------------------------------------------------------------------

def bf16_nearest(v: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16, rounded once to nearest even. (torch converts float64 through
    float32, a double rounding that can land one ulp off; rounding to odd in the float32 step
    makes the second rounding exact.)"""
    v = v.double()
    f = v.float()
    back = f.double()
    if torch.equal(back, v):  # exact in float32 (the usual case): one rounding, to bf16
        return f.to(torch.bfloat16)
    f = torch.where(back.abs() > v.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    bits = f.view(torch.int32)
    bits = torch.where(f.double() != v, bits | 1, bits)
    return bits.view(torch.float32).to(torch.bfloat16)


def bf16_ceil(v: torch.Tensor) -> torch.Tensor:
    """float64 (>= 0) -> the smallest bfloat16 >= v."""
    b = bf16_nearest(v)
    low = b.double() < v.double()
    bumped = (b.view(torch.int16) + 1).view(torch.bfloat16)  # next up, for b >= 0
    return torch.where(low, bumped, b)


# --- load-time packing -------------------------------------------------------------------------

def _rows_per_chunk(cols: int, multiple: int = 64) -> int:
    return max(multiple, _CHUNK_WEIGHTS // cols // multiple * multiple)


def _chunks(raws: Sequence[torch.Tensor], qtypes: Sequence[GGMLQuantizationType | int],
            shapes: Sequence[tuple[int, int]]):
    """(first row in the stacked matrix, GroupAffine of a slice of rows) over every part."""
    base = 0
    for raw, qtype, (rows, cols) in zip(raws, qtypes, shapes):
        raw = raw.reshape(rows, -1)
        step = _rows_per_chunk(cols, 1)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            yield base + r0, group_affine(raw[r0:r1], qtype, (r1 - r0, cols))
        base += rows


def _int4_params(ga: GroupAffine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's int4 convention, w = (u - 8) * s + z, from a 4-bit GroupAffine:
    u = codes - lo, s = scale, z = (lo + 8) * scale + offset. Returns (u uint8 (rows, cols),
    s, z float64 (rows, cols // 32)), exact."""
    if ga.group != INT4_GROUP or ga.lo not in (0, -8):
        raise ValueError(f"int4pack needs 4-bit codes in groups of {INT4_GROUP}")
    u = ga.codes if ga.lo == 0 else ga.codes + 8  # in [0, 15] by construction (nibbles)
    s = ga.scale.double()
    z = (ga.lo + 8) * s
    if ga.offset is not None:
        z = z + ga.offset.double()
    return u.view(torch.uint8), s, z


def _pack_int4(u: torch.Tensor) -> torch.Tensor:
    """(rows, cols) uint8 codes in [0, 15], rows a multiple of 16 -> torch's packed layout.
    The packer works on blocks of 64 rows (32 on AVX2) stored one after another, so packing
    slices of a multiple of 64 rows gives the same bytes as packing the whole matrix, with an
    int32 transient of one slice."""
    rows, cols = u.shape
    out = torch.empty(rows, cols // 2, dtype=torch.uint8)
    step = _rows_per_chunk(cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            u[r0:r1].to(torch.int32), 1)
    return out


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 weights (rows, cols) -> int8 codes and a bfloat16 scale per row, the codes
    chosen against the rounded scale: s = bf16_ceil(max|w| / 127), c = round(w / s), so
    |c| <= 127 and |c s - w| <= s / 2 (up to one float32 rounding of w / s)."""
    amax = w.abs().amax(dim=1)
    s = bf16_ceil(amax.double() / 127)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero row: codes 0
    c = torch.round(w / s.float().unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return c, s


# --- the linears -------------------------------------------------------------------------------

def _finish(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """A kernel's output (bfloat16, or float32 from q4vnni) in the activation dtype, plus bias
    and residual: a mixed add promotes to float32, so the cast costs no op where an add
    follows."""
    if bias is not None:
        y = torch.add(bias, y)  # bias is float32: promotes
    if residual is not None:
        return torch.add(residual, y)
    return y.to(dtype)


def _check_pair_formats(kind: str, qtypes) -> None:
    """The Q8_0 layouts (int4pair, q8vnni) read nothing else."""
    if any(Q(int(t)) not in PAIR_FORMATS for t in qtypes):
        raise ValueError(f"{kind} reads Q8_0 only, not "
                         f"{', '.join(Q(int(t)).name for t in qtypes)}")


def int4pack_torch(raws, qtypes, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' rows (GGUF bytes of 4-bit formats) stacked in torch's int4 layout, by torch
    ops: (packed (rows padded to 16, cols / 2) uint8, scale_zeros (cols / 32, padded, 2)
    bfloat16)."""
    rows = sum(r for r, _ in shapes)
    cols = shapes[0][1]
    padded = -(-rows // 16) * 16  # the packer needs rows in multiples of 16
    u = torch.full((padded, cols), 8, dtype=torch.uint8)
    scale_zeros = torch.zeros(cols // INT4_GROUP, padded, 2, dtype=torch.bfloat16)
    for r0, ga in _chunks(raws, qtypes, shapes):
        r1 = r0 + ga.shape[0]
        uc, s, z = _int4_params(ga)
        u[r0:r1] = uc
        scale_zeros[:, r0:r1, 0] = bf16_nearest(s).t()
        scale_zeros[:, r0:r1, 1] = bf16_nearest(z).t()
    return _pack_int4(u), scale_zeros


class Int4PackLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) through aten._weight_int4pack_mm_for_cpu (group 32).
    `packed` is (rows padded to 16, in/2) uint8 in torch's layout and `scale_zeros`
    (in/32, rows padded, 2) bfloat16."""

    kind = "int4pack"

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None):
        self.packed = packed
        self.scale_zeros = scale_zeros
        self._out = out_features
        self.bias = bias
        self.in_features = packed.shape[1] * 2

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Int4PackLinear":
        """Stack the parts' rows (GGUF bytes, all of 4-bit formats) into one packed weight:
        in one native pass where int4_pack.c can (weights.int4_native), else in torch ops
        (the same bits)."""
        from .int4_native import pack_native

        rows = sum(r for r, _ in shapes)
        packed = pack_native(raws, qtypes, shapes)
        return cls(*(packed or int4pack_torch(raws, qtypes, shapes)), rows, bias)

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def nbytes(self) -> int:
        """Bytes a call reads: the packed codes and the scales and zeros."""
        return self.packed.numel() + self.scale_zeros.numel() * 2

    def row_slice(self, r0: int, r1: int) -> "Int4PackLinear":
        """Output rows [r0, r1) as their own linear, sharing the packed codes (for splitting a
        layer by rows). The packer lays rows out in independent blocks of 64 (32 on AVX2),
        so r0 must be a multiple of 64, and r1 too unless it is out_features."""
        if r0 % 64 or not (r1 % 64 == 0 or r1 == self._out) or not 0 <= r0 < r1 <= self._out:
            raise ValueError(f"int4pack rows [{r0}, {r1}) do not start and end on 64-row "
                             f"blocks of {self._out}")
        end = self.packed.shape[0] if r1 == self._out else r1
        bias = None if self.bias is None else self.bias[r0:r1]
        return type(self)(self.packed[r0:end], self.scale_zeros[:, r0:end].contiguous(),
                          r1 - r0, bias)

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 x (m, in): bfloat16 (m, out), no bias."""
        y = _INT4_MM(xb, self.packed, INT4_GROUP, self.scale_zeros)
        return y if y.shape[1] == self._out else y[:, :self._out].contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return _finish(self.kernel(x.to(torch.bfloat16)), x.dtype, self.bias, residual)


class Int4PairLinear(Int4PackLinear):
    """Q8_0 through the int4 kernel: y = [x | x] @ [W_high | W_low]^T, where each 8-bit code
    q = 16 h + l is held as u_high = h + 8 (scale 16 d, zero 0) and u_low = l (scale d, zero
    8 d), so W_high + W_low = d q up to the bfloat16 rounding of d. `packed` is (rows padded
    to 16, in) uint8 (2 in codes) and `scale_zeros` (2 in / 32, rows padded, 2) bfloat16."""

    kind = "int4pair"

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__(packed, scale_zeros, out_features, bias)
        self.in_features = packed.shape[1]  # the kernel's input is twice this

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Int4PairLinear":
        """Stack the parts' rows (GGUF bytes, all Q8_0) into one packed weight."""
        _check_pair_formats(cls.kind, qtypes)
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // 16) * 16
        groups = cols // INT4_GROUP
        u = torch.full((padded, 2 * cols), 8, dtype=torch.uint8)
        scale_zeros = torch.zeros(2 * groups, padded, 2, dtype=torch.bfloat16)
        for r0, ga in _chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            q = ga.codes.to(torch.int16)  # [-128, 127]
            high = torch.div(q, 16, rounding_mode="floor")  # [-8, 7]: floor keeps l >= 0
            u[r0:r1, :cols] = (high + 8).to(torch.uint8)
            u[r0:r1, cols:] = (q - 16 * high).to(torch.uint8)  # l in [0, 15]
            d = bf16_nearest(ga.scale.double()).t()  # (groups, r1 - r0)
            scale_zeros[:groups, r0:r1, 0] = d * 16  # exact: powers of two
            scale_zeros[groups:, r0:r1, 0] = d
            scale_zeros[groups:, r0:r1, 1] = d * 8
        return cls(_pack_int4(u), scale_zeros, rows, bias)

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return super().kernel(torch.cat([xb, xb], dim=-1))


# q4vnni's layout (native/q4_matvec.c): rows in blocks of 16, each block's 32-column groups as
# records of 256 bytes of codes and 16 scales and 16 zeros (float16, or float32 where float16
# cannot hold them exactly); q8vnni's records: 512 bytes of codes and 16 float16 scales
Q4V_ROWS = 16
Q4V_CODE_BYTES = Q4V_ROWS * INT4_GROUP // 2
Q8V_RECORD_BYTES = 2 * Q4V_CODE_BYTES + 2 * Q4V_ROWS  # 8-bit codes, 16 float16 scales


def q4vnni_record_bytes(scale_f32: bool) -> int:
    return Q4V_CODE_BYTES + 2 * Q4V_ROWS * (4 if scale_f32 else 2)


# Q4_K's own scales (q4_matvec.c's Q4_KS): groups in runs of 8 (a Q4_K super-block), each run a
# header of the 16 rows' d and dmin (float16) and each group's 6-bit scales and mins as bytes
# (320 bytes), then the 8 groups' 256 bytes of codes: 296 bytes a group, 4.625 bits a weight
# against the float32 records' 6, with the same bits (d sc and -dmin mn are exact in float32).
Q4V_KS_RUN = 8
Q4V_KS_HEADER_BYTES = 2 * Q4V_ROWS * 2 + 2 * Q4V_KS_RUN * Q4V_ROWS
Q4V_KS_RECORD_BYTES = Q4V_CODE_BYTES + Q4V_KS_HEADER_BYTES // Q4V_KS_RUN
# Q4_KS is the default since session 36: on an H100's host (a 16-core Sapphire Rapids, no steal)
# the 70B at 24 GiB decoded 5.865 tok/s with it against 4.699 with the float32 records in the
# same call, its CPU share computing 154 Gweights/s (89.3 GB/s of its bytes) against 99 (74.2
# GB/s) with 12.55 cores busy in both (bench/results/2026-12-06-s36-hybrid-bench-{q4ks,f32}-
# h100-call1.json). SLIPSTREAM_Q4VNNI_KS=0 packs the float32 records instead.
Q4VNNI_KS = os.environ.get("SLIPSTREAM_Q4VNNI_KS", "1") != "0"

# record bytes -> q4_matvec.c's Q4_F16, Q4_F32, Q8_F16, Q4_KS
Q4V_FORMATS = {q4vnni_record_bytes(False): 0, q4vnni_record_bytes(True): 1, Q8V_RECORD_BYTES: 2,
               Q4V_KS_RECORD_BYTES: 3}


def q4vnni_k_scales(qtypes: Sequence[GGMLQuantizationType | int], cols: int) -> bool:
    """Whether q4vnni packs these parts with Q4_K's own scales (Q4_KS): every part Q4_K."""
    return Q4VNNI_KS and cols % (Q4V_KS_RUN * INT4_GROUP) == 0 and all(
        Q(int(t)) == Q.Q4_K for t in qtypes)


def q4vnni_nbytes(rows: int, cols: int, scale_f32: bool, k_scales: bool = False) -> int:
    """Bytes of a (rows, cols) q4vnni weight: with float16 scales, int4pack's 4 + 1 bits a
    weight (its rows padded to 16 rather than 64); float32, 4 + 2; Q4_K's own, 4 + 0.625."""
    record = Q4V_KS_RECORD_BYTES if k_scales else q4vnni_record_bytes(scale_f32)
    return -(-rows // Q4V_ROWS) * (cols // INT4_GROUP) * record


def q4vnni_parts_nbytes(qtypes: Sequence[GGMLQuantizationType | int], rows: int,
                        cols: int) -> int:
    """Bytes of the q4vnni weight Q4VnniLinear.from_raws makes of parts of these formats
    stacked into (rows, cols)."""
    has_k = any(Q(int(t)) == Q.Q4_K for t in qtypes)
    return q4vnni_nbytes(rows, cols, has_k, q4vnni_k_scales(qtypes, cols))


def q8vnni_nbytes(rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) q8vnni weight: 8 + 0.5 bits a weight, Q8_0's own size."""
    return -(-rows // Q4V_ROWS) * (cols // INT4_GROUP) * Q8V_RECORD_BYTES


def _q4vnni_params(ga: GroupAffine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4vnni's convention, w = s * u + z, from a 4-bit GroupAffine: u = codes - lo in [0, 15],
    s = scale, z = lo * scale + offset. All three formats' s and z are exact in float32 (Q4_0:
    -8 d; Q4_1: d, m; Q4_K: an f16 times a 6-bit integer)."""
    if ga.group != INT4_GROUP or ga.lo not in (0, -8):
        raise ValueError(f"q4vnni needs 4-bit codes in groups of {INT4_GROUP}")
    u = ga.codes if ga.lo == 0 else ga.codes + 8
    s = ga.scale.float()
    z = ga.lo * s
    if ga.offset is not None:
        z = z + ga.offset.float()
    return u.view(torch.uint8), s, z


def _q4vnni_codes(u: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes in [0, 15], rows a multiple of 16 -> (blocks, groups, 256) bytes:
    row r's columns 4j..4j+3 of a group at bytes 4r..4r+3 of 64-byte chunk j % 4, in the low
    nibble for j < 4 and the high one for j >= 4 (see q4_matvec.c)."""
    rows, cols = u.shape
    q = u.view(rows // Q4V_ROWS, Q4V_ROWS, cols // INT4_GROUP, 2, 4, 4)  # b, r, g, half, j%4, t
    q = q.permute(0, 2, 3, 4, 1, 5)  # b, g, half, j % 4, r, t
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows // Q4V_ROWS, cols // INT4_GROUP,
                                                    Q4V_CODE_BYTES)


def _q8vnni_codes(u: torch.Tensor) -> torch.Tensor:
    """(rows, cols) uint8 codes, rows a multiple of 16 -> (blocks, groups, 512) bytes: row r's
    columns 4j..4j+3 of a group at bytes 4r..4r+3 of 64-byte chunk j (see q4_matvec.c)."""
    rows, cols = u.shape
    q = u.view(rows // Q4V_ROWS, Q4V_ROWS, cols // INT4_GROUP, 8, 4).permute(0, 2, 3, 1, 4)
    return q.reshape(rows // Q4V_ROWS, cols // INT4_GROUP, 8 * Q4V_ROWS * 4)


def _q4vnni_ks(raws, qtypes, shapes, codes: torch.Tensor) -> torch.Tensor:
    """Q4_K parts stacked by rows, with their codes already in q4vnni's records ((blocks,
    groups, 256), padding rows 0) -> (blocks, groups, Q4V_KS_RECORD_BYTES) uint8 in Q4_KS's
    layout: per run of 8 groups, the 16 rows' d then dmin (the file's float16 bits), the 8
    groups' 16 scales each, their 16 mins each, then the 8 groups' codes."""
    blocks, groups = codes.shape[0], codes.shape[1]
    padded, runs = blocks * Q4V_ROWS, groups // Q4V_KS_RUN
    halves = torch.zeros(padded, runs, 2, dtype=torch.int16)  # d, dmin
    scale_min = torch.zeros(padded, groups, 2, dtype=torch.uint8)  # sc, mn
    r0 = 0
    for raw, qtype, (r, c) in zip(raws, qtypes, shapes):
        b = _blocks(raw, Q(int(qtype)), r, c)  # (r * runs, 144)
        halves[r0:r0 + r] = b[:, 0:4].contiguous().view(torch.int16).view(r, runs, 2)
        sc, mn = _k_scale_min(b[:, 4:16])
        scale_min[r0:r0 + r, :, 0] = sc.reshape(r, groups)
        scale_min[r0:r0 + r, :, 1] = mn.reshape(r, groups)
        r0 += r
    header = halves.view(blocks, Q4V_ROWS, runs, 2).permute(0, 2, 3, 1).contiguous()
    header = header.view(torch.uint8).view(blocks, runs, -1)
    # (blocks, runs, [sc, mn], group, row)
    sm = scale_min.view(blocks, Q4V_ROWS, runs, Q4V_KS_RUN, 2).permute(0, 2, 4, 3, 1)
    packed = torch.cat([header, sm.reshape(blocks, runs, -1),
                        codes.reshape(blocks, runs, Q4V_KS_RUN * Q4V_CODE_BYTES)], dim=2)
    return packed.view(blocks, groups, Q4V_KS_RECORD_BYTES)


def _q4vnni_plane(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, groups) float32 scales or zeros -> (blocks, groups, 16 * itemsize) bytes."""
    rows, groups = v.shape
    t = v.to(dtype).view(rows // Q4V_ROWS, Q4V_ROWS, groups).transpose(1, 2).contiguous()
    return t.view(torch.uint8).view(rows // Q4V_ROWS, groups, -1)


class _Q4Weight(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("fmt", ctypes.c_int64)]


# Bits the activations are quantized to per block of 32 (q4_matvec.c's Q4_X16): 8 is llama.cpp's
# int8 (4x int4pack's KL divergence on the default model, bench/results/*q4vnni*); 16, held as
# two int8 digits, loses less than bfloat16 does, for twice the vpdpbusd work (a quarter more
# time a token here). SLIPSTREAM_Q4VNNI_BITS=8 picks the faster, lossier one.
Q4VNNI_ACT_BITS = int(os.environ.get("SLIPSTREAM_Q4VNNI_BITS", "16"))


# The q4vnni/q8vnni matvec's threads take chunks of the rows as they finish, not one equal
# share each (native/q4_matvec.c, q4_parallel; same bits either way): on session 34's H100 host
# a 70B's split layers' shares ran at 104.4 GB/s alone with chunks against 82.9 with equal
# shares (15 threads), and hybrid decode at 5.25 tok/s against 4.14 at the same share
# (bench/results/2026-12-05-s34-hybrid-bench-*-h100-call1.json). SLIPSTREAM_CPU_CHUNKS=0: equal
# shares.
CPU_CHUNKS = os.environ.get("SLIPSTREAM_CPU_CHUNKS", "1") == "1"


def q4vnni_flags(x_f32: bool, y_f32: bool, threads: int, generic: bool = False,
                 act_bits: int | None = None, chunks: bool | None = None) -> int:
    """ss_q4_matvec's flags argument (see q4_matvec.c). chunks: the threads take chunks of
    the rows as they finish rather than one equal share each (default CPU_CHUNKS)."""
    x16 = (Q4VNNI_ACT_BITS if act_bits is None else act_bits) == 16
    chunks = CPU_CHUNKS if chunks is None else chunks
    return int(x_f32) | int(y_f32) << 1 | int(generic) << 2 | int(x16) << 3 | \
        int(chunks) << 4 | int(threads) << 8


class Q4VnniLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) for Q4_0, Q4_1 and Q4_K through native/q4_matvec.c: each
    activation row quantized to 16 (or 8) bits per block of 32 (a float scale each) and the
    integers multiplied by the 4-bit codes (AVX-512 VNNI where the CPU has it, else AVX2, else
    plain C), each group's scale and zero applied once. The weights are the GGUF ones
    exactly (scales and zeros float16 where that holds them, float32 otherwise); the
    activations' rounding (to Q4VNNI_ACT_BITS bits) is the kernel's only error besides float32
    sums. Needs the native library: kind_for picks q4vnni only where q4vnni_available().

    `packed` is (ceil(rows / 16), in / 32, record) uint8, record = 320 bytes (float16 scales)
    or 384 (float32)."""

    kind = "q4vnni"

    def __init__(self, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None):
        from .. import native

        self.packed = packed
        self._out = out_features
        self.bias = bias
        self.in_features = packed.shape[1] * INT4_GROUP
        fmt = Q4V_FORMATS.get(packed.shape[2])
        if fmt is None or (fmt == 2) != (self.kind == "q8vnni"):
            raise ValueError(f"{self.kind} records are not {packed.shape[2]} bytes")
        self.scale_f32 = fmt == 1
        self.k_scales = fmt == 3  # Q4_K's own scales (Q4_KS)
        lib = native.library()
        if lib is None:
            raise RuntimeError("q4vnni needs the native library (slipstream.native), which "
                               "this process does not have (no C compiler, or "
                               "SLIPSTREAM_NATIVE=0)")
        self._matvec = lib.ss_q4_matvec
        # q4_matvec.c's q4_weight, made once: the call then passes one pointer for it
        self._desc = _Q4Weight(packed.data_ptr(), out_features, self.in_features, fmt)
        self.desc = ctypes.addressof(self._desc)
        self.flags = q4vnni_flags(False, False, 0)  # the activation bits (bf16 in and out)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None,
                  round_scales: bool = False) -> "Q4VnniLinear":
        """Stack the parts' rows (GGUF bytes, all of 4-bit formats) into one packed weight.
        round_scales (kind "q4vnni-f16"): Q4_K's scales and zeros too are rounded to float16,
        for a sixth fewer bytes to read (not exact: ~11 bits of each, against int4pack's 8)."""
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // Q4V_ROWS) * Q4V_ROWS
        groups = cols // INT4_GROUP
        from .int4_native import q4vnni_native

        # in one native pass where the library is there (the same bits; in torch ops a 70B's
        # hybrid load took 70-85 s against int4pack's 25-34 s, which packs natively)
        native = q4vnni_native(raws, qtypes, shapes, padded)
        k_scales = not round_scales and q4vnni_k_scales(qtypes, cols)
        if native is not None:
            codes, s, z = native
        else:
            u = torch.zeros(padded, cols, dtype=torch.uint8)  # padding rows: codes, scales 0
            s = torch.zeros(padded, groups)
            z = torch.zeros(padded, groups)
            for r0, ga in _chunks(raws, qtypes, shapes):
                r1 = r0 + ga.shape[0]
                u[r0:r1], s[r0:r1], z[r0:r1] = _q4vnni_params(ga)
            codes = _q4vnni_codes(u)
        if k_scales:  # the scales and mins from the file's fields, not s and z
            return cls(_q4vnni_ks(raws, qtypes, shapes, codes), rows, bias)
        # float16 where it holds every scale and zero exactly: Q4_0's and Q4_1's (f16 fields;
        # -8 d too, short of overflow), never in general Q4_K's (an f16 times a 6-bit integer),
        # which keep float32 so that packed_nbytes can tell the size from the format
        if round_scales:
            top = float(torch.finfo(torch.float16).max)
            if max(float(s.abs().max()), float(z.abs().max())) > top:
                raise ValueError(f"a scale or zero past float16's range ({top:g}): this weight "
                                 f"cannot take q4vnni-f16; use q4vnni")
        halves = round_scales or not any(Q(int(t)) == Q.Q4_K for t in qtypes) and all(
            torch.equal(v.half().float(), v) for v in (s, z))
        dtype = torch.float16 if halves else torch.float32
        packed = torch.cat([codes, _q4vnni_plane(s, dtype), _q4vnni_plane(z, dtype)], dim=2)
        return cls(packed, rows, bias)

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def row_slice(self, r0: int, r1: int) -> "Q4VnniLinear":
        """Output rows [r0, r1) as their own linear, sharing the packed bytes; r0 a multiple of
        16, and r1 too unless it is out_features."""
        if r0 % Q4V_ROWS or not (r1 % Q4V_ROWS == 0 or r1 == self._out) or \
                not 0 <= r0 < r1 <= self._out:
            raise ValueError(f"q4vnni rows [{r0}, {r1}) do not start and end on "
                             f"{Q4V_ROWS}-row blocks of {self._out}")
        bias = None if self.bias is None else self.bias[r0:r1]
        return type(self)(self.packed[r0 // Q4V_ROWS:-(-r1 // Q4V_ROWS)], r1 - r0, bias)

    def matvec(self, x: torch.Tensor, out: torch.Tensor, threads: int | None = None,
               generic: bool = False, act_bits: int | None = None,
               chunks: bool | None = None) -> torch.Tensor:
        """out (m, out) = x (m, in) @ W^T: x and out contiguous, float32 or bfloat16 each.
        threads: torch's intra-op count unless given; generic: the plain-C loop even where
        a vector loop (VNNI or AVX2) is compiled in (tests compare the two); act_bits: 8 or
        16 (default Q4VNNI_ACT_BITS); chunks: the threads take chunks of the rows rather than
        equal shares (default CPU_CHUNKS; benchmarks and tests compare the two)."""
        m = x.shape[0]
        if x.shape[-1] != self.in_features or tuple(out.shape) != (m, self._out) or \
                not (x.is_contiguous() and out.is_contiguous()):
            raise ValueError(f"q4vnni matvec of {tuple(x.shape)} into {tuple(out.shape)}: "
                             f"needs contiguous (m, {self.in_features}) and (m, {self._out})")
        flags = q4vnni_flags(x.dtype == torch.float32, out.dtype == torch.float32,
                             torch.get_num_threads() if threads is None else threads, generic,
                             act_bits, chunks)
        self._matvec(self.desc, x.data_ptr(), out.data_ptr(), m, flags)
        return out

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 x (m, in): bfloat16 (m, out), no bias (what
        Int4PackLinear.kernel returns)."""
        if not xb.is_contiguous():
            xb = xb.contiguous()
        y = torch.empty(xb.shape[0], self._out, dtype=torch.bfloat16)
        self._matvec(self.desc, xb.data_ptr(), y.data_ptr(), xb.shape[0],
                     self.flags | (xb.dtype == torch.float32) | torch.get_num_threads() << 8)
        return y

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = torch.empty(x.shape[0], self._out)  # float32: one rounding fewer than the kernel
        self.matvec(x, y)
        return _finish(y, x.dtype, self.bias, residual)


class Q8VnniLinear(Q4VnniLinear):
    """Q8_0 through the same kernel (native/q4_matvec.c's Q8_F16 records): each code stored as
    u = q + 128 (unsigned, for vpdpbusd), with w = d u - 128 d, so the weights are Q8_0's exactly
    (d float16, as in the file) at Q8_0's own 8.5 bits a weight. Against int4pair (Q8_0 as two
    int4 halves through torch's kernel): 15% fewer bytes, exact scales, int8 activations.
    `packed` is (ceil(rows / 16), in / 32, 544) uint8."""

    kind = "q8vnni"

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Q8VnniLinear":
        """Stack the parts' rows (GGUF bytes, all Q8_0) into one packed weight."""
        _check_pair_formats(cls.kind, qtypes)
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // Q4V_ROWS) * Q4V_ROWS
        u = torch.zeros(padded, cols, dtype=torch.uint8)  # padding rows: scale 0
        s = torch.zeros(padded, cols // INT4_GROUP)
        for r0, ga in _chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            u[r0:r1] = (ga.codes.to(torch.int16) + 128).to(torch.uint8)
            s[r0:r1] = ga.scale
        packed = torch.cat([_q8vnni_codes(u), _q4vnni_plane(s, torch.float16)], dim=2)
        return cls(packed, rows, bias)


class Int8PackLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) through aten._weight_int8pack_mm: int8 codes (out, in)
    and one bfloat16 scale per output row (see `_int8_rows` for the requantization)."""

    kind = "int8pack"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None):
        self.codes = codes
        self.scales = scales
        self.bias = bias
        self.in_features = codes.shape[1]

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Int8PackLinear":
        """Stack the parts' rows (GGUF bytes, any formats group_affine reads), requantized."""
        rows = sum(r for r, _ in shapes)
        codes = torch.empty(rows, shapes[0][1], dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.bfloat16)
        for r0, ga in _chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            codes[r0:r1], scales[r0:r1] = _int8_rows(ga.dequantize())
        return cls(codes, scales, bias)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2

    def row_slice(self, r0: int, r1: int) -> "Int8PackLinear":
        """Output rows [r0, r1) as their own linear (views: no copy)."""
        return Int8PackLinear(self.codes[r0:r1], self.scales[r0:r1],
                              None if self.bias is None else self.bias[r0:r1])

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 x (m, in): bfloat16 (m, out), no bias."""
        return _INT8_MM(xb, self.codes, self.scales)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return _finish(self.kernel(x.to(torch.bfloat16)), x.dtype, self.bias, residual)


_COMPILED_DOT = None


def _dot_rows(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              x: torch.Tensor) -> torch.Tensor:
    """One activation row against group-affine weights, as one fused reduction: codes (N, B, g)
    int8, scale/offset (N, B), x (B, g) float32 -> (N,). Each group's dot product is formed on
    the codes and then scaled (sum_b s_b (q_b . x_b) + o_b sum(x_b)): the weights' float32
    values are never formed, so the sums differ from DenseLinear's in rounding only."""
    p = (codes.to(torch.float32) * x).sum(-1)
    if offset is None:
        return (p * scale).sum(-1)
    return (p * scale + offset * x.sum(-1)).sum(-1)


def _compiled_dot():
    global _COMPILED_DOT
    if _COMPILED_DOT is None:  # one compilation for every shape (dynamic), at the first call
        _COMPILED_DOT = torch.compile(_dot_rows, dynamic=True)
    return _COMPILED_DOT


class DequantLinear(Linear):
    """y = x @ W^T (+ b) (+ residual) in float32 on the GGUF codes: a few rows at a time are
    dequantized (codes * scale (+ offset), the dequantizer's own float32 operations) into a
    scratch buffer that stays in L2, then multiplied. Exact: the weights are bit-identical to
    slipstream.quant.dequantize; it reads 1 byte per weight plus 4 (or 8) bytes per group.

    compiled=True: a single row (decode) goes through one torch.compile'd reduction on the
    codes instead (`_dot_rows`; ~4x the eager rate here; the first call compiles, ~10-50 s,
    and needs a C++ compiler); more rows stay eager (the compiled loop reads the codes once
    per row)."""

    def __init__(self, ga: GroupAffine, bias: torch.Tensor | None = None,
                 compiled: bool = False):
        self.ga = ga
        self.bias = bias
        self.compiled = compiled
        rows, cols = ga.shape
        self.in_features = cols
        self._rows = max(1, min(rows, _DEQUANT_BUFFER_BYTES // (4 * cols)))
        self._buf = torch.empty(self._rows, cols)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None,
                  compiled: bool = False) -> "DequantLinear":
        """Stack the parts' rows (GGUF bytes; one group size, i.e. all 32 or all Q6_K)."""
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scale = offset = None
        group, lo = None, 0
        for r0, ga in _chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            if scale is None:
                group = ga.group
                scale = torch.empty(rows, cols // group)
            if ga.group != group:
                raise ValueError("parts of one DequantLinear need one group size")
            if ga.offset is not None and offset is None:
                offset = torch.zeros(rows, cols // group)
            codes[r0:r1], scale[r0:r1] = ga.codes, ga.scale
            if ga.offset is not None:
                offset[r0:r1] = ga.offset
            lo = min(lo, ga.lo)
        return cls(GroupAffine(codes, scale, offset, group, lo), bias, compiled)

    @property
    def kind(self) -> str:
        return "dequant-compiled" if self.compiled else "dequant"

    @property
    def out_features(self) -> int:
        return self.ga.codes.shape[0]

    @property
    def nbytes(self) -> int:
        ga = self.ga
        return ga.codes.numel() + ga.scale.numel() * 4 + (
            ga.offset.numel() * 4 if ga.offset is not None else 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        ga = self.ga
        rows, cols = ga.shape
        per = cols // ga.group
        xf = x.float()
        if self.compiled and x.shape[0] == 1:
            y = _compiled_dot()(ga.codes.view(rows, per, ga.group), ga.scale, ga.offset,
                                xf.view(per, ga.group)).unsqueeze(0)
        else:
            yt = torch.empty(rows, x.shape[0])  # (out, m): each chunk writes contiguous rows
            for r0 in range(0, rows, self._rows):
                r1 = min(rows, r0 + self._rows)
                buf = self._buf[:r1 - r0]
                g = buf.view(r1 - r0, per, ga.group)
                torch.mul(ga.codes[r0:r1].view(r1 - r0, per, ga.group),
                          ga.scale[r0:r1].unsqueeze(-1), out=g)
                if ga.offset is not None:
                    g.add_(ga.offset[r0:r1].unsqueeze(-1))
                torch.mm(buf, xf.t(), out=yt[r0:r1])
            y = yt.t()
            if x.shape[0] > 1:
                y = y.contiguous()
        if self.bias is not None:
            y = y + self.bias
        if residual is not None:
            y = residual + y
        return y.to(x.dtype)


# --- building ----------------------------------------------------------------------------------

def q4vnni_available() -> bool:
    """Whether q4vnni can run here: the native library builds (slipstream.native; a first call
    compiles it, ~2 s, then it is cached per machine) and is not turned off (SLIPSTREAM_NATIVE=0,
    or SLIPSTREAM_Q4VNNI=0 for this kind alone: the 4-bit formats then go to int4pack)."""
    from .. import native

    return os.environ.get("SLIPSTREAM_Q4VNNI", "1") != "0" and native.library() is not None


def kind_for(qtype: GGMLQuantizationType | int, kind: str = "auto") -> str | None:
    """The layout a tensor of `qtype` gets: `kind` if it can take it ("q4vnni" and "int4pack"
    only for 4-bit formats with groups of 32, "q8vnni" and "int4pair" only for Q8_0), or with
    kind="auto": where the native library is there (q4vnni_available), q4vnni for
    Q4_0/Q4_1/Q4_K and q8vnni for Q8_0; where not, int4pack and int4pair (int8pack's per-row
    requantization costs Q8_0 more than the issue's 0.5% perplexity allowance on the default
    model; int4pair, 0.03%); int8pack for Q6_K (16-wide sub-blocks fit no int4 group); None
    for formats no layout reads (keep DenseLinear for those). kind="torch": auto's choice
    among torch's kernels alone (int4pack, int4pair, int8pack). kind="auto-f16": auto's, with
    "q4vnni-f16" for "q4vnni" (Q4_K's scales rounded to float16: 5 bits a weight, not 6)."""
    qtype = Q(int(qtype))
    if kind not in AUTO_KINDS and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(AUTO_KINDS + KINDS)}, not {kind!r}")
    if qtype not in UNPACKED_FORMATS:
        return None
    if kind in AUTO_KINDS:
        ours = kind != "torch" and q4vnni_available()
        if qtype in INT4_FORMATS:
            return ("q4vnni-f16" if kind == "auto-f16" else "q4vnni") if ours else "int4pack"
        if qtype in PAIR_FORMATS:
            return "q8vnni" if ours else "int4pair"
        return "int8pack"
    if kind in ("int4pack", "q4vnni", "q4vnni-f16") and qtype not in INT4_FORMATS:
        return None
    if kind in ("int4pair", "q8vnni") and qtype not in PAIR_FORMATS:
        return None
    return kind


def _dequant_compiled(raws, qtypes, shapes, bias=None) -> DequantLinear:
    return DequantLinear.from_raws(raws, qtypes, shapes, bias, compiled=True)


def _q4vnni_f16(raws, qtypes, shapes, bias=None) -> "Q4VnniLinear":
    return Q4VnniLinear.from_raws(raws, qtypes, shapes, bias, round_scales=True)


_BUILDERS = {"q4vnni": Q4VnniLinear.from_raws, "q4vnni-f16": _q4vnni_f16,
             "q8vnni": Q8VnniLinear.from_raws,
             "int4pack": Int4PackLinear.from_raws, "int4pair": Int4PairLinear.from_raws,
             "int8pack": Int8PackLinear.from_raws,
             "dequant": DequantLinear.from_raws, "dequant-compiled": _dequant_compiled}


def packed_nbytes(qtype: GGMLQuantizationType | int, shape: tuple[int, int],
                  kind: str = "auto") -> int | None:
    """RAM the layout of kind_for(qtype, kind) takes for a (rows, cols) matrix (what `nbytes`
    of the built linear reports), without building it; None where no layout reads qtype. For
    memory planners (a resident CPU layer's bytes)."""
    k = kind_for(qtype, kind)
    if k is None:
        return None
    rows, cols = (int(s) for s in shape)
    if k == "q4vnni":  # float16 scales and zeros hold Q4_0's and Q4_1's exactly, not Q4_K's
        return q4vnni_parts_nbytes((qtype,), rows, cols)
    if k == "q4vnni-f16":
        return q4vnni_nbytes(rows, cols, scale_f32=False)
    if k == "q8vnni":
        return q8vnni_nbytes(rows, cols)
    if k in ("int4pack", "int4pair"):
        width = cols if k == "int4pack" else 2 * cols  # int4pair: two nibble planes
        padded = -(-rows // 16) * 16
        return padded * width // 2 + width // INT4_GROUP * padded * 2 * 2
    if k == "int8pack":
        return rows * cols + rows * 2
    q = Q(int(qtype))
    group = 16 if q == Q.Q6_K else 32
    planes = 2 if q in (Q.Q4_1, Q.Q4_K) else 1  # scale, and offset where the format has one
    return rows * cols + rows * (cols // group) * 4 * planes


def _concat_bias(biases: Sequence[torch.Tensor | None], shapes) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b.float() if b is not None else torch.zeros(s[0])
                      for b, s in zip(biases, shapes)])


def pack_linear(raw: torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, int],
                bias: torch.Tensor | None = None, kind: str = "auto") -> Linear | None:
    """One GGUF matrix (uint8, rows x row_bytes, on the CPU) as a packed CPU linear, or None
    where no layout reads its format (see kind_for). The bytes are only read (a view of the
    file's memory map, or of a staging buffer about to be reused, will do)."""
    fused, _ = pack_group([raw], [qtype], [shape], [bias], kind)
    return fused


def pack_group(raws: Sequence[torch.Tensor], qtypes: Sequence[GGMLQuantizationType | int],
               shapes: Sequence[tuple[int, int]], biases: Sequence[torch.Tensor | None],
               kind: str = "auto") -> tuple[Linear | None, list[Linear | None]]:
    """The parts of one LinearGroup (q/k/v, gate/up: same input width) as packed CPU linears.

    Where every part gets the same layout (e.g. Q4_K and Q4_0 both go to int4pack), their rows
    are concatenated into one linear, returned as (fused, []). Otherwise (None, parts), with a
    None part where its format has no layout. A single part comes back as (it, [])."""
    kinds = [kind_for(t, kind) for t in qtypes]
    groups = {16 if Q(int(t)) == Q.Q6_K else 32 for t in qtypes}
    if kinds[0] is not None and len(set(kinds)) == 1 and (
            not kinds[0].startswith("dequant") or len(groups) == 1):
        return _BUILDERS[kinds[0]](raws, qtypes, shapes, _concat_bias(biases, shapes)), []
    parts = [_BUILDERS[k]([r], [t], [s], b) if k is not None else None
             for r, t, s, k, b in zip(raws, qtypes, shapes, kinds, biases)]
    return None, parts


# --- decode through a packed layout, batches through the dense weight ---------------------------

class PackedDecodeLinear(Linear):
    """A CPU linear held twice: packed (above) for calls of up to `max_rows` tokens (decode),
    where a matvec is bound by the bytes it reads (int4 reads a quarter of float16's), and
    dense for larger ones (prefill), where torch's packed CPU kernels are FLOP-bound and slower
    than a float32 GEMM.

    The packed copy is made at the first call that needs it, from GGUF bytes the caller copied
    at load (so the model file is not read again): packing costs about as much as the rest of
    the load, which the first token (a prefill) then does not wait for. Where `pack` returns
    None (no layout reads the format), decode stays dense. RAM: the packed copy on top of the
    dense weight, and the GGUF bytes until it is made.

    Decode on CPU is bound by per-op overhead as much as by the kernels (a 135M model's token
    is ~120 kernel calls and ~25 small ops a layer), so the block's fused forms go straight to
    the bfloat16 kernel: `norm_matmul` normalizes into bfloat16 in one op (`rms_norm_bf16`)
    and returns the kernel's bfloat16 output (the RoPE, the cache write and `glu_matmul` that
    consume it widen it exactly), and `glu_matmul` takes that bfloat16 [gate | up] as it is.
    Every op works row by row, so a row's bits never depend on the others in its call."""

    def __init__(self, dense: Linear, pack: Callable[[], Linear | None], max_rows: int):
        self.dense = dense
        self._pack: Callable[[], Linear | None] | None = pack
        self._packed: Linear | None = None
        self.max_rows = max_rows
        # the packed copy's bare bfloat16 product (Int4PackLinear.kernel...) and its bias,
        # looked up once: each attribute lookup is a measurable share of a decode step
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._bias: torch.Tensor | None = None
        self._row: torch.Tensor | None = None  # norm_matmul's one-row bfloat16 input

    @classmethod
    def decode_only(cls, packed: Linear, max_rows: int) -> "PackedDecodeLinear":
        """A packed copy alone, with no dense weight behind it: a streamed layer's decode
        linear (weights.cpu_image), which serves calls of up to `max_rows` tokens exactly as
        a resident layer's PackedDecodeLinear does; a larger call is an error (the store
        builds prefill layers dense)."""
        lin = cls(_NoDense(packed.out_features, max_rows), lambda: packed, max_rows)
        lin.packed  # noqa: B018 (the kernel and bias looked up now, not at the first call)
        return lin

    @property
    def out_features(self) -> int:
        return self.dense.out_features

    @property
    def packed(self) -> Linear:
        """The decode copy (made now if not yet; the dense weight where none can be)."""
        if self._pack is not None:
            self._packed, self._pack = self._pack(), None  # the GGUF bytes go with the thunk
            self._kernel = getattr(self._packed, "kernel", None)
            self._bias = getattr(self._packed, "bias", None)
        return self._packed if self._packed is not None else self.dense

    def _decode_kernel(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The bfloat16 product for a call of `rows` rows, or None (a prefill, or a packed
        copy without one: no layout, or DequantLinear)."""
        if rows > self.max_rows:
            return None
        if self._pack is not None:
            self.packed  # noqa: B018 (made at the first call that needs it)
        return self._kernel

    def one_row_kernel(self) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                      torch.Tensor | None] | None:
        """The bare bfloat16 product of a one-row call and the bias to add to it (float32, or
        None), for callers that fuse what surrounds it (model.cpu_native); None where decode
        has no packed kernel."""
        kernel = self._decode_kernel(1)
        return None if kernel is None else (kernel, self._bias)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self._decode_kernel(x.shape[0])
        if kernel is None:
            return self.packed(x, residual) if x.shape[0] <= self.max_rows else \
                self.dense(x, residual)
        return _finish(kernel(x.to(torch.bfloat16)), x.dtype, self._bias, residual)

    def norm_matmul(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)); bfloat16 (plus a bias, float32) on the packed
        path."""
        kernel = self._decode_kernel(x.shape[0])
        if kernel is None:
            return super().norm_matmul(x, norm_weight, eps)
        if x.shape[0] == 1:  # decode: the normed row goes in a buffer kept for it
            if self._row is None:
                with torch.inference_mode(False):  # writable in and outside inference mode
                    self._row = torch.empty(x.shape, dtype=torch.bfloat16)
            y = kernel(rms_norm_bf16(x, norm_weight, eps, self._row))
        else:
            y = kernel(rms_norm_bf16(x, norm_weight, eps))
        return y if self._bias is None else torch.add(self._bias, y)

    def glu_matmul(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """self(silu(gate) * up) (+ residual); on the packed path the product is formed in
        gate_up's dtype (bfloat16 from `norm_matmul`), which the kernel reads anyway."""
        kernel = self._decode_kernel(gate_up.shape[0])
        if kernel is None:
            return super().glu_matmul(gate_up, residual)
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.mul(F.silu(gate), up)
        if h.dtype != torch.bfloat16:
            h = h.to(torch.bfloat16)
        return _finish(kernel(h), gate_up.dtype if residual is None else residual.dtype,
                       self._bias, residual)


class _NoDense(Linear):
    """The dense side of a decode-only PackedDecodeLinear: there is none."""

    def __init__(self, out_features: int, max_rows: int):
        self.out_features = out_features
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError(f"a decode-only layer (packed weights alone) was called with "
                           f"{x.shape[0]} rows; it serves up to {self.max_rows}: passes of "
                           f"more tokens need the layer built with its dense weights")


_ZERO = torch.zeros(())


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16(x * rsqrt(mean(x^2) + eps) * weight) for float32 x (m, n), into `out` if
    given: the norm's scale is taken to the host (one small reduction) and the rest is one
    addcmul writing bfloat16, instead of F.rms_norm's chain of ops and a cast. Row by row
    (the one-row case is the same elementwise op), so each row's bits are those of a call of
    its own."""
    n = x.shape[-1]
    norms = torch.linalg.vector_norm(x, dim=-1)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16)
    if x.shape[0] == 1:  # float() of the one norm: a third of tolist()'s cost
        norm = float(norms)
        return torch.addcmul(_ZERO, x, weight, value=1.0 / math.sqrt(norm * norm / n + eps),
                             out=out)
    scales = [1.0 / math.sqrt(norm * norm / n + eps) for norm in norms.tolist()]
    for i, r in enumerate(scales):
        torch.addcmul(_ZERO, x[i], weight, value=r, out=out[i])
    return out
