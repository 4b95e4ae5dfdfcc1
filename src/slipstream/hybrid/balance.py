"""Hybrid decode's split, kept balanced while decoding: how many split layers the CPU serves.

The plan sets each split layer's CPU share from bandwidths probed at start-up
(hybrid.plan). The CPU's rate then changes under the engine: on the H200's host,
sharing its cores with other tenants, the CPU's shares ran at 26-34 GB/s in some runs
against a 59-63 GB/s probe, and hybrid decode fell to 2.74-3.95 tok/s, below copying whole
layers (3.10), because the GPU waited on the CPU at every split layer.

Changing the share itself would repack the CPU's weights. Instead, a split layer can run
whole on the GPU: its image is copied in full (the rest units are in it already, as for
prefill) and its CPU share sits idle. So the balance is a count k of the split layers that
go on computing on the CPU, spread evenly over them, chosen to minimise a decode token's
time through both paths:

    cpu(k)  = CPU bytes of the k layers / the CPU's rate measured over the last passes
              + k x the hand-over each split layer pays on the CPU's path
    pcie(k) = the bytes all streamed layers copy with k of them split / the PCIe rate
    token   = max(cpu(k), pcie(k))

The CPU's rate is what its worker measured (bytes read over seconds computing, from each
input's arrival), so it follows the machine. PCIe's is what the copies achieved over the same
passes where the store meters them (memory.timeline.CopyMeter), else the plan's probe beside
the CPU: on the H200 the probe said 49.4 GB/s and decode's copies ran at 43.6 beside the
CPU's share, which then finished 67 ms of a 224 ms token early.

k never drops below 1, so that the CPU's rate stays measured, and never exceeds the split
layers packed at load. So the balance can only take work off the CPU. Packing each share with
headroom and starting with fewer layers split, so that k could also climb, loses: on the H200
the 70B at 24 GiB decoded 4.288 tok/s with 28 of 36 layers split at a 0.73 share against 5.036
with all 36 at 0.54, the same bytes on each side in all. The copy stream
runs one slot ahead of compute: while the GPU waits at a split layer for the CPU's share, the
copy link can bring only the next layer, whose prefix is short when it is split too, and then
idles. A share the CPU finishes in about the time the next layer's copy takes keeps both busy;
a few heavier layers do not, whatever the totals say. So where the store gives the balance its
ring (every layer of a pass in order, and the slots), a token's time is that of the ring
itself, simulated layer by layer (pipeline_seconds): each streamed layer's copy waits for its
slot to be freed by the compute of the layer `slots` places before it, and each layer's
compute for its copy, the layer before, and at a split layer the CPU's share and hand-over.
That model put the two runs above at 191 and 244 ms a token (measured 199 and 233); the totals
alone put them within 3% of each other (185 and 190).

A change costs one host wait (the ring's copies are settled and restarted), so it is made only
for a predicted gain of MIN_GAIN or more, judged every WINDOW decode passes, and only once two
windows in a row call for a change the same way: on the H200 the first window after a load
measured the CPU at 40 GB/s and the next at 49, and a
single window took three layers off the CPU for eight passes before giving them back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .plan import GPU_LAYER_S
from ..memory.planner import evenly_spaced

WINDOW = 8  # decode passes between judgements
MIN_GAIN = 0.03  # the predicted token-time gain a change must promise


@dataclass
class SplitLayer:
    """One split layer's bytes: its CPU share's packed weights, the GPU share's image prefix
    (what PCIe copies while it is split) and its whole image (while it runs whole)."""

    cpu_bytes: int
    prefix_bytes: int
    image_bytes: int


def token_seconds(layers: dict[int, SplitLayer], active: set[int], other_bytes: int,
                  cpu_gbps: float, pcie_gbps: float, layer_s: float = 0.0) -> float:
    """A decode token's time through CPU and PCIe (the module's model) with `active` split,
    each of them paying `layer_s` on the CPU's path besides its bytes."""
    cpu = sum(layers[i].cpu_bytes for i in active) / (cpu_gbps * 1e9) + layer_s * len(active)
    pcie_bytes = other_bytes + sum(
        s.prefix_bytes if i in active else s.image_bytes for i, s in layers.items())
    return max(cpu, pcie_bytes / (pcie_gbps * 1e9))


def pipeline_seconds(ring: list[tuple[int, int]], layers: dict[int, SplitLayer],
                     active: set[int], cpu_gbps: float, pcie_gbps: float, layer_s: float = 0.0,
                     slots: int = 2, gpu_s: float = GPU_LAYER_S, tokens: int = 3) -> float:
    """A decode token's time through the slot ring (the module doc), in its steady state (the
    last of `tokens` simulated: the copies run ahead into the next token). ring: every layer
    of a pass in order as (layer, bytes its whole image copies; 0 for a resident layer). A
    layer the GPU computes whole takes gpu_s on the chain; a split one `layer_s` (its GPU
    part and the hand-over: the GPU's share of the FFN runs beside the CPU's, as --trace
    shows) and the CPU's share."""
    pcie, cpu = pcie_gbps * 1e9, cpu_gbps * 1e9
    copy_end = compute_end = token = 0.0
    done: deque[float] = deque(maxlen=max(1, slots))  # the last slots' compute ends
    for _ in range(tokens):
        start = compute_end
        for i, whole in ring:
            if not whole:
                compute_end += gpu_s
                continue
            split = layers.get(i)
            on_cpu = split is not None and i in active
            nbytes = split.prefix_bytes if on_cpu else (split.image_bytes if split else whole)
            # the slot this copy takes was last read by the layer `slots` copies back
            begin = max(copy_end, done[0]) if len(done) == done.maxlen else copy_end
            copy_end = begin + nbytes / pcie
            chain = split.cpu_bytes / cpu + layer_s if on_cpu else gpu_s
            compute_end = max(copy_end, compute_end) + chain
            done.append(compute_end)
        token = compute_end - start
    return token


def modelled_seconds(layers: dict[int, SplitLayer], active: set[int], other_bytes: int,
                     cpu_gbps: float, pcie_gbps: float, layer_s: float = 0.0,
                     ring: list[tuple[int, int]] | None = None, slots: int = 2) -> float:
    """A token's time with `active` split: the ring's (pipeline_seconds) where it is known,
    else token_seconds' totals."""
    if ring is not None:
        return pipeline_seconds(ring, layers, active, cpu_gbps, pcie_gbps, layer_s, slots)
    return token_seconds(layers, active, other_bytes, cpu_gbps, pcie_gbps, layer_s)


def best_count(layers: dict[int, SplitLayer], other_bytes: int, cpu_gbps: float,
               pcie_gbps: float, layer_s: float = 0.0, ring: list[tuple[int, int]] | None = None,
               slots: int = 2) -> int:
    """The count of split layers (1 .. all) that minimises modelled_seconds, the layers taken
    evenly spaced; the largest such count on a tie."""
    order = sorted(layers)
    best_k, best_t = len(order), float("inf")
    for k in range(len(order), 0, -1):
        t = modelled_seconds(layers, set(evenly_spaced(order, k)), other_bytes, cpu_gbps,
                             pcie_gbps, layer_s, ring, slots)
        if t < best_t * (1 - 1e-9):
            best_k, best_t = k, t
    return best_k


@dataclass
class HybridBalance:
    """The running judgement over one store's split layers (see the module doc).

    observe(cpu_seconds, cpu_bytes, copy_seconds, copy_bytes) is called at each decode pass's
    start with the store's running totals (the copies' where metered, else None); every
    WINDOW passes it judges, and returns the new active set when this window and the one
    before both found a change that pays (the same way), else None. `changes` records each
    change: (pass, layers split, CPU GB/s measured, PCIe GB/s judged by)."""

    layers: dict[int, SplitLayer]
    other_bytes: int  # what the streamed layers that are not split copy per token
    pcie_gbps: float  # the plan's probe: PCIe's rate until the copies are measured
    active: set[int] = field(default_factory=set)
    window: int = WINDOW
    layer_s: float = 0.0  # what each split layer pays on the chain besides its share
    # the store's ring (pipeline_seconds' `ring`) and slots; None: judge by the totals
    ring: list[tuple[int, int]] | None = None
    slots: int = 2
    passes: int = 0
    changes: list[tuple[int, int, float, float]] = field(default_factory=list)
    cpu_gbps: float | None = None  # the rate measured over the last window
    pcie_measured: float | None = None  # the copies' rate over the last window, if metered
    _mark: tuple[float, int, float | None, int | None] | None = None
    _since: int = 0
    _wanted: int = 0  # the direction the last window called for: -1 fewer, +1 more, 0 none

    def __post_init__(self) -> None:
        if not self.active:
            self.active = set(self.layers)

    def observe(self, cpu_seconds: float, cpu_bytes: int, copy_seconds: float | None = None,
                copy_bytes: int | None = None) -> set[int] | None:
        self.passes += 1
        mark = (cpu_seconds, cpu_bytes, copy_seconds, copy_bytes)
        if self._mark is None:
            self._mark = mark
            return None
        self._since += 1
        if self._since < self.window:
            return None
        before, self._mark, self._since = self._mark, mark, 0
        seconds, nbytes = cpu_seconds - before[0], cpu_bytes - before[1]
        if seconds <= 0 or nbytes <= 0 or not self.layers:
            return None
        self.cpu_gbps = nbytes / seconds / 1e9
        if copy_seconds is not None and before[2] is not None:
            copied_s, copied = copy_seconds - before[2], copy_bytes - before[3]
            if copied_s > 0 and copied > 0:
                self.pcie_measured = copied / copied_s / 1e9
        pcie = self.pcie_measured or self.pcie_gbps
        k = best_count(self.layers, self.other_bytes, self.cpu_gbps, pcie, self.layer_s,
                       self.ring, self.slots)
        chosen = set(evenly_spaced(sorted(self.layers), k))
        now, then = (modelled_seconds(self.layers, active, self.other_bytes, self.cpu_gbps,
                                      pcie, self.layer_s, self.ring, self.slots)
                     for active in (self.active, chosen))
        wanted = 0 if k == len(self.active) or then > now * (1 - MIN_GAIN) else \
            (1 if k > len(self.active) else -1)
        confirmed = wanted != 0 and wanted == self._wanted
        self._wanted = 0 if confirmed else wanted
        if not confirmed:
            return None
        self.active = chosen
        self.changes.append((self.passes, k, round(self.cpu_gbps, 1), round(pcie, 1)))
        return chosen

    def forget(self, layers) -> None:
        """Layers no longer split (promoted to VRAM: the GPU computes them whole)."""
        for i in layers:
            self.layers.pop(i, None)
            self.active.discard(i)
