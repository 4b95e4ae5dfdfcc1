"""q4vnni and q8vnni: CPU linears on slipstream's own kernel (native/q4_matvec.c), the 4-bit
formats' and Q8_0's layouts wherever the native library builds.

Each activation row is quantized per block of 32 to 16 bits (two int8 digits, one float scale)
and multiplied by the weights' codes as integers (AVX-512 VNNI where the CPU has it, else AVX2,
else plain C: the same bits from all three), each group's scale and zero applied once, as
llama.cpp does with int8. The weights are exact: w = s u + z with s, z float16 for Q4_0 and Q4_1,
Q4_K's own 6-bit scales and mins under its float16 d and dmin (4.625 bits a weight), or float32
records where Q4_K is stacked with another format; Q8_0 keeps its codes and float16 scales
(8.5 bits a weight). The activations' rounding, less than bfloat16's, is the only error besides
float32 sums.

Layout: rows in blocks of 16, each block's 32-column groups as records of codes and the 16
rows' scales and zeros (see q4_matvec.c for the byte order).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch
from gguf import GGMLQuantizationType

from ... import native
from ..linear import Linear
from .groups import (INT4_GROUP, OFFSET8_FORMATS, Q4V_CODE_BYTES, Q4V_ROWS, GroupAffine, Q,
                     RowBlocks, check_pair_formats, gguf_blocks, k_scale_min, q4vnni_flags, row_chunks)
from .native_pack import Q8V_RECORD_BYTES, q4vnni_native, q8vnni_native


def q4vnni_record_bytes(scale_f32: bool) -> int:
    return Q4V_CODE_BYTES + 2 * Q4V_ROWS * (4 if scale_f32 else 2)


# Q4_K's own scales (q4_matvec.c's Q4_KS): groups in runs of 8 (a Q4_K super-block), each run a
# header of the 16 rows' d and dmin (float16) and each group's 6-bit scales and mins as bytes
# (320 bytes), then the 8 groups' 256 bytes of codes: 296 bytes a group, 4.625 bits a weight
# against the float32 records' 6, with the same bits (d sc and -dmin mn are exact in float32).
# On a 16-core H100 host the 70B at 24 GiB decoded 5.865 tok/s with them against 4.699 with the
# float32 records, its CPU share computing 154 Gweights/s (89.3 GB/s of its bytes) against 99
# (74.2 GB/s) with 12.55 cores busy in both.
Q4V_KS_RUN = 8
Q4V_KS_HEADER_BYTES = 2 * Q4V_ROWS * 2 + 2 * Q4V_KS_RUN * Q4V_ROWS
Q4V_KS_RECORD_BYTES = Q4V_CODE_BYTES + Q4V_KS_HEADER_BYTES // Q4V_KS_RUN
# q8vnni's records with a float32 scale and zero per row and group (Q5_1, Q5_K: q4_matvec.c's
# Q8_F32): 8-bit codes, 10 bits a weight
Q8V_F32_RECORD_BYTES = 2 * Q4V_CODE_BYTES + 2 * Q4V_ROWS * 4
# record bytes -> q4_matvec.c's Q4_F16, Q4_F32, Q8_F16, Q4_KS, Q8_F32
Q4V_FORMATS = {q4vnni_record_bytes(False): 0, q4vnni_record_bytes(True): 1, Q8V_RECORD_BYTES: 2,
               Q4V_KS_RECORD_BYTES: 3, Q8V_F32_RECORD_BYTES: 4}


def q4vnni_k_scales(qtypes: Sequence[GGMLQuantizationType | int], cols: int) -> bool:
    """Whether q4vnni packs these parts with Q4_K's own scales (Q4_KS): every part Q4_K."""
    return cols % (Q4V_KS_RUN * INT4_GROUP) == 0 and all(
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


def q8vnni_nbytes(rows: int, cols: int, zeros: bool = False) -> int:
    """Bytes of a (rows, cols) q8vnni weight: 8 + 0.5 bits a weight, Q8_0's own size; with
    `zeros` (Q5_1's or Q5_K's mins: float32 scales and zeros), 8 + 2."""
    record = Q8V_F32_RECORD_BYTES if zeros else Q8V_RECORD_BYTES
    return -(-rows // Q4V_ROWS) * (cols // INT4_GROUP) * record


def q8vnni_zeros(qtypes: Sequence[GGMLQuantizationType | int]) -> bool:
    """Whether q8vnni packs these parts with float32 scales and zeros: any has mins."""
    return any(Q(int(t)) in OFFSET8_FORMATS for t in qtypes)


def q4vnni_params(ga: GroupAffine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def q4vnni_codes(u: torch.Tensor) -> torch.Tensor:
    """(rows, cols) codes in [0, 15], rows a multiple of 16 -> (blocks, groups, 256) bytes:
    row r's columns 4j..4j+3 of a group at bytes 4r..4r+3 of 64-byte chunk j % 4, in the low
    nibble for j < 4 and the high one for j >= 4 (see q4_matvec.c)."""
    rows, cols = u.shape
    q = u.view(rows // Q4V_ROWS, Q4V_ROWS, cols // INT4_GROUP, 2, 4, 4)  # b, r, g, half, j%4, t
    q = q.permute(0, 2, 3, 4, 1, 5)  # b, g, half, j % 4, r, t
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows // Q4V_ROWS, cols // INT4_GROUP,
                                                    Q4V_CODE_BYTES)


def q8vnni_codes(u: torch.Tensor) -> torch.Tensor:
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
        b = gguf_blocks(raw, Q(int(qtype)), r, c)  # (r * runs, 144)
        halves[r0:r0 + r] = b[:, 0:4].contiguous().view(torch.int16).view(r, runs, 2)
        sc, mn = k_scale_min(b[:, 4:16])
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


class Q4VnniLinear(RowBlocks, Linear):
    """y = x @ W^T (+ b) (+ residual) for Q4_0, Q4_1 and Q4_K through native/q4_matvec.c: each
    activation row quantized to 16 bits per block of 32 (a float scale each) and the
    integers multiplied by the 4-bit codes (AVX-512 VNNI where the CPU has it, else AVX2, else
    plain C), each group's scale and zero applied once. The weights are the GGUF ones
    exactly (scales and zeros float16 where that holds them, float32 otherwise); the
    activations' rounding (to 16 bits, two int8 digits) is the kernel's only error besides
    float32 sums. Needs the native library: kind_for picks q4vnni only where q4vnni_available().

    `packed` is (ceil(rows / 16), in / 32, record) uint8, record = 320 bytes (float16 scales),
    384 (float32) or 296 (Q4_K's own scales, in runs of 8 groups)."""

    kind = "q4vnni"

    def __init__(self, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None):
        self.packed = packed
        self._out = out_features
        self.bias = bias
        self.in_features = packed.shape[1] * INT4_GROUP
        fmt = Q4V_FORMATS.get(packed.shape[2])
        if fmt is None or (fmt in (2, 4)) != (self.kind == "q8vnni"):
            raise ValueError(f"{self.kind} records are not {packed.shape[2]} bytes")
        self.scale_f32 = fmt == 1
        self.k_scales = fmt == 3  # Q4_K's own scales (Q4_KS)
        lib = native.required("q4vnni")
        self._matvec = lib.ss_q4_matvec
        # q4_matvec.c's q4_weight, made once: the call then passes one pointer for it
        self._desc = _Q4Weight(packed.data_ptr(), out_features, self.in_features, fmt)
        self.desc = ctypes.addressof(self._desc)
        self.flags = q4vnni_flags(False, False, 0)  # bfloat16 in and out, threads added per call

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Q4VnniLinear":
        """Stack the parts' rows (GGUF bytes, all of 4-bit formats) into one packed weight."""
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // Q4V_ROWS) * Q4V_ROWS
        groups = cols // INT4_GROUP
        # in one native pass where the library is there (the same bits; in torch ops a 70B's
        # hybrid load took 70-85 s against int4pack's 25-34 s, which packs natively)
        by_native = q4vnni_native(raws, qtypes, shapes, padded)
        if by_native is not None:
            codes, s, z = by_native
        else:
            u = torch.zeros(padded, cols, dtype=torch.uint8)  # padding rows: codes, scales 0
            s = torch.zeros(padded, groups)
            z = torch.zeros(padded, groups)
            for r0, ga in row_chunks(raws, qtypes, shapes):
                r1 = r0 + ga.shape[0]
                u[r0:r1], s[r0:r1], z[r0:r1] = q4vnni_params(ga)
            codes = q4vnni_codes(u)
        if q4vnni_k_scales(qtypes, cols):  # the scales and mins from the file's fields
            return cls(_q4vnni_ks(raws, qtypes, shapes, codes), rows, bias)
        # float16 where it holds every scale and zero exactly: Q4_0's and Q4_1's (f16 fields;
        # -8 d too, short of overflow), never in general Q4_K's (an f16 times a 6-bit integer),
        # which keep float32 (where Q4_K is stacked with another format: all-Q4_K parts keep the
        # file's own scales above) so that packed_nbytes can tell the size from the format
        halves = not any(Q(int(t)) == Q.Q4_K for t in qtypes) and all(
            torch.equal(v.half().float(), v) for v in (s, z))
        dtype = torch.float16 if halves else torch.float32
        packed = torch.cat([codes, _q4vnni_plane(s, dtype), _q4vnni_plane(z, dtype)], dim=2)
        return cls(packed, rows, bias)

    def kernel(self, xb: torch.Tensor) -> torch.Tensor:
        """The bare product of bfloat16 x (m, in): bfloat16 (m, out), no bias (what
        Int4PackLinear.kernel returns)."""
        if not xb.is_contiguous():
            xb = xb.contiguous()
        y = torch.empty(xb.shape[0], self._out, dtype=torch.bfloat16)
        self._matvec(self.desc, xb.data_ptr(), y.data_ptr(), xb.shape[0],
                     self.flags | (xb.dtype == torch.float32) | torch.get_num_threads() << 8)
        return y


class Q8VnniLinear(Q4VnniLinear):
    """Q8_0 through the same kernel (native/q4_matvec.c's Q8_F16 records): each code stored as
    u = q + 128 (unsigned, for vpdpbusd), with w = d u - 128 d, so the weights are Q8_0's exactly
    (d float16, as in the file) at Q8_0's own 8.5 bits a weight. Against int4pair (Q8_0 as two
    int4 halves through torch's kernel): 15% fewer bytes, exact scales, int8 activations.
    `packed` is (ceil(rows / 16), in / 32, 544) uint8. Q5_1's and Q5_K's five-bit codes with
    their mins take Q8_F32 records (u = q, float32 s and z: Q5_K's d sc is an f16 times a 6-bit
    integer), 640 bytes: their weights exactly, at 10 bits a weight against 16 as float16."""

    kind = "q8vnni"

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Q8VnniLinear":
        """Stack the parts' rows (GGUF bytes, all Q8_0) into one packed weight."""
        check_pair_formats(cls.kind, qtypes)
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        padded = -(-rows // Q4V_ROWS) * Q4V_ROWS
        # in one native pass where the library is there (the same bytes): in torch ops the
        # default model's tied head (49152 x 576) took 0.24 s, which its first token waited for
        # (int4_pack.c reads Q8_0's blocks; Q5_0's go through torch)
        by_native = (q8vnni_native(raws, shapes, padded)
                     if all(Q(int(t)) == Q.Q8_0 for t in qtypes) else None)
        if by_native is not None:
            return cls(by_native, rows, bias)
        u = torch.zeros(padded, cols, dtype=torch.uint8)  # padding rows: scale 0
        s = torch.zeros(padded, cols // INT4_GROUP)
        zeros = q8vnni_zeros(qtypes)
        z = torch.zeros(padded, cols // INT4_GROUP) if zeros else None
        for r0, ga in row_chunks(raws, qtypes, shapes):
            r1 = r0 + ga.shape[0]
            if zeros:  # w = s u + z: u = q - lo, z = lo s (+ the format's min)
                u[r0:r1] = (ga.codes.to(torch.int16) - ga.lo).to(torch.uint8)
                z[r0:r1] = ga.lo * ga.scale + (ga.offset if ga.offset is not None else 0)
            else:
                u[r0:r1] = (ga.codes.to(torch.int16) + 128).to(torch.uint8)
            s[r0:r1] = ga.scale
        if zeros:
            packed = torch.cat([q8vnni_codes(u), _q4vnni_plane(s, torch.float32),
                                _q4vnni_plane(z, torch.float32)], dim=2)
        else:
            packed = torch.cat([q8vnni_codes(u), _q4vnni_plane(s, torch.float16)], dim=2)
        return cls(packed, rows, bias)
