"""Tier B on CUDA: layers kept in pinned host RAM, copied into a ring of GPU slots per use.

At load time each streamed layer is built once on the GPU (repacked for the kernels), then
flattened into one contiguous pinned buffer: its "image". Per token, one host-to-device copy per
layer moves the image into a free slot on a dedicated copy stream, and the layer is rebuilt as
views into the slot, so no repacking happens on the hot path.

Ordering is all on the GPU, with no host sync per layer:
- compute waits on the event recorded after the slot's copy;
- a copy into a slot waits on the event recorded after the last kernel that read the slot.
So a slot is never overwritten while a kernel may still read it (the reference engine's race).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from ..model.llama import LayerWeights
from ..weights.linear import QuantLinear, Workspace
from .store import StoreStats

_ALIGN = 256  # bytes: keeps every plane aligned for the kernels' 16-byte vector loads
_PLANES = ("lo", "hi", "d", "m", "sc", "mn", "sm")


@dataclass(frozen=True)
class _Entry:
    key: tuple  # ("attn_norm",) or ("attn_qkv", "lo"), ("attn_qkv", "bias"), ...
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class LayerImage:
    entries: list[_Entry]
    linears: dict[str, tuple]  # field -> (qtype, rows, cols, gguf_bytes) of each QuantLinear
    host: torch.Tensor  # pinned uint8 holding every tensor of the layer

    @property
    def nbytes(self) -> int:
        return self.host.numel()


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


def to_image(layer: LayerWeights) -> LayerImage:
    """Copy a GPU-built layer into one pinned host buffer (the GPU copy can then be freed)."""
    entries, offset = [], 0
    for key, t in _tensors(layer):
        n = t.numel() * t.element_size()
        entries.append(_Entry(key, t.dtype, tuple(t.shape), offset, n))
        offset += (n + _ALIGN - 1) // _ALIGN * _ALIGN
    host = torch.empty(max(offset, _ALIGN), dtype=torch.uint8, pin_memory=True)
    tensors = dict(_tensors(layer))
    for e in entries:
        src = tensors[e.key].contiguous().view(torch.uint8).reshape(-1)
        host[e.offset:e.offset + e.nbytes].copy_(src)
    linears = {}
    for f in dataclasses.fields(layer):
        v = getattr(layer, f.name)
        if isinstance(v, QuantLinear):
            p = v.packed
            linears[f.name] = (p.qtype, p.rows, p.cols, p.gguf_bytes)
    return LayerImage(entries, linears, host)


def from_image(image: LayerImage, slot: torch.Tensor, workspace: Workspace) -> LayerWeights:
    """The layer as views into a device slot holding a copy of `image.host`."""
    from ..kernels import PackedWeight

    views: dict[tuple, torch.Tensor] = {}
    for e in image.entries:
        views[e.key] = slot[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
    fields = {}
    for name, (qtype, rows, cols, gguf_bytes) in image.linears.items():
        planes = {p: views.get((name, p)) for p in _PLANES}
        packed = PackedWeight(qtype, rows, cols, gguf_bytes=gguf_bytes, **planes)
        fields[name] = QuantLinear(packed, views.get((name, "bias")), workspace)
    for e in image.entries:
        if len(e.key) == 1:
            fields[e.key[0]] = views[e.key]
    for f in dataclasses.fields(LayerWeights):
        fields.setdefault(f.name, None)
    return LayerWeights(**fields)


class PinnedLayerStore:
    """Resident layers from `resident`; the others from pinned images through `n_slots` GPU
    slots. `delay` (tests): the largest number of GPU clock cycles to stall the copy stream
    before each copy, drawn at random, to shake out ordering bugs."""

    def __init__(self, resident: list[LayerWeights | None], images: dict[int, LayerImage],
                 device: torch.device, workspace: Workspace, n_slots: int = 2,
                 delay: int = 0, seed: int = 0):
        self.layers = resident
        self.images = images
        self.order = sorted(images)
        self.device = device
        self.workspace = workspace
        size = max((im.nbytes for im in images.values()), default=_ALIGN)
        n_slots = max(1, min(n_slots, len(self.order)))
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(n_slots)]
        self.freed = [torch.cuda.Event() for _ in range(n_slots)]
        self.slot_of: dict[int, int] = {}  # streamed layer -> slot its copy went to
        self.slot_next = 0  # slot the next enqueued copy uses
        self.next = 0  # index into self.order of the next layer to copy
        self.in_use: dict[int, int] = {}  # layer acquired and not yet released -> slot
        self.delay = delay
        self.rng = random.Random(seed)
        self.stats = StoreStats()
        self.bytes_copied = 0
        self.note = ""

    def __len__(self) -> int:
        return len(self.layers)

    def _enqueue(self) -> None:
        """Start the copy of the next layer in order into the next slot in the ring."""
        i = self.order[self.next % len(self.order)]
        k = self.slot_next
        image = self.images[i]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[k])  # the slot's last reader is done
            if self.delay:
                torch.cuda._sleep(self.rng.randrange(self.delay))
            self.slots[k][: image.nbytes].copy_(image.host, non_blocking=True)
            self.copied[k].record(self.copy_stream)
        self.slot_of[i] = k
        self.slot_next = (k + 1) % len(self.slots)
        self.next += 1
        self.bytes_copied += image.nbytes

    def acquire(self, i: int) -> LayerWeights:
        layer = self.layers[i]
        if layer is not None:
            return layer
        if i not in self.slot_of:
            # First use, or an out-of-order request: restart the ring at this layer. Slots
            # stay protected by their `freed` events whatever was queued before.
            self.slot_of.clear()
            self.next = self.order.index(i)
            for _ in range(len(self.slots)):
                self._enqueue()
        k = self.slot_of.pop(i)
        torch.cuda.current_stream(self.device).wait_event(self.copied[k])
        self.in_use[i] = k
        self.stats.layers_streamed += 1
        return from_image(self.images[i], self.slots[k], self.workspace)

    def release(self, i: int) -> None:
        k = self.in_use.pop(i, None)
        if k is None:
            return
        self.freed[k].record(torch.cuda.current_stream(self.device))
        self._enqueue()  # refill the slot just released with the layer n_slots ahead

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
