"""A split layer's prefill with the experts outside VRAM streamed to the GPU (weights.
split_experts): a pass of many rows routes to most of a layer's experts (pp512 of
Qwen3-30B-A3B: 4096 routed pairs over 128 experts, 32 rows each), and the CPU computing the
ones outside VRAM one at a time while the GPU waits runs the pass at the CPU's speed.

The pass, where streaming is faster than the CPU (StreamRates):
1. the experts outside VRAM that the pass routes to are copied, in ascending order, into a
   few VRAM staging slots (STAGING_SLOTS, SlotStacks of the layer's layout, written by the
   same packing as the VRAM slots from the expert's GGUF bytes: those the RAM tier holds,
   else read from the file) on the copy stream, from a ring of pinned host buffers;
2. the compute stream meanwhile runs the experts in VRAM slots, then the staged ones in the
   order they arrive, each waiting for its copy's event; each staged expert's last read is
   an event that the copy into its slot after it waits for. The host waits for no kernel:
   only, before refilling a pinned buffer, for the copy that last read it (PINNED_RING
   buffers, so the host runs at most that many experts ahead of the copies);
3. each expert's rows, times their router weights, go into their places of one buffer of
   the pass's (row, expert) pairs grouped by expert, and are added into the output expert
   by expert in ascending order after: model.moe.experts_ffn's products and order of
   addition, so the all-VRAM bank's bits (the same kernels on the same planes).

On a CPU device (Triton's interpreter, the tests) the same order runs without streams:
every copy lands when issued, so a slot rewritten before its last read shows in the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import BadArgument
from .linear import OnDemandDenseLinear

if TYPE_CHECKING:
    from .split_experts import ExpertBytes, SlotStacks, SplitExperts, SplitRuntime

# VRAM staging slots per expert layout: triple buffered, one being written, one computed and
# one landed ahead of it. A Qwen3-30B-A3B Q4_K expert is ~2.6 MB: 0.05 ms at 55 GB/s against
# tens of microseconds for its 32 rows of pp512 on an H100, so a pass is bound by the copies
# and more slots would only absorb their jitter (each one more is an expert's planes of VRAM)
STAGING_SLOTS = 3
# Weights packed at a time into a staging slot: a pack is ~50 small launches on the host
# whatever its rows, and a swap's 256 rows at a time (split_experts.SLOT_WRITE_ROWS) would make
# a Qwen3-30B-A3B expert 14 packs, several ms of launches against its 0.05 ms copy; 4M weights
# are one pack per projection of it (gate/up 1536 x 2048, down 2048 x 768; gpt-oss-120b's gate/up
# five), for ~96 MiB of temporaries (memory.vram.PACK_TEMP_BYTES), which the plan reserves
STAGING_WRITE_ELEMENTS = 4 << 20
# Pinned host buffers per layout (each one expert's GGUF bytes and biases): twice the slots,
# so that the host fills the next experts' while the copy stream waits for a slot to free
PINNED_RING = 2 * STAGING_SLOTS


@dataclass(frozen=True)
class StreamRates:
    """What decides a pass between streaming and the CPU (both measured before the load,
    runtime.build.measured): pinned host-to-device copies, GB/s (memory.probes.
    h2d_pinned_gbps), and the CPU's expert kernel on one row, GB/s of weights read (hybrid.
    probe.cpu_packed_gbps).

    Streaming an expert costs its bytes over the link once, whatever its rows; the CPU reads
    its bytes once per row (rows x bytes over its rate: above a few rows the CPU's kernels
    get more from each byte, so this overstates the CPU's time, and streams a little early).
    The GPU's compute overlaps the copies, and the bytes of an expert are about the same in
    either form (GGUF and the CPU's packed layout), so a pass streams where its pairs outside
    VRAM are more than `rows_per_expert` a streamed expert: cpu_gbps / h2d_gbps (107.1 over
    55.5 GB/s, the two probes on an H100 host in a 12 GiB hybrid run: 2 rows; decode, 1 row of
    k experts, never streams)."""

    h2d_gbps: float
    cpu_gbps: float

    def __post_init__(self) -> None:
        if not (self.h2d_gbps > 0 and self.cpu_gbps > 0):
            raise BadArgument(f"stream rates h2d_gbps={self.h2d_gbps}, cpu_gbps="
                              f"{self.cpu_gbps}: both must be positive")

    @property
    def rows_per_expert(self) -> float:
        return self.cpu_gbps / self.h2d_gbps

    def streams(self, pairs: int, experts: int) -> bool:
        """Whether `pairs` routed pairs over `experts` experts outside VRAM are faster
        streamed (experts x bytes / h2d) than computed by the CPU (pairs x bytes / cpu)."""
        return experts > 0 and pairs * self.h2d_gbps > experts * self.cpu_gbps


def held_bytes(pair: tuple[object, object] | None) -> list[torch.Tensor] | None:
    """The gate, up and down GGUF bytes behind a RAM-held CPU expert (weights.experts.
    expert_linears' lazy linears, perhaps inside a packed decode copy), or None where it is
    not held or holds no bytes."""
    if pair is None:
        return None
    out = []
    for lin in pair:
        dense = getattr(lin, "dense", lin)
        if not isinstance(dense, OnDemandDenseLinear):
            return None
        out += [raw for raw, _, _ in dense.parts]
    return out if len(out) == 3 else None


@dataclass
class _Staging:
    """One layout's staging slots and pinned ring, with their events (CUDA): each slot's last
    read (the compute stream's) and each buffer's last copy (the copy stream's)."""

    stacks: "SlotStacks"
    ring: list[tuple[torch.Tensor, torch.Tensor | None]]
    slot_free: list[object] = field(default_factory=list)
    ring_free: list[object] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slot_free = [None] * self.stacks.bank.n_experts
        self.ring_free = [None] * len(self.ring)


def _layout_key(layout: "ExpertBytes") -> tuple:
    return (tuple(int(t) for t in layout.types), tuple(layout.shapes),
            tuple(b is not None for b in layout.biases))


class ExpertStreamer:
    """The runtime's prefill streamer (module doc): staging per expert layout (a model's
    layers mostly share one; Q4_K_M files mix two), made at the first pass that needs it."""

    def __init__(self, runtime: "SplitRuntime", rates: StreamRates,
                 slots: int = STAGING_SLOTS, ring: int = PINNED_RING):
        if slots < 1 or ring < 1:
            raise BadArgument(f"slots={slots}, ring={ring}: need at least one of each")
        self.runtime = runtime
        self.rates = rates
        self.slots = slots
        self.ring = ring
        # copies issued ahead of the staged expert being computed: `slots`, so that a copy
        # into a slot is issued after the last read of the expert before it (more is the
        # negative control's too-early reuse)
        self.ahead = slots
        self._staging: dict[tuple, _Staging] = {}

    def streams(self, bank: "SplitExperts", flat: list[int], outside_pairs: int) -> bool:
        experts = len({e for e in flat if not bank.map.in_vram(e)})
        return self.rates.streams(outside_pairs, experts)

    # --- the pass ---------------------------------------------------------------------------

    def mix(self, bank: "SplitExperts", h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor, flat: list[int]) -> torch.Tensor:
        """The routed sum of a pass, float32 (T, hidden), for its ids and router weights
        (T, k) on the device and the ids on the host (`flat`, row-major)."""
        T, hidden = h.shape
        k = ids.shape[1]
        dev = h.device
        counts = torch.bincount(torch.tensor(flat), minlength=bank.n_experts).tolist()
        starts = [0] * bank.n_experts
        for e in range(1, bank.n_experts):
            starts[e] = starts[e - 1] + counts[e - 1]
        # experts_ffn's grouping: (row, expert) pairs by expert, rows ascending in each
        order = torch.argsort(ids.reshape(-1), stable=True)
        rows = order // k
        scale = weights.reshape(-1)[order]
        pairs = torch.empty(T * k, hidden, dtype=torch.float32, device=dev)

        def run(experts, e: int, slot: int) -> None:
            a, n = starts[e], counts[e]
            y = experts.ffn(slot, h.index_select(0, rows[a:a + n])).float()
            torch.mul(y, scale[a:a + n, None], out=pairs[a:a + n])

        routed = [e for e in range(bank.n_experts) if counts[e]]
        staged = [e for e in routed if not bank.map.in_vram(e)]
        st = self._stage(bank, staged[0])
        cuda = dev.type == "cuda"
        compute = torch.cuda.current_stream(dev) if cuda else None
        ready: list[object] = []

        def issue(j: int) -> None:
            ready.append(self._copy(bank, st, j, staged[j]))

        issued = min(self.ahead, len(staged))
        for j in range(issued):
            issue(j)
        for e in routed:  # the VRAM slots' experts while the first copies land
            if bank.map.in_vram(e):
                run(bank.slots.bank, e, bank.map.slot_of[e])
        for i, e in enumerate(staged):
            s = i % self.slots
            if cuda:
                compute.wait_event(ready[i])
            run(st.stacks.bank, e, s)
            if cuda:
                st.slot_free[s] = compute.record_event()
            while issued < min(i + 1 + self.ahead, len(staged)):
                issue(issued)
                issued += 1
        out = torch.zeros(T, hidden, dtype=torch.float32, device=dev)
        for e in routed:  # experts_ffn's order of addition
            a, n = starts[e], counts[e]
            out.index_add_(0, rows[a:a + n], pairs[a:a + n])
        return out

    def _copy(self, bank: "SplitExperts", st: _Staging, j: int, e: int) -> object:
        """The j-th staged expert of the pass, e, into staging slot j % slots from ring buffer
        j % ring, on the copy stream (CUDA) after the slot's last read; returns the copy's
        event (None on a CPU device)."""
        rt = self.runtime
        s, b = j % self.slots, j % self.ring
        if st.ring_free[b] is not None:
            st.ring_free[b].synchronize()  # the buffer's last copy read it (module doc, 2)
        parts, bias, nbytes = self._fill(bank, st.ring[b], e)
        stream = rt.copy_stream
        if stream is None:
            st.stacks.write_parts(s, parts, bias, STAGING_WRITE_ELEMENTS)
            ev = None
        else:
            with torch.cuda.stream(stream):
                if st.slot_free[s] is not None:
                    stream.wait_event(st.slot_free[s])
                st.stacks.write_parts(s, parts, bias, STAGING_WRITE_ELEMENTS)
                ev = stream.record_event()
            st.ring_free[b] = ev
        rt.stats.expert_streamed += 1
        rt.stats.expert_stream_bytes += nbytes
        return ev

    def _fill(self, bank: "SplitExperts", buf: tuple[torch.Tensor, torch.Tensor | None],
              e: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
        """Expert e's bytes and bias rows into a ring buffer, as SlotStacks.write_parts takes
        them (views of the buffer), and their bytes."""
        layout = bank.layout
        raws = held_bytes(bank.cpu.held.get(e))
        ahead = bank.cpu.pending.pop(e, None)  # a read ahead of the guess, if any
        if raws is None and ahead is not None:
            raws = ahead.result()
        data, fbuf = buf
        views, off = [], 0
        for k, sl in enumerate(bank.cpu.slices):
            v = data[off:off + sl.rows * sl.row_bytes].view(sl.rows, sl.row_bytes)
            if raws is not None:  # held in RAM (or read ahead): copied in
                v.copy_(raws[k])
            else:  # read from the file straight into the buffer
                self.runtime.file.read_into(sl, e, v)
            views.append(v)
            off += v.numel()
        if layout.fused:  # gate then up, one after the other: ExpertBytes.split's [gate | up]
            g, u = views[0], views[1]
            views = [data[:g.numel() + u.numel()].view(g.shape[0] + u.shape[0], g.shape[1]),
                     views[2]]
        bias: list[torch.Tensor | None] = []
        foff = 0
        for row in layout.bias_rows(e):
            if row is None:
                bias.append(None)
                continue
            v = fbuf[foff:foff + row.numel()]
            v.copy_(row)
            bias.append(v)
            foff += row.numel()
        return views, bias, off + 4 * foff

    def _stage(self, bank: "SplitExperts", first: int) -> _Staging:
        """The staging of the bank's layout, made from expert `first`'s bytes (which set the
        planes' shapes; every slot is written before it is read)."""
        key = _layout_key(bank.layout)
        st = self._staging.get(key)
        if st is not None:
            return st
        layout = bank.layout
        raws = held_bytes(bank.cpu.held.get(first)) or \
            [self.runtime.file.read(sl, first) for sl in bank.cpu.slices]
        stacks = bank.stacks(raws, self.slots)
        nbytes = sum(sl.rows * sl.row_bytes for sl in layout.slices)
        nbias = sum(r.numel() for r in layout.bias_rows(0) if r is not None)
        pin = self.runtime.device.type == "cuda"  # asynchronous copies need pinned memory
        ring = [(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin),
                 torch.empty(nbias, dtype=torch.float32, pin_memory=pin) if nbias else None)
                for _ in range(self.ring)]
        st = self._staging[key] = _Staging(stacks, ring)
        return st
