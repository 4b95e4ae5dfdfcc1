"""The GPU slot ring: streamed layers' images are brought into `n_slots` GPU slots, ahead of
compute, from per-tier sources (sources.py), and each layer is read as views into its slot.

Ordering is on the GPU, with no host sync per layer:
- compute waits on the event recorded after its slot's copy (`copied`);
- a copy into a slot waits on the event recorded after the last kernel that read the slot
  (`freed`), so a slot is never overwritten while a kernel may still read it (the reference
  engine's race); a source that writes outside stream order (KvikIO) waits for that event on
  the host instead.

Copies run ahead of compute in layer order, cycling into the next token: the copy into a slot
is enqueued as soon as the slot is released and the bytes are there, so the main thread only
blocks on a disk read when the layer it needs next has not arrived. A request out of that order
(a pass that stopped part-way) settles what is in flight and restarts the ring at the layer
asked for: the one place the host waits on the GPU.

The CPU disk store has no ring of slots: it builds a layer straight from the staging buffer
its bytes were read into (staging.py, the read-ahead ring both share), with no copy to order.
"""

from __future__ import annotations

import random

import torch

from .protocol import StoreStats
from .sources import Source
from .timeline import CopyMeter, Timeline


class SlotRing:
    def __init__(self, device: torch.device, sources: list[Source], n_slots: int,
                 slot_bytes: int, stats: StoreStats, copy_cycles: int = 0, seed: int = 0):
        """copy_cycles (tests): the copy stream stalls for a random number of GPU cycles below
        this before each copy (StreamDelays.copy_cycles)."""
        self.device = device
        self.source_of = {i: src for src in sources for i in src.layouts}
        self.sources = sources
        self.order = sorted(self.source_of)  # the layers the ring serves, in use order
        self.skipped: frozenset[int] = frozenset()  # served by no one (skip())
        if not self.order:
            raise ValueError("a slot ring needs at least one layer")
        n_slots = max(1, min(n_slots, len(self.order)))
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device)
                      for _ in range(n_slots)]
        self.copy_stream = torch.cuda.Stream(device)
        self.copied = [torch.cuda.Event() for _ in range(n_slots)]
        self.freed = [torch.cuda.Event() for _ in range(n_slots)]
        self.slot_of: dict[int, int] = {}  # layer enqueued, not yet acquired -> its slot
        self.in_use: dict[int, int] = {}  # layer acquired, not yet released -> its slot
        self.slot_next = 0  # the slot the next enqueued copy uses
        # Positions count copies in ring order (layer order[pos % len(order)]). A copy may run
        # at most `window` positions ahead of the releases: its slot is the one freed then.
        self.pos = 0
        self.released = 0
        self.stats = stats
        self.copy_cycles = copy_cycles
        self.rng = random.Random(seed)
        self.timeline: Timeline | None = None  # set by the store while --stats is on
        self.meter: CopyMeter | None = None  # set by the store while hybrid decode balances

    def copy_in(self, k: int, src: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        """Enqueue a copy of `src` (uint8, host) into slot k on the copy stream, after the
        slot's last reader; `done`: an event to record after it too (a staging buffer's)."""
        n = src.numel()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[k])  # the slot's last reader is done
            if self.copy_cycles:
                torch.cuda._sleep(self.rng.randrange(self.copy_cycles))
            t = self.timeline
            start_ev = t.mark(self.copy_stream) if t is not None else None
            meter = self.meter if self.meter is not None and self.meter.on else None
            metered = meter.start(self.copy_stream) if meter is not None else None
            self.slots[k][:n].copy_(src, non_blocking=True)
            if t is not None:
                t.copy(start_ev, t.mark(self.copy_stream), n)
            if meter is not None:
                meter.end(self.copy_stream, metered, n)
            self.copied[k].record(self.copy_stream)
            if done is not None:
                done.record(self.copy_stream)
        self.stats.h2d_bytes += n

    def pump(self, until: int | None = None) -> None:
        """Enqueue copies in ring order while a slot is free. Stops at a layer whose bytes are
        not there yet, unless it is at or before `until`, which must be enqueued on return."""
        n = len(self.order)
        if n == 0:
            return  # every layer it served was made resident (drop)
        while self.pos < self.released + self.window:
            i = self.order[self.pos % n]
            if until is None and not self.source_of[i].ready(i):
                return
            self._enqueue(i)
            if i == until:
                until = None

    @property
    def window(self) -> int:
        """How many positions copies may run ahead of the releases: one per slot, but never
        more than the layers served (after skip() leaves fewer layers than slots), so that
        no layer is in the ring twice."""
        return min(len(self.slots), len(self.order))

    def _enqueue(self, i: int) -> None:
        k = self.slot_next
        self.source_of[i].enqueue(self, i, k)
        self.slot_of[i] = k
        self.slot_next = (k + 1) % len(self.slots)
        self.pos += 1

    def restart(self, i: int) -> None:
        """An out-of-order request (a forward pass that stopped part-way, say): settle what is
        in flight (host waits, but only here) and restart the ring at layer i."""
        self._release_in_use()
        start = self.order.index(i)
        n = len(self.order)
        ahead = [self.order[(start + j) % n] for j in range(n)]
        for src in self.sources:  # first: a write outside stream order (kvikio) must land
            if any(x in src.layouts for x in ahead):  # before the copy stream is drained
                src.restart(ahead)
        self.copy_stream.synchronize()  # stale copies must not land after the next writes
        self.slot_of.clear()
        self.pos = self.released = start

    def skip(self, layers: frozenset[int]) -> None:
        """Serve only the layers not in `layers` from now on (layer skip): settle what is in
        flight, as restart does, and restart the ring at the first layer left. A skipped layer
        is then never copied, and the copies run ahead across it, so that the slot it would
        have taken holds the next layer served instead."""
        self._release_in_use()
        self.skipped = frozenset(layers)
        for src in self.sources:  # first: reads ahead of the old order must land or drop
            src.skip(self.skipped)
        self.copy_stream.synchronize()
        self.slot_of.clear()
        self.order = [i for i in sorted(self.source_of) if i not in self.skipped]
        self.pos = self.released = 0

    def drop(self, layers) -> None:
        """Serve `layers` no more (made resident elsewhere): settle what is in flight, as
        restart does, and restart the ring at the first layer left."""
        self._release_in_use()
        self.copy_stream.synchronize()
        self.slot_of.clear()
        for i in layers:
            self.source_of.pop(i, None)
        self.order = [i for i in sorted(self.source_of) if i not in self.skipped]
        self.pos = self.released = 0

    def _release_in_use(self) -> None:
        """Layers acquired and not released (a pass that stopped part-way): their slots are
        free once the kernels enqueued so far are done."""
        for k in self.in_use.values():
            self.freed[k].record(torch.cuda.current_stream(self.device))
        self.in_use.clear()

    def waiting(self, i: int) -> bool:
        """Whether acquire(i) would block the host on bytes not there yet: after enqueueing
        the copies that are ready, layer i is the next due and its bytes have not landed. An
        out-of-order request (acquire restarts the ring) is not a wait on a read: False."""
        if i in self.slot_of or i in self.skipped or i not in self.source_of:
            return False
        self.pump()
        if i in self.slot_of or self.pos >= self.released + self.window:
            return False
        return self.order[self.pos % len(self.order)] == i and not self.source_of[i].ready(i)

    def acquire(self, i: int, stream: torch.cuda.Stream) -> torch.Tensor:
        """The slot holding layer i, with `stream` ordered after its arrival."""
        if i in self.skipped:
            raise ValueError(f"layer {i} is skipped: the slot ring no longer serves it")
        if i not in self.slot_of:
            n = len(self.order)
            if self.order[self.pos % n] != i or self.pos >= self.released + self.window:
                self.restart(i)
            self.pump(until=i)
        k = self.slot_of.pop(i)
        self.source_of[i].arrive(self, i, k, stream)
        self.in_use[i] = k
        return self.slots[k]

    def release(self, i: int, stream: torch.cuda.Stream) -> None:
        k = self.in_use.pop(i, None)
        if k is None:
            return  # acquired before a restart, which settled it already
        self.freed[k].record(stream)
        self.released += 1
        self.pump()  # refill the slot just released, if its layer's bytes are there
