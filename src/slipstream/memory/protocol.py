"""What every layer store offers the engine and the tools around it (CLI, bench, API).

The engine asks for layer i (a global layer index, 0..n_layers-1), computes, and gives it back.
Every store implements every member, as a no-op where it means nothing for that store, so no
caller ever probes a store with hasattr. StoreBase holds those no-ops and the context-manager
protocol once.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..model.llama import LayerWeights


@dataclass
class StoreStats:
    disk_wait_s: float = 0.0  # time the engine (main thread) waited for reads to finish
    build_s: float = 0.0  # time turning streamed bytes into layers (dequantize)
    layers_streamed: int = 0
    disk_bytes: int = 0  # bytes of streamed layers read from disk (or mmap)
    h2d_bytes: int = 0  # bytes copied host-to-device into the GPU slots
    # Measured only while stats are on (CUDA events, read back once per forward pass):
    compute_s: float = 0.0  # GPU busy on the layers (compute stream)
    stall_s: float = 0.0  # GPU idle between layers: waiting for a copy, or for the host
    h2d_s: float = 0.0  # copy stream busy (overlaps compute)
    disk_read_s: float = 0.0  # wall time with at least one read running (overlaps compute)
    # Hybrid decode (hybrid.split), host clock: the CPU's FFN shares, waits for their inputs
    # included, and the packed bytes they read
    cpu_s: float = 0.0
    cpu_bytes: int = 0
    # A mixture of experts placed expert by expert (weights.expert_tiers): expert calls served
    # from RAM (hits) and from the file (misses), and the bytes those misses read and how long
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0
    expert_read_s: float = 0.0  # host clock: the main thread reading cold experts' bytes
    # (or waiting for a read ahead to finish)
    # Pre-gating read-ahead (weights.expert_ahead): experts read ahead on the background
    # thread, their bytes, and the misses whose bytes were so read (the guess's hits)
    expert_ahead_reads: int = 0
    expert_ahead_bytes: int = 0
    expert_ahead_hits: int = 0
    # A mixture of experts split between VRAM and the CPU (weights.split_experts): routed
    # (token, expert) pairs computed from VRAM slots and by the CPU, the host syncs for the
    # routing ids (one per split layer and pass), and the swaps into VRAM with their bytes
    expert_vram_pairs: int = 0
    expert_cpu_pairs: int = 0
    expert_syncs: int = 0
    expert_swaps: int = 0
    expert_swap_bytes: int = 0
    # ... and a prefill's experts streamed to the GPU's staging slots (weights.expert_stream):
    # the experts, the bytes copied up for them, and the routed pairs they computed
    expert_streamed: int = 0
    expert_stream_bytes: int = 0
    expert_stream_pairs: int = 0

    @property
    def expert_hit_rate(self) -> float | None:
        calls = self.expert_hits + self.expert_misses
        return self.expert_hits / calls if calls else None

    @property
    def expert_ahead_rate(self) -> float | None:
        """The share of cold routed experts (misses) whose bytes were read ahead, or None
        where nothing was read ahead."""
        if not self.expert_ahead_reads or not self.expert_misses:
            return None
        return self.expert_ahead_hits / self.expert_misses

    @property
    def expert_vram_rate(self) -> float | None:
        """The share of routed (token, expert) pairs served from VRAM (a split mixture of
        experts), or None where none was counted."""
        pairs = self.expert_vram_pairs + self.expert_cpu_pairs + self.expert_stream_pairs
        return self.expert_vram_pairs / pairs if pairs else None

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


@runtime_checkable
class LayerStore(Protocol):
    stats: StoreStats
    note: str  # what the user should know about the I/O path ("" when nothing)
    # True only when every layer is resident: a captured CUDA graph would freeze one set of
    # streamed weights
    graph_capturable: bool

    def __len__(self) -> int: ...

    def acquire(self, i: int) -> LayerWeights:
        """Layer i, ready for the current stream's kernels."""
        ...

    def release(self, i: int) -> None:
        """The kernels that read layer i are enqueued; its memory may be reused after them."""
        ...

    def waiting(self, i: int) -> bool:
        """Whether acquiring layer i now would block the host on a read that has not landed
        (never blocks itself): a caller with other work to enqueue (a speculative draft's
        next level) may do it first and ask again."""
        ...

    def fixed(self, i: int) -> bool:
        """Whether layer i is handed out as the same weights, computed the same way, on every
        pass (resident and not split), so that a CUDA graph of its forward stays valid
        (runtime.layer_graphs)."""
        ...

    def skip(self, layers: frozenset[int]) -> None:
        """The engine will not ask for `layers` (layer skip, runtime.layer_skip) until the next
        call: a streaming store drops them from its read-ahead order, so it neither reads nor
        copies them. Called between forward passes; a streaming store refuses to
        hand out a skipped layer."""
        ...

    def begin_pass(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens starts (the engine calls it before acquiring the
        pass's first layer): a store whose layers compute differently by batch size (hybrid
        decode's CPU share) gets ready for it."""
        ...

    def promote(self, room: int | None, most: int | None = None,
                only: Collection[int] | None = None) -> list[int]:
        """Make streamed layers resident while `room` more bytes of the device's memory
        last (memory a speculative draft gave back, say; None: as the allocator allows), at
        most `most` of them, of `only` where given; returns the layers promoted, which are
        served like layers built at load from then on."""
        ...

    def enable_timing(self, on: bool = True) -> None:
        """--stats: measure where a token's time goes (CUDA events on CUDA)."""
        ...

    def collect(self) -> None:
        """Fold timing still pending into stats (end of a --stats run)."""
        ...

    def close(self) -> None:
        """Give back reader threads, file descriptors, maps, pinned buffers and GPU slots.
        Idempotent."""
        ...

    def __enter__(self) -> "LayerStore": ...

    def __exit__(self, *exc) -> None: ...


class StoreBase:
    """The LayerStore members that mean nothing for some stores, as no-ops; and `with store:`
    closing it."""

    note = ""
    graph_capturable = False

    def skip(self, layers: frozenset[int]) -> None:
        pass  # a store that reads nothing ahead has no order to change

    def begin_pass(self, tokens: int) -> None:
        pass  # layers computed the same at any batch size

    def waiting(self, i: int) -> bool:
        return False  # nothing read ahead: acquire never waits on a read in flight

    def fixed(self, i: int) -> bool:
        return self.graph_capturable  # a store that streams nothing hands out fixed layers

    def promote(self, room: int | None, most: int | None = None,
                only: Collection[int] | None = None) -> list[int]:
        return []  # a store with no cheaper place to put a layer keeps its tiers

    def enable_timing(self, on: bool = True) -> None:
        pass

    def collect(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
