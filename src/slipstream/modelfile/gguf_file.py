"""Open and validate a GGUF file on top of the `gguf` package.

`gguf.GGUFReader` parses the header and memory-maps the tensor data, trusting every count and
length in the file: a huge array count makes it loop (one numpy view per element) until memory
runs out, and other damage comes out as bare ValueErrors or numpy reshape errors. So before the
reader runs, `validate.scan_layout` walks the header with `struct` alone and checks every count
and length against the bytes that remain, then `validate.check_tensor_layout` checks each tensor's
type, shape, byte size, alignment and place in the data section, and `check_metadata_types` the
types of the keys slipstream reads. Failures are `GGUFError` subclasses (`UnsupportedTensorType`
for an unknown type) naming the offending field and value.

The reader stays the parser of record (header, keys, types, tensor infos, the data map), but
long metadata arrays (a vocabulary, its merges and token types) are taken as one span each and
decoded in one pass (`_BulkArrayField`): gguf-py's two numpy views per element made opening the
default model's 49k-token vocabulary take ~3 s.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from . import validate
from ..errors import GGUFError, InvalidMetadata, MissingMetadata, ModelNotFound

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
_HEADER_BYTES = validate.HEADER_BYTES  # magic, version, tensor count, kv count


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


_BULK_MIN = 16  # arrays at least this long are read whole (shorter ones: gguf-py's way)
_U64 = struct.Struct("<Q")


class _BulkArrayField(ReaderField):
    """A metadata array the reader took in one piece: its parts end [item type, count, body], body
    being the whole element region (scalars: one typed array; strings: the uint8 bytes of every
    length-prefixed string). gguf-py makes two numpy views per string element, which took
    seconds for a 49k-token vocabulary; this decodes the body in one pass on first use.
    `contents()` answers as ReaderField's does (the same values, the same UnicodeDecodeError on a
    string that is not UTF-8); `data` holds the body's index once, not one index per element."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        values = self.__dict__.get("_values")
        if values is None:
            body = self.parts[-1]
            if self.types[-1] == GGUFValueType.STRING:
                values = _decode_strings(body.tobytes(), int(self.parts[-2][0]))
            else:
                values = body.tolist()
            self.__dict__["_values"] = values
        return values[index_or_slice]


def _decode_strings(body: bytes, count: int) -> list[str]:
    """`count` length-prefixed UTF-8 strings laid end to end (validate.scan_layout has checked
    that every length fits)."""
    out: list[str] = []
    append, unpack, pos = out.append, _U64.unpack_from, 0
    for _ in range(count):
        (n,) = unpack(body, pos)
        pos += 8
        append(body[pos:pos + n].decode("utf-8"))
        pos += n
    return out


class _CheckedReader(GGUFReader):
    """GGUFReader over a header `validate.scan_layout` has checked, that checks each tensor's
    type, shape and extent once more (against the reader's own parse) before mapping its data,
    and reads long metadata arrays in one piece (_BulkArrayField)."""

    _plain: np.ndarray | None = None
    _bulk: set[int] | None = None  # offsets of the fields whose arrays were read in one piece

    def __init__(self, path: Path, mode: str = "r", scanned_ends: dict[int, int] | None = None):
        """scanned_ends: where each metadata value ends, by its offset, as validate.scan_layout
        walked them: a string array's end is taken from there rather than walked again (49k
        tokens and 49k merges: 15 ms of the default model's open). Set before GGUFReader's
        constructor, which parses."""
        self.scanned_ends = scanned_ends or {}
        super().__init__(path, mode)

    def _get_field_parts(  # type: ignore[override]
            self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, itype = int(alen[0]), int(raw_itype[0])
        body_at = orig_offs + 12
        if itype == GGUFValueType.STRING and count >= _BULK_MIN:
            end, size = self.scanned_ends.get(orig_offs), len(self.data)
            if end is None or end > size:
                end = self._walk_strings(orig_offs, body_at, count)
            body = self._get(body_at, np.uint8, end - body_at)
        elif itype in self.gguf_scalar_to_np and count >= _BULK_MIN:
            body = self._get(body_at, self.gguf_scalar_to_np[GGUFValueType(itype)], count)
            end = body_at + int(body.nbytes)
        else:
            return super()._get_field_parts(orig_offs, raw_type)
        if self._bulk is None:
            self._bulk = set()
        self._bulk.add(orig_offs)
        return end - orig_offs, [raw_itype, alen, body], [2], [GGUFValueType.ARRAY,
                                                             GGUFValueType(itype)]

    def _walk_strings(self, orig_offs: int, body_at: int, count: int) -> int:
        """Where the array of `count` length-prefixed strings at body_at ends."""
        end, size = body_at, len(self.data)
        plain, unpack = self._plain_view(), _U64.unpack_from
        for _ in range(count):  # lengths only: no view per element
            if end + 8 > size:
                raise ValueError(f"string array at {orig_offs} runs past the end of file")
            end += 8 + unpack(plain, end)[0]
            if end > size:
                raise ValueError(f"string array at {orig_offs} runs past the end of file")
        return end

    def _push_field(self, field: ReaderField, skip_sum: bool = False) -> int:
        # _build_fields makes a plain ReaderField of our parts: the value starts after the key
        # (8-byte length + key) and the 4-byte type, which is where _get_field_parts was called
        if self._bulk and field.types[:1] == [GGUFValueType.ARRAY] and \
                field.offset + 12 + len(field.name.encode()) in self._bulk:
            field = _BulkArrayField(*field)
        return super()._push_field(field, skip_sum)

    def _plain_view(self) -> np.ndarray:
        if self._plain is None or len(self._plain) != len(self.data):
            self._plain = self.data.view(np.ndarray)
        return self._plain

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> np.ndarray:  # type: ignore[override]
        # gguf-py's _get, on a plain ndarray view of the same map: slicing numpy's memmap
        # subclass costs several microseconds a call, and the reader makes one or two calls per
        # metadata array element (the header of a 49k-token vocabulary took seconds).
        count = int(count)
        dt = np.dtype(dtype)
        arr = self._plain_view()[offset:offset + dt.itemsize * count].view(dtype=dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        file_size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            ne = [int(d) for d in dims]
            ggml_type, n_bytes = validate.tensor_nbytes(int(raw_dtype[0]), ne, "GGUF", name)
            begin = int(start_offs + int(offset_tensor[0]))
            if begin + n_bytes > file_size:
                raise GGUFError(
                    f"tensor {name!r} ({ggml_type.name}, shape {ne}) needs bytes {begin}.."
                    f"{begin + n_bytes} but the file has only {file_size} bytes: the file is "
                    f"truncated or corrupt; download it again")
        super()._build_tensors(start_offs, fields)


# GGUFFile.keep's parses, by the file's identity (path, size, mtime, inode): at most one
_KEPT: dict[tuple, "GGUFFile"] = {}


def _identity(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino


class GGUFFile:
    """A validated, memory-mapped GGUF file: metadata as Python values and a tensor index."""

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GGUFFile":
        """GGUFFile(path), or the parse `keep` left for this file where it has not changed
        since (same path, size, mtime and inode), taken once."""
        try:
            kept = _KEPT.pop(_identity(Path(path)), None)
        except OSError:
            kept = None
        return kept if kept is not None and kept.reader is not None else cls(path)

    def keep(self) -> None:
        """Leave this parse for the next GGUFFile.open of the same unchanged file, in place of
        another: the CLI reads a model's training context before its load (cli.notices), and
        parsing the default model's header again cost the load 0.07 s. The one kept before,
        if any, is let go."""
        _KEPT.clear()
        try:
            _KEPT[_identity(self.path)] = self
        except OSError:
            pass

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFound(f"model file {str(self.path)!r} does not exist")
        if not self.path.is_file():
            raise ModelNotFound(f"{str(self.path)!r} is not a file; give the path of a .gguf")
        name = self.path.name
        try:
            self._check_header()
            with open(self.path, "rb") as f, \
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                # the map's length, not an earlier stat: every check is against these bytes
                self.file_size = len(buf)
                self.layout = validate.scan_layout(buf, self.file_size, name)
                validate.check_tensor_layout(self.layout, name)
            validate.check_metadata_types(self.layout, name)
            self.reader = _CheckedReader(self.path, "r", {kv.value_offset: kv.end
                                                          for kv in self.layout.kvs})
        except OSError as e:  # unreadable (permissions, I/O error): not a traceback
            raise GGUFError(f"{name}: cannot read the file ({e.strerror or e})") from None
        except (ValueError, IndexError, TypeError, OverflowError, UnicodeDecodeError,
                KeyError) as e:
            # The scan passed but the reader did not: the two disagree about the format.
            raise GGUFError(f"{name}: corrupt or truncated GGUF header ({e})") from None
        if (self.reader.data_offset != self.layout.data_offset
                or len(self.reader.tensors) != len(self.layout.tensors)):
            raise GGUFError(f"{name}: the GGUF reader and slipstream's header scan disagree "
                            f"(data at {self.reader.data_offset} or {self.layout.data_offset}); "
                            f"the header is corrupt")
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
        self._check_rope_freqs()

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
            hint = ("; this looks like a big-endian GGUF, which slipstream does not read"
                    if int.from_bytes(head[4:8], "big") in SUPPORTED_VERSIONS else "")
            raise GGUFError(f"{self.path.name}: unsupported GGUF version {version}; supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}{hint}")

    def _check_overlaps(self) -> None:
        spans = sorted(self.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if a.offset + a.n_bytes > b.offset:
                raise GGUFError(
                    f"tensor {a.name!r} ({a.ggml_type.name}, shape {list(a.shape)}) occupies "
                    f"{a.n_bytes} bytes, which runs into tensor {b.name!r}: its shape does not "
                    f"match the bytes stored for it")

    def _check_rope_freqs(self) -> None:
        """Llama 3's `rope_freqs` divisors (a few dozen floats) divide RoPE's frequencies: a
        zero, negative or non-finite one makes every logit NaN, so they are read now."""
        info = self.tensors.get("rope_freqs.weight")
        if info is None or info.ggml_type != GGMLQuantizationType.F32 or info.n_elements > 1 << 16:
            return
        values = np.frombuffer(self.tensor_bytes(info.name), dtype=np.float32)
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidMetadata(
                f"{self.path.name}: tensor 'rope_freqs.weight' has value {float(values[i])!r} "
                f"at index {i}; RoPE frequency divisors must be finite and positive; "
                f"{validate.FIX}")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise MissingMetadata(f"{self.path.name}: missing required metadata "
                                  f"'general.architecture'")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 view of the memory map."""
        info = self.tensors[name]
        return self.reader.data[info.offset: info.offset + info.n_bytes]

    def close(self) -> None:
        """Drop the reader and its memory map: the map and its file descriptor go as soon as
        no tensor viewing it is left (Model.close drops the weights first). A read of the
        tensor data started for a load (weights.loader.read_ahead) goes too."""
        self.reader = None
        self.__dict__.pop("_read_ahead", None)


def _field_value(field: Any) -> Any:
    """Decode one metadata field into plain Python values (str, int, float, bool, lists)."""
    try:
        value = field.contents()
    except Exception as e:  # a malformed value is a corrupt file, not a crash
        raise GGUFError(f"metadata field {field.name!r} cannot be decoded ({e})") from None
    if field.types and field.types[0] == GGUFValueType.STRING and isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return value
