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

from ..model import Step, device_decode_step

if TYPE_CHECKING:
    from .engine import Engine

GRAPH_BUCKET = 256
# Only this thread is barred from unsafe CUDA calls while it captures: tier C's reader threads
# wait on copy events meanwhile (staging.py), which a global capture would turn into errors
CAPTURE_MODE = "thread_local"


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
        # the slot the step about to replay writes (so nothing it clobbers was still needed:
        # a sliding-window layer's ring holds the slot ctx - 1 at (ctx - 1) mod its length,
        # which may be a key of the window, model.ring); then capture.
        self.pos.fill_(self.engine.length)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body(span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
            logits = self.body(span)
        torch.cuda.synchronize(self.device)
        self.graphs[span] = (graph, logits)
        self.capture_s += time.perf_counter() - t0


# Widths a masked step is padded to for capture: few graphs, at most 2x the rows (a draft's
# level of 5 nodes runs as 8; kernels.qgemm pads 5..16 rows to 16 and 17..32 to 32 anyway).
STEP_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)


class StepGraphs:
    """CUDA graphs of masked steps over up to STEP_WIDTHS[-1] tokens: a speculative draft's
    tree levels, which eagerly cost ~10x the captured decode step in launch overhead alone.

    One graph per (width, span) bucket, captured on first use from the step it first serves,
    with its tokens, positions, slots and mask in static buffers. Padding rows write keys and
    values to the slots right past the step's end (free: nothing reads them before a later
    step writes them) and attend to slot 0 only, so they stay finite. All graphs share one
    memory pool: they never run at once, and a replay's logits are read before the next one.
    """

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.device = engine.device
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.eager: set[tuple[int, int]] = set()  # buckets whose capture ran out of memory
        self.pool = None
        self.capture_s = 0.0

    def serves(self, step) -> bool:
        """Whether a graph can run `step`: few enough tokens, and room past its end for the
        padding rows' slots (near the end of the context it runs eagerly)."""
        n = step.tokens
        if n > STEP_WIDTHS[-1] or step.causal:
            return False
        width = next(w for w in STEP_WIDTHS if w >= n)
        key = (width, bucket_span(step.end - 1, self.engine.ctx))
        return step.end + (width - n) <= self.engine.ctx and key not in self.eager

    def run(self, ids: torch.Tensor, step) -> torch.Tensor:
        """Logits (n, vocab) of the step's n tokens (a view of the graph's static output)."""
        n = step.tokens
        width = next(w for w in STEP_WIDTHS if w >= n)
        span = bucket_span(step.end - 1, self.engine.ctx)  # >= step.end
        key = (width, span)
        entry = self.graphs.get(key)
        buffers = entry[1] if entry is not None else self._buffers(width, span)
        self._fill(buffers, ids, step, width)
        if entry is None:
            try:
                entry = self._capture(buffers, span)
            except torch.cuda.OutOfMemoryError:
                # a tight VRAM budget: this bucket runs eagerly from now on, in what the
                # allocator has cached rather than in a pool of its own
                self.eager.add(key)
                torch.cuda.empty_cache()
                return self.engine.run_step(ids, step)
            self.graphs[key] = entry
        graph, _, logits = entry
        graph.replay()
        return logits[:n]

    def _buffers(self, width: int, span: int) -> dict[str, torch.Tensor]:
        dev = self.device
        return dict(tokens=torch.zeros(width, dtype=torch.long, device=dev),
                    positions=torch.zeros(width, dtype=torch.long, device=dev),
                    slots=torch.zeros(width, dtype=torch.long, device=dev),
                    allowed=torch.zeros(width, span, dtype=torch.bool, device=dev))

    @staticmethod
    def _fill(b: dict[str, torch.Tensor], ids: torch.Tensor, step, width: int) -> None:
        n = step.tokens
        b["tokens"][:n].copy_(ids, non_blocking=True)
        b["positions"][:n].copy_(step.positions, non_blocking=True)
        b["slots"][:n].copy_(step.slots, non_blocking=True)
        allowed = b["allowed"]
        allowed.zero_()
        allowed[:n, :step.span].copy_(step.allowed, non_blocking=True)
        if width > n:
            b["tokens"][n:].zero_()
            b["positions"][n:].zero_()
            torch.arange(step.end, step.end + width - n, out=b["slots"][n:])
            allowed[n:, 0] = True

    def _body(self, b: dict[str, torch.Tensor], span: int) -> torch.Tensor:
        step = Step(b["positions"], b["slots"], span=span, end=span, start=None,
                    causal=False, allowed=b["allowed"])
        return self.engine.run_step(b["tokens"], step)

    def _capture(self, b: dict[str, torch.Tensor], span: int) -> tuple:
        """Warm up on a side stream with the step being served (its cache writes are the
        real ones, so repeating them is harmless), then capture."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(b, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            logits = self._body(b, span)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        self.capture_s += time.perf_counter() - t0
        return graph, b, logits
