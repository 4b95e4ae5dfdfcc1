"""Open and validate a GGUF file on top of the `gguf` package.

`gguf.GGUFReader` parses the header and memory-maps the tensor data. It reports problems as bare
ValueErrors (or worse, a numpy reshape error for a truncated file), so this module checks the file
before and while the reader runs and raises `GGUFError` / `UnsupportedTensorType` naming the
offending value instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from .errors import GGUFError, ModelNotFound, UnsupportedTensorType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
_HEADER_BYTES = 24  # magic, version, tensor count, kv count


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live in the file, and what they mean."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows, cols): GGUF's ne reversed
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type, shape and extent before mapping its data."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        file_size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            type_id = int(raw_dtype[0])
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorType(
                    f"tensor {name!r} has unknown GGML type id {type_id}") from None
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            ne = [int(d) for d in dims]
            if any(d <= 0 for d in ne):
                raise GGUFError(f"tensor {name!r} has a non-positive dimension in shape {ne}")
            if ne and ne[0] % block_size:
                raise GGUFError(
                    f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                    f"{ggml_type.name} block size {block_size}, so shape {ne} does not match "
                    f"any byte size")
            n_bytes = int(np.prod(ne, dtype=np.int64)) * type_size // block_size
            begin = int(start_offs + int(offset_tensor[0]))
            if begin + n_bytes > file_size:
                raise GGUFError(
                    f"tensor {name!r} ({ggml_type.name}, shape {ne}) needs bytes {begin}.."
                    f"{begin + n_bytes} but the file has only {file_size} bytes: the file is "
                    f"truncated or corrupt; download it again")
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """A validated, memory-mapped GGUF file: metadata as Python values and a tensor index."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFound(f"model file {str(self.path)!r} does not exist")
        self.file_size = self.path.stat().st_size
        self._check_header()
        try:
            self.reader = _CheckedReader(self.path, "r")
        except (GGUFError, UnsupportedTensorType):
            raise
        except (ValueError, IndexError, TypeError, OverflowError, UnicodeDecodeError,
                KeyError) as e:
            # The header parsed but the metadata or tensor table did not: a truncated or
            # corrupted file in practice.
            raise GGUFError(f"{self.path.name}: corrupt or truncated GGUF header ({e})") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _field_value(field)
        self.tensors: dict[str, TensorInfo] = {}
        for t in self.reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, t.tensor_type, shape, int(t.n_bytes),
                                              int(t.data_offset))
        self._check_overlaps()

    def _check_header(self) -> None:
        with open(self.path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES:
            raise GGUFError(f"{self.path.name}: file is {len(head)} bytes, too short for a GGUF "
                            f"header ({_HEADER_BYTES} bytes); it is truncated")
        if head[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path.name}: bad magic {head[:4]!r}, expected b'GGUF'; this is "
                            f"not a GGUF file")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path.name}: unsupported GGUF version {version}; supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}")

    def _check_overlaps(self) -> None:
        spans = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if a.offset + a.n_bytes > b.offset:
                raise GGUFError(
                    f"tensor {a.name!r} ({a.ggml_type.name}, shape {list(a.shape)}) occupies "
                    f"{a.n_bytes} bytes, which runs into tensor {b.name!r}: its shape does not "
                    f"match the bytes stored for it")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            from .errors import MissingMetadata

            raise MissingMetadata(f"{self.path.name}: missing required metadata "
                                  f"'general.architecture'")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 view of the memory map."""
        info = self.tensors[name]
        return self.reader.data[info.offset: info.offset + info.n_bytes]

    def close(self) -> None:
        """Drop the reader and its memory map: the map and its file descriptor go as soon as
        no tensor viewing it is left (Model.close drops the weights first)."""
        self.reader = None


def _field_value(field: Any) -> Any:
    """Decode one metadata field into plain Python values (str, int, float, bool, lists)."""
    try:
        value = field.contents()
    except Exception as e:  # a malformed value is a corrupt file, not a crash
        raise GGUFError(f"metadata field {field.name!r} cannot be decoded ({e})") from None
    if field.types and field.types[0] == GGUFValueType.STRING and isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return value
