"""Layer images: a layer built for the GPU kernels, flattened into one contiguous buffer.

At load time each streamed layer is built once on the GPU (repacked for the kernels), then
flattened: its "image". Tier B keeps images in pinned RAM; tier C keeps them in a file
(memory.image_file). Per use, one host-to-device copy moves an image into a GPU slot and the
layer is rebuilt as views into the slot (`from_image`), so no repacking happens on the hot path.
The format knows the weight objects' planes (QuantLinear, PackedWeight), hence it lives beside
them; the streaming itself is in memory (slots, sources, cuda_store).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from ..kernels.pack import PackedWeight  # the plane layout only: needs no Triton
from ..model.llama import LayerWeights
from .linear import QuantLinear, Workspace

IMAGE_ALIGN = 256  # bytes: every tensor of an image starts on this boundary (memory.vram sizes
# images with it), which keeps every plane aligned for the kernels' 16-byte vector loads
_PLANES = ("lo", "hi", "d", "m", "sc", "mn", "sm")


@dataclass(frozen=True)
class _Entry:
    key: tuple  # ("attn_norm",) or ("attn_qkv", "lo"), ("attn_qkv", "bias"), ...
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class LayerLayout:
    """Where each tensor of a layer sits inside its image: enough to rebuild the layer as views
    into any buffer holding the image's bytes."""

    entries: list[_Entry]
    # field -> (qtype, rows, cols, gguf_bytes, f16_scales) of each QuantLinear
    linears: dict[str, tuple]
    nbytes: int

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes,
                "entries": [[list(e.key), str(e.dtype).removeprefix("torch."), list(e.shape),
                             e.offset, e.nbytes] for e in self.entries],
                "linears": {k: [int(v[0]), *v[1:]] for k, v in self.linears.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "LayerLayout":
        entries = [_Entry(tuple(k), getattr(torch, dt), tuple(shape), off, n)
                   for k, dt, shape, off, n in d["entries"]]
        linears = {k: (GGMLQuantizationType(v[0]), *v[1:4], bool(v[4]))
                   for k, v in d["linears"].items()}
        return cls(entries, linears, d["nbytes"])


@dataclass
class LayerImage:
    layout: LayerLayout
    host: torch.Tensor  # uint8 (pinned for tier B) holding every tensor of the layer

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    # tier-B code reads these straight off the image
    @property
    def entries(self) -> list[_Entry]:
        return self.layout.entries

    @property
    def linears(self) -> dict[str, tuple]:
        return self.layout.linears


def _tensors(layer: LayerWeights):
    for f in dataclasses.fields(layer):
        v = getattr(layer, f.name)
        if isinstance(v, torch.Tensor):
            yield (f.name,), v
        elif isinstance(v, QuantLinear):
            for plane in _PLANES:
                t = getattr(v.packed, plane)
                if t is not None:
                    yield (f.name, plane), t
            if v.bias is not None:
                yield (f.name, "bias"), v.bias


def layout_of(layer: LayerWeights) -> LayerLayout:
    """Where each of a built layer's tensors goes in its image (nothing copied)."""
    entries, offset = [], 0
    for key, t in _tensors(layer):
        n = t.numel() * t.element_size()
        entries.append(_Entry(key, t.dtype, tuple(t.shape), offset, n))
        offset += (n + IMAGE_ALIGN - 1) // IMAGE_ALIGN * IMAGE_ALIGN
    linears = {}
    for f in dataclasses.fields(layer):
        v = getattr(layer, f.name)
        if isinstance(v, QuantLinear):
            p = v.packed
            linears[f.name] = (p.qtype, p.rows, p.cols, p.gguf_bytes, p.f16_scales)
    return LayerLayout(entries, linears, max(offset, IMAGE_ALIGN))


def _fill(buf: torch.Tensor, layer: LayerWeights, layout: LayerLayout) -> None:
    tensors = dict(_tensors(layer))
    for e in layout.entries:
        src = tensors[e.key].contiguous().view(torch.uint8).reshape(-1)
        buf[e.offset:e.offset + e.nbytes].copy_(src)


def to_image(layer: LayerWeights, pin: bool = True,
             alloc: Callable[[int], torch.Tensor] | None = None) -> LayerImage:
    """Copy a GPU-built layer into one host buffer (the GPU copy can then be freed); pinned for
    tier B, pageable when the image is only on its way to a file. `alloc(nbytes)`: the pinned
    buffer's maker (memory.pinned.pinned_empty: exactly sized), instead of torch's."""
    layout = layout_of(layer)
    # a file image is zeroed so its padding is deterministic; pinned memory skips the memset
    if alloc is not None:
        host = alloc(layout.nbytes)
    else:
        host = (torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True) if pin
                else torch.zeros(layout.nbytes, dtype=torch.uint8))
    _fill(host, layer, layout)
    return LayerImage(layout, host)


def flattened(layer: LayerWeights, workspace: Workspace) -> LayerWeights:
    """The layer moved into one buffer on its own device, laid out as its image, and rebuilt
    as views into it (as a streamed layer in its slot): the same bytes, one allocation.

    A layer built in place holds a dozen planes, and those under 10 MiB (scales, norms) share
    the caching allocator's 20 MiB segments with the build's transients; once the transients
    are freed, those segments stay reserved around the planes, unusable for a large request.
    On the H200 a 70B's 45 resident layers left 0.47-0.57 GiB so stranded, and its first
    prefill ran out of memory at a 24 GiB budget. The caller frees the build's transients
    first (weights.loader.release_transients), so the buffer takes a segment of its own."""
    layout = layout_of(layer)
    device = next(t for _, t in _tensors(layer)).device
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    _fill(buf, layer, layout)
    return from_image(layout, buf, workspace)


def prefix_bytes(layout: LayerLayout, leave_out: tuple[str, ...]) -> int:
    """Bytes of the image before the first tensor of the fields `leave_out` (which to_image
    lays out last when they are LayerWeights' last fields): a copy of only that many bytes
    holds every other field whole."""
    offsets = [e.offset for e in layout.entries if e.key[0] in leave_out]
    return min(offsets) if offsets else layout.nbytes


def _views(entries: list[_Entry], buf: torch.Tensor, upto: int | None = None
           ) -> dict[tuple, torch.Tensor]:
    """Each tensor of a layout as a view into `buf` (with `upto`, those within its first
    `upto` bytes)."""
    return {e.key: buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in entries if upto is None or e.offset + e.nbytes <= upto}


def _packed_weight(linears: dict[str, tuple], views: dict[tuple, torch.Tensor], name: str):
    """Linear `name`'s PackedWeight over its planes' views."""
    qtype, rows, cols, gguf_bytes, f16_scales = linears[name]
    planes = {p: views.get((name, p)) for p in _PLANES}
    return PackedWeight(qtype, rows, cols, gguf_bytes=gguf_bytes, f16_scales=f16_scales,
                        **planes)


def from_image(image: LayerImage | LayerLayout, slot: torch.Tensor,
               workspace: Workspace, upto: int | None = None) -> LayerWeights:
    """The layer as views into a device slot holding a copy of the image's bytes; with `upto`,
    only the image's first `upto` bytes are in the slot, and the fields with a tensor past
    them are left None."""
    views = _views(image.entries, slot, upto)
    fields = {}
    for name in image.linears:
        if upto is not None and not any(k[0] == name for k in views):
            continue
        packed = _packed_weight(image.linears, views, name)
        # as built: an image is never re-packed on the hot path
        fields[name] = QuantLinear(packed, views.get((name, "bias")), workspace, fuse=False)
    for e in image.entries:
        if len(e.key) == 1 and e.key in views:
            fields[e.key[0]] = views[e.key]
    for f in dataclasses.fields(LayerWeights):
        fields.setdefault(f.name, None)
    return LayerWeights(**fields)


def resident_copy(image: LayerImage, device: torch.device, workspace: Workspace) -> LayerWeights:
    """A streamed layer made resident (memory given back: a draft released) as the loader
    builds resident layers, in one buffer of its own. At precision "fast" resident layers fold
    their scales into one plane (kernels.pack.fuse_scales) while images keep the GGUF planes
    (pack.f16_scales); the two give the same bits, but the unfused decode GEMV gathers four
    scale planes per unit and is slower where bytes moved no longer set the speed, so the
    fused plane is made here, on the GPU, from the image's scale planes alone (the code planes
    go from the host straight into the layer's buffer: no second copy of the layer in VRAM)."""
    fuse = workspace.int8_activations and any(v[4] for v in image.linears.values())
    if not fuse:
        buf = torch.empty(image.nbytes, dtype=torch.uint8, device=device)
        buf.copy_(image.host)
        return from_image(image.layout, buf, workspace)
    from ..kernels.qgemm import with_fused_scales  # local: a Triton module (CUDA hosts only)

    on_host = from_image(image.layout, image.host, workspace)
    dummy = torch.empty(1, dtype=torch.int32, device=device)  # a pointer the kernel never reads
    fields = {}
    for f in dataclasses.fields(on_host):
        v = getattr(on_host, f.name)
        if isinstance(v, QuantLinear) and v.packed.f16_scales:
            p = v.packed
            scales = {k: getattr(p, k).to(device) for k in ("d", "m", "sc", "mn")
                      if getattr(p, k) is not None}
            sm = with_fused_scales(dataclasses.replace(p, lo=dummy, **scales)).sm
            spec = p.spec
            # what pack.fuse_scales keeps: the codes, the fused plane, d where it is the scale
            packed = dataclasses.replace(p, d=None if spec.kquant or spec.has_min else p.d,
                                         m=None, sc=None, mn=None, sm=sm, f16_scales=False)
            v = QuantLinear(packed, v.bias, workspace, fuse=False)
        fields[f.name] = v
    mixed = LayerWeights(**fields)  # planes on the host and on the GPU: _fill copies both
    layout = layout_of(mixed)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    _fill(buf, mixed, layout)
    return from_image(layout, buf, workspace)
