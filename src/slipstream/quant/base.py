"""The block-format description every quant family shares, and the registry they add themselves to.

A GGML tensor row is a run of fixed-size blocks: `block_size` logical elements stored in
`type_size` bytes. A format only has to turn a batch of raw blocks into floats; reshaping whole
tensors, size checks and error messages live in `slipstream.quant` so each family stays small.
The sizes come from gguf-py's `GGML_QUANT_SIZES`, the same table the file writer uses, so they
can never drift from what is on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import GGUFError

# (n_blocks, type_size) uint8 -> (n_blocks, block_size) float32
BlockDequant = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QuantFormat:
    """One GGML tensor type: its block geometry and its reference (pure torch) dequantizer."""

    qtype: GGMLQuantizationType
    kernel: BlockDequant = field(repr=False)
    block_size: int = field(init=False)  # logical elements per block
    type_size: int = field(init=False)  # bytes per block

    def __post_init__(self) -> None:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "type_size", type_size)

    @property
    def name(self) -> str:
        return self.qtype.name

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of `n_cols` elements; `n_cols` must be a whole number of blocks."""
        if n_cols % self.block_size != 0:
            raise GGUFError(f"a {self.name} row of {n_cols} elements is not a whole number of "
                             f"{self.block_size}-element blocks")
        return n_cols // self.block_size * self.type_size

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """(n_blocks, type_size) uint8 -> (n_blocks, block_size) float32, on the same device."""
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.type_size:
            raise GGUFError(f"{self.name} blocks must be uint8 of shape (n, {self.type_size}), "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        return self.kernel(blocks)


_REGISTRY: dict[GGMLQuantizationType, QuantFormat] = {}


def register(qtype: GGMLQuantizationType, kernel: BlockDequant) -> QuantFormat:
    """Add a format to the registry (each family module calls this at import) and return it."""
    if qtype in _REGISTRY:
        raise RuntimeError(f"{qtype.name} registered twice")
    fmt = QuantFormat(qtype, kernel)
    _REGISTRY[qtype] = fmt
    return fmt


def registry() -> dict[GGMLQuantizationType, QuantFormat]:
    return _REGISTRY


# --- small helpers the family modules share ---------------------------------------------------

def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian f16 at byte `offset` of each block, as float32 of shape (n_blocks, 1).

    Copied first: a dtype view that changes the element size needs a dense last dim and a
    storage offset aligned to the new size, which a slice of the file's bytes need not have
    (`.contiguous()` would not do: it returns a one-block slice as it is). 2 bytes per block.
    """
    field = blocks[:, offset:offset + 2].clone(memory_format=torch.contiguous_format)
    return field.view(torch.float16).float()


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., k) -> uint8 (..., 2, k): low nibbles first, then high nibbles.

    That is the GGML order: byte i holds element i in its low nibble and element i + k in its
    high nibble, so stacking on a new second-to-last axis and flattening gives element order.
    Both halves are written straight into the result (no temporaries to stack: a load
    dequantizes every weight, and streaming on CPU every streamed layer on every token).
    """
    k = packed.shape[-1]
    out = torch.empty((*packed.shape[:-1], 2, k), dtype=torch.uint8, device=packed.device)
    torch.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(packed, 4, out=out[..., 1, :])
    return out


def crumbs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., k) -> uint8 (..., 4, k): the 2-bit fields at shifts 0, 2, 4, 6, in that order."""
    return torch.stack([(packed >> s) & 0x03 for s in (0, 2, 4, 6)], dim=-2)


def bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., k) -> uint8 (..., 8, k): bit b of byte i lands at [..., b, i]."""
    return torch.stack([(packed >> b) & 0x01 for b in range(8)], dim=-2)
