"""Validation of hostile or damaged GGUF files, before anything is allocated or computed.

`scan_layout` walks a GGUF header with `struct` alone and checks every count and length against
the bytes that remain in the file, so that `gguf.GGUFReader` (which trusts them: a huge array
count makes it loop for hours, one numpy view per element) only ever runs on a header whose
shape is known to fit. `check_tensor_layout` checks each tensor's type, shape and byte size and
the layout of the data section, as llama.cpp does: every tensor starts exactly where the one
before it ends (padded to the alignment), so there are no gaps, no overlaps, and the data ends
where the file ends. `check_metadata_types` checks the types of the metadata keys slipstream
reads; the `md_*` helpers that read hyper-parameters with ranges (ModelConfig.from_metadata)
are modelfile.hparams', re-exported here.

Every failure is a GGUFError subclass (UnsupportedTensorType for an unknown type) whose message
names the field and the offending value, and says what to do.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import GGUFLayoutError, InvalidMetadata, TensorInfoError, UnsupportedTensorType
# the md_* readers live in hparams (no gguf import), for the modules that need only them
from .hparams import FIX, md_float, md_int, md_ints, md_str  # noqa: F401 (re-exported)

HEADER_BYTES = 24  # magic, version, tensor count, kv count
DEFAULT_ALIGNMENT = 32

# Bounds on what a header may declare, far above any real model (the largest have a few
# thousand tensors, ~50 metadata keys and vocabularies of ~260k tokens) but low enough that
# gguf-py, which makes a numpy view per array element, finishes parsing in seconds.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 21
MAX_TOTAL_ARRAY_ELEMENTS = 1 << 23
MAX_KEY_BYTES = 1 << 16
MAX_TENSOR_NAME = 63  # llama.cpp's GGML_MAX_NAME (64) less the terminating NUL
MAX_DIMS = 4  # GGML_MAX_DIMS

_T = GGUFValueType
_SCALAR_SIZE = {_T.UINT8: 1, _T.INT8: 1, _T.UINT16: 2, _T.INT16: 2, _T.UINT32: 4, _T.INT32: 4,
                _T.FLOAT32: 4, _T.BOOL: 1, _T.UINT64: 8, _T.INT64: 8, _T.FLOAT64: 8}
_MIN_SIZE = {**_SCALAR_SIZE, _T.STRING: 8, _T.ARRAY: 12}  # smallest encoding of one value
_INTS = frozenset({_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64,
                   _T.INT64})
_FLOATS = frozenset({_T.FLOAT32, _T.FLOAT64})
_MIN_KV = 8 + 4 + 1  # key length, value type, one byte of value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass
class KVInfo:
    """Where one metadata entry lies in the file (for error messages and the fuzzer)."""

    key: str
    offset: int  # of the key's length field
    type_offset: int
    vtype: int
    value_offset: int
    end: int
    item_type: int | None = None  # arrays: the element type
    count: int | None = None  # arrays: the element count
    count_offset: int | None = None  # arrays: where the count lies


@dataclass
class RawTensorInfo:
    """One tensor-info record as stored (GGUF order: ne[0] is the row length)."""

    name: str
    offset: int  # of the name's length field
    n_dims_offset: int
    dims: list[int]
    type_offset: int
    type_id: int
    data_offset_offset: int  # where the tensor's data offset lies
    rel_offset: int  # the tensor's data offset, relative to the data section
    end: int
    # filled in by check_tensor_layout
    ggml_type: GGMLQuantizationType | None = None
    n_bytes: int = 0


@dataclass
class Layout:
    """The validated shape of a GGUF header."""

    file_size: int
    version: int
    tensor_count: int
    kv_count: int
    kvs: list[KVInfo] = field(default_factory=list)
    tensors: list[RawTensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    infos_end: int = 0  # first byte after the tensor-info table
    data_offset: int = 0  # start of the data section (infos_end padded to the alignment)


class _Cursor:
    def __init__(self, buf: Any, size: int, name: str):
        self.buf, self.size, self.name, self.pos = buf, size, name, 0

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            raise GGUFLayoutError(
                f"{self.name}: {what} at byte {self.pos} needs {n} bytes but only {left} remain "
                f"in the {self.size}-byte file; {FIX}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, max_len: int | None = None) -> bytes:
        at = self.pos
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise GGUFLayoutError(f"{self.name}: {what} at byte {at} has length {n}, more than "
                                  f"the {max_len} allowed; {FIX}")
        self.need(n, f"{what} ({n} bytes)")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s


def _value_type(raw: int, what: str, name: str, at: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFLayoutError(f"{name}: {what} at byte {at} has unknown value type id {raw} "
                              f"(valid: 0..12); {FIX}") from None


def _decode(raw: bytes, what: str, name: str, at: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GGUFLayoutError(f"{name}: {what} at byte {at} is not valid UTF-8 ({raw[:40]!r}: "
                              f"{e.reason}); {FIX}") from None


def scan_layout(buf: Any, size: int, name: str) -> Layout:
    """Walk the header in `buf` (bytes, mmap or memoryview of a file of `size` bytes), checking
    every count and length against the bytes that remain. Raises GGUFError subclasses."""
    if size < HEADER_BYTES:
        raise GGUFLayoutError(f"{name}: file is {size} bytes, too short for a GGUF header "
                              f"({HEADER_BYTES} bytes); it is truncated")
    version, = _U32.unpack_from(buf, 4)
    tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
    left = size - HEADER_BYTES
    if kv_count > MAX_KV or kv_count * _MIN_KV > left:
        raise GGUFLayoutError(
            f"{name}: the header declares {kv_count} metadata entries (GGUF kv_count, byte 16) "
            f"but {left} bytes follow the header, room for at most {left // _MIN_KV} "
            f"(and at most {MAX_KV} are accepted); {FIX}")
    if tensor_count > MAX_TENSORS or kv_count * _MIN_KV + tensor_count * _MIN_TENSOR_INFO > left:
        room = (left - kv_count * _MIN_KV) // _MIN_TENSOR_INFO
        raise GGUFLayoutError(
            f"{name}: the header declares {tensor_count} tensors (GGUF tensor_count, byte 8) "
            f"but the bytes after the header have room for at most {max(room, 0)} tensor "
            f"infos (and at most {MAX_TENSORS} are accepted); {FIX}")
    lay = Layout(size, version, tensor_count, kv_count)
    cur = _Cursor(buf, size, name)
    cur.pos = HEADER_BYTES
    seen: set[str] = set()
    total_elements = 0
    for i in range(kv_count):
        at = cur.pos
        raw_key = cur.string(f"key of metadata entry {i}", MAX_KEY_BYTES)
        key = _decode(raw_key, f"key of metadata entry {i}", name, at)
        if key in seen:
            raise GGUFLayoutError(f"{name}: metadata key {key!r} appears twice (entry {i} at "
                                  f"byte {at}); {FIX}")
        seen.add(key)
        type_at = cur.pos
        vtype = _value_type(cur.u32(f"value type of {key!r}"), f"metadata {key!r}", name,
                            type_at)
        kv = KVInfo(key, at, type_at, int(vtype), cur.pos, 0)
        if vtype == _T.ARRAY:
            item_at = cur.pos
            itype = _value_type(cur.u32(f"element type of array {key!r}"),
                                f"element type of array {key!r}", name, item_at)
            if itype == _T.ARRAY:
                raise GGUFLayoutError(f"{name}: metadata {key!r} is an array of arrays, which "
                                      f"GGUF readers do not support; {FIX}")
            kv.item_type, kv.count_offset = int(itype), cur.pos
            count = cur.u64(f"element count of array {key!r}")
            kv.count = count
            room = (size - cur.pos) // _MIN_SIZE[itype]
            if count > room or count > MAX_ARRAY_ELEMENTS:
                raise GGUFLayoutError(
                    f"{name}: metadata array {key!r} declares {count} {itype.name} elements "
                    f"(count at byte {kv.count_offset}) but the {size - cur.pos} bytes left in "
                    f"the file hold at most {room} (and at most {MAX_ARRAY_ELEMENTS} are "
                    f"accepted); {FIX}")
            total_elements += count
            if total_elements > MAX_TOTAL_ARRAY_ELEMENTS:
                raise GGUFLayoutError(
                    f"{name}: the metadata arrays hold more than {MAX_TOTAL_ARRAY_ELEMENTS} "
                    f"elements in all (reached at {key!r}); {FIX}")
            if itype == _T.STRING:
                pos, buf_, end = cur.pos, buf, size
                for j in range(count):
                    if end - pos < 8:
                        cur.pos = pos
                        cur.need(8, f"length of element {j} of {key!r}")
                    (n,) = _U64.unpack_from(buf_, pos)
                    pos += 8
                    if n > end - pos:
                        cur.pos = pos - 8
                        raise GGUFLayoutError(
                            f"{name}: element {j} of metadata array {key!r} (byte {pos - 8}) "
                            f"has length {n} but only {end - pos} bytes remain; {FIX}")
                    pos += n
                cur.pos = pos
            else:
                n = count * _SCALAR_SIZE[itype]
                cur.need(n, f"the {count} elements of {key!r}")
                cur.pos += n
        elif vtype == _T.STRING:
            cur.string(f"value of {key!r}")
        else:
            cur.need(_SCALAR_SIZE[vtype], f"value of {key!r}")
            cur.pos += _SCALAR_SIZE[vtype]
        kv.end = cur.pos
        lay.kvs.append(kv)

    names: set[str] = set()
    for i in range(tensor_count):
        at = cur.pos
        raw_name = cur.string(f"name of tensor info {i}", 1 << 16)
        tname = _decode(raw_name, f"name of tensor info {i}", name, at)
        if len(raw_name) > MAX_TENSOR_NAME:
            raise TensorInfoError(f"{name}: tensor name {tname[:80]!r} (tensor info {i}, byte "
                                  f"{at}) is {len(raw_name)} bytes long; GGUF allows at most "
                                  f"{MAX_TENSOR_NAME}; {FIX}")
        if tname in names:
            raise TensorInfoError(f"{name}: tensor {tname!r} appears twice in the tensor table "
                                  f"(tensor info {i}, byte {at}); {FIX}")
        names.add(tname)
        nd_at = cur.pos
        n_dims = cur.u32(f"dimension count of tensor {tname!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise TensorInfoError(f"{name}: tensor {tname!r} has {n_dims} dimensions (byte "
                                  f"{nd_at}); GGUF tensors have 1 to {MAX_DIMS}; {FIX}")
        cur.need(8 * n_dims, f"dimensions of tensor {tname!r}")
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, cur.pos))
        cur.pos += 8 * n_dims
        type_at = cur.pos
        type_id = cur.u32(f"type of tensor {tname!r}")
        off_at = cur.pos
        rel = cur.u64(f"data offset of tensor {tname!r}")
        lay.tensors.append(RawTensorInfo(tname, at, nd_at, dims, type_at, type_id, off_at, rel,
                                         cur.pos))
    lay.infos_end = cur.pos

    align_kv = next((kv for kv in lay.kvs if kv.key == "general.alignment"), None)
    if align_kv is not None:
        if align_kv.vtype != _T.UINT32:
            raise InvalidMetadata(f"{name}: metadata 'general.alignment' has type "
                                  f"{GGUFValueType(align_kv.vtype).name}, expected UINT32; {FIX}")
        (align,) = _U32.unpack_from(buf, align_kv.value_offset)
        if align == 0 or align & (align - 1) or align > 1 << 24:
            raise InvalidMetadata(f"{name}: metadata 'general.alignment' is {align}; it must be "
                                  f"a power of two (32 by default, at most {1 << 24}); {FIX}")
        lay.alignment = align
    lay.data_offset = _pad(lay.infos_end, lay.alignment)
    return lay


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def tensor_nbytes(type_id: int, dims: list[int], name: str, tname: str) -> tuple[
        GGMLQuantizationType, int]:
    """The type and byte size of a tensor of GGML type `type_id` and GGUF dims `dims`, after
    checking the dims are positive and whole blocks."""
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedTensorType(f"{name}: tensor {tname!r} has unknown GGML type id "
                                    f"{type_id}; {FIX}") from None
    if ggml_type not in GGML_QUANT_SIZES:
        raise UnsupportedTensorType(f"{name}: tensor {tname!r} has GGML type "
                                    f"{ggml_type.name}, which has no defined size") from None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if any(d <= 0 for d in dims):
        raise TensorInfoError(f"{name}: tensor {tname!r} has a non-positive dimension in shape "
                              f"{dims}; {FIX}")
    if dims[0] % block_size:
        raise TensorInfoError(
            f"{name}: tensor {tname!r}: row length {dims[0]} is not a multiple of the "
            f"{ggml_type.name} block size {block_size}, so shape {dims} does not match any byte "
            f"size; {FIX}")
    return ggml_type, math.prod(dims) // block_size * type_size


def check_tensor_layout(lay: Layout, name: str) -> None:
    """Each tensor's type, shape and extent, and the data section's layout: tensor i starts
    where tensor i-1 ends padded to the alignment (llama.cpp's rule), the first at 0, and the
    data ends at the end of the file (up to the last tensor's padding)."""
    expected = 0
    prev: RawTensorInfo | None = None
    for t in lay.tensors:
        t.ggml_type, t.n_bytes = tensor_nbytes(t.type_id, t.dims, name, t.name)
        desc = f"{t.name!r} ({t.ggml_type.name}, shape {t.dims})"
        if t.n_bytes > lay.file_size:
            raise TensorInfoError(f"{name}: tensor {desc} would take {t.n_bytes} bytes, more "
                                  f"than the whole {lay.file_size}-byte file; {FIX}")
        if t.rel_offset % lay.alignment:
            raise TensorInfoError(
                f"{name}: tensor {t.name!r} has data offset {t.rel_offset}, which is not a "
                f"multiple of the file's alignment {lay.alignment}; {FIX}")
        begin = lay.data_offset + t.rel_offset
        if begin + t.n_bytes > lay.file_size:
            raise GGUFLayoutError(
                f"{name}: tensor {desc} needs bytes {begin}..{begin + t.n_bytes} but the file "
                f"has only {lay.file_size} bytes: the file is truncated or corrupt; download it "
                f"again")
        if prev is not None and t.rel_offset < expected:
            raise TensorInfoError(
                f"{name}: tensor {prev.name!r} ({prev.ggml_type.name}, shape {prev.dims}) "
                f"occupies {prev.n_bytes} bytes, which runs into tensor {t.name!r} at data "
                f"offset {t.rel_offset}: its type or shape does not match the bytes stored for "
                f"it; {FIX}")
        if t.rel_offset != expected:
            after = (f"where tensor {prev.name!r} ({prev.ggml_type.name}, shape {prev.dims}, "
                     f"{prev.n_bytes} bytes) ends" if prev is not None else
                     "at the start of the data section")
            raise TensorInfoError(
                f"{name}: tensor {t.name!r} has data offset {t.rel_offset}, but the data "
                f"section puts it at {expected}, {after}: {t.rel_offset - expected} bytes are "
                f"unaccounted for, so a type, shape or offset in the tensor table is wrong; "
                f"{FIX}")
        expected = t.rel_offset + _pad(t.n_bytes, lay.alignment)
        prev = t
    if prev is not None:
        end = lay.data_offset + prev.rel_offset + prev.n_bytes
        if lay.file_size > lay.data_offset + expected:
            raise GGUFLayoutError(
                f"{name}: the tensor data ends at byte {end} but the file has "
                f"{lay.file_size} bytes: {lay.file_size - end} bytes after the last tensor "
                f"({prev.name!r}) belong to no tensor, so the tensor count or the tensor table "
                f"is wrong; {FIX}")


# -- metadata types ---------------------------------------------------------------------------

_INT, _FLOAT, _BOOL, _STR = "integer", "float", "bool", "string"
_GENERAL_KEYS: dict[str, tuple[str, bool]] = {  # key -> (kind, array of it?)
    "general.architecture": (_STR, False),
    "general.name": (_STR, False),
    "tokenizer.ggml.model": (_STR, False),
    "tokenizer.ggml.pre": (_STR, False),
    "tokenizer.ggml.tokens": (_STR, True),
    "tokenizer.ggml.token_type": (_INT, True),
    "tokenizer.ggml.scores": (_FLOAT, True),
    "tokenizer.ggml.merges": (_STR, True),
    "tokenizer.ggml.add_bos_token": (_BOOL, False),
    "tokenizer.ggml.add_eos_token": (_BOOL, False),
    "tokenizer.ggml.add_space_prefix": (_BOOL, False),
    "tokenizer.chat_template": (_STR, False),
    **{f"tokenizer.ggml.{t}_token_id": (_INT, False)
       for t in ("bos", "eos", "unknown", "padding", "eot", "eom", "sep", "cls", "mask")},
}
_ARCH_KEYS: dict[str, tuple[str, bool | None]] = {  # None: scalar or per-layer array
    "context_length": (_INT, False),
    "embedding_length": (_INT, False),
    "block_count": (_INT, False),
    "feed_forward_length": (_INT, None),
    "vocab_size": (_INT, False),
    "attention.head_count": (_INT, None),
    "attention.head_count_kv": (_INT, None),
    "attention.key_length": (_INT, False),
    "attention.value_length": (_INT, False),
    "attention.layer_norm_rms_epsilon": (_FLOAT, False),
    "rope.dimension_count": (_INT, False),
    "rope.freq_base": (_FLOAT, False),
    "rope.scaling.type": (_STR, False),
    "rope.scaling.factor": (_FLOAT, False),
}


def _kind_ok(kind: str, t: int) -> bool:
    if kind == _INT:
        return t in _INTS
    if kind == _FLOAT:
        return t in _FLOATS or t in _INTS
    if kind == _BOOL:
        return t == _T.BOOL or t in _INTS
    return t == _T.STRING


def check_metadata_types(lay: Layout, name: str) -> None:
    """The metadata keys slipstream reads have the types it expects (any integer width for an
    integer, an integer or float for a float), so that no value of the wrong kind reaches
    int(), float() or the tokenizer."""
    for kv in lay.kvs:
        spec = _GENERAL_KEYS.get(kv.key)
        if spec is None and "." in kv.key:
            spec = _ARCH_KEYS.get(kv.key.split(".", 1)[1])
        if spec is None:
            continue
        kind, is_array = spec
        got = GGUFValueType(kv.vtype).name
        if kv.vtype == _T.ARRAY:
            got = f"ARRAY of {GGUFValueType(kv.item_type).name}"
            ok = is_array is not False and (kv.count == 0 or _kind_ok(kind, kv.item_type))
        else:
            ok = is_array is not True and _kind_ok(kind, kv.vtype)
        if not ok:
            a = "an" if kind[0] in "aeiou" else "a"
            want = f"an array of {kind}s" if is_array else f"{a} {kind}"
            if is_array is None:
                want = f"{a} {kind} or an array of {kind}s"
            raise InvalidMetadata(f"{name}: metadata {kv.key!r} has type {got}, expected {want}; "
                                  f"{FIX}")
