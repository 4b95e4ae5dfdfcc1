"""GGML tensor formats: block geometry and a reference dequantizer in plain torch.

Each family module (floats, legacy, kquants) registers its formats at import. The dequantizers
here are the oracle the fused kernels are tested against: vectorized over all blocks, no numpy,
so the same code runs on CPU and CUDA tensors. `slipstream.quant.encode` is the numpy inverse,
used to synthesize test models.
"""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from ..errors import GGUFError, UnsupportedTensorType
from . import floats, kquants, legacy  # noqa: F401  (importing them registers the formats)
from .base import QuantFormat, registry

__all__ = ["QuantFormat", "dequantize", "get_format", "row_bytes", "supported_types"]


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
