"""The fuzzer's mutations of a GGUF document (gguf_doc) and its seed files: metadata values,
types, lengths and keys, tensor infos, the header counts, raw length and type fields,
truncation, byte flips and splices; and the loud ones, which a load must refuse or warn about:
absurd block scales, norms and biases, and tensors renamed to a near name. A case is a pure function of (seed, case number, seed
files)."""

from __future__ import annotations

import copy
import json
import math
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from slipstream.modelfile import validate

from gguf_doc import (ARRAY, BOOL, KV, STRING, TI, TYPE_IDS, Doc, parse, relayout, serialize,
                      tensor_size)
from gguf_loud import LOUD, loud_names  # noqa: F401  (re-exported for the worker)

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
    "tensor": m_tensor, **LOUD,
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
            # a loud mutation comes alone, on the seed's own layout, so that what it damaged
            # is what the load reads
            cls = rng.choice([c for c in STRUCTURED if k == 0 or c not in LOUD])
            try:
                descs.append(STRUCTURED[cls](doc, rng))
            except (IndexError, ValueError):
                descs.append(f"{cls}: no-op")
            classes.append(cls)
            if cls in LOUD:
                break
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


_SEED_CACHE: dict[str, list[Seed]] = {}


def _seed_objs(seeds: list[tuple[str, str, float]]) -> list[Seed]:
    key = json.dumps(seeds)
    if key not in _SEED_CACHE:
        _SEED_CACHE[key] = [load_seed(n, Path(p), w) for n, p, w in seeds]
    return _SEED_CACHE[key]


