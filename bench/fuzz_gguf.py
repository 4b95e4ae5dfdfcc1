"""A mutation fuzzer for GGUF loading: every damaged file must end in a SlipstreamError or load
and generate finite logits.

Valid seed files (small `slipstream.synth` models of several kinds, and optionally the default
SmolLM2 model) are parsed into a document (metadata entries, tensor infos, data), mutated, and
written back: metadata values, types, lengths and keys (the hyper-parameters and tokenizer keys
above all), tensor infos (type, shape, offset, name, count), the header counts, raw length and
type fields, truncation, byte flips and splices. Structured mutations can lay the data section
out again so that the file stays consistent and the deeper checks are reached.

Each case runs in a worker process under an address-space limit (RLIMIT_AS) and a timeout kept
by the parent: first what `load()` does before it allocates (GGUFFile, ModelConfig, Tokenizer,
ChatTemplate, the layer shapes, the tensor formats); a file that passes all of that, and a
sampled fraction of the others, then goes through `slipstream.load(path, device="cpu", ctx=64)`,
generates 2 tokens and has its logits checked. Outcomes:

    clean     a SlipstreamError (the file was refused with a message)
    ok        loaded, generated, finite logits
    uncaught  any other exception
    crash     the worker died by a signal
    hang      the case ran past the timeout
    memory    MemoryError / allocation failure, or the worker's peak RSS grew past the limit
    nan       loaded and generated, but the logits are not finite

    python bench/fuzz_gguf.py --cases 2000 --jobs 2                      # a quick run
    python bench/fuzz_gguf.py --cases 100000 --out bench/results/...json # the long run
    python bench/fuzz_gguf.py --seed 1 --repro 1234 --write bad.gguf    # one case's file

A case is a pure function of (--seed, case number, seed files), so any case can be rebuilt.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import math
import os
import random
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
# FUZZ_GGUF_SRC: fuzz another copy of slipstream's sources (an older commit, for comparison)
SRC = Path(os.environ.get("FUZZ_GGUF_SRC") or REPO / "src")
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

from slipstream.modelfile import validate  # noqa: E402

BAD = ("uncaught", "crash", "hang", "memory", "nan")
OUTCOMES = ("clean", "ok") + BAD + ("harness",)  # harness: the fuzzer's own failure

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


# -- mutations --------------------------------------------------------------------------------

INTS = [0, 1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 257, 1000, 1023,
        1024, 4095, 4096, 65535, 65536, 2**20, 2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
        2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -64, -2**31, -2**63]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, 1e-38, 1e-30, 1e-12, 1e-6, 1e-5, 0.999, 1.5,
          1e3, 1e6, 1e12, 1e30, 1e38, 3.5e38, 1e300, math.nan, -math.nan, math.inf, -math.inf,
          -1e-5, 2.0**24]
STRINGS = [b"", b" ", b"\x00", b"\xff\xfe", b"\xed\xa0\x80", b"\xc3", b"llama", b"qwen2",
           b"mistral", b"mamba", b"gpt2", b"bert", b"llama3", b"none", b"linear", b"yarn",
           b"smollm", b"llama-bpe", b"qwen2", b"tekken", b"A" * 5000, b"\xe2\x96\x81",
           b"{{", b"{% if %}", b"{{ messages[0]['content'] }}", b"<|eot_id|>",
           b"{% for m in messages %}{{ m }}{% endfor %}", "\u0130\u1e9e".encode()]

HYPER_KEYS = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "attention.value_length",
              "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
              "rope.scaling.type", "rope.scaling.factor", "context_length", "vocab_size"]
TOKENIZER_KEYS = ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
                  "tokenizer.chat_template", "general.architecture", "general.alignment",
                  "general.name"]
# the value type each known key is written with, for keys a mutation adds
KEY_TYPES = {"block_count": 4, "embedding_length": 4, "feed_forward_length": 4,
             "attention.head_count": 4, "attention.head_count_kv": 4,
             "attention.key_length": 4, "attention.value_length": 4,
             "attention.layer_norm_rms_epsilon": 6, "rope.dimension_count": 4,
             "rope.freq_base": 6, "rope.scaling.type": STRING, "rope.scaling.factor": 6,
             "context_length": 4, "vocab_size": 4, "tokenizer.ggml.model": STRING,
             "tokenizer.ggml.pre": STRING, "tokenizer.ggml.tokens": ARRAY,
             "tokenizer.ggml.token_type": ARRAY, "tokenizer.ggml.merges": ARRAY,
             "tokenizer.ggml.scores": ARRAY, "tokenizer.ggml.bos_token_id": 4,
             "tokenizer.ggml.eos_token_id": 4, "tokenizer.ggml.unknown_token_id": 4,
             "tokenizer.ggml.padding_token_id": 4, "tokenizer.ggml.eot_token_id": 4,
             "tokenizer.ggml.add_bos_token": BOOL, "tokenizer.ggml.add_eos_token": BOOL,
             "tokenizer.ggml.add_space_prefix": BOOL, "tokenizer.chat_template": STRING,
             "general.architecture": STRING, "general.alignment": 4, "general.name": STRING}


def rand_int(rng: random.Random, orig: Any = None) -> int:
    r = rng.random()
    if isinstance(orig, int) and not isinstance(orig, bool) and r < 0.4:
        return rng.choice([orig + 1, orig - 1, orig * 2, orig // 2, orig + 2, orig * 1000,
                           -orig, orig * 3, orig + 64, orig - 64, orig // 3])
    if r < 0.9:
        return rng.choice(INTS)
    return rng.randrange(-2**63, 2**64)


def rand_float(rng: random.Random, orig: Any = None) -> float:
    if isinstance(orig, float) and rng.random() < 0.3:
        return rng.choice([orig * 10, orig / 10, -orig, orig * 1e30, orig * 1e-30, orig + 1])
    if rng.random() < 0.85:
        return rng.choice(FLOATS)
    return struct.unpack("<f", rng.randbytes(4))[0]


def rand_str(rng: random.Random, orig: Any = None) -> bytes:
    if isinstance(orig, bytes) and orig and rng.random() < 0.4:
        i = rng.randrange(len(orig))
        op = rng.randrange(4)
        if op == 0:
            return orig[:i]
        if op == 1:
            return orig[:i] + bytes([rng.randrange(256)]) + orig[i + 1:]
        if op == 2:
            return orig + orig
        return orig[:i] + rng.randbytes(rng.randint(1, 8)) + orig[i:]
    if rng.random() < 0.9:
        return rng.choice(STRINGS)
    return rng.randbytes(rng.randint(0, 64))


def rand_value(rng: random.Random, t: int, orig: Any = None) -> Any:
    if t == STRING:
        return rand_str(rng, orig)
    if t in (6, 12):
        return rand_float(rng, orig)
    if t == BOOL:
        return rng.choice([0, 1, 2, 255])
    return rand_int(rng, orig)


def mutate_array(rng: random.Random, kv: KV, doc: Doc) -> str:
    items = kv.value
    n = len(items)
    op = rng.choice(["set", "set", "drop", "dup", "truncate", "empty", "append", "swap",
                     "copy-other", "shrink-one", "grow-one"])
    if op == "empty" or not items:
        kv.value = []
        return "empty"
    i = rng.randrange(n)
    if op == "set":
        it = kv.itype if kv.itype is not None else 4
        if kv.key == b"tokenizer.ggml.merges" and rng.random() < 0.6:
            v = rng.choice([b"", b"a", b" ", b"a b c", b"zz qq", b" e", b"e ", b"\xc4\xa0 ",
                            b"\xc4\xa0 \xc4\xa0", items[rng.randrange(n)]])
        elif kv.key == b"tokenizer.ggml.tokens" and rng.random() < 0.6:
            v = rng.choice([b"", items[rng.randrange(n)], b"<|eot_id|>", b"A" * 3000,
                            b"\xff", b"<0xZZ>", b"<0x41>", b" "])
        elif kv.key == b"tokenizer.ggml.token_type" and rng.random() < 0.6:
            v = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, -1, 255, 2**31 - 1])
        else:
            v = rand_value(rng, it, items[i])
        items[i] = v
        return f"set[{i}]={v!r:.40}"
    if op == "drop":
        del items[i]
        return f"drop[{i}]"
    if op == "dup":
        items.insert(i, items[i])
        return f"dup[{i}]"
    if op == "truncate":
        k = rng.randrange(n)
        kv.value = items[:k]
        return f"truncate->{k}"
    if op == "append":
        it = kv.itype if kv.itype is not None else 4
        items.append(rand_value(rng, it))
        return "append"
    if op == "swap":
        j = rng.randrange(n)
        items[i], items[j] = items[j], items[i]
        return f"swap[{i},{j}]"
    if op == "shrink-one":
        kv.value = items[:-1]
        return "shrink-one"
    if op == "grow-one":
        items.append(items[-1] if kv.key != b"tokenizer.ggml.tokens" else b"<|extra|>")
        return "grow-one"
    other = rng.choice([k for k in doc.kvs if k.vtype == ARRAY] or [kv])
    kv.value, kv.itype = list(other.value), other.itype
    return f"copy-from={other.key.decode(errors='replace')}"


def m_kv_value(doc: Doc, rng: random.Random) -> str:
    """A metadata value: a known hyper-parameter / tokenizer key most of the time."""
    r = rng.random()
    if r < 0.45:
        key = f"{doc.arch()}.{rng.choice(HYPER_KEYS)}"
    elif r < 0.8:
        key = rng.choice(TOKENIZER_KEYS)
    else:
        key = rng.choice(doc.kvs).key.decode()
    kv = doc.kv(key)
    if kv is None:  # add it
        t = KEY_TYPES.get(key.split(".", 1)[1] if key.startswith(doc.arch() + ".") else key, 4)
        if t == ARRAY:
            kv = KV(key.encode(), ARRAY, [rand_value(rng, 4) for _ in range(rng.randint(0, 8))],
                    4)
        else:
            kv = KV(key.encode(), t, rand_value(rng, t))
        doc.kvs.insert(rng.randrange(len(doc.kvs) + 1), kv)
        return f"add {key}={kv.value!r:.60}"
    if kv.vtype == ARRAY:
        return f"{key}: " + mutate_array(rng, kv, doc)
    kv.value = rand_value(rng, kv.vtype, kv.value)
    return f"{key}={kv.value!r:.60}"


def m_kv_type(doc: Doc, rng: random.Random) -> str:
    """A metadata value's type (its value converted, or kept as bits)."""
    kv = rng.choice(doc.kvs) if rng.random() < 0.4 else (
        doc.kv(f"{doc.arch()}.{rng.choice(HYPER_KEYS)}") or doc.kv(rng.choice(TOKENIZER_KEYS))
        or rng.choice(doc.kvs))
    old = kv.vtype
    new = rng.choice([t for t in TYPE_IDS if t != old] + [13, 99, 2**31])
    if new == ARRAY:
        kv.itype = old if old != ARRAY else rng.choice(TYPE_IDS[:9])
        kv.value = kv.value if isinstance(kv.value, list) else [kv.value]
        if rng.random() < 0.3:  # a per-layer array of a hyper-parameter
            kv.value = kv.value * rng.randint(1, 4)
    elif old == ARRAY:
        kv.value = kv.value[0] if kv.value else 0
        kv.itype = None
    if new == STRING and not isinstance(kv.value, bytes):
        kv.value = str(kv.value).encode()
    elif new not in (STRING, ARRAY) and isinstance(kv.value, bytes):
        kv.value = len(kv.value)
    elif new not in (STRING, ARRAY) and isinstance(kv.value, list):
        kv.value = 0
    kv.vtype = new
    return f"{kv.key.decode(errors='replace')}: type {old}->{new}"


def m_kv_structure(doc: Doc, rng: random.Random) -> str:
    """Delete, duplicate, rename or reorder metadata entries."""
    op = rng.choice(["delete", "delete-known", "duplicate", "rename", "rename-arch", "swap"])
    i = rng.randrange(len(doc.kvs))
    kv = doc.kvs[i]
    if op == "delete":
        del doc.kvs[i]
        return f"delete {kv.key.decode()}"
    if op == "delete-known":
        key = rng.choice([f"{doc.arch()}.{k}" for k in HYPER_KEYS] + TOKENIZER_KEYS)
        doc.kvs = [k for k in doc.kvs if k.key != key.encode()]
        return f"delete {key}"
    if op == "duplicate":
        doc.kvs.insert(rng.randrange(len(doc.kvs) + 1), copy.deepcopy(kv))
        return f"duplicate {kv.key.decode()}"
    if op == "rename":
        new = rand_str(rng, kv.key)
        old, kv.key = kv.key, new
        return f"rename {old.decode()}->{new!r:.40}"
    if op == "rename-arch":
        arch = rng.choice([b"llama", b"qwen2", b"mistral", b"mamba", b"gemma"])
        cur = doc.arch().encode()
        for k in doc.kvs:
            if k.key.startswith(cur + b"."):
                k.key = arch + k.key[len(cur):]
        a = doc.kv("general.architecture")
        if a is not None and rng.random() < 0.7:
            a.value = arch
        return f"architecture keys -> {arch.decode()}"
    j = rng.randrange(len(doc.kvs))
    doc.kvs[i], doc.kvs[j] = doc.kvs[j], doc.kvs[i]
    return f"swap kv {i},{j}"


SAME_SIZE = [[0, 26], [1, 30, 17], [2, 12, 20, 40], [6, 13], [11, 21], [16, 35], [23, 39],
             [28, 27]]


def m_tensor(doc: Doc, rng: random.Random) -> str:
    """A tensor info: type, shape, offset, name; or the table itself. Half of the time the data
    section is laid out again so that the file stays consistent."""
    t = rng.choice(doc.tensors)
    name = t.name.decode(errors="replace")
    op = rng.choice(["type", "type-same-size", "dims", "dims-same-count", "ndims", "offset",
                     "rename", "delete", "add", "swap", "alignment"])
    if op == "type":
        new = rng.choice(list(range(42)) + [99, 2**31, 2**32 - 1])
        desc = f"{name}: type {t.type_id}->{new}"
        t.type_id = new
    elif op == "type-same-size":
        group = next((g for g in SAME_SIZE if t.type_id in g), [t.type_id, 0, 1])
        new = rng.choice(group)
        desc = f"{name}: type {t.type_id}->{new} (same size)"
        t.type_id = new
    elif op == "dims":
        k = rng.randrange(len(t.dims))
        old = t.dims[k]
        t.dims[k] = rand_int(rng, old)
        desc = f"{name}: ne[{k}] {old}->{t.dims[k]}"
    elif op == "dims-same-count":
        if len(t.dims) >= 2 and t.dims[1] % 2 == 0:
            t.dims[0], t.dims[1] = t.dims[0] * 2, t.dims[1] // 2
        else:
            t.dims = t.dims[::-1]
        desc = f"{name}: dims -> {t.dims}"
    elif op == "ndims":
        if rng.random() < 0.5 and len(t.dims) > 1:
            t.dims = t.dims[:-1]
        else:
            t.dims = t.dims + [rng.choice([1, 1, 2, 0])] * rng.randint(1, 4)
        desc = f"{name}: dims -> {t.dims}"
    elif op == "offset":
        old = t.offset
        t.offset = rng.choice([old + 1, old - 1, old + 32, old - 32, 0, old * 2, 2**63,
                               2**64 - 32, old + 4096, rand_int(rng, old)])
        return f"{name}: offset {old}->{t.offset}"  # never laid out again: that would undo it
    elif op == "rename":
        layer = rng.choice([0, 1, 2, 5, 99, 2**40])
        choices = [name.replace("blk.0.", f"blk.{layer}.").replace("blk.1.", f"blk.{layer}."),
                   rng.choice(doc.tensors).name.decode(), "x" * 70, "", "token_embd.weight",
                   "output.weight", "rope_freqs.weight", name + ".bias", name[:-1]]
        new = rng.choice(choices)
        desc = f"rename {name}->{new[:40]}"
        t.name = new.encode()
    elif op == "delete":
        doc.tensors.remove(t)
        desc = f"delete {name}"
    elif op == "add":
        new = TI(rng.choice([b"blk.2.attn_q.weight", b"extra.weight", b"rope_freqs.weight",
                             b"output.weight", b"blk.0.attn_q.bias"]),
                 rng.choice([[8], [64], [64, 64], [32, 4], [1]]), rng.choice([0, 1, 8, 26]),
                 doc.tensors[-1].offset, (0, 64))
        doc.tensors.insert(rng.randrange(len(doc.tensors) + 1), new)
        desc = f"add {new.name.decode()} {new.dims} type {new.type_id}"
    elif op == "swap":
        i, j = rng.randrange(len(doc.tensors)), rng.randrange(len(doc.tensors))
        doc.tensors[i], doc.tensors[j] = doc.tensors[j], doc.tensors[i]
        desc = f"swap tensor infos {i},{j}"
    else:
        align = rng.choice([0, 1, 3, 8, 16, 64, 4096, 2**31, 2**32 - 1])
        doc.kvs = [k for k in doc.kvs if k.key != b"general.alignment"]
        doc.kvs.append(KV(b"general.alignment", rng.choice([4, 4, 4, 5, 10]), align))
        desc = f"general.alignment={align}"
    if rng.random() < 0.5:
        relayout(doc, rng, rng.choice(["orig", "random", "repeat"]))
        desc += " (relaid)"
    return desc


STRUCTURED: dict[str, Callable[[Doc, random.Random], str]] = {
    "kv-value": m_kv_value, "kv-type": m_kv_type, "kv-structure": m_kv_structure,
    "tensor": m_tensor,
}


def _fields(lay: validate.Layout) -> tuple[list[int], list[int]]:
    """Offsets of the u64 and u32 fields of a header (lengths, counts, dims, offsets; types)."""
    u64 = [8, 16]
    u32 = [4]
    for k in lay.kvs:
        u64.append(k.offset)
        u32.append(k.type_offset)
        if k.count_offset is not None:
            u32.append(k.count_offset - 4)
            u64.append(k.count_offset)
        elif k.vtype == STRING:
            u64.append(k.value_offset)
        elif k.vtype in (4, 5):
            u32.append(k.value_offset)
        elif k.vtype in (10, 11):
            u64.append(k.value_offset)
    for t in lay.tensors:
        u64 += [t.offset] + [t.n_dims_offset + 4 + 8 * i for i in range(len(t.dims))]
        u64.append(t.data_offset_offset)
        u32 += [t.n_dims_offset, t.type_offset]
    return u64, u32


def raw_mutation(buf: bytearray, lay: validate.Layout,
                 rng: random.Random) -> tuple[bytes, str, str]:
    """One mutation of the raw bytes: (the new bytes, its class, a description)."""
    data, desc, op = _raw_mutation(buf, lay, rng)
    return data, op, desc


def _raw_mutation(buf: bytearray, lay: validate.Layout,
                  rng: random.Random) -> tuple[bytes, str, str]:
    op = rng.choice(["counts", "u64", "u64", "u32", "u32", "array-count", "elem-length",
                     "truncate", "truncate", "flip", "flip", "splice", "version", "data"])
    head_end = max(min(lay.data_offset, len(buf)), 25)
    if len(buf) <= head_end:
        op = rng.choice(["counts", "truncate"])
    if op == "counts":
        at = rng.choice([8, 16])
        (old,) = struct.unpack_from("<Q", buf, at)
        new = rand_int(rng, old) & (2**64 - 1)
        struct.pack_into("<Q", buf, at, new)
        return bytes(buf), f"{'tensor' if at == 8 else 'kv'}_count {old}->{new}", op
    if op in ("u64", "u32"):
        u64, u32 = _fields(lay)
        at = rng.choice(u64 if op == "u64" else u32)
        f = "<Q" if op == "u64" else "<I"
        (old,) = struct.unpack_from(f, buf, at)
        new = rand_int(rng, old) & (2**64 - 1 if op == "u64" else 2**32 - 1)
        struct.pack_into(f, buf, at, new)
        return bytes(buf), f"{op} at {at}: {old}->{new}", op
    if op == "array-count":
        arrays = [k for k in lay.kvs if k.count_offset is not None]
        if arrays:
            k = rng.choice(arrays)
            new = rand_int(rng, k.count) & (2**64 - 1)
            struct.pack_into("<Q", buf, k.count_offset, new)
            return bytes(buf), f"{k.key}: array count {k.count}->{new}", op
        op = "truncate"
    if op == "elem-length":
        arrays = [k for k in lay.kvs if k.item_type == STRING and k.count]
        if arrays:
            k = rng.choice(arrays)
            j = rng.randrange(min(k.count, 4096))
            at = k.count_offset + 8
            for _ in range(j):
                if at + 8 > len(buf):
                    break
                at += 8 + struct.unpack_from("<Q", buf, at)[0]
            if at + 8 <= len(buf):
                (old,) = struct.unpack_from("<Q", buf, at)
                new = rand_int(rng, old) & (2**64 - 1)
                struct.pack_into("<Q", buf, at, new)
                return bytes(buf), f"{k.key}[{j}]: string length {old}->{new}", op
        op = "truncate"
    if op == "truncate":
        r = rng.random()
        if r < 0.4:
            cut = rng.randrange(len(buf))
        elif r < 0.8:
            cut = rng.randrange(min(head_end + 64, len(buf)))
        else:
            cut = len(buf) - rng.randint(1, 64)
        return bytes(buf[:cut]), f"truncate to {cut} of {len(buf)}", op
    if op == "flip":
        n = rng.choice([1, 1, 2, 4, 8, 16])
        where = []
        for _ in range(n):
            at = rng.randrange(24 if rng.random() < 0.9 else 0, head_end)
            buf[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
            where.append(at)
        return bytes(buf), f"flip {n} header bytes at {where[:4]}", op
    if op == "splice":
        at = rng.randrange(24, head_end)
        if rng.random() < 0.5:  # (insert or delete)
            n = rng.randint(1, 64)
            return bytes(buf[:at] + rng.randbytes(n) + buf[at:]), f"insert {n} bytes at {at}", op
        n = rng.randint(1, 64)
        return bytes(buf[:at] + buf[at + n:]), f"delete {n} bytes at {at}", op
    if op == "version":
        v = rng.choice([0, 1, 2, 4, 0x03000000, 2**32 - 1])
        struct.pack_into("<I", buf, 4, v)
        return bytes(buf), f"version {v}", op
    # data: the tensor bytes themselves (NaN/Inf scales and the like)
    n = rng.choice([1, 4, 64])
    for _ in range(n):
        at = rng.randrange(head_end, len(buf))
        buf[at] = rng.randrange(256)
    return bytes(buf), f"data: {n} random bytes", op


@dataclass
class Seed:
    name: str
    path: Path
    data: bytes
    doc: Doc
    layout: validate.Layout
    weight: float


def load_seed(name: str, path: Path, weight: float) -> Seed:
    data = Path(path).read_bytes()
    doc = parse(data)
    assert serialize(doc) == data, f"{name}: parse/serialize does not round-trip"
    lay = validate.scan_layout(data, len(data), name)
    return Seed(name, Path(path), data, doc, lay, weight)


def make_case(seeds: list[Seed], seed: int, case: int) -> tuple[Seed, bytes, str, str]:
    """Case `case` of run `seed`: (its seed file, the mutated bytes, the mutation class and a
    description). A pure function of its arguments."""
    rng = random.Random(f"{seed}:{case}")
    s = rng.choices(seeds, weights=[x.weight for x in seeds])[0]
    steps = 1 if rng.random() < 0.8 else rng.randint(2, 3)
    descs, classes = [], []
    doc = None
    raw_data: bytes | None = None
    for k in range(steps):
        if rng.random() < 0.6:
            if raw_data is not None:
                break  # structured mutations come first
            doc = doc or copy.deepcopy(s.doc)
            cls = rng.choice(list(STRUCTURED))
            try:
                descs.append(STRUCTURED[cls](doc, rng))
            except (IndexError, ValueError):
                descs.append(f"{cls}: no-op")
            classes.append(cls)
        else:
            if raw_data is None:
                raw_data = serialize(doc) if doc is not None else s.data
            try:
                lay = validate.scan_layout(raw_data, len(raw_data), "case")
            except Exception:
                lay = s.layout if doc is None else None
            if lay is None:
                break
            try:
                raw_data, op, d = raw_mutation(bytearray(raw_data), lay, rng)
            except (struct.error, IndexError, ValueError):  # a stale layout: cut the file
                cut = rng.randrange(len(raw_data) + 1)
                raw_data, op, d = raw_data[:cut], "truncate", f"truncate to {cut} (fallback)"
            descs.append(d)
            classes.append("raw-" + op)
    data = raw_data if raw_data is not None else (serialize(doc) if doc is not None else s.data)
    return s, data, "+".join(classes) or "none", "; ".join(descs)


# -- running one case (in a worker) -----------------------------------------------------------

def _mem_error(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text or \
        "DefaultCPUAllocator" in text or "not enough memory" in text


def check_file(path: Path, full: bool, prompt: str = "Hello world, the") -> dict:
    """What load() does before allocating; then, for a file that passes (or `full`), a real
    load, 2 generated tokens and the logits. Returns {'outcome', 'stage', 'error', ...}."""
    import torch

    import slipstream
    from slipstream import quant
    from slipstream.modelfile.chat_template import ChatTemplate
    from slipstream.modelfile.config import ModelConfig
    from slipstream.errors import NonFiniteLogits, SlipstreamError
    from slipstream.modelfile.gguf_file import GGUFFile
    from slipstream.modelfile.tokenizer import Tokenizer
    from slipstream.weights.loader import check_layer_shapes

    res: dict[str, Any] = {}

    def fail(stage: str, e: BaseException) -> dict:
        if isinstance(e, SlipstreamError):
            outcome = "clean"
        elif _mem_error(e):
            outcome = "memory"
        else:
            outcome = "uncaught"
        res.update(outcome=outcome, stage=stage, error=type(e).__name__,
                   message=" ".join(str(e).split())[:300])
        if isinstance(e, NonFiniteLogits):
            res["nonfinite"] = True
        if outcome != "clean":
            res["traceback"] = traceback.format_exc()[-2000:]
        return res

    try:
        gf = GGUFFile(path)
        try:
            cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
            Tokenizer.from_metadata(gf.metadata)
            ChatTemplate.from_metadata(gf.metadata)
            check_layer_shapes(gf, cfg)
            for info in gf.tensors.values():
                quant.get_format(info.ggml_type)
        finally:
            gf.close()
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        fail("validate", e)
        if not full:
            return res
    res["accepted"] = "outcome" not in res
    prevalidated = dict(res)
    try:
        model = slipstream.load(path, device="cpu", ctx=64)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        out = fail("load", e)
        if prevalidated.get("outcome") not in (None, "clean") and out["outcome"] == "clean":
            out.update({k: v for k, v in prevalidated.items()})
        return out
    if "outcome" in prevalidated and prevalidated["outcome"] != "clean":
        return prevalidated
    try:
        with model:
            ids = model.tokenize(prompt)
            events = list(model.generate(ids, max_tokens=2, seed=0))
            logits = model.logits(ids)
            finite = bool(torch.isfinite(logits).all())
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return fail("generate", e)
    if "outcome" in prevalidated:
        # refused by the checks above but loaded by load(): the two paths disagree
        return {"outcome": "uncaught", "stage": "load",
                "error": "LoadedDespiteValidation", "message": prevalidated.get("message", "")}
    res.update(outcome="ok" if finite else "nan", stage="generate", tokens=[e.id for e in events])
    return res


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so that the next case's
    peak is its own and not one the harness set while building the case (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset (ru_maxrss cannot be reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_main(args: argparse.Namespace) -> None:
    """Read case numbers from stdin, answer one JSON line each on stdout."""
    limit = int(args.mem_limit_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    seeds = [load_seed(n, Path(p), w) for n, p, w in json.loads(args.seeds)]
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    path = tmp / "case.gguf"
    # the answers go through a copy of fd 1; fd 1 itself (anything the code under test
    # prints, from Python or C) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # FUZZ_GGUF_INJECT="12:hang,13:crash,14:rss,15:uncaught": faults for testing the harness
    inject = dict(x.split(":") for x in os.environ.get("FUZZ_GGUF_INJECT", "").split(",") if x)
    check_file(seeds[0].path, full=True)  # warm up: imports, first load
    # What the warm-up made lives on: moved out of the collector's sight, so that the
    # gc.collect() before each case costs ~1 ms instead of ~35 (torch makes many objects).
    gc.collect()
    gc.freeze()
    resettable = _reset_peak_rss()
    base = _peak_rss()
    out.write(json.dumps({"ready": True, "base_rss": base}) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            case = int(line)
            rng = random.Random(f"{args.seed}:{case}:mode")
            try:
                s, data, cls, desc = make_case(seeds, args.seed, case)
            except Exception as e:  # the fuzzer's own bug: reported, not counted as slipstream's
                out.write(json.dumps({"outcome": "harness", "case": case,
                                      "message": f"make_case: {type(e).__name__}: {e}"}) + "\n")
                out.flush()
                continue
            path.write_bytes(data)
            size = len(data)
            del data  # the case's own bytes are not what is measured
            full = rng.random() < args.full_fraction
            gc.collect()
            rss_now = _current_rss()
            if resettable:
                _reset_peak_rss()
            peak_before = _peak_rss()
            t0 = time.perf_counter()
            fault = inject.get(str(case))
            if fault == "hang":
                time.sleep(3600)
            elif fault == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif fault == "rss":
                blob = bytearray(args.mem_growth_mib * 2**20 + 2**28)
                blob[::4096] = b"x" * len(blob[::4096])
                del blob
            res = check_file(path, full) if fault != "uncaught" else {
                "outcome": "uncaught", "stage": "validate", "error": "ValueError",
                "message": "injected"}
            res.update(case=case, seed_file=s.name, cls=cls, desc=desc[:300], full=full,
                       size=size, seconds=round(time.perf_counter() - t0, 4))
            # The case's growth: its peak above the RSS it started from. With the peak mark
            # reset before each case that is exact; without it (no clear_refs), growth is seen
            # only when the case sets a new peak for the process, and a worker whose peak
            # drifts past half the limit is replaced, so that no growth past the limit can
            # hide under an earlier peak.
            peak = _peak_rss()
            growth = peak - rss_now if resettable or peak > peak_before else 0
            res["peak_growth_mib"] = growth >> 20
            limit = args.mem_growth_mib * 2**20
            if growth > limit and res["outcome"] in ("clean", "ok"):
                res["clean_outcome"] = res["outcome"]
                res.update(outcome="memory", message=f"peak RSS grew {growth >> 20} MiB during "
                                                     f"the case (limit {args.mem_growth_mib} MiB)")
            res.pop("traceback", None) if res["outcome"] in ("clean", "ok") else None
            retire = (_current_rss() if resettable else peak) - base > limit // 2
            if retire:
                res["retire"] = True  # the parent starts a fresh worker
            out.write(json.dumps(res, default=str) + "\n")
            out.flush()
            if retire:
                break
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


# -- the parent -------------------------------------------------------------------------------

class Worker:
    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.buf = b""

    def start(self, timeout: float) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.buf = b""
        self.eof = False
        ready = self.read(timeout)
        if not ready or not ready.get("ready"):
            raise RuntimeError(f"fuzz worker did not start: {ready}")

    def read(self, timeout: float) -> dict | None:
        """One JSON line, or None on timeout / EOF (check self.proc.poll())."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.eof = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"outcome": "crash", "message": f"garbled answer {line[:200]!r}"}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc = None


SMOLLM_WEIGHT = 0.05  # against 9 for the synth seeds: ~0.55% of cases, ~1.4 s each


def make_seeds(directory: Path, smollm: Path | None = None,
               only: str | None = None) -> list[tuple[str, str, float]]:
    """The seed files: (name, path, weight). Small models of several kinds, so that a case
    parses in milliseconds; the real default model, rarely, when given. `only`: that seed
    file alone (e.g. "smollm2")."""
    from slipstream.synth import SynthShape, write_synth

    micro = SynthShape(hidden=64, ffn=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab=300,
                       context=512, rope_base=10000.0)
    specs = [
        ("micro-llama-q8", dict(shape=micro, quant_mix="Q8_0"), 4.0),
        ("micro-qwen2-f16", dict(shape=micro, quant_mix="F16", arch="qwen2"), 2.0),
        ("micro-tied-ropefreqs", dict(shape=micro, quant_mix="Q8_0", tie_embeddings=True,
                                      rope_freqs=True), 2.0),
        ("tiny-q4km", dict(shape="tiny", quant_mix="Q4_K_M", from_floats=True, std=0.05), 1.0),
    ]
    out = []
    for name, kw, w in specs:
        p = directory / f"{name}.gguf"
        if not p.exists():
            write_synth(p, **kw)
        out.append((name, str(p), w))
    if smollm is not None:
        out.append(("smollm2", str(smollm), SMOLLM_WEIGHT))
    if only is not None:
        out = [x for x in out if x[0] == only]
        if not out:
            raise SystemExit(f"no seed file named {only!r}")
    return out


def fuzz(cases: int, seed: int = 0, jobs: int = 1, full_fraction: float = 0.05,
         smollm: Path | None = None, mem_limit_gib: float = 6.0, mem_growth_mib: int = 1024,
         timeout: float = 60.0, time_limit: float | None = None, start: int = 0,
         workdir: Path | None = None, progress: Callable[[str], None] | None = None,
         checkpoint: Path | None = None, resume: dict | None = None,
         only: str | None = None) -> dict:
    """Run cases start..start+cases over `jobs` workers; returns the report (counts by outcome,
    by mutation class and by error class, and every bad case). `resume`: a partial report of
    the same run (written every 2000 cases to `checkpoint`) to carry on from."""
    t0 = time.time()
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-seeds-")) if own else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = make_seeds(workdir, smollm, only)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seed", str(seed),
            "--seeds", json.dumps(seeds), "--full-fraction", str(full_fraction),
            "--mem-limit-gib", str(mem_limit_gib), "--mem-growth-mib", str(mem_growth_mib)]
    seed_info = [{"name": n, "weight": w, "bytes": os.path.getsize(p)} for n, p, w in seeds]
    source = source_state()
    counts: Counter = Counter()
    by_class: dict[str, Counter] = defaultdict(Counter)
    by_seed: dict[str, Counter] = defaultdict(Counter)
    errors: Counter = Counter()
    stages: Counter = Counter()
    bad: list[dict] = []
    extra = Counter()
    lock = threading.Lock()
    end = start + cases
    done = [0]
    completed: set[int] = set()  # case numbers done beyond `through`
    through = [start]  # every case below this is done
    elapsed_before = 0.0
    if resume is not None:
        if resume["seed"] != seed or resume["first_case"] != start:
            raise SystemExit("--resume: the report is of another run (seed or first case)")
        counts.update(resume["counts"])
        extra.update({k: resume[k] for k in ("full_loads", "accepted_by_validation",
                                             "clean_nonfinite_logits") if k in resume})
        stages.update(resume["by_outcome_stage"])
        errors.update(resume["clean_error_classes"])
        for k, v in resume["by_mutation"].items():
            by_class[k].update(v)
        for k, v in resume["by_seed_file"].items():
            by_seed[k].update(v)
        bad.extend(resume["bad_cases"])
        done[0] = resume["cases"]
        through[0] = resume["completed_through"]
        completed.update(resume["completed_beyond"])
        elapsed_before = resume["elapsed_s"]
    next_case = [through[0]]
    deadline = None if time_limit is None else t0 + time_limit

    def record(res: dict) -> None:
        with lock:
            done[0] += 1
            if isinstance(res.get("case"), int):
                completed.add(res["case"])
                while through[0] in completed:
                    completed.discard(through[0])
                    through[0] += 1
            o = res["outcome"]
            counts[o] += 1
            by_class[res.get("cls", "?").split("+")[0]][o] += 1
            by_seed[res.get("seed_file", "?")][o] += 1
            stages[f"{o}:{res.get('stage', '?')}"] += 1
            if o == "clean":
                errors[res.get("error", "?")] += 1
            if res.get("full"):
                extra["full_loads"] += 1
            if res.get("accepted"):
                extra["accepted_by_validation"] += 1
            if res.get("nonfinite"):
                extra["clean_nonfinite_logits"] += 1
            if o in BAD or o == "harness":
                bad.append(res)
                if progress:
                    progress(f"BAD case {res.get('case')} [{o}] {res.get('seed_file')} "
                             f"{res.get('desc', '')[:120]} -> {res.get('error', '')}: "
                             f"{res.get('message', '')[:200]}")
            if progress and done[0] % 500 == 0:
                progress(f"{done[0]} cases, {time.time() - t0:.0f}s: {dict(counts)}")
            if checkpoint is not None and done[0] % 2000 == 0:
                _write_json(checkpoint, {**report(), "partial": True})

    def take() -> int | None:
        with lock:
            while next_case[0] in completed:  # done before a resume
                next_case[0] += 1
            if next_case[0] >= end or (deadline is not None and time.time() > deadline):
                return None
            next_case[0] += 1
            return next_case[0] - 1

    def run_worker() -> None:
        try:
            serve()
        except Exception as e:  # never lose cases silently: the report says so
            record({"outcome": "harness", "message": f"worker thread: {type(e).__name__}: {e}"})

    def serve() -> None:
        w = Worker(argv)
        w.start(max(timeout, 120.0))
        try:
            while (case := take()) is not None:
                try:
                    w.proc.stdin.write(f"{case}\n".encode())
                    w.proc.stdin.flush()
                except BrokenPipeError:  # it died after its last answer: a fresh one
                    w.kill()
                    w.start(max(timeout, 120.0))
                    w.proc.stdin.write(f"{case}\n".encode())
                    w.proc.stdin.flush()
                res = w.read(timeout)
                if res is None:
                    rc = w.proc.poll()
                    if rc is None and w.eof:  # it closed its output: it is exiting
                        try:
                            rc = w.proc.wait(30)
                        except subprocess.TimeoutExpired:
                            rc = None
                    if rc is None:
                        res = {"outcome": "hang", "message": f"no answer in {timeout:.0f}s"}
                    elif rc < 0:
                        res = {"outcome": "crash", "message": f"worker died by signal {-rc}"}
                    else:
                        res = {"outcome": "crash", "message": f"worker exited with {rc}"}
                    res["case"] = case
                    try:
                        s_file, _, cls, desc = make_case(_seed_objs(seeds), seed, case)
                        res.update(seed_file=s_file.name, cls=cls, desc=desc[:300])
                    except Exception as e:
                        res.update(desc=f"(make_case failed: {type(e).__name__})")
                    w.kill()
                    record(res)
                    w.start(max(timeout, 120.0))
                    continue
                record(res)
                if w.proc.poll() is not None or res.get("retire"):
                    w.kill()
                    w.start(max(timeout, 120.0))
        finally:
            w.kill()

    def report() -> dict:
        return {
            "seed": seed, "cases": done[0], "first_case": start, "requested_cases": cases,
            "source": source,
            "completed_through": through[0], "completed_beyond": sorted(completed),
            "elapsed_s": round(elapsed_before + time.time() - t0, 1), "jobs": jobs,
            "full_fraction": full_fraction, "mem_limit_gib": mem_limit_gib,
            "mem_growth_mib": mem_growth_mib, "timeout_s": timeout,
            "seeds": seed_info,
            "counts": {o: counts.get(o, 0) for o in OUTCOMES},
            "bad_total": sum(counts.get(o, 0) for o in BAD),
            "harness_errors": counts.get("harness", 0),
            **dict(extra),
            "by_outcome_stage": dict(sorted(stages.items())),
            "by_mutation": {k: dict(v) for k, v in sorted(by_class.items())},
            "by_seed_file": {k: dict(v) for k, v in sorted(by_seed.items())},
            "clean_error_classes": dict(errors.most_common()),
            "bad_cases": bad[:200],
        }

    threads = [threading.Thread(target=run_worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if own:
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()
    with lock:
        return report()


def source_state() -> dict:
    """What was fuzzed: the repository's commit and a hash of slipstream's sources as they
    were (the working tree may differ from the commit)."""
    h = hashlib.sha256()
    for f in sorted((SRC / "slipstream").rglob("*.py")):
        h.update(str(f.relative_to(SRC)).encode() + b"\0" + f.read_bytes())
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                                capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"src": str(SRC), "commit": commit, "src_sha256": h.hexdigest()[:16]}


def format_table(report: dict) -> str:
    """The report as a short text table: outcomes, then outcomes by mutation class and by
    seed file, then the clean errors by class."""
    cols = [o for o in OUTCOMES if o != "harness" or report["counts"].get(o)]
    rate = report["cases"] / max(report["elapsed_s"], 1e-9)
    src = report.get("source", {})
    lines = [f"GGUF mutation fuzzer (bench/fuzz_gguf.py): seed {report['seed']}, cases "
             f"{report['first_case']}..{report['first_case'] + report['cases'] - 1}, "
             f"{report['cases']} cases in {report['elapsed_s']:.0f} s ({rate:.1f} cases/s, "
             f"{report['jobs']} worker(s)); sources {src.get('commit', '?')[:10]} "
             f"+ tree {src.get('src_sha256', '?')}",
             f"bad (uncaught, crash, hang, memory, nan): {report['bad_total']}; cases put "
             f"through load() whatever the checks said (sampled): "
             f"{report.get('full_loads', 0)}; refused at generation by NonFiniteLogits (counted "
             f"clean): {report.get('clean_nonfinite_logits', 0)}", ""]

    def table(title: str, rows: dict[str, dict]) -> None:
        w = max([len(title)] + [len(k) for k in rows])
        lines.append(f"{title:<{w}}  " + "  ".join(f"{c:>8}" for c in cols) + f"  {'total':>8}")
        for k, v in rows.items():
            lines.append(f"{k:<{w}}  " + "  ".join(f"{v.get(c, 0):>8}" for c in cols)
                         + f"  {sum(v.values()):>8}")
        lines.append("")

    table("outcome", {"all cases": report["counts"]})
    table("mutation class", report["by_mutation"])
    table("seed file", report["by_seed_file"])
    lines.append("clean errors by class: " + ", ".join(
        f"{k} {v}" for k, v in report["clean_error_classes"].items()))
    for b in report["bad_cases"][:20]:
        lines.append(f"BAD case {b.get('case')} [{b['outcome']}] {b.get('seed_file')} "
                     f"{b.get('cls')}: {b.get('desc')} -> {b.get('error', '')}: "
                     f"{b.get('message', '')[:200]}")
    return "\n".join(lines).rstrip() + "\n"


def _write_json(path: Path, obj: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


_SEED_CACHE: dict[str, list[Seed]] = {}


def _seed_objs(seeds: list[tuple[str, str, float]]) -> list[Seed]:
    key = json.dumps(seeds)
    if key not in _SEED_CACHE:
        _SEED_CACHE[key] = [load_seed(n, Path(p), w) for n, p, w in seeds]
    return _SEED_CACHE[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--full-fraction", type=float, default=0.05,
                    help="fraction of refused files also put through load() (accepted files "
                         "always are)")
    ap.add_argument("--only", default=None, help="fuzz this seed file alone (e.g. smollm2)")
    ap.add_argument("--smollm", default=None,
                    help="path of the default model to use as a rare seed, or 'auto' (the "
                         "cached copy, if any)")
    ap.add_argument("--mem-limit-gib", type=float, default=6.0, help="RLIMIT_AS of a worker")
    ap.add_argument("--mem-growth-mib", type=int, default=1024,
                    help="peak-RSS growth of a worker over its warmed-up size that counts as a "
                         "memory blow-up")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case (a hang)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop taking new cases after this many seconds")
    ap.add_argument("--out", default=None, help="write the JSON report here (and a partial one "
                                                "every 2000 cases)")
    ap.add_argument("--resume", action="store_true",
                    help="carry on from the partial report in --out (same --seed, --start)")
    ap.add_argument("--workdir", default=None, help="keep the seed files here")
    ap.add_argument("--repro", type=int, default=None, help="rebuild this case's file")
    ap.add_argument("--write", default=None, help="with --repro: where to write it")
    ap.add_argument("--table-from", default=None,
                    help="write the .txt table of this JSON report next to it, and print it")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seeds", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.table_from:
        report = json.loads(Path(args.table_from).read_text())
        text = format_table(report)
        Path(args.table_from).with_suffix(".txt").write_text(text)
        print(text, end="")
        return
    smollm = None
    if args.smollm == "auto":
        from slipstream.hub.pull import default_model_path

        cand = default_model_path()
        smollm = cand if cand.exists() else None
    elif args.smollm:
        smollm = Path(args.smollm)
    if args.repro is not None:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fuzz-seeds-"))
        seeds = _seed_objs(make_seeds(workdir, smollm, args.only))
        s, data, cls, desc = make_case(seeds, args.seed, args.repro)
        out = Path(args.write or f"fuzz-case-{args.seed}-{args.repro}.gguf")
        out.write_bytes(data)
        print(f"case {args.repro}: seed file {s.name}, {cls}: {desc}\nwritten to {out}")
        res = check_file(out, full=True)
        print(json.dumps(res, indent=1, default=str))
        return
    report = fuzz(args.cases, args.seed, args.jobs, args.full_fraction, smollm,
                  args.mem_limit_gib, args.mem_growth_mib, args.timeout, args.time_limit,
                  args.start, Path(args.workdir) if args.workdir else None,
                  progress=lambda m: print(m, flush=True),
                  checkpoint=Path(args.out) if args.out else None,
                  resume=json.loads(Path(args.out).read_text()) if args.resume else None,
                  only=args.only)
    if args.out:
        _write_json(Path(args.out), report)
        Path(args.out).with_suffix(".txt").write_text(format_table(report))
    summary = {k: report[k] for k in ("cases", "elapsed_s", "counts", "bad_total")}
    print(json.dumps(summary, indent=1))
    for b in report["bad_cases"][:20]:
        print(f"BAD case {b.get('case')} [{b['outcome']}] {b.get('seed_file')} {b.get('cls')}: "
              f"{b.get('desc')} -> {b.get('error', '')}: {b.get('message', '')[:200]}")


if __name__ == "__main__":
    main()
