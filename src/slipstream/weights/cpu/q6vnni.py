"""q6vnni: Q6_K's CPU linear on slipstream's own kernel (native/q6_matvec.c), where the native
library builds with its VNNI loop; elsewhere Q6_K keeps int8pack.

The weights are the file's exactly: Q6_K's 6-bit codes, int8 sub-block scales and float16
super-block scales, rearranged into 16-row blocks (6.625 bits a weight against the file's
6.5625: a 32-byte pad keeps every run on a 64-byte line). The activations are quantized as
q4vnni's (16 bits per block of 32, two int8 digits), multiplied by the codes as integers
(AVX-512 VNNI), each 16-column sub-block's sum exact, then scaled once. Against int8pack, which
requantizes each row to int8 with one bfloat16 scale (8 bits a weight and the requantization's
error, a float kernel): fewer bytes, exact weights, integer products. On the 2-core AVX-512
EPYC, shared with other work (load average 8-9), a Qwen3-MoE head (151936 x 2048: 257 MB
here, 311 MB as int8pack) took 23-28 ms at best this way against 42-85 through int8pack, one
thread each; from cache the loop runs at about 39 Gweights/s a core.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ... import native
from ...quant import get_format
from ..linear import Linear
from .groups import Q, RowBlocks

Q6V_ROWS = 16
Q6V_RUN = 256  # columns per run: one Q6_K super-block
Q6V_RUN_BYTES = 320 + 8 * 384  # header (d, scales, pad) and 8 groups of 32 columns' codes


@functools.lru_cache(maxsize=None)
def q6vnni_available() -> bool:
    """Whether q6vnni runs here: the native library builds with the VNNI loop (without it the
    plain-C loop would read Q6_K slower than torch's int8 kernel)."""
    lib = native.library()
    return lib is not None and bool(lib.ss_q6_has_vnni())


def q6vnni_nbytes(rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) q6vnni weight: rows padded to 16, 6.625 bits a weight."""
    return -(-rows // Q6V_ROWS) * (cols // Q6V_RUN) * Q6V_RUN_BYTES


class _Q6Weight(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class Q6VnniLinear(RowBlocks, Linear):
    """y = x @ W^T (+ b) (+ residual) for Q6_K through native/q6_matvec.c (see the module doc).
    `packed` is (ceil(rows / 16), in / 256, 3392) uint8."""

    kind = "q6vnni"
    ROWS = Q6V_ROWS

    def __init__(self, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None):
        if packed.dim() != 3 or packed.shape[2] != Q6V_RUN_BYTES or \
                packed.shape[0] != -(-out_features // Q6V_ROWS):
            raise ValueError(f"q6vnni weight of {out_features} rows needs "
                             f"({-(-out_features // Q6V_ROWS)}, runs, {Q6V_RUN_BYTES}) bytes, "
                             f"not {tuple(packed.shape)}")
        lib = native.required("q6vnni")
        self.packed = packed
        self._out = out_features
        self.bias = bias
        self.in_features = packed.shape[1] * Q6V_RUN
        self._matvec = lib.ss_q6_matvec
        self._desc = _Q6Weight(packed.data_ptr(), out_features, self.in_features)
        self.desc = ctypes.addressof(self._desc)

    @classmethod
    def from_raws(cls, raws, qtypes, shapes, bias: torch.Tensor | None = None
                  ) -> "Q6VnniLinear":
        """Stack the parts' rows (GGUF bytes, all Q6_K) into one packed weight."""
        if any(Q(int(t)) != Q.Q6_K for t in qtypes):
            raise ValueError(f"q6vnni reads Q6_K only, not "
                             f"{', '.join(Q(int(t)).name for t in qtypes)}")
        rows, cols = sum(r for r, _ in shapes), shapes[0][1]
        if cols % Q6V_RUN:
            raise ValueError(f"Q6_K rows of {cols} columns: not whole {Q6V_RUN}-column blocks")
        lib = native.required("q6vnni")
        blocks = -(-rows // Q6V_ROWS)
        # every byte of a real row is written by the packer; a last block's padding rows
        # need zeros (d = 0)
        packed = torch.empty(blocks, cols // Q6V_RUN, Q6V_RUN_BYTES, dtype=torch.uint8)
        if rows % Q6V_ROWS:
            packed[-1].zero_()
        row_bytes = get_format(Q.Q6_K).row_bytes(cols)
        row0 = 0
        for raw, (r, c) in zip(raws, shapes):
            if c != cols:
                raise ValueError(f"parts of one packed linear need one width, not {c} and "
                                 f"{cols}")
            raw = raw.reshape(r, -1).contiguous()
            if raw.dtype != torch.uint8 or raw.shape[1] != row_bytes:
                raise ValueError(f"Q6_K rows of {cols} columns are {row_bytes} uint8 bytes, "
                                 f"not {tuple(raw.shape)} {raw.dtype}")
            lib.ss_q6vnni_rows(raw.data_ptr(), row_bytes, r, cols, row0, packed.data_ptr(),
                               torch.get_num_threads())
            row0 += r
        return cls(packed, rows, bias)

