"""The CPU computing on the GPU kernels' weight planes (kernels.pack) where they lie in host
memory: hybrid decode's CPU share read from the pinned layer image that PCIe copies from,
through native/plane_matvec.c.

Why: a split layer's image already holds the CPU's units (its "rest" linears, which prefill
copies and runs on the GPU), as planes of 4.625 bits a Q4_K weight. The CPU layouts
(weights.cpu_packed) would pack a second copy of them: q4vnni's 6 bits a Q4_K weight, made at
load and kept beside the image. Reading the planes in place takes no RAM and no packing time,
and reads 23% fewer bytes a token than q4vnni, which matters where the CPU and the copy engine
share the host's memory bus (bench/results/2026-12-05-session29.md: 126-130 GB/s between them
on the H100's host). The 4-bit formats with no high-bit plane are read: Q4_0, Q4_1 and Q4_K.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType as Q

from ..weights.cpu_packed import CPU_CHUNKS
from ..weights.linear import Linear

# plane_matvec.c's formats
PLANE_FORMATS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q4_K: 2}
KIND = "planes"  # hybrid.ffn's name for this CPU layout
_GENERIC, _X16, _CHUNKS, _THREADS_SHIFT = 4, 8, 16, 8  # plane_matvec.c's flags


def plane_nbytes(qtype: Q | int, rows: int, cols: int) -> int:
    """Bytes of a (rows, cols) weight's planes (kernels.pack) in a PLANE_FORMATS format: the
    4-bit codes, float16 d (and m) per 32 columns, or for Q4_K per 256 with a byte of scale and
    one of min per 32."""
    qtype = Q(int(qtype))
    if qtype not in PLANE_FORMATS:
        raise ValueError(f"{qtype.name} is not read by the CPU's plane kernel")
    codes = rows * cols // 2
    if qtype == Q.Q4_K:
        return codes + rows * (cols // 256) * 4 + rows * (cols // 32) * 2
    return codes + rows * (cols // 32) * (4 if qtype == Q.Q4_1 else 2)


class _PlaneWeight(ctypes.Structure):
    _fields_ = [("lo", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("sc", ctypes.c_void_p), ("mn", ctypes.c_void_p), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("fmt", ctypes.c_int64)]


def plane_readable(packed) -> bool:
    """Whether plane_matvec.c reads this PackedWeight: a 4-bit format without high bits, its
    scales kept as in GGUF (not fused into `sm`), on the CPU."""
    return (packed.qtype in PLANE_FORMATS and packed.sm is None and packed.hi is None
            and packed.lo is not None and packed.lo.device.type == "cpu")


def planes_available() -> bool:
    """Whether the native library (with plane_matvec.c) is built here."""
    from .. import native

    return native.library() is not None


class PlaneLinear(Linear):
    """y = x @ W^T for W held as kernels.pack planes in host memory (a pinned image's views):
    each activation row quantized per block of 32 to 16 bits (two int8 digits; or 8), the
    integer sums exact, each unit's scale and zero applied once in float32 (plane_matvec.c).
    The weights are the GGUF ones exactly; the activations' rounding is the only error besides
    float32 sums, as in Q4VnniLinear. The planes are read, never copied: whoever made them
    keeps them alive (this object holds references too)."""

    kind = KIND

    def __init__(self, packed, act_bits: int | None = None):
        from .. import native
        from ..weights.cpu_packed import Q4VNNI_ACT_BITS

        if not plane_readable(packed):
            raise ValueError(f"{packed.qtype.name} planes on {packed.lo.device} are not read "
                             f"by the CPU's plane kernel (4-bit formats without high bits, "
                             f"GGUF scales, host memory)")
        lib = native.library()
        if lib is None:
            raise RuntimeError("the CPU's plane kernel needs the native library "
                               "(slipstream.native), which this process does not have (no C "
                               "compiler, or SLIPSTREAM_NATIVE=0)")
        planes = [packed.lo, packed.d, packed.m, packed.sc, packed.mn]
        if not all(p is None or p.is_contiguous() for p in planes):
            raise ValueError("the CPU's plane kernel reads contiguous planes")
        self.packed = packed
        self._matvec = lib.ss_plane_matvec
        ptr = [0 if p is None else p.data_ptr() for p in planes]
        self._desc = _PlaneWeight(*ptr, packed.rows, packed.cols, PLANE_FORMATS[packed.qtype])
        self.desc = ctypes.addressof(self._desc)
        self.act_bits = Q4VNNI_ACT_BITS if act_bits is None else act_bits

    @property
    def out_features(self) -> int:
        return self.packed.rows

    @property
    def in_features(self) -> int:
        return self.packed.cols

    @property
    def nbytes(self) -> int:
        """Bytes read per pass over the weight (the planes' own, shared with the image)."""
        return self.packed.nbytes

    def matvec(self, x: torch.Tensor, out: torch.Tensor, threads: int | None = None,
               generic: bool = False, act_bits: int | None = None,
               chunks: bool | None = None) -> torch.Tensor:
        """out (m, out) = x (m, in) @ W^T, both float32 and contiguous. threads: torch's
        intra-op count unless given; generic: the plain-C loop even where the AVX2 one is
        compiled in (tests compare them); act_bits 8 or 16 (default: the instance's); chunks:
        the threads take chunks of the rows as they finish rather than one equal share each
        (default cpu_packed.CPU_CHUNKS; the same bits either way)."""
        m = x.shape[0]
        if x.dtype != torch.float32 or out.dtype != torch.float32 or \
                x.shape[-1] != self.in_features or tuple(out.shape) != (m, self.out_features) \
                or not (x.is_contiguous() and out.is_contiguous()):
            raise ValueError(f"plane matvec of {tuple(x.shape)} {x.dtype} into "
                             f"{tuple(out.shape)} {out.dtype}: needs contiguous float32 "
                             f"(m, {self.in_features}) and (m, {self.out_features})")
        bits = self.act_bits if act_bits is None else act_bits
        if bits not in (8, 16):
            raise ValueError(f"activation bits must be 8 or 16, not {bits!r}")
        threads = torch.get_num_threads() if threads is None else threads
        chunks = CPU_CHUNKS if chunks is None else chunks
        flags = (_GENERIC if generic else 0) | (_X16 if bits == 16 else 0) | \
            (_CHUNKS if chunks else 0) | int(threads) << _THREADS_SHIFT
        if self._matvec(self.desc, x.data_ptr(), out.data_ptr(), m, flags) != 0:
            raise MemoryError(f"the CPU's plane kernel could not allocate its scratch for "
                              f"{m} rows of {self.in_features}")
        return out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x32 = x.float().contiguous()
        y = self.matvec(x32, torch.empty(x32.shape[0], self.out_features))
        if residual is not None:
            y = residual.float() + y
        return y.to(x.dtype)
