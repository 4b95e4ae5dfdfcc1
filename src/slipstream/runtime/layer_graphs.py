"""CUDA graphs of single fixed layers inside an eager decode step.

A model that streams some of its layers decodes eagerly: its streamed layers' weights move
through ring slots, and a hybrid layer hands part of its FFN to the CPU in mid-layer. The host
then pays for enqueueing each layer's kernels one by one, about 0.5 ms a layer, and twice that
beside hybrid decode's CPU share. On an H100 host's 8B at 4 GiB the enqueue took 36.7 ms of a
37.0 ms token: a split layer's input reached the CPU 825 us after the layer began on the GPU,
the host still enqueueing the resident layer before it.

A layer the store hands out as the same weights on every pass (`LayerStore.fixed`: resident,
not split) computes one decode token with the same kernels and launch shapes each time, the
position read from device memory. So its forward is captured once per (layer, span bucket)
and replayed: one copy of the hidden state in and one graph launch instead of a dozen kernel
launches. The graphs read the same kernels with the same launch shape as the eager step
(runtime.graphs.bucket_span), so they give its bits.

Off unless SLIPSTREAM_LAYER_GRAPHS=1, until a GPU run measures it.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import envs
from ..model import Step, device_decode_step
from .graphs import CAPTURE_MODE


def layer_graphs_enabled() -> bool:
    """SLIPSTREAM_LAYER_GRAPHS=1, read when an engine is made."""
    return envs.get("SLIPSTREAM_LAYER_GRAPHS")


LayerForward = Callable[[torch.Tensor, Step], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # the graph's static output
    # the layer captured, weakly: a layer promoted or rebuilt is another object, and a dead
    # reference means the weights it pointed at may have been freed
    layer: weakref.ref


class LayerGraphs:
    """One stage's captured layers (a stage is one device). All graphs share one memory pool
    and one static input: they run one after another on one stream, and each one's output
    is read (copied into the input) before the next replay."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # the step's position
        self.x: torch.Tensor | None = None  # the static input, made at the first capture
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.eager: set[tuple[int, int]] = set()  # keys whose capture ran out of memory
        self.pool = None
        self.capture_s = 0.0

    def begin_step(self, step: Step) -> None:
        """A decode step starts: its position into the graphs' static copy (one device copy,
        no host sync)."""
        self.pos.copy_(step.positions[:1], non_blocking=True)

    def run(self, i: int, layer: object, x: torch.Tensor, forward: LayerForward,
            span: int) -> torch.Tensor | None:
        """Layer i's decode forward of x (1, hidden) through its graph for `span`, captured on
        first use; None where it must run eagerly (its capture ran out of memory). The result
        is a static buffer, overwritten by the layer's next replay."""
        key = (i, span)
        if key in self.eager:
            return None
        entry = self.graphs.get(key)
        if entry is None or entry.layer() is not layer:
            self.graphs.pop(key, None)
            entry = self._capture_within_budget(layer, x, forward, span)
            if entry is None:  # a tight VRAM budget: eager at this span from now on
                self.eager.add(key)
                return None
            self.graphs[key] = entry
        self.x.copy_(x)
        entry.graph.replay()
        return entry.out

    def _capture_within_budget(self, layer: object, x: torch.Tensor, forward: LayerForward,
                               span: int) -> _Captured | None:
        """_capture; where the pool cannot grow under the budget's cap (memory.vram_cap), once
        more after the allocator's cache is given back (a device sync, at a capture only);
        None if that fails too, or if the capture recorded nothing (_capture)."""
        for _ in range(2):
            try:
                return self._capture(layer, x, forward, span)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
        return None

    def _capture(self, layer: object, x: torch.Tensor, forward: LayerForward,
                 span: int) -> _Captured | None:
        """Warm up once on a side stream on the real input (Triton compiles, workspaces; the
        token's keys and values written as the replay will write them again), then capture.
        None where the capture recorded nothing."""
        t0 = time.perf_counter()
        if self.x is None or self.x.shape != x.shape or self.x.dtype != x.dtype:
            self.x = torch.empty_like(x)
            self.graphs.clear()  # they read the input they were captured with
        if not self.graphs:
            # a pool lives only while a graph captured into it does: once the last one is
            # dropped (its layer rebuilt, the input remade), torch's allocator refuses the id
            # for good (an internal assert at capture_begin, seen on a 70B), so the next
            # capture starts a pool of its own
            self.pool = None
        self.x.copy_(x)
        step = device_decode_step(self.pos, span)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward(self.x, step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # capture_begin/end on the side stream rather than torch.cuda.graph, whose entry
        # synchronizes the device and empties the allocator's caches (and the pinned host
        # cache) at every capture: a layer per span bucket, many per generation
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # the pool positionally and only when there is one, as torch.cuda.graph passes it
            pool = () if self.pool is None else (self.pool,)
            graph.capture_begin(*pool, capture_error_mode=CAPTURE_MODE)
            try:
                out = forward(self.x, step)
            except BaseException:
                with warnings.catch_warnings():
                    # a capture cut short at the layer's first allocation (out of memory) is
                    # empty, and torch warns of it: noise beside the error raised next
                    warnings.simplefilter("ignore")
                    try:
                        graph.capture_end()
                    except RuntimeError:
                        pass  # the capture the error broke; the first error is the one to see
                raise
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if any("graph is empty" in str(w.message).lower() for w in said):
            # nothing was captured: a replay would leave the static output as it was, a wrong
            # layer rather than a slow one, so the layer runs eagerly instead
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.capture_s += time.perf_counter() - t0
        return _Captured(graph, out, weakref.ref(layer))
