"""A mixture of experts' layer split between the GPU and the CPU (model.moe.ExpertBank on CUDA,
memory.expert_split_plan): some experts in VRAM slots, the others computed by the CPU from RAM
or read from the file when routed to (weights.expert_tiers' bank, whose packed CPU layouts
take the native one-call sum, native/moe_ffn.c).

VRAM slots: each projection's slots stacked in one packed weight as weights.routed_experts
stacks every expert (slot s is rows [s * rows, (s + 1) * rows)), read by the same routed GEMVs
with slot numbers for expert ids. Which expert a slot holds is a SlotMap's (weights.
expert_slots): on the host for the CPU's half, mirrored on the device as an expert-id -> slot
table (-1: not in VRAM) that the GPU's half gathers its slots from.

A decode token of a split layer:
1. the ids and weights come to the host: the layer's one host sync (the CPU must know its
   experts; the GPU's half could do without);
2. the normed input's copy down is queued (hybrid.host_io.HostIO, the dense hybrid's
   hand-off), and the CPU's experts go to its worker thread;
3. the GPU's routed GEMVs run over every pair, the CPU's pairs given slot 0 and weight 0
   (adding an exact zero changes no bit of the sum);
4. a kernel on the stream waits for the worker's counter and adds the CPU's sum from pinned
   memory (kernels.wait_host_add): the host does not wait for the CPU.
A pass of more rows (prefill) groups its rows by expert: where the runtime's streamer finds
streaming faster than the CPU for the pass (weights.expert_stream), the experts outside VRAM
are copied into a few VRAM staging slots while the GPU computes the others; else
model.moe.experts_ffn runs a slot's expert as a QuantLinear over its rows of the stack and
the CPU's on the host.

Every SWAP_EVERY decode tokens the layer swaps its hottest experts outside VRAM into its
coldest slots: the expert's bytes read from the file, copied and packed on a copy stream
that first waits for the compute stream, which then waits for the copy before its next
kernel; the map changes after. An expert computes the same bits in any slot, so a swap
changes which side computes an expert, never the slot's numbers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from .. import kernels
from ..errors import UnsupportedArchitecture
from ..kernels.pack import FLOAT_DTYPES, PackedWeight, f16_scales, fuse_scales
from ..model.moe import experts_ffn
from .expert_slots import SlotMap
from .expert_tiers import ExpertFile, ExpertSlice, TieredExperts
from .linear import Workspace
from .routed_experts import RoutedExperts, RoutedLinear

if TYPE_CHECKING:
    from ..hybrid.host_io import HostIO
    from .expert_stream import ExpertStreamer

PLANES = ("lo", "hi", "d", "m", "sc", "mn", "sm")
# Rows of an expert's projection packed at once into its slot (at the load and in a swap):
# packing takes ~24 bytes of int64 temporaries per weight (memory.vram.PACK_TEMP_BYTES), 416
# MiB for a gpt-oss-120b expert's gate/up (5760 x 2880) whole, 18 MiB for 256 of its rows.
# Rows pack independently, so the planes are those of the whole expert.
SLOT_WRITE_ROWS = 256


@dataclass
class SplitCounts:
    """The counters a split model keeps where no store's stats are given (a store's
    StoreStats has the same fields): routed (token, expert) pairs computed from VRAM slots
    and by the CPU, swaps and the bytes they copied, the CPU's seconds and bytes, and the
    CPU side's cold-expert reads, and the experts a prefill streamed to the GPU
    (weights.expert_stream), the bytes copied up for them and their routed pairs."""

    expert_vram_pairs: int = 0
    expert_cpu_pairs: int = 0
    expert_swaps: int = 0
    expert_swap_bytes: int = 0
    expert_syncs: int = 0
    cpu_s: float = 0.0
    cpu_bytes: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0
    expert_read_s: float = 0.0
    expert_ahead_reads: int = 0
    expert_ahead_bytes: int = 0
    expert_ahead_hits: int = 0
    expert_streamed: int = 0
    expert_stream_bytes: int = 0
    expert_stream_pairs: int = 0


class SplitRuntime:
    """What a split model's layers share: the GGUF file the CPU's cold experts and swaps read,
    the hand-off to the CPU's worker (one HostIO, its jobs in layer order), the copy stream
    of the swaps and of a prefill's streamed experts, the counters (`stats`: the runtime points
    it at its store's), and the prefill's streamer (weights.expert_stream.ExpertStreamer, set
    by weights.split_build; None: a prefill's experts outside VRAM are the CPU's)."""

    def __init__(self, file: ExpertFile, device: torch.device, hidden: int,
                 io_factory: Callable[[], "HostIO"]):
        self.file = file
        self.streamer: "ExpertStreamer | None" = None
        self.device = device
        self.hidden = hidden
        self.io = io_factory()
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._stats: object = SplitCounts()
        self.stats = self._stats

    @property
    def stats(self) -> object:
        return self._stats

    @stats.setter
    def stats(self, s: object) -> None:
        self._stats = s
        self.file.stats = s
        self.io.stats = s

    def close(self) -> None:
        """Stop the CPU's worker once its jobs are done, and close the file."""
        self.io.close()
        self.file.close()


def _transform(packed: PackedWeight, ws: Workspace, fuse: bool) -> PackedWeight:
    """RoutedLinear's scale layout of a stack, applied to one expert's planes (int8
    activations: the scales fused, or rounded to f16 in the kernels)."""
    if ws.int8_activations and packed.qtype not in FLOAT_DTYPES and packed.spec.grid is None:
        return fuse_scales(packed) if fuse else f16_scales(packed)
    return packed


def empty_stack(one: PackedWeight, n: int) -> PackedWeight:
    """Planes for n weights of `one`'s shape and layout, stacked by rows (uninitialised)."""
    planes = {f: torch.empty((n * p.shape[0], *p.shape[1:]), dtype=p.dtype, device=p.device)
              for f in PLANES if (p := getattr(one, f)) is not None}
    return replace(one, rows=n * one.rows, gguf_bytes=n * one.gguf_bytes, **planes)


def write_rows(stack: PackedWeight, start: int, part: PackedWeight) -> None:
    """The stack's rows [start, start + part.rows) := part, plane by plane, on the current
    stream."""
    for f in PLANES:
        src, dst = getattr(part, f), getattr(stack, f)
        if (src is None) != (dst is None):
            raise ValueError(f"plane {f} is in one of the stack and the weight only")
        if src is not None:
            dst[start:start + part.rows].copy_(src)


@dataclass
class ExpertBytes:
    """How a layer's experts are laid out in the file: their GGML types, (rows, cols) per
    projection (gate, up, down), the slices of the three 3-D tensors, and the biases of every
    expert (gpt-oss; host float32 (n_experts, rows) or None)."""

    types: list
    shapes: list[tuple[int, int]]
    slices: list[ExpertSlice]
    biases: list[torch.Tensor | None]

    @property
    def fused(self) -> bool:
        """Gate and up in one stack ([gate_e | up_e] rows), as weights.experts._routed."""
        return self.types[0] == self.types[1]

    def stacks(self) -> list[tuple[object, int, int]]:
        """(qtype, rows, cols) of each stacked projection: [gate_up] or [gate, up], down."""
        (g, cols), (u, _), down = self.shapes[0], self.shapes[1], self.shapes[2]
        first = [(self.types[0], g + u, cols)] if self.fused else \
            [(self.types[0], g, cols), (self.types[1], u, cols)]
        return first + [(self.types[2], *down)]

    def split(self, raws: list[torch.Tensor]) -> list[torch.Tensor]:
        """An expert's gate, up and down bytes as the stacks take them."""
        return [torch.cat(raws[:2], dim=0)] + raws[2:] if self.fused else raws

    def bias_rows(self, e: int) -> list[torch.Tensor | None]:
        """Expert e's bias rows per stack, float32 on the host, or None each."""
        b = [x[e] if x is not None else None for x in self.biases]
        if not self.fused:
            return b
        gate_up = None
        if b[0] is not None or b[1] is not None:
            rows = [self.shapes[k][0] for k in (0, 1)]
            gate_up = torch.cat([b[k] if b[k] is not None else torch.zeros(rows[k])
                                 for k in (0, 1)])
        return [gate_up, b[2]]


class SlotStacks:
    """A layer's VRAM slots: one packed stack per projection over `slots` experts, their
    biases, and the routed bank over them (RoutedExperts with slot numbers for ids)."""

    def __init__(self, layout: ExpertBytes, first: list[torch.Tensor], slots: int,
                 device: torch.device, ws: Workspace, fuse: bool, act: str):
        """first: expert 0's bytes per projection (gate, up, down), which set the planes'
        shapes; every slot is written by `write` before use."""
        self.layout, self.device, self.ws, self.fuse = layout, device, ws, fuse
        ones = [self._pack_rows(r[:1], q, 1, cols)
                for r, (q, _, cols) in zip(layout.split(first), layout.stacks())]
        self.bias = [torch.zeros(slots, b.shape[0], device=device) if b is not None else None
                     for b in layout.bias_rows(0)]
        rows = [rows for _, rows, _ in layout.stacks()]
        linears = [RoutedLinear(empty_stack(p, slots * r), slots, b, ws, fuse)
                   for p, r, b in zip(ones, rows, self.bias)]
        # the stacks as the linears hold them (their scale layout is final already: the
        # same planes), which `write` fills
        self.planes = [lin.packed for lin in linears]
        self.bank = RoutedExperts(linears[:-1], linears[-1], act)

    def _pack_rows(self, raw: torch.Tensor, qtype, rows: int, cols: int) -> PackedWeight:
        packed = kernels.pack_weight(raw.to(self.device, non_blocking=True), qtype, rows, cols)
        return _transform(packed, self.ws, self.fuse)

    def write(self, s: int, e: int, raws: list[torch.Tensor]) -> int:
        """Slot s := expert e (its gate, up and down bytes, (rows, row_bytes) each), on the
        current stream, SLOT_WRITE_ROWS rows at a time; returns the bytes copied."""
        bias = [b if b is not None or dst is None else torch.zeros(dst.shape[1])
                for dst, b in zip(self.bias, self.layout.bias_rows(e))]
        return self.write_parts(s, self.layout.split(raws), bias)

    def write_parts(self, s: int, parts: list[torch.Tensor],
                    bias: list[torch.Tensor | None], elements: int | None = None) -> int:
        """Slot s := an expert given as each stack's bytes (ExpertBytes.split's) and bias row
        (ExpertBytes.bias_rows', a row wherever the stack has a bias), on the current stream;
        from pinned memory the copies are asynchronous (weights.expert_stream). Packed
        SLOT_WRITE_ROWS rows at a time, or `elements` weights at a time where given. Returns
        the packed bytes written."""
        moved = 0
        for stack, raw, (q, rows, cols) in zip(self.planes, parts, self.layout.stacks()):
            step = SLOT_WRITE_ROWS if elements is None else max(1, elements // cols)
            for r0 in range(0, rows, step):
                r1 = min(r0 + step, rows)
                part = self._pack_rows(raw[r0:r1], q, r1 - r0, cols)
                write_rows(stack, s * rows + r0, part)
                moved += part.nbytes
        for dst, b in zip(self.bias, bias):
            if dst is not None:
                dst[s].copy_(b, non_blocking=True)
        return moved


@dataclass
class _CpuShare:
    """One token's experts the CPU computes, as HostIO's worker takes a share (hybrid.share.
    HostFFN's members): their ids in ascending order and their router weights."""

    bank: TieredExperts
    layer: int
    ids: list[int]
    weights: torch.Tensor
    act_dtype: torch.dtype
    nbytes: int
    slot: int = 0

    def compute(self, h: torch.Tensor) -> torch.Tensor:
        return self.bank.ffn_one(self.ids, self.weights, h.to(self.act_dtype)).float()

    def compute_into(self, h: torch.Tensor, out: torch.Tensor, scratch) -> None:
        out.copy_(self.compute(h))


class SplitExperts:
    """A layer's experts split between VRAM slots and the CPU (see the module doc); the
    ExpertBank model.moe routes into."""

    def __init__(self, layer: int, slots: SlotStacks | None, slot_map: SlotMap,
                 cpu: TieredExperts, runtime: SplitRuntime, cpu_act_dtype: torch.dtype,
                 expert_cpu_bytes: int, layout: ExpertBytes | None = None,
                 stacks: Callable[[list[torch.Tensor], int], SlotStacks] | None = None):
        """layout: how the layer's experts lie in the file; stacks: makes SlotStacks of that
        layout over `n` slots from an expert's bytes (gate, up, down), as the VRAM slots were
        made: the streamer's staging slots (both None: a prefill never streams)."""
        self.layer = layer
        self.layout = layout
        self.stacks = stacks
        self.slots = slots
        self.map = slot_map
        self.cpu = cpu
        self.runtime = runtime
        self.cpu_act_dtype = cpu_act_dtype
        self.expert_cpu_bytes = expert_cpu_bytes  # what one CPU expert reads, for the stats
        dev = runtime.device
        self.slot_of = torch.tensor(slot_map.slot_of, dtype=torch.long, device=dev)

    @property
    def n_experts(self) -> int:
        return self.map.n_experts

    # --- the bank ---------------------------------------------------------------------------

    def mix(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if h.is_cuda and torch.cuda.is_current_stream_capturing():
            raise UnsupportedArchitecture(
                f"layer {self.layer}'s experts are split between VRAM and the CPU, which "
                f"syncs once a layer for the routing: no CUDA graph holds it (speculative "
                f"step graphs and layer graphs are not built for a split mixture of experts)")
        T, k = ids.shape
        # the layer's one host sync, ids and weights together, before any of the GPU's work
        # is enqueued (float64 holds both exactly)
        host = torch.stack([ids.double(), weights.double()]).cpu()
        self.runtime.stats.expert_syncs += 1
        flat = host[0].long().view(-1).tolist()
        self.map.record(flat, T)
        if T == 1 and self.map.due():
            self.swap_round()
        vram = sum(1 for e in flat if self.map.in_vram(e))
        stats = self.runtime.stats
        stats.expert_vram_pairs += vram
        streamer = self.runtime.streamer
        if T > 1 and streamer is not None and self.stacks is not None \
                and streamer.streams(self, flat, len(flat) - vram):
            stats.expert_stream_pairs += len(flat) - vram
            return streamer.mix(self, h, ids, weights, flat)
        stats.expert_cpu_pairs += len(flat) - vram
        if T > 1:
            return experts_ffn(h, ids, weights, self)
        return self._decode(h, ids, weights, flat, host[1][0].float(), vram)

    def _decode(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                flat: list[int], host_w: torch.Tensor, vram: int) -> torch.Tensor:
        io = self.runtime.io
        cpu = sorted((e, j) for j, e in enumerate(flat) if not self.map.in_vram(e))
        if cpu:  # the input's copy down first: the CPU starts while the GPU computes
            io.send(h)
        if vram:
            slot = self.slot_of[ids]  # (1, k): -1 where the CPU computes
            w = torch.where(slot >= 0, weights.float(), torch.zeros((), device=h.device))
            out = self.slots.bank.mix(h, slot.clamp(min=0), w)
        else:
            out = torch.zeros(1, h.shape[-1], dtype=torch.float32, device=h.device)
        if not cpu:
            return out
        share = _CpuShare(self.cpu, self.layer, [e for e, _ in cpu],
                          host_w[[j for _, j in cpu]].contiguous(), self.cpu_act_dtype,
                          len(cpu) * self.expert_cpu_bytes)
        return io.finish(share, out)

    def ffn(self, e: int, h: torch.Tensor) -> torch.Tensor:
        s = self.map.slot_of[e]
        if s >= 0:
            return self.slots.bank.ffn(s, h)
        y = self.cpu.ffn(e, h.to("cpu", self.cpu_act_dtype))
        return y.to(h.device, torch.float32)

    def ffn_one(self, ids: list[int], weights: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        dev = h.device
        return self.mix(h, torch.tensor([ids], device=dev), weights.view(1, -1).to(dev))

    # --- placement --------------------------------------------------------------------------

    def swap_round(self) -> None:
        """The map's swaps for this round: each new expert's bytes read from the file and
        written into its slot on the copy stream, which waits for the compute stream first;
        the compute stream waits for the copies before its next kernel."""
        swaps = self.map.plan_swaps()
        if not swaps or self.slots is None:
            return
        rt = self.runtime
        stream = rt.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(rt.device))
        for sw in swaps:
            raws = [rt.file.read(sl, sw.new) for sl in self.cpu.slices]
            if stream is not None:
                raws = [r.pin_memory() for r in raws]  # an asynchronous copy up
                with torch.cuda.stream(stream):
                    moved = self.slots.write(sw.slot, sw.new, raws)
            else:
                moved = self.slots.write(sw.slot, sw.new, raws)
            self.map.apply(sw)
            # the new expert's RAM slot (if it held one) goes to the next expert the CPU
            # reads; the old one is read from the file on its next use, and admitted
            self.cpu.held.pop(sw.new, None)
            rt.stats.expert_swaps += 1
            rt.stats.expert_swap_bytes += moved
        if stream is not None:
            torch.cuda.current_stream(rt.device).wait_stream(stream)
        # the device's map, in stream order after the copies
        self.slot_of.copy_(torch.tensor(self.map.slot_of, dtype=torch.long), non_blocking=False)
