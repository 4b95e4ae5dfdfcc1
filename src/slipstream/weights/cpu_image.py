"""CPU layer images: a streamed layer packed for the CPU decode kernels, as one flat buffer.

A resident CPU layer at precision="fast" decodes through packed copies of its weights
(weights.cpu.PackedDecodeLinear: q4vnni, q8vnni, q6vnni, cb4, or torch's int4/int8 CPU kernels). A streamed
layer computes the
same way, from an image of those packed copies written once at
load (memory.image_file.build_cpu_images): per decode pass the disk store reads the image into a staging buffer and
`decode_layer` makes the layer as views into it, so no token dequantizes or repacks anything.

The image holds exactly what decode reads, made by the resident path's own code from the same
GGUF bytes (LayerBuilder.build, then each linear's `.packed`), so a streamed layer gives the
same bits as a resident one:
- each linear group (q/k/v fused, gate/up fused, the output and down projections): its packed
  copy's planes (q4vnni, q8vnni, q6vnni, cb4: their records; int4pack, int4pair: codes and bfloat16
  scale/zero pairs; int8pack: codes and per-row scales) and float32 bias, or, where no packed layout reads its formats (the resident
  layer then decodes dense too), its dense weight at precision.weight_dtype;
- the norms, float32.
Prefill (more than GEMV_MAX_ROWS tokens a pass) goes through the same views where the
resident layer's prefill would read nothing else (`prefills_from_image`: every linear either
of a packed-prefill layout, weights.cpu.kinds.PREFILL_KINDS, or held dense in the image); a
layer with a linear that prefills through a dense weight the image lacks (cb4, iq, torch's
layouts) is rebuilt from the GGUF file instead (memory.store).

torch's int4 layout depends on the CPU's vector width, so an image is only valid on a machine
that packs alike: `layout_fingerprint` goes into the image file's identity.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from ..model.families import spec_for
from ..model.llama import LayerWeights
from .cpu.decode import PackedDecodeLinear
from .cpu.groups import INT4_GROUP, Q
from .cpu.kinds import PREFILL_KINDS, kind_for, packed_prefill_on, q4vnni_available
from .cpu.codebook import Cb4Linear, cb4_grid, cb4_nbytes
from .cpu.iquant import IqLinear, iq_nbytes
from .cpu.parts import PartsLinear
from .cpu.q6vnni import Q6VnniLinear, q6vnni_nbytes
from .cpu.torch_kernels import Int4PackLinear, Int4PairLinear, Int8PackLinear
from .cpu.vnni import (Q4VnniLinear, Q8VnniLinear, q4vnni_parts_nbytes, q8vnni_nbytes,
                       q8vnni_zeros)
from .image import IMAGE_ALIGN, _Entry
from .linear import GEMV_MAX_ROWS, DenseLinear
from .loader import LayerBuilder, TensorSource

CPU = torch.device("cpu")
# a PartsLinear's kind in an image: "parts:" and each part's kind/rows, comma-separated
PARTS = "parts:"
_PACKED = {"int4pack": Int4PackLinear, "int4pair": Int4PairLinear, "int8pack": Int8PackLinear}


@dataclass
class CpuLayerLayout:
    """Where each tensor of a CPU layer image sits, and what each linear is: enough to make
    the layer as views into any buffer holding the image's bytes."""

    entries: list[_Entry]
    linears: dict[str, tuple[str, int]]  # field -> (kind: q4vnni/int4pack/.../dense, rows)
    nbytes: int

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes,
                "entries": [[list(e.key), str(e.dtype).removeprefix("torch."), list(e.shape),
                             e.offset, e.nbytes] for e in self.entries],
                "linears": {k: list(v) for k, v in self.linears.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "CpuLayerLayout":
        entries = [_Entry(tuple(k), getattr(torch, dt), tuple(shape), off, n)
                   for k, dt, shape, off, n in d["entries"]]
        linears = {k: (str(v[0]), int(v[1])) for k, v in d["linears"].items()}
        return cls(entries, linears, int(d["nbytes"]))


def layout_fingerprint() -> int:
    """CRC-32 of torch's int4 packing of a fixed 64 x 64 pattern on this machine: differs
    where the packer's layout does (AVX-512 against AVX2, another torch)."""
    r = torch.arange(64).unsqueeze(1)
    c = torch.arange(64).unsqueeze(0)
    u = ((r * 7 + c * 3) % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    crc = zlib.crc32(packed.contiguous().view(torch.uint8).numpy().tobytes())
    # whether the 4-bit formats pack as q4vnni (native library there) or int4pack: an image
    # of one is no use to a process that would build the other. "q4vnni-ks": Q4_K's q4vnni
    # records with its own scales ("q4vnni-1" named the float32 records an older build made)
    if not q4vnni_available():
        return crc
    return zlib.crc32(b"q4vnni-ks", crc)


def _fields(architecture: str, layer: LayerWeights) -> list[str]:
    """The LayerWeights fields a decode layer holds: one linear per group (the fused field of
    a multi-part group: block_forward uses it whenever it is set), or the parts the layer
    has where it holds no fused one (a Gemma 4 layer that projects queries only)."""
    out = []
    for g in spec_for(architecture).linears:
        if getattr(layer, g.field) is not None:
            out.append(g.field)
        else:
            out += [p for p in g.parts if getattr(layer, p) is not None]
    return out


def _linear_tensors(lin) -> tuple[str, int, list[tuple[str, torch.Tensor]]]:
    """(kind, rows, [(plane, tensor)]) of the linear decode uses."""
    if isinstance(lin, PackedDecodeLinear):
        lin = lin.packed  # packs now (its dense weight where pack_group made no copy)
    if isinstance(lin, PartsLinear):  # each part's planes (and bias) under its index
        kinds, planes = [], []
        for i, part in enumerate(lin.parts):
            kind, rows, own = _linear_tensors(part)
            kinds.append(f"{kind}/{rows}")
            planes += [(f"{i}.{plane}", t) for plane, t in own]
        return PARTS + ",".join(kinds), lin.out_features, planes
    if isinstance(lin, (Q4VnniLinear, Q6VnniLinear)):
        planes, kind = [("packed", lin.packed)], lin.kind
    elif isinstance(lin, Cb4Linear):  # the grid in the kind's name: MXFP4's is "cb4-mx"
        planes, kind = [("packed", lin.packed)], ("cb4", "cb4-mx")[lin.grid]
    elif isinstance(lin, IqLinear):  # the format in the kind's name: "iq-IQ3_XXS"
        planes, kind = [("packed", lin.packed)], f"iq-{lin.qtype.name}"
    elif isinstance(lin, Int4PackLinear):  # and Int4PairLinear
        planes = [("packed", lin.packed), ("scale_zeros", lin.scale_zeros)]
        kind = lin.kind
    elif isinstance(lin, Int8PackLinear):
        planes, kind = [("codes", lin.codes), ("scales", lin.scales)], lin.kind
    elif isinstance(lin, DenseLinear):
        planes, kind = [("weight", lin.weight)], "dense"
    else:
        raise TypeError(f"no CPU image holds a {type(lin).__name__}")
    if lin.bias is not None:
        planes.append(("bias", lin.bias))
    return kind, lin.out_features, planes


def to_cpu_image(layer: LayerWeights, architecture: str) -> tuple[torch.Tensor, CpuLayerLayout]:
    """A CPU-built layer (LayerBuilder at precision.cpu_packed_decode) as (uint8 image,
    layout): the packed copies its decode uses (made now), and its norms."""
    items: list[tuple[tuple, torch.Tensor]] = []
    linears: dict[str, tuple[str, int]] = {}
    for name in _fields(architecture, layer):
        kind, rows, planes = _linear_tensors(getattr(layer, name))
        linears[name] = (kind, rows)
        items += [((name, plane), t) for plane, t in planes]
    for f in dataclasses.fields(layer):
        v = getattr(layer, f.name)
        if isinstance(v, torch.Tensor):
            items.append(((f.name,), v))
    return _laid_out(items, linears)


def packed_image(linears: dict[str, PackedDecodeLinear]) -> tuple[torch.Tensor, CpuLayerLayout]:
    """The packed decode copies of resident linears (made now where not yet) as (uint8 image,
    layout), by name. A linear with no packed copy (its formats take no one layout: it decodes
    dense) is recorded as kind "none" with no bytes, so a load from the image knows not to
    try packing it either."""
    items: list[tuple[tuple, torch.Tensor]] = []
    layout: dict[str, tuple[str, int]] = {}
    for name, lin in linears.items():
        if lin.packed is lin.dense:
            layout[name] = ("none", lin.out_features)
            continue
        kind, rows, planes = _linear_tensors(lin.packed)
        layout[name] = (kind, rows)
        items += [((name, plane), t) for plane, t in planes]
    return _laid_out(items, layout)


def packed_image_nbytes(linears: dict[str, PackedDecodeLinear]) -> int:
    """Bytes of packed_image(linears), without copying anything (the copies are made now)."""
    total = 0
    for lin in linears.values():
        if lin.packed is not lin.dense:
            total += sum(_aligned(t.numel() * t.element_size())
                         for _, t in _linear_tensors(lin.packed)[2])
    return max(total, IMAGE_ALIGN)


def _laid_out(items: list[tuple[tuple, torch.Tensor]], linears: dict[str, tuple[str, int]]
              ) -> tuple[torch.Tensor, CpuLayerLayout]:
    """`items` copied into one uint8 buffer, each at an IMAGE_ALIGN boundary."""
    entries, offset = [], 0
    for key, t in items:
        n = t.numel() * t.element_size()
        entries.append(_Entry(key, t.dtype, tuple(t.shape), offset, n))
        offset += (n + IMAGE_ALIGN - 1) // IMAGE_ALIGN * IMAGE_ALIGN
    host = torch.zeros(max(offset, IMAGE_ALIGN), dtype=torch.uint8)  # padding deterministic
    for e, (_, t) in zip(entries, items):
        host[e.offset:e.offset + e.nbytes].copy_(t.contiguous().view(torch.uint8).reshape(-1))
    return host, CpuLayerLayout(entries, linears, host.numel())


def cpu_image_of(gf, cfg, precision, i: int) -> tuple[torch.Tensor, CpuLayerLayout]:
    """Layer i of `gf` built as a resident CPU layer is (packed decode copies on), as an
    image."""
    if not precision.cpu_packed_decode:
        raise ValueError(f"CPU layer images hold packed decode copies, which precision "
                         f"{precision.name!r} does not use")
    layer = LayerBuilder(cfg, CPU, precision).build(TensorSource(gf), i)
    return to_cpu_image(layer, cfg.architecture)


def _views(layout: CpuLayerLayout, buf: torch.Tensor) -> dict[tuple, torch.Tensor]:
    return {e.key: buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in layout.entries}


def _packed_linear(name: str, kind: str, rows: int, views: dict[tuple, torch.Tensor]):
    """The packed linear `name` of an image, as views (`views`: the image's, by key)."""
    if kind.startswith(PARTS):
        parts = []
        for i, (part_kind, part_rows) in enumerate(_parts_of(kind)):
            own = {(name, plane[len(f"{i}."):]): v for (n, *rest), v in views.items()
                   if n == name and rest and (plane := rest[0]).startswith(f"{i}.")}
            parts.append(_packed_linear(name, part_kind, part_rows, own))
        return PartsLinear(parts)
    bias = views.get((name, "bias"))
    if kind == "int8pack":
        return Int8PackLinear(views[(name, "codes")], views[(name, "scales")], bias)
    if kind in ("q4vnni", "q8vnni", "q6vnni"):
        cls = {"q4vnni": Q4VnniLinear, "q8vnni": Q8VnniLinear, "q6vnni": Q6VnniLinear}[kind]
        return cls(views[(name, "packed")], rows, bias)
    if kind in ("cb4", "cb4-mx"):
        return Cb4Linear(views[(name, "packed")], rows, bias, grid=int(kind == "cb4-mx"))
    if kind.startswith("iq-"):
        return IqLinear(views[(name, "packed")], rows, bias, Q[kind[3:]])
    if kind in _PACKED:
        return _PACKED[kind](views[(name, "packed")], views[(name, "scale_zeros")], rows, bias)
    raise ValueError(f"an image's linear {name!r} has kind {kind!r}, which no CPU layout is")


def packed_views(layout: CpuLayerLayout, buf: torch.Tensor) -> dict[str, object]:
    """packed_image's linears as views into `buf` (uint8, holding the image's bytes): name ->
    the packed linear, or None where the image says it has none (kind "none")."""
    views = _views(layout, buf)
    return {name: None if kind == "none" else _packed_linear(name, kind, rows, views)
            for name, (kind, rows) in layout.linears.items()}


def prefills_from_image(layout: CpuLayerLayout) -> bool:
    """Whether the layer's prefill passes (more than GEMV_MAX_ROWS tokens) may compute on
    its image's views and give the resident layer's bits: packed prefill is on
    (SLIPSTREAM_PACKED_PREFILL), at least one linear takes it (a layer of dense linears
    alone reads its smaller GGUF span, as before), and every other linear is held dense in
    the image (the float16 weight a resident layer's prefill widens too)."""
    kinds = [kind for kind, _ in layout.linears.values()]
    return packed_prefill_on() and any(_prefills(k) for k in kinds) and \
        all(_prefills(k) or k == "dense" for k in kinds)


def _prefills(kind: str) -> bool:
    """Whether an image's linear of `kind` takes prefill through its packed copy: a layout
    of PREFILL_KINDS, or parts (PartsLinear) all of such layouts, as the resident layer's
    (weights.cpu.kinds.prefills_packed: every part's layout)."""
    if kind.startswith(PARTS):
        return all(k in PREFILL_KINDS for k, _ in _parts_of(kind))
    return kind in PREFILL_KINDS


def _parts_of(kind: str) -> list[tuple[str, int]]:
    """A PartsLinear's image kind ("parts:" and each part's kind/rows) as (kind, rows) pairs."""
    specs = (spec.rpartition("/") for spec in kind[len(PARTS):].split(","))
    return [(k, int(rows)) for k, _, rows in specs]


def decode_layer(layout: CpuLayerLayout, buf: torch.Tensor) -> LayerWeights:
    """The layer as views into `buf` (uint8, holding the image's bytes), for passes of up to
    GEMV_MAX_ROWS tokens, and of more where `prefills_from_image(layout)`: each linear
    computes as a resident layer's does (PackedDecodeLinear over the packed copy, whose
    prefill takes it too for the PREFILL_KINDS layouts, or DenseLinear where the image holds
    the dense weight). The views are valid while `buf` is not overwritten."""
    views = _views(layout, buf)
    fields: dict[str, object] = {}
    prefill = packed_prefill_on()
    for name, (kind, rows) in layout.linears.items():
        if kind == "dense":
            fields[name] = DenseLinear(views[(name, "weight")], views.get((name, "bias")))
            continue
        fields[name] = PackedDecodeLinear.decode_only(
            _packed_linear(name, kind, rows, views), GEMV_MAX_ROWS,
            packed_prefill=prefill and _prefills(kind))
    for key, v in views.items():
        if len(key) == 1:
            fields[key[0]] = v
    for f in dataclasses.fields(LayerWeights):
        fields.setdefault(f.name, None)
    return LayerWeights(**fields)


def _aligned(n: int) -> int:
    return (n + IMAGE_ALIGN - 1) // IMAGE_ALIGN * IMAGE_ALIGN


def image_nbytes(gf, cfg, i: int, precision) -> int:
    """Bytes of layer i's CPU image (what to_cpu_image makes), from the tensors' types and
    shapes alone: the planner sizes the disk tier with it before anything is built."""
    lc = cfg.layer(i)  # layer i's (Gemma 4's layers differ)
    spec = spec_for(cfg.architecture, cfg.n_experts).at(lc)
    shapes = spec.shapes(lc)
    dense_bytes = torch.finfo(precision.weight_dtype).bits // 8
    total = 0
    for group in spec.linears:
        names = [f"blk.{i}.{p}" for p in group.parts]
        types = [gf.tensors[f"{n}.weight"].ggml_type for n in names]
        part_shapes = [shapes[f"{p}.weight"] for p in group.parts]
        rows, cols = sum(s[0] for s in part_shapes), part_shapes[0][1]
        biased = [f"{n}.bias" in gf.tensors for n in names]
        kinds = {kind_for(t) for t in types}
        kind = next(iter(kinds)) if len(kinds) == 1 else None
        # LayerBuilder._packed_decode packs a group whose parts all take one layout as one
        # linear (cpu.pack_group: cb4 of one grid, iq of one format), one whose parts take
        # several as a PartsLinear of one per part (cpu.pack_joined), each with its own
        # bias; a group with a part no layout reads decodes dense
        one = kind is not None and (kind != "cb4" or len({cb4_grid(t) for t in types}) == 1) \
            and (kind != "iq" or len(set(types)) == 1)
        if not one and None not in kinds:
            total += sum(_linear_nbytes(kind_for(t), [t], s[0], s[1], dense_bytes)
                         + (_aligned(s[0] * 4) if b else 0)
                         for t, s, b in zip(types, part_shapes, biased))
            continue
        total += _linear_nbytes(kind, types, rows, cols, dense_bytes)
        if any(biased):
            total += _aligned(rows * 4)
    for norm in spec.norms:
        if f"{norm}.weight" in shapes:  # (an optional vector the file lacks is not made)
            total += _aligned(int(torch.Size(shapes[f"{norm}.weight"]).numel()) * 4)
    for vector in spec.vectors:  # (float32 tensors named otherwise: Qwen3.5's ssm_a)
        total += _aligned(int(torch.Size(shapes[vector]).numel()) * 4)
    return max(total, IMAGE_ALIGN)


def _linear_nbytes(kind: str | None, types, rows: int, cols: int, dense_bytes: int) -> int:
    """Bytes of one packed linear of `kind` over `rows` rows of `types` in an image (its
    planes but the bias), or of its dense weight where kind is None."""
    padded = -(-rows // 16) * 16
    if kind == "q4vnni":
        return _aligned(q4vnni_parts_nbytes(types, rows, cols))
    if kind == "q8vnni":
        return _aligned(q8vnni_nbytes(rows, cols, q8vnni_zeros(types)))
    if kind == "q6vnni":
        return _aligned(q6vnni_nbytes(rows, cols))
    if kind == "cb4":
        return _aligned(cb4_nbytes(rows, cols))
    if kind == "iq" and len(set(types)) == 1:  # iq fuses parts of one format only
        return _aligned(iq_nbytes(types[0], rows, cols))
    if kind == "int4pack":
        return _aligned(padded * cols // 2) + _aligned(cols // INT4_GROUP * padded * 4)
    if kind == "int4pair":
        return _aligned(padded * cols) + _aligned(2 * cols // INT4_GROUP * padded * 4)
    if kind == "int8pack":
        return _aligned(rows * cols) + _aligned(rows * 2)
    return _aligned(rows * cols * dense_bytes)
