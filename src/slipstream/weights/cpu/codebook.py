"""cb4: the 4-bit codebook formats' CPU linear (MXFP4, IQ4_NL, IQ4_XS) on slipstream's own
kernel (native/cb4_matvec.c), wherever the native library builds.

The weights are the file's exactly: each 4-bit code kept as 4 bits and looked up in its
format's 16-value int8 grid in registers (IQ4_NL's kvalues for IQ4_NL and IQ4_XS, e2m1 doubled
for MXFP4), one float32 scale per 32 columns (IQ4_NL's d; IQ4_XS's d (sc - 32); MXFP4's e8m0
scale halved), 5 bits a weight read. The activations are quantized as q4vnni's (16 bits per
block of 32, two int8 digits), each group's integer sum exact, then scaled once: the other
native kernels' quantization, so a model's bits err as theirs do, and decode is bound by the
bytes read rather than by the second digit's products. From cache, on one core of the 2-core
AVX-512 EPYC (1024 x 2048, one process, back to back): 53 Gweights/s for MXFP4 and IQ4_XS
against q4vnni's 54 (Q4_K) and 58 (Q4_0); the AVX2 loop 23. Without it these formats decode
through dense float weights (an expert's made at every call): a gpt-oss-20b-shaped file cut
to 4 layers decoded at 0.3 tok/s before, 8.3 with it (llama.cpp 12.0, its 201088 x 2880 Q8_0
head most of each token's bytes).

Layout: rows in blocks of 16, each block's 32-column groups as 320-byte records of 256 bytes
of codes (q4vnni's order) and the 16 rows' float32 scales (see cb4_matvec.c).
"""

from __future__ import annotations

import ctypes

import torch

from ... import native
from ...quant import get_format
from ..linear import Linear
from .groups import Q, RowBlocks

CB4_ROWS = 16
CB4_GROUP = 32
CB4_RECORD_BYTES = 256 + 4 * CB4_ROWS  # codes, then 16 float32 scales
# the formats cb4 reads -> (cb4_matvec.c's file format, its grid: 0 kvalues_iq4nl, 1 mxfp4)
CB4_FORMATS = {Q.MXFP4: (0, 1), Q.IQ4_NL: (1, 0), Q.IQ4_XS: (2, 0)}
CB4_USE_AVX2 = 16  # ss_cb4_matvec's flag: the AVX2 loop where the VNNI one is built (tests)


def cb4_available() -> bool:
    """Whether cb4 runs here: the native library builds (any CPU: a VNNI, an AVX2 and a plain-C
    loop, all with the same bits)."""
    return native.library() is not None


def cb4_grid(qtype) -> int | None:
    """The grid a format's codes index (0: IQ4_NL's, 1: MXFP4's), None where cb4 reads none."""
    entry = CB4_FORMATS.get(Q(int(qtype)))
    return None if entry is None else entry[1]


def cb4_nbytes(rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) cb4 weight: rows padded to 16, 5 bits a weight."""
    return -(-rows // CB4_ROWS) * (cols // CB4_GROUP) * CB4_RECORD_BYTES


class _Cb4Weight(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("grid", ctypes.c_int64)]


class Cb4Linear(RowBlocks, Linear):
    """y = x @ W^T (+ b) (+ residual) for MXFP4, IQ4_NL and IQ4_XS through native/cb4_matvec.c
    (see the module doc). `packed` is (ceil(rows / 16), in / 32, 320) uint8; `grid` 0 for the
    IQ4 formats' values, 1 for MXFP4's."""

    kind = "cb4"
    AVX2_FLAG = CB4_USE_AVX2
    ROWS = CB4_ROWS

    def __init__(self, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None, grid: int = 0):
        if packed.dim() != 3 or packed.shape[2] != CB4_RECORD_BYTES or \
                packed.shape[0] != -(-out_features // CB4_ROWS):
            raise ValueError(f"cb4 weight of {out_features} rows needs "
                             f"({-(-out_features // CB4_ROWS)}, groups, {CB4_RECORD_BYTES}) "
                             f"bytes, not {tuple(packed.shape)}")
        if grid not in (0, 1):
            raise ValueError(f"cb4 grid must be 0 (IQ4_NL's) or 1 (MXFP4's), not {grid!r}")
        lib = native.required("cb4")
        self.packed = packed
        self._out = out_features
        self.bias = bias
        self.grid = grid
        self.in_features = packed.shape[1] * CB4_GROUP
        self._matvec = lib.ss_cb4_matvec
        self._desc = _Cb4Weight(packed.data_ptr(), out_features, self.in_features, grid)
        self.desc = ctypes.addressof(self._desc)

    def row_slice(self, r0: int, r1: int) -> "Cb4Linear":
        sliced = super().row_slice(r0, r1)  # built with grid 0: rebuilt with this one's
        return Cb4Linear(sliced.packed, sliced.out_features, sliced.bias, self.grid)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None) -> "Cb4Linear":
        """Stack the parts' rows (GGUF bytes of MXFP4, IQ4_NL or IQ4_XS, one grid) into one
        packed weight."""
        grids = {cb4_grid(t) for t in qtypes}
        if None in grids or len(grids) != 1:
            raise ValueError(f"cb4 stacks MXFP4, or IQ4_NL and IQ4_XS (one grid), not "
                             f"{', '.join(Q(int(t)).name for t in qtypes)}")
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        lib = native.required("cb4")
        blocks = -(-rows // CB4_ROWS)
        packed = torch.empty(blocks, cols // CB4_GROUP, CB4_RECORD_BYTES, dtype=torch.uint8)
        if rows % CB4_ROWS:
            packed[-1].zero_()  # padding rows: codes and scales 0
        row0 = 0
        for raw, qtype, (r, c) in zip(raws, qtypes, shapes):
            qtype = Q(int(qtype))
            fmt = get_format(qtype)
            if c != cols or c % fmt.block_size:
                raise ValueError(f"{qtype.name} parts of one packed linear need one width in "
                                 f"whole {fmt.block_size}-column blocks, not {c} and {cols}")
            row_bytes = fmt.row_bytes(c)
            raw = raw.reshape(r, -1).contiguous()
            if raw.dtype != torch.uint8 or raw.shape[1] != row_bytes:
                raise ValueError(f"{qtype.name} rows of {c} columns are {row_bytes} uint8 "
                                 f"bytes, not {tuple(raw.shape)} {raw.dtype}")
            lib.ss_cb4_rows(raw.data_ptr(), row_bytes, CB4_FORMATS[qtype][0], r, c, row0,
                            packed.data_ptr(), torch.get_num_threads())
            row0 += r
        return cls(packed, rows, bias, grids.pop())

