"""Unquantized types: F32, F16 and BF16 (block size 1, so a "block" is one element)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .base import register


def _as_elements(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # (n, type_size) uint8 -> (n, 1) of `dtype`. The view needs a dense tensor whose storage
    # offset is a multiple of the element size; a slice of an mmap'd file may not be, so copy
    # once rather than fail.
    blocks = blocks.contiguous()
    try:
        return blocks.view(dtype)
    except RuntimeError:
        return blocks.clone().view(dtype)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return _as_elements(blocks, torch.float32)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return _as_elements(blocks, torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    # bf16 -> f32 is the 16 bits shifted up, exactly what gguf-py does with int32 arithmetic;
    # torch's conversion does the same, including for NaN/inf, on every torch we support.
    return _as_elements(blocks, torch.bfloat16).float()


F32 = register(GGMLQuantizationType.F32, _f32)
F16 = register(GGMLQuantizationType.F16, _f16)
BF16 = register(GGMLQuantizationType.BF16, _bf16)
