"""dequantize_as's fast path: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K bytes to float16 or float32 in one
native pass (native/dequant.c), with the bits of the torch path (quant.legacy and
quant.kquants, then the cast): a CPU
prefill's dense weights are made this way. In torch ops the default model's 106M layer weights
took about 0.7 s of a core, which the first token of a `run` waited for on a 2-core machine;
in one native pass, about a tenth of that."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from .. import native
from .base import registry

FORMATS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q8_0: 2, Q.Q4_K: 3, Q.Q6_K: 4}  # dequant.c's DQ_* codes
DTYPES = {torch.float16: 1, torch.float32: 0}  # its out_f16 flag
# Below this many GGUF bytes the blocks are dequantized on the calling thread: a decode token's
# embedding row (a Q6_K row of 2048: 1.7 KB) in an OpenMP region of 2 waited for the other
# thread, and on the 2-core EPYC with two other processes busy that took 3.8-8 ms a token of
# a Qwen3-30B-A3B-shaped file's ~70 (a thread descheduled holds the region for its slice).
# Each value is made from its own block either way, so the bits are the same.
ONE_THREAD_BYTES = 1 << 16


def dequantize_native(blocks: torch.Tensor, qtype: Q, shape: tuple[int, ...],
                      dtype: torch.dtype, out: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """`blocks` ((n, type_size) uint8 of `qtype`, on the CPU) as a `dtype` tensor of `shape`
    (n * 32 elements), written into `out` where given (contiguous, of that shape and dtype),
    or None where this path does not serve (another format or dtype, a CUDA tensor, no
    native library, SLIPSTREAM_NATIVE=0): the caller's torch path then does."""
    code, f16 = FORMATS.get(qtype), DTYPES.get(dtype)
    if code is None or f16 is None or blocks.device.type != "cpu":
        return None
    lib = native.library()
    if lib is None:
        return None
    blocks = blocks.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    threads = torch.get_num_threads() if blocks.numel() >= ONE_THREAD_BYTES else 1
    lib.ss_dequant_blocks(blocks.data_ptr(), code, blocks.shape[0], out.data_ptr(), f16,
                          threads)
    return out


def dequantize_widened(raw: torch.Tensor, qtype: Q, shape: tuple[int, ...], out: torch.Tensor,
                       threads: int) -> torch.Tensor | None:
    """GGUF bytes (uint8, on the CPU) as float32 values rounded through float16, into `out`
    (contiguous float32 of `shape`): dequantize_as(..., float16).float()'s bits in one pass,
    what a float16 weight widened for a float32 GEMM holds. None where the native pass does
    not serve (the caller then widens the float16 weight itself)."""
    code = FORMATS.get(qtype)
    if code is None or raw.device.type != "cpu" or raw.dtype != torch.uint8:
        return None
    lib = native.library()
    if lib is None:
        return None
    fmt = registry()[qtype]
    if raw.numel() * fmt.block_size != out.numel() * fmt.type_size or \
            tuple(out.shape) != tuple(shape) or out.dtype != torch.float32 or \
            not out.is_contiguous():
        raise ValueError(f"{qtype.name} bytes {tuple(raw.shape)} do not fill a float32 "
                         f"{tuple(shape)} output ({tuple(out.shape)} {out.dtype})")
    blocks = raw.contiguous()
    lib.ss_dequant_blocks(blocks.data_ptr(), code, blocks.numel() // fmt.type_size,
                          out.data_ptr(), 2, threads)
    return out
