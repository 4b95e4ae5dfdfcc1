"""Where a layer's tensors come from: the memory-mapped file, or a buffer holding the bytes of
a span of it (a staging buffer a layer was read into, or the private copy of a CPU model's
tensor data, weights.file_bytes), as uint8 tensors in the file's formats."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .. import quant
from ..errors import GGUFError
from ..model.families import file_spec
from ..modelfile.gguf_file import GGUFFile


def raw_tensor(gf: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's bytes as a uint8 torch tensor (rows, row_bytes), after checking its shape."""
    info = gf.tensors.get(name)
    if info is None:
        raise GGUFError(f"{gf.path.name}: missing tensor {name!r}")
    if tuple(info.shape) != tuple(shape):
        raise GGUFError(f"{gf.path.name}: tensor {name!r} has shape {list(info.shape)}, "
                        f"expected {list(shape)} from the model metadata")
    data = gf.tensor_bytes(name)
    with warnings.catch_warnings():
        # The memory map is read-only and torch warns about that; we never write through it.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.asarray(data))
    return t.view(_rows(shape), -1)


def _rows(shape: tuple[int, ...]) -> int:
    """Rows of a tensor's bytes viewed (rows, row_bytes): a matrix's rows, a 3-D expert
    tensor's experts * rows (each expert's rows then a contiguous slice), one for a vector."""
    return math.prod(shape[:-1]) if len(shape) >= 2 else 1


class TensorSource:
    """Where a layer's tensors come from: the memory-mapped file (resident loading), or a
    buffer holding the bytes of a span of the file (streaming from disk)."""

    def __init__(self, gf: GGUFFile, buffer: torch.Tensor | None = None, base: int = 0,
                 private: bool = False, held: bool = False):
        """held: `buffer` belongs to the model (private_file_bytes), not a staging buffer
        that is reused, so weights may stay views of it and be made after the build."""
        self.gf = gf
        self.buffer = buffer  # uint8, file bytes [base, base + len)
        self.base = base
        self.private = private  # copy what would view the memory map (see the module doc)
        self.held = held and buffer is not None

    @property
    def lazy(self) -> bool:
        """Whether a weight may be made after the build returns: from the memory-mapped file
        or a held buffer, not from a staging buffer that is reused."""
        return self.buffer is None or self.held

    def raw_held(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """raw(), as bytes that stay valid after the build: a held buffer's view, a private
        copy where the model must not read its file after the load (see the module doc),
        else the map's view."""
        raw = self.raw(name, shape)
        return raw.clone() if (self.private and self.buffer is None) or \
            (self.buffer is not None and not self.held) else raw

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def type_of(self, name: str):
        return self.gf.tensors[name].ggml_type

    def raw(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if self.buffer is None:
            return raw_tensor(self.gf, name, shape)
        info = self.gf.tensors.get(name)
        if info is None or tuple(info.shape) != tuple(shape):
            return raw_tensor(self.gf, name, shape)  # raises, naming the tensor
        start = info.offset - self.base
        return self.buffer[start:start + info.n_bytes].view(_rows(shape), -1)

    def dense(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        raw = self.raw(name, shape)
        # narrowed chunk by chunk as it is decoded (the same bits as a whole float32 tensor
        # narrowed after): no float32 copy of the whole weight to fault in and walk again
        t = quant.dequantize_as(raw, self.type_of(name), shape, dtype).to(device=device)
        if (self.buffer is not None or self.private) and _shares_memory(t, raw):
            # F32 (and F16 at float16) tensors decode to views: a staging buffer gets reused,
            # a private model must not read its file after the load, and a held buffer is
            # freed once the layers' weights are made from it (a view would keep it whole)
            t = t.clone()
        return t


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a's bytes lie inside b's storage (a view of it, not a copy)."""
    lo = b.untyped_storage().data_ptr()
    return lo <= a.data_ptr() < lo + b.untyped_storage().nbytes()


def layer_span(gf: GGUFFile, i: int) -> tuple[int, int]:
    """[start, end) of the file bytes holding layer i's tensors."""
    names = file_spec(gf).names(i, gf.tensors)  # (all a layer may hold)
    infos = [gf.tensors[n] for n in names]
    return min(t.offset for t in infos), max(t.offset + t.n_bytes for t in infos)
