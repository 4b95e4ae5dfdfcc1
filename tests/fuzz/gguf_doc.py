"""A GGUF file as values, for the mutation fuzzer (fuzz_gguf.py) and the tests that damage files
on purpose: parse() a file into a Doc (metadata entries, tensor infos, data), edit it, and
serialize() it back; relayout() lays the data section out again so that offsets stay
consistent and the deeper checks are reached."""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from slipstream.modelfile import validate

# -- the document: a GGUF file as values ------------------------------------------------------

STRING, ARRAY, BOOL = 8, 9, 7
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q",
        12: "d"}
_UFMT = {1: "B", 2: "H", 4: "I", 8: "Q"}
TYPE_IDS = list(range(13))


@dataclass
class KV:
    key: bytes
    vtype: int
    value: Any  # int/float, bytes (string), list (array)
    itype: int | None = None  # array element type


@dataclass
class TI:
    name: bytes
    dims: list[int]
    type_id: int
    offset: int
    src: tuple[int, int] = (0, 0)  # (offset, n_bytes) of its bytes in the seed's data section


@dataclass
class Doc:
    version: int
    kvs: list[KV]
    tensors: list[TI]
    data: bytes  # the data section

    def kv(self, key: str) -> KV | None:
        k = key.encode()
        return next((kv for kv in self.kvs if kv.key == k), None)

    def arch(self) -> str:
        kv = self.kv("general.architecture")
        return kv.value.decode() if kv is not None and isinstance(kv.value, bytes) else "llama"


def _read_scalar(buf: bytes, pos: int, t: int) -> tuple[Any, int]:
    f = _FMT[t]
    (v,) = struct.unpack_from("<" + f, buf, pos)
    return v, pos + struct.calcsize(f)


def _read_value(buf: bytes, pos: int, t: int) -> tuple[Any, int, int | None]:
    if t == STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return bytes(buf[pos + 8:pos + 8 + n]), pos + 8 + n, None
    if t == ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype == STRING:
            out = []
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, pos)
                out.append(bytes(buf[pos + 8:pos + 8 + n]))
                pos += 8 + n
            return out, pos, itype
        f = _FMT[itype]
        out = list(struct.unpack_from(f"<{count}{f}", buf, pos))
        return out, pos + count * struct.calcsize(f), itype
    v, pos = _read_scalar(buf, pos, t)
    return v, pos, None


def parse(buf: bytes) -> Doc:
    """A valid GGUF's bytes as a Doc (the seed files only: validate.scan_layout checks them)."""
    lay = validate.scan_layout(buf, len(buf), "seed")
    validate.check_tensor_layout(lay, "seed")
    kvs = []
    for k in lay.kvs:
        value, _, itype = _read_value(buf, k.value_offset, k.vtype)
        kvs.append(KV(k.key.encode(), k.vtype, value, itype))
    tensors = [TI(t.name.encode(), list(t.dims), t.type_id, t.rel_offset,
                  (t.rel_offset, t.n_bytes)) for t in lay.tensors]
    return Doc(lay.version, kvs, tensors, bytes(buf[lay.data_offset:]))


def _pack_scalar(t: int, v: Any) -> bytes:
    f = _FMT[t]
    if f in "fd":
        try:
            return struct.pack("<" + f, float(v))
        except (OverflowError, ValueError, TypeError):
            return struct.pack("<" + f, math.copysign(math.inf, float(v) if _num(v) else 1.0))
    size = struct.calcsize(f)
    iv = int(v) if _num(v) and not (isinstance(v, float) and not math.isfinite(v)) else 0
    return struct.pack("<" + _UFMT[size], iv & ((1 << (8 * size)) - 1))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float))


def _pack_str(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _pack_value(t: int, v: Any, itype: int | None) -> bytes:
    if t == STRING:
        return _pack_str(v if isinstance(v, bytes) else str(v).encode())
    if t == ARRAY:
        items = v if isinstance(v, list) else [v]
        it = itype if itype is not None else 4
        body = b"".join(_pack_value(it, x, None) for x in items) if it != ARRAY else b""
        return struct.pack("<IQ", it, len(items)) + body
    if t not in _FMT:  # an unknown type id: what follows is whatever bytes we give it
        return b""
    return _pack_scalar(t, v)


def alignment_of(doc: Doc) -> int:
    kv = doc.kv("general.alignment")
    if kv is not None and kv.vtype == 4 and isinstance(kv.value, int) and kv.value > 0 \
            and not kv.value & (kv.value - 1) and kv.value <= 1 << 16:
        return kv.value
    return validate.DEFAULT_ALIGNMENT  # (a huge alignment is left inconsistent, not padded)


def serialize(doc: Doc, tensor_count: int | None = None, kv_count: int | None = None) -> bytes:
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", doc.version & 0xFFFFFFFF,
                       len(doc.tensors) if tensor_count is None else tensor_count,
                       len(doc.kvs) if kv_count is None else kv_count)
    for kv in doc.kvs:
        out += _pack_str(kv.key) + struct.pack("<I", kv.vtype & 0xFFFFFFFF)
        out += _pack_value(kv.vtype, kv.value, kv.itype)
    for t in doc.tensors:
        out += _pack_str(t.name) + struct.pack("<I", len(t.dims))
        out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.dims)
        out += struct.pack("<IQ", t.type_id & 0xFFFFFFFF, t.offset & (2**64 - 1))
    align = alignment_of(doc)
    out += bytes(-len(out) % align)
    out += doc.data
    return bytes(out)


def tensor_size(t: TI) -> int | None:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
    except (ValueError, KeyError):
        return None
    if not t.dims or any(d <= 0 for d in t.dims) or t.dims[0] % block:
        return None
    n = math.prod(t.dims) // block * size
    return n if n <= 1 << 26 else None  # larger ones keep their size: a cheap inconsistent file


def relayout(doc: Doc, rng: random.Random, fill: str = "orig") -> None:
    """Lay the data section out again for the tensors' current types and shapes, each tensor's
    bytes taken from its seed bytes (cut or extended: zeros, random, or repeated)."""
    align = alignment_of(doc)
    data = bytearray()
    old = doc.data
    for t in doc.tensors:
        n = tensor_size(t)
        if n is None:
            n = t.src[1]
        t.offset = len(data)
        src = old[t.src[0]:t.src[0] + min(n, t.src[1])]
        if len(src) < n:
            more = n - len(src)
            if fill == "random":
                src += rng.randbytes(more)
            elif fill == "repeat" and src:
                src = (src * (n // len(src) + 1))[:n]
            else:
                src += bytes(more)
        data += src
        data += bytes(-len(data) % align)
    doc.data = bytes(data)


