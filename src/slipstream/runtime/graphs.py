"""CUDA graphs of the decode step, outside the model math.

A captured decode graph reads a fixed number of cache slots (its span) and takes the position
from device memory, so one graph serves every position below its span. One graph per bucket of
GRAPH_BUCKET positions keeps the wasted attention reads under one bucket while capturing at most
ctx / GRAPH_BUCKET graphs, each on first use. A step then costs one launch from the host and
never waits on the GPU.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..model import device_decode_step

if TYPE_CHECKING:
    from .engine import Engine

GRAPH_BUCKET = 256


def bucket_span(length: int, ctx: int) -> int:
    """The span of the decode graph (and of eager CUDA decode steps, so that both run the same
    kernels with the same launch shape and give the same bits) for a token at slot `length`."""
    return min(ctx, (length // GRAPH_BUCKET + 1) * GRAPH_BUCKET)


class DecodeGraphs:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.device = engine.device
        self.token = torch.zeros(1, dtype=torch.long, device=self.device)  # static input
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # static position
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0  # total time spent capturing, reported apart from runs

    def body(self, span: int) -> torch.Tensor:
        """The decode step over the static buffers: what a graph records (runs eagerly too)."""
        return self.engine.run_step(self.token, device_decode_step(self.pos, span))

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Replay the graph for the engine's current length; returns its static logits."""
        engine = self.engine
        span = bucket_span(engine.length, engine.ctx)
        if span not in self.graphs:
            self._capture(span)
        graph, logits = self.graphs[span]
        self.token.copy_(token.view(1), non_blocking=True)
        self.pos.fill_(engine.length)
        graph.replay()
        engine.set_length(engine.length + 1)
        return logits

    def _capture(self, span: int) -> None:
        t0 = time.perf_counter()
        # Warm up on a side stream (compiles Triton kernels, allocates workspaces), writing to
        # a cache slot no real step has reached yet; then capture.
        self.pos.fill_(self.engine.ctx - 1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body(span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.body(span)
        torch.cuda.synchronize(self.device)
        self.graphs[span] = (graph, logits)
        self.capture_s += time.perf_counter() - t0
