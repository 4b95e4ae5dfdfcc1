"""GGUF blocks as codes and per-group scales (`group_affine`), the roundings to bfloat16 the
torch layouts need, and what every CPU layout's load-time packing shares: slices of rows small
enough for L2, and the epilogue of a packed product (bias, residual, dtype).

Each GGUF format this reads (Q4_0, Q4_1, Q4_K, Q8_0, Q6_K) is, per group of 16 or 32 weights
of one row, w = codes * scale (+ offset), exactly; `GroupAffine.dequantize` forms it in the
dequantizer's own float32 order, so it is bit-identical to slipstream.quant.dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from gguf import GGMLQuantizationType

from ...quant import get_format
from ...quant.base import bits, crumbs, f16_field, nibbles
from ...quant.legacy import five_bit

Q = GGMLQuantizationType
INT4_GROUP = 32  # torch's int4 CPU kernel takes groups of 32, 64, 128 or 256; GGUF's are 32
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significant bits: |round(v) - v| <= 2^-8 |v|
INT4_FORMATS = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
INT8_FORMATS = frozenset({Q.Q8_0, Q.Q5_0, Q.Q6_K})  # int8pack's formats (any format can go)
UNPACKED_FORMATS = INT4_FORMATS | INT8_FORMATS  # the formats `group_affine` reads
# signed codes of at most 8 bits in groups of 32 with one float16 scale each: Q8_0's, and
# Q5_0's (q - 16 in [-16, 15]: Q4_K_M files hold it where a matrix's rows are not whole
# 256-blocks, Gemma 3 270M's 640-wide q/k and FFN gate/up), kept exactly at 8.5 bits a
# weight where a dense float16 copy took 16
PAIR_FORMATS = frozenset({Q.Q8_0, Q.Q5_0})
# unsigned five-bit codes with a scale and a min for each group of 32: Q5_1's (d, m) and Q5_K's
# (d sc, dmin m, as Q4_K's), which q8vnni keeps exactly at 10 bits a weight (8-bit codes, a
# float32 scale and zero per group), where a dense float16 copy took 16
OFFSET8_FORMATS = frozenset({Q.Q5_1, Q.Q5_K})
# Load-time work goes a slice of rows at a time, ~256K weights (1 MiB of float32 transients),
# so each unpacking step reads and writes L2 rather than RAM.
_CHUNK_WEIGHTS = 1 << 18
# q4vnni's layout (native/q4_matvec.c): rows in blocks of 16, each block's 32-column groups as
# records of 256 bytes of codes and 16 scales and 16 zeros (float16, or float32 where float16
# cannot hold them exactly); q8vnni's records: 512 bytes of codes and 16 float16 scales
Q4V_ROWS = 16
Q4V_CODE_BYTES = Q4V_ROWS * INT4_GROUP // 2


def q4vnni_flags(x_f32: bool, y_f32: bool, threads: int, generic: bool = False,
                 gelu: bool = False) -> int:
    """ss_q4_matvec's flags argument (see q4_matvec.c): the input's and output's types, the
    plain-C loop (tests), the threads sharing the rows, and (ss_q4_ffn) GeGLU for SwiGLU."""
    return (int(x_f32) | int(y_f32) << 1 | int(generic) << 2 | int(gelu) << 3
            | int(threads) << 8)


class RowBlocks:
    """What the native layouts of output rows in blocks of ROWS share (q4vnni, q8vnni,
    q6vnni: `packed` (blocks, ...) bytes, `_out` rows, an optional bias): the output width,
    the bytes held, row slices that share the packed bytes, and the call around the layout's
    native `matvec`."""

    ROWS = Q4V_ROWS
    kind: str  # the layout's name
    packed: torch.Tensor
    bias: torch.Tensor | None
    _out: int
    in_features: int
    # the matvec flag that forces the AVX2 loop where the VNNI one is built (0: no such flag)
    AVX2_FLAG = 0

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        y = torch.empty(x.shape[0], self._out)  # float32: one rounding fewer than the kernel
        self.matvec(x, y)
        return finish(y, x.dtype, self.bias, residual)

    def check_call(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """What the native matvec takes: contiguous x (m, in) and out (m, out), each float32
        or bfloat16 (the kernels read any other 16-bit type as bfloat16)."""
        m = x.shape[0]
        if x.dim() != 2 or x.shape[-1] != self.in_features or \
                tuple(out.shape) != (m, self._out) or \
                not (x.is_contiguous() and out.is_contiguous()):
            raise ValueError(f"{self.kind} matvec of {tuple(x.shape)} into {tuple(out.shape)}: "
                             f"needs contiguous (m, {self.in_features}) and (m, {self._out})")
        for t in (x, out):
            if t.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{self.kind} matvec takes float32 or bfloat16, not {t.dtype}")

    def matvec(self, x: torch.Tensor, out: torch.Tensor, threads: int | None = None,
               generic: bool = False, avx2: bool = False) -> torch.Tensor:
        """out (m, out) = x (m, in) @ W^T: x and out contiguous, float32 or bfloat16 each.
        threads: torch's intra-op count unless given; generic: the plain-C loop even where a
        vector loop is compiled in; avx2: the AVX2 loop where the VNNI one is built, for a
        layout with an AVX2_FLAG (tests compare the loops)."""
        self.check_call(x, out)
        if avx2 and not self.AVX2_FLAG:
            raise ValueError(f"{self.kind} has no AVX2 loop to force beside its VNNI one")
        flags = q4vnni_flags(x.dtype == torch.float32, out.dtype == torch.float32,
                             torch.get_num_threads() if threads is None else threads, generic)
        self._matvec(self.desc, x.data_ptr(), out.data_ptr(), x.shape[0],
                     flags | (self.AVX2_FLAG if avx2 else 0))
        return out

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 (or float32) x (m, in): bfloat16 (m, out), no bias."""
        if not xb.is_contiguous():
            xb = xb.contiguous()
        y = torch.empty(xb.shape[0], self._out, dtype=torch.bfloat16)
        self._matvec(self.desc, xb.data_ptr(), y.data_ptr(), xb.shape[0],
                     int(xb.dtype == torch.float32) | torch.get_num_threads() << 8)
        return y

    def row_slice(self, r0: int, r1: int):
        """Output rows [r0, r1) as their own linear, sharing the packed bytes; r0 a multiple of
        ROWS, and r1 too unless it is out_features."""
        rows = self.ROWS
        if r0 % rows or not (r1 % rows == 0 or r1 == self._out) or not 0 <= r0 < r1 <= self._out:
            raise ValueError(f"{self.kind} rows [{r0}, {r1}) do not start and end on "
                             f"{rows}-row blocks of {self._out}")
        bias = None if self.bias is None else self.bias[r0:r1]
        return type(self)(self.packed[r0 // rows:-(-r1 // rows)], r1 - r0, bias)


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


def gguf_blocks(raw: torch.Tensor, qtype: Q, rows: int, cols: int) -> torch.Tensor:
    fmt = get_format(qtype)
    if raw.dtype != torch.uint8 or raw.numel() != rows * fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name} tensor of shape {(rows, cols)} needs "
                         f"{rows * fmt.row_bytes(cols)} uint8 bytes, got {raw.numel()} "
                         f"{raw.dtype}")
    return raw.reshape(-1, fmt.type_size)


def k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    b = gguf_blocks(raw, qtype, rows, cols)
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
    elif qtype == Q.Q5_0:  # d | qh[4] | qs[16]: five-bit codes, w = d (q - 16)
        codes = five_bit(b[:, 2:6], b[:, 6:22]).to(torch.int8) - 16
        scale, offset, group, lo = f16_field(b, 0), None, 32, -16
    elif qtype == Q.Q5_1:  # d | m | qh[4] | qs[16]: five-bit codes, w = d q + m
        codes = five_bit(b[:, 4:8], b[:, 8:24]).to(torch.int8)
        scale, offset, group, lo = f16_field(b, 0), f16_field(b, 2), 32, 0
    elif qtype == Q.Q5_K:  # d | dmin | scales[12] | qh[32] | qs[128]: 8 sub-blocks of 32
        d, dmin = f16_field(b, 0), f16_field(b, 2)
        sc, m = k_scale_min(b[:, 4:16])
        low = nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)  # as Q4_K's
        high = bits(b[:, 16:48])  # bit j of byte l: the fifth bit of sub-block j's element l
        codes = (low | (high << 4)).reshape(n, 256).to(torch.int8)
        scale = d * sc.float()  # exact: an f16 times a 6-bit integer
        offset = -(dmin * m.float())
        group, lo = 32, 0
    elif qtype == Q.Q4_K:  # d | dmin | scales[12] | qs[128]: 8 sub-blocks of 32
        d, dmin = f16_field(b, 0), f16_field(b, 2)
        sc, m = k_scale_min(b[:, 4:16])
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
        raise ValueError(f"no packed CPU layout reads {qtype.name}; these do: "
                         f"{', '.join(t.name for t in sorted(UNPACKED_FORMATS | OFFSET8_FORMATS))}")
    per_row = cols // group
    scale = scale.reshape(rows, per_row)
    if offset is not None:
        offset = offset.reshape(rows, per_row)
    return GroupAffine(codes.reshape(rows, cols).contiguous(), scale.contiguous(),
                       None if offset is None else offset.contiguous(), group, lo)


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


def rows_per_chunk(cols: int, multiple: int = 64) -> int:
    return max(multiple, _CHUNK_WEIGHTS // cols // multiple * multiple)


def row_chunks(raws: Sequence[torch.Tensor], qtypes: Sequence[GGMLQuantizationType | int],
            shapes: Sequence[tuple[int, int]]):
    """(first row in the stacked matrix, GroupAffine of a slice of rows) over every part."""
    base = 0
    for raw, qtype, (rows, cols) in zip(raws, qtypes, shapes):
        raw = raw.reshape(rows, -1)
        step = rows_per_chunk(cols, 1)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            yield base + r0, group_affine(raw[r0:r1], qtype, (r1 - r0, cols))
        base += rows


def finish(y: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """A kernel's output (bfloat16, or float32 from q4vnni) in the activation dtype, plus bias
    and residual: a mixed add promotes to float32, so the cast costs no op where an add
    follows."""
    if bias is not None:
        y = torch.add(bias, y)  # bias is float32: promotes
    if residual is not None:
        return torch.add(residual, y)
    return y.to(dtype)


def check_pair_formats(kind: str, qtypes) -> None:
    """The 8-bit layouts read PAIR_FORMATS, and q8vnni OFFSET8_FORMATS too."""
    known = PAIR_FORMATS | (OFFSET8_FORMATS if kind == "q8vnni" else frozenset())
    if any(Q(int(t)) not in known for t in qtypes):
        raise ValueError(f"{kind} reads {', '.join(sorted(t.name for t in known))} "
                         f"only, not {', '.join(Q(int(t)).name for t in qtypes)}")


def concat_bias(biases: Sequence[torch.Tensor | None], shapes) -> torch.Tensor | None:
    """The parts' biases as one float32 bias (zeros for a part without one), or None."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b.float() if b is not None else torch.zeros(s[0])
                      for b, s in zip(biases, shapes)])
