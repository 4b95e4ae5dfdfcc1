"""GGML tensor formats: block geometry and a reference dequantizer in plain torch.

Each family module (floats, legacy, kquants, codebook, iquants) registers its formats at import. The
dequantizers here are the oracle the fused kernels are tested against: vectorized over all
blocks, no numpy, so the same code runs on CPU and CUDA tensors. `slipstream.quant.encode` is
the numpy inverse, used to synthesize test models.
"""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from ..errors import GGUFError, UnsupportedTensorType
# importing them registers the formats
from . import codebook, floats, iquants, kquants, legacy  # noqa: F401
from .base import QuantFormat, registry
from .native import dequantize_native

__all__ = ["QuantFormat", "dequantize", "dequantize_as", "get_format", "row_bytes",
           "supported_types"]

# dequantize_as: elements per chunk, so that a chunk's float32 steps (widen the codes, scale,
# offset) stay in the core's cache (1 MiB of float32) instead of crossing RAM once per step
CHUNK_ELEMENTS = 1 << 18


def supported_types() -> list[GGMLQuantizationType]:
    """The GGML types slipstream can dequantize, in GGML's numbering order."""
    return sorted(registry(), key=int)


def get_format(qtype: GGMLQuantizationType | int) -> QuantFormat:
    """The format of `qtype`; raises UnsupportedTensorType naming it for anything else."""
    try:
        qtype = GGMLQuantizationType(int(qtype))
    except (TypeError, ValueError):
        name = f"{qtype!r} (unknown to gguf-py)"
    else:
        fmt = registry().get(qtype)
        if fmt is not None:
            return fmt
        name = qtype.name
    supported = ", ".join(t.name for t in supported_types())
    raise UnsupportedTensorType(f"tensor type {name} is not supported; supported: {supported}")


def row_bytes(qtype: GGMLQuantizationType | int, n_cols: int) -> int:
    """Bytes in one row of `n_cols` elements of `qtype` (GGUFError if not whole blocks)."""
    return get_format(qtype).row_bytes(n_cols)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType | int,
               shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a whole tensor: uint8 bytes -> float32 of `shape`, on raw's device.

    `raw` is the tensor's bytes, 1-D or (rows, row_bytes); `shape` is the logical shape in torch
    order (rows, cols), i.e. GGUF's `ne` reversed. For F32 the result may share memory with raw.
    """
    fmt = get_format(qtype)
    if raw.dtype != torch.uint8:
        raise GGUFError(f"{fmt.name} tensor bytes must be a uint8 tensor, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise GGUFError(f"invalid {fmt.name} tensor shape {shape}")
    expected = math.prod(shape[:-1]) * fmt.row_bytes(shape[-1])
    if raw.numel() != expected:
        raise GGUFError(f"{fmt.name} tensor of shape {shape} needs {expected} bytes, "
                        f"got {raw.numel()}")
    blocks = raw.reshape(-1, fmt.type_size)  # (n_blocks, type_size)
    return fmt.dequantize_blocks(blocks).reshape(shape)


def dequantize_as(raw: torch.Tensor, qtype: GGMLQuantizationType | int,
                  shape: tuple[int, ...], dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize(raw, qtype, shape).to(dtype), bit for bit, in chunks of blocks written
    straight into the result: a load (and a streamed CPU layer, on every token) no longer
    makes the whole float32 tensor and then a second pass to narrow it. Q4_0, Q4_1 and Q8_0
    on the CPU go through one native pass where the library is there (quant.native: the same
    bits). Unquantized types (one element per block) and float32 results otherwise take the
    plain path, which makes no extra pass.

    out: a contiguous tensor of `shape` and `dtype` on raw's device to write the result into
    (and return), instead of a new one."""
    fmt = get_format(qtype)
    shape = tuple(int(s) for s in shape)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype
                            or out.device != raw.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on "
                         f"{raw.device}, not {out.dtype} {tuple(out.shape)} on {out.device}")
    if fmt.block_size == 1 or raw.dtype != torch.uint8 or not shape or any(s < 0 for s in shape) \
            or raw.numel() != math.prod(shape[:-1]) * fmt.row_bytes(shape[-1]):
        # raises, with dequantize's own message, where the bytes are wrong
        whole = dequantize(raw, qtype, shape).to(dtype)
        return whole if out is None else out.copy_(whole)
    blocks = raw.reshape(-1, fmt.type_size)
    fast = dequantize_native(blocks, fmt.qtype, shape, dtype, out)
    if fast is not None:
        return fast
    if dtype == torch.float32:
        whole = dequantize(raw, qtype, shape)
        return whole if out is None else out.copy_(whole)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    flat = out.view(-1, fmt.block_size)
    step = max(1, CHUNK_ELEMENTS // fmt.block_size)
    for at in range(0, blocks.shape[0], step):
        flat[at:at + step].copy_(fmt.dequantize_blocks(blocks[at:at + step]))
    return out
