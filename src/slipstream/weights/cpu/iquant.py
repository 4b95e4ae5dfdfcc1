"""iq: the i-quant grid formats' CPU linear (IQ3_XXS, IQ2_XXS, IQ3_S, IQ1_S, IQ2_XS, IQ2_S,
IQ1_M) on slipstream's kernel (native/iq_matvec.c), wherever the native library builds.

The weights are the file's rows, bytes for bytes (98 bytes per 256 weights for IQ3_XXS, 3.06
bits a weight; 66 for IQ2_XXS, 2.06; 110 for IQ3_S, 3.44; 50 for IQ1_S, 1.56; 74 for IQ2_XS,
2.31; 82 for IQ2_S, 2.56; 56 for IQ1_M, 1.75): no repack into rows of 16, whose float scales
would add bytes. The kernel is compute-bound (about 2.5 GB/s on
one core of the 2-core EPYC, q4vnni 30: building 32 weights from their grid points takes
longer than reading them), yet 46 times the dense path it replaces (1024 x 4096 IQ3_XXS:
0.60 ms a call against 27.6 ms for torch's dequantization and a matmul; IQ2_XS 0.55 ms,
IQ2_S 0.56, IQ1_M 0.68, from cache). It looks the grid
points and sign patterns up per block as llama.cpp's CPU backend does, from gguf-py's tables
(handed to the C through the weight's descriptor), and multiplies them with the activations
quantized as every native kernel's (16 bits per block of 32, two int8 digits: see
iq_matvec.c). Without it these formats decode through dense float weights made at every call.
"""

from __future__ import annotations

import ctypes

import torch

from ... import native
from ...quant import get_format
from ...quant.iquants import grid as iq_grid
from ..linear import Linear
from .groups import Q, RowBlocks

# the formats iq reads -> iq_matvec.c's IQ_FMT_*
IQ_FORMATS = {Q.IQ3_XXS: 0, Q.IQ2_XXS: 1, Q.IQ3_S: 2, Q.IQ1_S: 3, Q.IQ2_XS: 4, Q.IQ2_S: 5,
              Q.IQ1_M: 6}
_SIGNED_GRIDS = (Q.IQ1_S, Q.IQ1_M)  # -1, 0, 1 points: handed to the C as int8 8 g
IQ_BLOCK = 256
IQ_USE_AVX2 = 16  # ss_iq_matvec's flag: the AVX2 loop where the VNNI one is built (tests)

_TABLES: dict[Q, tuple[torch.Tensor, torch.Tensor]] = {}


def iq_available() -> bool:
    """Whether iq runs here: the native library builds (any CPU: an AVX-512 VNNI, an AVX2 and
    a plain-C loop, all with the same bits)."""
    return native.library() is not None


def iq_nbytes(qtype, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) iq weight: the file's."""
    return rows * get_format(Q(int(qtype))).row_bytes(cols)


def _tables(qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's grid of qtype as uint8 (points, width) (IQ1_S's and IQ1_M's -1, 0, 1 as int8
    8 g, the integer weight without its +-1 shift) and its ksigns patterns as int8 (128, 8) of +-1,
    contiguous, made once and kept for the process (the C reads them by address)."""
    got = _TABLES.get(qtype)
    if got is None:
        from ...quant.iquants import _table  # the signs table the torch dequantizer uses

        g = iq_grid(qtype, torch.device("cpu"))
        g = (8 * g).to(torch.int8) if qtype in _SIGNED_GRIDS else g.to(torch.uint8)
        g = g.contiguous()
        signs = _table("ksign_rows", torch.device("cpu")).to(torch.int8).contiguous()
        got = _TABLES[qtype] = (g, signs)
    return got


class _IqWeight(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("fmt", ctypes.c_int64), ("grid", ctypes.c_void_p), ("signs", ctypes.c_void_p)]


class IqLinear(RowBlocks, Linear):
    """y = x @ W^T (+ b) (+ residual) for IQ_FORMATS through native/iq_matvec.c (see
    the module doc). `packed` is the file's (rows, row_bytes) uint8 rows; `qtype` its format."""

    kind = "iq"
    AVX2_FLAG = IQ_USE_AVX2
    ROWS = 1

    def __init__(self, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None, qtype: Q = Q.IQ3_XXS):
        qtype = Q(int(qtype))
        if qtype not in IQ_FORMATS:
            raise ValueError(f"iq reads {', '.join(t.name for t in IQ_FORMATS)}, "
                             f"not {qtype.name}")
        fmt = get_format(qtype)
        if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[0] != out_features \
                or packed.shape[1] % fmt.type_size or not packed.is_contiguous():
            raise ValueError(f"iq {qtype.name} weight of {out_features} rows needs contiguous "
                             f"uint8 (rows, blocks * {fmt.type_size}), not "
                             f"{tuple(packed.shape)} {packed.dtype}")
        lib = native.required("iq")
        self.packed = packed
        self._out = out_features
        self.bias = bias
        self.qtype = qtype
        self.in_features = packed.shape[1] // fmt.type_size * IQ_BLOCK
        self._matvec = lib.ss_iq_matvec
        g, signs = _tables(qtype)
        self._desc = _IqWeight(packed.data_ptr(), out_features, self.in_features,
                               IQ_FORMATS[qtype], g.data_ptr(), signs.data_ptr())
        self.desc = ctypes.addressof(self._desc)

    def row_slice(self, r0: int, r1: int) -> "IqLinear":
        sliced = super().row_slice(r0, r1)
        return IqLinear(sliced.packed, sliced.out_features, sliced.bias, self.qtype)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None) -> "IqLinear":
        """Stack the parts' rows (GGUF bytes of one of IQ_FORMATS) into one weight."""
        kinds = {Q(int(t)) for t in qtypes}
        if len(kinds) != 1 or not kinds <= IQ_FORMATS.keys():
            raise ValueError(f"iq stacks parts of one of {', '.join(t.name for t in IQ_FORMATS)}"
                             f", not {', '.join(Q(int(t)).name for t in qtypes)}")
        qtype = kinds.pop()
        fmt = get_format(qtype)
        cols = shapes[0][1]
        parts = []
        for raw, (r, c) in zip(raws, shapes):
            if c != cols or c % IQ_BLOCK:
                raise ValueError(f"{qtype.name} parts of one linear need one width in whole "
                                 f"{IQ_BLOCK}-column blocks, not {c} and {cols}")
            raw = raw.reshape(r, -1)
            if raw.dtype != torch.uint8 or raw.shape[1] != fmt.row_bytes(c):
                raise ValueError(f"{qtype.name} rows of {c} columns are {fmt.row_bytes(c)} "
                                 f"uint8 bytes, not {tuple(raw.shape)} {raw.dtype}")
            parts.append(raw)
        packed = torch.cat(parts) if len(parts) > 1 else parts[0].clone(
            memory_format=torch.contiguous_format)  # the caller's bytes may be reused
        return cls(packed, packed.shape[0], bias, qtype)

