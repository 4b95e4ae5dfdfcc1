"""CPU linears on torch's packed kernels: Int4PackLinear (Q4_0, Q4_1, Q4_K through
`aten._weight_int4pack_mm_for_cpu`, group 32), Int4PairLinear (Q8_0 as two int4 halves on the same
kernel) and Int8PackLinear (`aten._weight_int8pack_mm`, one scale a row: Q6_K). They serve where
the native library cannot build (q4vnni and q8vnni need it), and Q6_K everywhere.

Every group of 32 weights of one output row is w = (u - 8) * s + z with u in [0, 15] in torch's
int4 convention. The GGUF 4-bit formats are that exactly (see `int4_params`):

    Q4_0  x = d * (q - 8)           ->  u = q, s = d,      z = 0
    Q4_1  x = d * q + m             ->  u = q, s = d,      z = 8 d + m
    Q4_K  x = d*sc_j * q - dmin*m_j ->  u = q, s = d*sc_j, z = 8 d*sc_j - dmin*m_j
                                        (j: the 32-element sub-block; sc_j, m_j 6-bit)

The kernels are fast only in bfloat16 (float32/float16 inputs take a scalar loop ~40x slower),
and then s, z, x and the output are all bfloat16: s and z are rounded to nearest from their exact
values, which is the mapping's only weight error. Int4PairLinear holds each Q8_0 code
q = 16 h + l as a high nibble (scale 16 d, zero 0) and a low one (scale d, zero 8 d), so every
weight is exactly bf16(d) q: on the default model's Q8_0 requantization it costs 16x less KL
divergence than int8pack's per-row requantization (+0.6% perplexity there), for 10 bits a weight
read instead of 8. Int8PackLinear requantizes each row: s_n = the smallest bfloat16 >= max_k
|w_nk| / 127, c = round(w / s_n), which errs by at most s_n / 2 per weight.

torch's int4 layout depends on the CPU's vector width (blocks of 64 rows with AVX-512, 32 with
AVX2), so packed bytes are made on the machine that runs them: by int4_pack.c where it reproduces
torch's packing here (native_block), else by torch's own packer (the same bits).
"""

from __future__ import annotations

import functools

import torch

from ... import native
from ..linear import Linear
from .groups import (INT4_GROUP, GroupAffine, Q, bf16_ceil, bf16_nearest, check_pair_formats,
                     finish, row_chunks, rows_per_chunk)
from .native_pack import BLOCKS, FORMATS, pack_int4_rows, random_matrix

# The packed kernels as torch functions: torch.ops.aten's Python dispatch costs ~1.5 us a call,
# which a decode step pays ~120 times (looked up at the call where torch lacks the function).
_INT4_MM = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or (
    lambda *args: torch.ops.aten._weight_int4pack_mm_for_cpu(*args))
_INT8_MM = getattr(torch, "_weight_int8pack_mm", None) or (
    lambda *args: torch.ops.aten._weight_int8pack_mm(*args))


def int4_params(ga: GroupAffine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """(rows, cols) uint8 codes in [0, 15], rows a multiple of 16 -> torch's packed layout.
    The packer works on blocks of 64 rows (32 on AVX2) stored one after another, so packing
    slices of a multiple of 64 rows gives the same bytes as packing the whole matrix, with an
    int32 transient of one slice."""
    rows, cols = u.shape
    out = torch.empty(rows, cols // 2, dtype=torch.uint8)
    step = rows_per_chunk(cols)
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


def int4pack_torch(raws, qtypes, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' rows (GGUF bytes of 4-bit formats) stacked in torch's int4 layout, by torch
    ops: (packed (rows padded to 16, cols / 2) uint8, scale_zeros (cols / 32, padded, 2)
    bfloat16)."""
    rows = sum(r for r, _ in shapes)
    cols = shapes[0][1]
    padded = -(-rows // 16) * 16  # the packer needs rows in multiples of 16
    u = torch.full((padded, cols), 8, dtype=torch.uint8)
    scale_zeros = torch.zeros(cols // INT4_GROUP, padded, 2, dtype=torch.bfloat16)
    for r0, ga in row_chunks(raws, qtypes, shapes):
        r1 = r0 + ga.shape[0]
        uc, s, z = int4_params(ga)
        u[r0:r1] = uc
        scale_zeros[:, r0:r1, 0] = bf16_nearest(s).t()
        scale_zeros[:, r0:r1, 1] = bf16_nearest(z).t()
    return pack_int4(u), scale_zeros


def pack_native(raws, qtypes, shapes, threads: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What int4pack_torch returns, made by int4_pack.c; None where it cannot be: no library, a
    format it does not read, rows not in whole blocks, or a packing unlike torch's here.
    threads: OpenMP threads of the call (default torch's count for this thread: 1 inside a
    pool that set it so)."""
    if any(Q(int(t)) not in FORMATS for t in qtypes):
        return None
    block = native_block()
    if block is None or any(r % block for r, _ in shapes):
        return None
    return pack_int4_rows(raws, qtypes, shapes, block, threads or torch.get_num_threads())


def native_block() -> int | None:
    """The row block with which int4_pack.c reproduces torch's packing here, or None. Checked
    once per library: while SLIPSTREAM_NATIVE=0 turns the library off, nothing is cached, so
    the check runs when it comes back."""
    lib = native.library()
    return None if lib is None else _checked_block(lib._handle)


@functools.lru_cache(maxsize=None)
def _checked_block(handle: int) -> int | None:
    gen = torch.Generator().manual_seed(0)
    cases = [random_matrix(q, 128, 512, gen) for q in FORMATS]
    refs = [int4pack_torch([raw], [q], [(128, 512)]) for q, raw in zip(FORMATS, cases)]
    for block in BLOCKS:
        if all(_same(pack_int4_rows([raw], [q], [(128, 512)], block, 1), ref)
               for q, raw, ref in zip(FORMATS, cases, refs)):
            return block
    return None


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b))


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
        in one native pass where int4_pack.c can (native_pack), else in torch ops
        (the same bits)."""
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
        return finish(self.kernel(x.to(torch.bfloat16)), x.dtype, self.bias, residual)


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
        check_pair_formats(cls.kind, qtypes)
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // 16) * 16
        groups = cols // INT4_GROUP
        u = torch.full((padded, 2 * cols), 8, dtype=torch.uint8)
        scale_zeros = torch.zeros(2 * groups, padded, 2, dtype=torch.bfloat16)
        for r0, ga in row_chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            q = ga.codes.to(torch.int16)  # [-128, 127]
            high = torch.div(q, 16, rounding_mode="floor")  # [-8, 7]: floor keeps l >= 0
            u[r0:r1, :cols] = (high + 8).to(torch.uint8)
            u[r0:r1, cols:] = (q - 16 * high).to(torch.uint8)  # l in [0, 15]
            d = bf16_nearest(ga.scale.double()).t()  # (groups, r1 - r0)
            scale_zeros[:groups, r0:r1, 0] = d * 16  # exact: powers of two
            scale_zeros[groups:, r0:r1, 0] = d
            scale_zeros[groups:, r0:r1, 1] = d * 8
        return cls(pack_int4(u), scale_zeros, rows, bias)

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        return super().kernel(torch.cat([xb, xb], dim=-1))


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
        for r0, ga in row_chunks(raws, qtypes, shapes):
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
        return finish(self.kernel(x.to(torch.bfloat16)), x.dtype, self.bias, residual)
