"""Streaming layers through the GPU: the layer store for CUDA.

Resident layers are handed out as built. Each streamed layer's image (weights.image) comes from
its tier's source (sources.py: pinned RAM, the image file through staging buffers or KvikIO,
or the mmap baseline) into a GPU slot of the ring (slots.py), and the layer is rebuilt as views
into the slot, so no repacking happens on the hot path. With --stats, CUDA events time compute,
stalls and copies (timeline.py); without, nothing here waits on the GPU per layer.

With hybrid decode, split layers copy only their image's prefix in decode and the CPU computes
the rest of their FFN. The store knows that split through a SplitPolicy (below, implemented by
hybrid.policy.HybridSplit): memory/ does not import hybrid/.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..model.llama import LayerWeights
from ..weights.image import LayerImage, from_image, prefix_bytes, resident_copy
from .image_file import ImageFile
from .planner import evenly_spaced
from .protocol import StoreBase, StoreStats
from .slots import SlotRing
from .sources import KvikioSource, MmapSource, PinnedSource, Source, StagedDiskSource
from .staging import StagingRing
from .store import StreamDelays
from .timeline import CopyMeter, Timeline

if TYPE_CHECKING:
    from ..runtime.trace import Tracer


class Balance(Protocol):
    """The running judgement of how many split layers the CPU serves (hybrid.balance)."""

    other_bytes: int  # what the streamed layers that are not split copy per token
    ring: list[tuple[int, int]] | None  # a pass's layers in order: (layer, whole image bytes)

    def observe(self, cpu_seconds: float, cpu_bytes: int, copy_seconds: float | None = None,
                copy_bytes: int | None = None) -> set[int] | None: ...

    def forget(self, layers) -> None: ...


class SplitPolicy(Protocol):
    """Hybrid decode's split as the store uses it (hybrid.policy.HybridSplit)."""

    hosts: dict[int, Any]  # split layer -> its CPU share (a layer view's `ffn_host`)
    rest_fields: tuple[str, ...]  # the image's tail (LayerWeights fields) decode leaves out
    max_tokens: int  # passes of up to this many tokens split; larger ones copy whole images

    def balance(self, prefix: dict[int, int], image: dict[int, int], other_bytes: int,
                ring: list[tuple[int, int]], slots: int) -> Balance | None: ...

    def count_into(self, stats: StoreStats) -> None: ...

    def trace(self, tracer: "Tracer | None") -> None: ...

    def close(self) -> None: ...


class CudaLayerStore(StoreBase):
    def __init__(self, resident: list[LayerWeights | None], device: torch.device, workspace,
                 images: dict[int, LayerImage] | None = None, disk: ImageFile | None = None,
                 io: str = "direct", n_slots: int = 2, n_staging: int = 3, threads: int = 2,
                 delays: StreamDelays | None = None, seed: int = 0,
                 drop_cache: bool = True, split: SplitPolicy | None = None):
        """split: hybrid decode's split of pinned layers, whose images end with the CPU's units
        in GPU format (the part decode leaves out); with a balance from it, decode keeps the
        split balanced as the CPU's and the copies' measured rates change."""
        self.layers = resident
        self.device = device
        self.workspace = workspace
        self.images = images or {}
        self.disk = disk
        self.stats = StoreStats()
        self.timeline: Timeline | None = None  # set by enable_timing (--stats)
        self.skipped: frozenset[int] = frozenset()  # layers the engine skips (skip())
        self._last_acquired = -1  # the layer acquired last (a smaller index starts a pass)
        delays = delays or StreamDelays()
        self.layouts = {i: im.layout for i, im in self.images.items()}  # streamed layers'
        if disk is not None:
            self.layouts.update(disk.layouts)
        size = max((lay.nbytes for lay in self.layouts.values()), default=256)  # a slot's bytes
        self.sources: list[Source] = []
        try:
            if self.images:
                self.sources.append(PinnedSource(self.images, self.stats))
            if disk is not None:
                self.sources.append(self._disk_source(disk, io, size, n_staging, threads,
                                                      delays, drop_cache))
            in_ring = [src for src in self.sources if not src.own_slot]
            self.ring = SlotRing(device, in_ring, n_slots, size, self.stats,
                                 delays.copy_cycles, seed) if in_ring else None
        except BaseException:  # the slots past a VRAM budget, say: no reader thread may stay
            for src in self.sources:
                src.close()
            raise
        # layer -> what hands out its slot: the ring, or a source with a slot of its own
        self.feed = {i: src if src.own_slot else self.ring
                     for src in self.sources for i in src.layouts}
        self._views: dict[tuple[int, int, bool], LayerWeights] = {}  # (layer, slot, split)
        self.split = split
        self.hosts = dict(split.hosts) if split is not None else {}
        # split layers: the bytes of their images before the GPU copy of the CPU's share
        self.prefix = {i: prefix_bytes(self.layouts[i], split.rest_fields) for i in self.hosts}
        self.split_mode = False  # the pass running computes the CPU's shares on the CPU
        if split is not None:
            split.count_into(self.stats)
        # the split layers whose shares the CPU computes in decode; the others run whole
        self.active = set(self.hosts)
        self.balance = split.balance(
            self.prefix, {i: self.layouts[i].nbytes for i in self.hosts},
            self._unsplit_bytes(), self._ring_layout(),
            len(self.ring.slots) if self.ring is not None else 2) if self.hosts else None
        if self.balance is not None and self.ring is not None:
            # the copies' achieved rate, for the balance's judgement of PCIe
            self.ring.meter = CopyMeter()
        self.begin_pass(1)  # the ring's first copies are a decode token's

    def begin_pass(self, tokens: int) -> None:
        """Split layers compute the CPU's share on the CPU for passes of up to the host
        buffers' tokens (decode, small trees); larger ones are FLOP-bound there and copy
        whole images. On a change the copies already made for the other kind of pass are
        settled and the ring restarts (one host wait, at a prefill or a large tree)."""
        if not self.hosts:
            return
        split = tokens <= self.split.max_tokens
        if split and self.balance is not None:
            meter = self.ring.meter if self.ring is not None else None
            copied = meter.poll() if meter is not None else (None, None)
            active = self.balance.observe(self.stats.cpu_s, self.stats.cpu_bytes, *copied)
            if active is not None:
                self.split_only(active)
        if split != self.split_mode:
            self._set_split(split)

    def _set_split(self, split: bool) -> None:
        """Copy the active split layers' prefixes (split) or every image whole; the copies
        already made the other way are settled and the ring restarts."""
        self.split_mode = split
        if self.ring is not None and self.ring.meter is not None:
            self.ring.meter.on = split  # prefill's whole copies run without the CPU beside
        pinned = next(src for src in self.sources if isinstance(src, PinnedSource))
        pinned.upto = {i: self.prefix[i] for i in self.active} if split else {}
        if self.ring is not None and self.ring.pos:
            self.ring.drop(())

    def split_only(self, layers: Collection[int]) -> None:
        """Decode computes the CPU's shares of these split layers only; the other split
        layers run whole on the GPU (their images copied in full, as for prefill)."""
        active = set(layers)
        if not active <= set(self.hosts):
            raise ValueError(f"layers {sorted(active - set(self.hosts))} are not split")
        if active != self.active:
            self.active = active
            if self.split_mode:  # the copies made for the old split go; views follow active
                self._set_split(True)

    def _ring_layout(self) -> list[tuple[int, int]]:
        """A decode pass's layers in order as the balance's ring model takes them (hybrid.
        balance.pipeline_seconds): (layer, bytes of its whole image; 0 if resident), the
        skipped ones left out."""
        return [(i, 0 if self.layers[i] is not None else self.layouts[i].nbytes)
                for i in range(len(self.layers))
                if i not in self.skipped and (self.layers[i] is not None or i in self.feed)]

    def _unsplit_bytes(self) -> int:
        """What the streamed layers that are not split copy per decode token."""
        return sum(self.layouts[i].nbytes for i in self.feed
                   if i not in self.hosts and i not in self.skipped)

    def _disk_source(self, disk: ImageFile, io: str, size: int, n_staging: int, threads: int,
                     delays: StreamDelays, drop_cache: bool) -> Source:
        """Tier C's source for the --io mode."""
        if io in ("direct", "buffered"):
            pinned = self.device.type == "cuda"  # (tests drive this store on the CPU)
            return StagedDiskSource(disk, self.stats, size, io, n_staging, threads,
                                    delays.reader, pinned)
        if io == "kvikio":
            return KvikioSource(disk, self.stats, threads, delays.reader)
        if io == "mmap":
            return MmapSource(disk, self.stats, size, self.device, drop_cache)
        raise ValueError(f"unknown --io mode {io!r}")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def note(self) -> str:
        """What the user should know about the I/O path (an O_DIRECT fallback, say)."""
        return "; ".join(src.note for src in self.sources if src.note)

    @property
    def staging(self) -> StagingRing | None:
        """Tier C's staging ring, where reads go through one (bench and tests look at it)."""
        return next((src.staging for src in self.sources
                     if isinstance(src, StagedDiskSource)), None)

    def enable_timing(self, on: bool = True) -> None:
        """--stats: time compute, stalls and copies with CUDA events (one host sync per pass)."""
        self.timeline = Timeline() if on else None
        if self.ring is not None:
            self.ring.timeline = self.timeline
        for src in self.sources:
            src.enable_timing(on)

    def trace(self, tracer: "Tracer | None") -> None:
        """--trace: the compute and copy events of the timeline become spans (so timing goes
        on, as with --stats), and tier C's reads too."""
        if tracer is not None and self.timeline is None:
            self.enable_timing()
        if self.timeline is not None:
            self.timeline.tracer = tracer
            ring = self.ring
            # a copy is enqueued by ring._enqueue(i), while order[pos] is still i
            self.timeline.copy_layer = (lambda: ring.order[ring.pos % len(ring.order)]) \
                if ring is not None and tracer is not None else None
        if self.staging is not None:
            self.staging.trace(tracer)
        if self.split is not None:  # hybrid decode's CPU worker: its wait and share
            self.split.trace(tracer)

    # --- the engine's side ----------------------------------------------------------------

    def skip(self, layers: frozenset[int]) -> None:
        """Stream only the layers the engine will ask for: the ring's copy order and the disk
        read-ahead leave the skipped ones out, so that no slot or read is spent on them."""
        self.skipped = frozenset(layers)
        if self.balance is not None:
            self.balance.other_bytes = self._unsplit_bytes()
            self.balance.ring = self._ring_layout()
        if self.ring is not None:
            self.ring.skip(self.skipped)
        for src in self.sources:
            if src.own_slot:  # outside the ring (mmap): told directly
                src.skip(self.skipped)

    def promote(self, room: int | None, most: int | None = None,
                only: Collection[int] | None = None) -> list[int]:
        """Make pinned-tier layers resident while `room` bytes last (None: all those the
        allocator gives room for; at most `most` of them: the user's cap on layers in VRAM; of
        `only`, where given): each image is copied
        once into a GPU buffer of its own, laid out as the loader lays out resident layers
        (weights.image.resident_copy: the same bits, and the resident decode kernels); its
        pinned copy is given back.
        The layers taken are spread evenly over the pinned ones, so that those left streaming
        stay spread between resident layers (planner._interleave: a run of streamed layers
        makes the copies wait on the compute, measured on the H200: 2.64 tok/s after taking
        the first 12 in layer order, against 2.88 with the planner's spread). Disk-tier layers
        stay: they are the slowest to bring in and the last to be worth holding."""
        pinned = next((src for src in self.sources if isinstance(src, PinnedSource)), None)
        if pinned is None or self.ring is None:
            return []
        candidates = sorted(i for i in pinned.images if only is None or i in only)
        if not candidates:
            return []
        size = max(pinned.images[i].host.numel() for i in candidates)
        k = min(len(candidates), len(candidates) if room is None else room // size,
                len(candidates) if most is None else most)
        chosen = evenly_spaced(candidates, k)
        if not chosen:
            return []
        # each layer built first, while the ring goes on streaming it from the same pinned
        # bytes: where the room counted is not there in one piece (the allocator's holes),
        # the layers not built go on streaming
        built: dict[int, LayerWeights] = {}
        for i in chosen:
            try:
                built[i] = resident_copy(pinned.images[i], self.device, self.workspace)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                break
        chosen = list(built)
        if not chosen:
            return []
        if self.balance is not None:
            self.balance.forget(chosen)
        self.ring.drop(chosen)  # settles the copies in flight first
        for i in chosen:
            pinned.images.pop(i)
            pinned.layouts.pop(i, None)
            pinned.upto.pop(i, None)  # a split layer becomes whole: the GPU computes it all
            self._views = {k: v for k, v in self._views.items() if k[0] != i}
            self.hosts.pop(i, None)
            self.active.discard(i)
            self.prefix.pop(i, None)
            self.layouts.pop(i)
            self.layers[i] = built[i]
            self.feed.pop(i, None)
        if self.balance is not None:
            self.balance.other_bytes = self._unsplit_bytes()
            self.balance.ring = self._ring_layout()
        return chosen

    def acquire(self, i: int) -> LayerWeights:
        if i in self.skipped and self.layers[i] is None:
            raise ValueError(f"layer {i} is skipped: the store no longer streams it")
        stream = torch.cuda.current_stream(self.device)
        if i <= self._last_acquired and self.timeline is not None:
            # a new pass (the layer index went back; with stages, this store's first layer
            # need not be 0): read the last pass's events back
            self.timeline.flush(self.stats)
        # the host starting to enqueue this layer (--trace's launch track), after that wait
        launched = time.perf_counter() if self.timeline is not None else None
        self._last_acquired = i
        layer = self.layers[i]
        if layer is None:
            layer = self._views_of(i, self.feed[i].acquire(i, stream))
            self.stats.layers_streamed += 1
        if self.timeline is not None:
            self.timeline.layer_start(stream, i, launched)
        return layer

    def fixed(self, i: int) -> bool:
        # resident (built at load or promoted); a split or streamed layer has no entry here
        return self.layers[i] is not None

    def waiting(self, i: int) -> bool:
        """Layer i streams through the ring and its bytes (a tier-C read) are not there yet.
        Resident layers never wait; the mmap baseline reads on demand, nothing ahead."""
        if self.layers[i] is not None or self.ring is None or self.feed.get(i) is not self.ring:
            return False
        return self.ring.waiting(i)

    def _views_of(self, i: int, slot) -> LayerWeights:
        """Layer i as views into `slot`, built once per slot it lands in (and per mode): a
        layer's dozens of views and weight objects cost the host about a millisecond, which
        hybrid decode, whose host waits on every split layer, would pay on its critical path.
        Slots live as long as the store, so the views stay valid."""
        split = self.split_mode and i in self.active
        key = (i, slot.data_ptr(), split)
        layer = self._views.get(key)
        if layer is None:
            if split:
                layer = from_image(self.layouts[i], slot, self.workspace, upto=self.prefix[i])
                layer.ffn_host = self.hosts[i]
            else:
                layer = from_image(self.layouts[i], slot, self.workspace)
            self._views[key] = layer
        return layer

    def release(self, i: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        if self.timeline is not None:
            self.timeline.layer_end(stream)
        feed = self.feed.get(i)
        if feed is not None:
            feed.release(i, stream)

    def collect(self) -> None:
        """Fold the timing of the pass still open into stats (end of a --stats run)."""
        if self.timeline is not None:
            self.timeline.flush(self.stats)
            for src in self.sources:
                src.collect()

    def close(self) -> None:
        """Join the reader threads, close the files and maps, give back the pinned images,
        staging buffers and GPU slots. Idempotent."""
        if not self.sources:
            return
        failure = None
        if self.split is not None:
            try:  # hybrid's CPU worker first: the stream may be waiting on it
                self.split.close()
            except RuntimeError as e:
                failure = e
        torch.cuda.synchronize(self.device)  # no copy or kernel may still use what goes
        for src in self.sources:
            src.close()
        self.sources = []
        self.ring = None
        self.feed = {}
        self.images = {}
        self._views = {}
        if failure is not None:
            raise failure


