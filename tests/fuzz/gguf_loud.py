"""The fuzzer's loud mutations: damage to one tensor the model reads that a load must refuse
or warn about, naming the tensor (gguf_check.check_file counts a load that does neither as
"silent"): a block scale, a norm or a bias set to a non-finite or absurd value, or a tensor
renamed to a near name. Each is written from ggml-common.h's block structs, not from
slipstream's own table (weights.checks.SCALE_FIELDS), so that the two are checked against each
other. A loud mutation comes alone in a case, on the seed's own layout (make_case)."""

from __future__ import annotations

import math
import random
import struct
from typing import Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from gguf_doc import TI, Doc, tensor_size

# GGML type id -> byte offsets of the block's f16 scales (d, and dmin or m where it has one)
F16_SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,),
              12: (0, 2), 13: (0, 2), 14: (208,)}
# beyond any bound a loader could keep for a scale (trained models' stay below 10)
ABSURD_SCALES = [math.nan, -math.nan, math.inf, -math.inf, 65504.0, -65504.0, 1e4, -2048.0,
                 1100.0]
# norms and biases: non-finite, or past float16's range (65504) and so past any bound
ABSURD_VECTOR = [math.nan, math.inf, -math.inf, 1e38, -1e38, 1e5, -7e4]


def _data_tensors(doc: Doc) -> list[TI]:
    """Tensors whose data lies where the tensor table says (the seed's layout)."""
    return [t for t in doc.tensors if (n := tensor_size(t)) is not None
            and t.offset + n <= len(doc.data)]


def _poke(doc: Doc, at: int, fmt: str, value: float) -> None:
    data = bytearray(doc.data)
    struct.pack_into(fmt, data, at, value)
    doc.data = bytes(data)


def m_data_scale(doc: Doc, rng: random.Random) -> str:
    """One f16 block scale of a quantized tensor set to a non-finite or absurd value (a file
    of float weights gets a norm or bias instead)."""
    quantized = [t for t in _data_tensors(doc) if t.type_id in F16_SCALES]
    if not quantized:
        return m_data_vector(doc, rng)
    t = rng.choice(quantized)
    type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)][1]
    block = rng.randrange(tensor_size(t) // type_size)
    offset = rng.choice(F16_SCALES[t.type_id])
    value = rng.choice(ABSURD_SCALES)
    _poke(doc, t.offset + block * type_size + offset, "<e", value)
    return f"{t.name.decode()}: f16 scale at byte {offset} of block {block} -> {value}"


def m_data_vector(doc: Doc, rng: random.Random) -> str:
    """One element of a norm or bias (F32/F16 vectors) set to a non-finite or absurd value."""
    vectors = [t for t in _data_tensors(doc) if len(t.dims) == 1 and t.type_id in (0, 1)
               and (t.name.endswith(b"norm.weight") or t.name.endswith(b".bias"))]
    t = rng.choice(vectors)
    i = rng.randrange(t.dims[0])
    value = rng.choice(ABSURD_VECTOR)
    if t.type_id == 0:
        _poke(doc, t.offset + 4 * i, "<f", value)
    else:  # f16: past its range is inf
        _poke(doc, t.offset + 2 * i, "<e", value if abs(value) <= 65504 else
              math.copysign(math.inf, value))
    return f"{t.name.decode()}: element {i} -> {value}"


def m_rename_near(doc: Doc, rng: random.Random) -> str:
    """A tensor renamed to a near name (a typo, a suffix): above all the ones a model reads
    only where present (the head, QKV biases, rope_freqs), which a loader could skip."""
    names = [t.name.decode() for t in doc.tensors]
    optional = [n for n in names if n in ("output.weight", "rope_freqs.weight")
                or n.endswith(".bias")]
    old = rng.choice(optional) if optional and rng.random() < 0.7 else rng.choice(names)
    for _ in range(20):
        op = rng.randrange(4)
        if op == 0:
            new = old + rng.choice(["_", ".0", "x"])
        elif op == 1:
            new = old[:-1] + rng.choice("xyz_")
        elif op == 2:
            new = old.replace(".weight", ".weigth").replace(".bias", ".bais")
        else:
            i = rng.randrange(len(old) - 1)
            new = old[:i] + old[i + 1] + old[i] + old[i + 2:]
        if new != old and new not in names and len(new.encode()) <= 63:
            break
    else:
        raise ValueError("no near name")
    tensor = next(t for t in doc.tensors if t.name == old.encode())
    tensor.name = new.encode()
    return f"rename {old}->{new}"


LOUD: dict[str, Callable[[Doc, random.Random], str]] = {
    "data-scale": m_data_scale, "data-vector": m_data_vector, "rename-near": m_rename_near,
}


def loud_names(cls: str, desc: str) -> list[str] | None:
    """The tensor names a loud case's load must mention (in an error or a warning), or None
    for a case of other mutations."""
    if cls not in LOUD or "no-op" in desc:
        return None
    if desc.startswith("rename "):
        return desc[len("rename "):].split("->")
    return [desc.split(": ", 1)[0]]
