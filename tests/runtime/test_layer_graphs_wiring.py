"""Engine dispatch to runtime.layer_graphs (SLIPSTREAM_LAYER_GRAPHS), on the CPU with a stand-in
for the graphs (capture needs CUDA: tests/gpu/test_hybrid_gpu.py replays real ones): in a
decode step, each layer its store calls fixed goes to the graphs with the step's span, and
their result is the layer's output; where they decline (None) the layer runs eagerly;
prefill never asks them. The graphs' own bits are the GPU test's."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_engine
from slipstream.model import append_step
from slipstream.synth import write_synth


class StandIn:
    """Runs the layer's forward as the eager step would (the same step), recording calls; the
    layers in `decline` are left to the engine."""

    def __init__(self, engine, decline: set[int]):
        self.engine, self.decline = engine, decline
        self.calls: list[tuple[int, int]] = []

    def run(self, i, layer, x, forward, span):
        self.calls.append((i, span))
        if i in self.decline:
            return None
        return forward(x, append_step(self.engine.length, 1, x.device, span))


@pytest.mark.slow
def test_fixed_layers_of_a_decode_step_go_through_the_graphs(tmp_path, monkeypatch):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=4, from_floats=True,
                       std=0.1, seed=5)
    plain = cpu_engine(path, ctx=64, precision="exact")
    routed = cpu_engine(path, ctx=64, precision="exact")
    fixed = {0, 2, 3}
    monkeypatch.setattr(routed.layers, "fixed", lambda i: i in fixed)
    stand_in = StandIn(routed, decline={3})
    steps = []

    def graphs_of(stage, step):
        steps.append(step.tokens)
        return stand_in if step.tokens == 1 else None

    monkeypatch.setattr(routed, "_graphs_of", graphs_of)
    prompt = [3, 17, 99, 250, 7]
    assert torch.equal(routed.forward(prompt), plain.forward(prompt))
    assert stand_in.calls == [] and steps == [len(prompt)]  # prefill: no graphs
    for t in range(3):
        token = torch.tensor([11 + t])
        assert torch.equal(routed.decode(token), plain.decode(token))
    # each step's span (on the CPU one past its slot; on CUDA its graph bucket)
    assert stand_in.calls == [(i, len(prompt) + 1 + t) for t in range(3) for i in (0, 2, 3)]


@pytest.mark.slow
def test_graphs_of_stays_off_without_the_setting_and_on_the_cpu(tmp_path, monkeypatch):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", from_floats=True, std=0.1, seed=5)
    monkeypatch.delenv("SLIPSTREAM_LAYER_GRAPHS", raising=False)
    engine = cpu_engine(path, ctx=64, precision="exact")
    assert engine.layer_graphs is False
    monkeypatch.setenv("SLIPSTREAM_LAYER_GRAPHS", "1")
    engine = cpu_engine(path, ctx=64, precision="exact")
    assert engine.layer_graphs is True
    step = append_step(0, 1, torch.device("cpu"), 64)
    assert engine._graphs_of(engine.stages[0], step) is None  # the CPU has no graphs


class Layer:
    """A stand-in layer object (held weakly by the graphs, as LayerWeights is)."""


def test_one_capture_per_layer_and_span_again_for_a_new_layer_eager_after_two_ooms(monkeypatch):
    """LayerGraphs.run's bookkeeping, with a stand-in for the capture: a (layer, span) is
    captured once and replayed after (the input through the static copy); a new object for
    the layer (promoted, rebuilt) is captured again; a capture out of memory twice leaves that
    key eager (None) for good."""
    import weakref

    from slipstream.runtime import layer_graphs

    graphs = layer_graphs.LayerGraphs(torch.device("cpu"))
    captured, oom = [], {("ooms", 512)}

    def capture(layer, x, forward, span):
        if (getattr(layer, "name", ""), span) in oom:
            raise torch.cuda.OutOfMemoryError("stand-in")
        if graphs.x is None:
            graphs.x = torch.empty_like(x)
        out = torch.empty_like(x)

        class Graph:
            def replay(self) -> None:
                out.copy_(forward(graphs.x, span))

        captured.append((layer, span))
        return layer_graphs._Captured(Graph(), out, weakref.ref(layer))

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def forward(x, span):
        return x * 2 + span

    a, b = Layer(), Layer()
    x = torch.ones(1, 4)
    assert torch.equal(graphs.run(0, a, x, forward, 256), x * 2 + 256)
    assert torch.equal(graphs.run(0, a, 3 * x, forward, 256), 3 * x * 2 + 256)  # a replay
    assert torch.equal(graphs.run(0, a, x, forward, 512), x * 2 + 512)
    assert captured == [(a, 256), (a, 512)]
    graphs.run(0, b, x, forward, 256)  # layer 0 is another object now
    assert captured[-1] == (b, 256)
    failing = Layer()
    failing.name = "ooms"
    assert graphs.run(1, failing, x, forward, 512) is None
    assert (1, 512) in graphs.eager and graphs.run(1, failing, x, forward, 512) is None
    assert len(captured) == 3


class FakeAllocator:
    """torch's rule for graph pools, as CUDACachingAllocator keeps it: a pool lives while a
    graph captured into it does, and a capture into an id whose graphs are all gone fails (an
    internal assert in torch, which a 70B hit)."""

    def __init__(self):
        self.use_count: dict[tuple[int, int], int] = {}
        self.next_id = 1

    def graph_class(self, empty_for: set[int]):
        allocator_rules = self

        class Graph:
            """torch.cuda.CUDAGraph's capture surface; `empty_for`: the layers whose capture
            records nothing (torch warns at capture_end)."""

            def __init__(self):
                self.id = None

            def capture_begin(self, *pool, capture_error_mode=None):
                if pool:
                    count = allocator_rules.use_count.get(pool[0])
                    if count is not None and count <= 0:
                        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
                    self.id = pool[0]
                else:
                    self.id = (0, allocator_rules.next_id)
                    allocator_rules.next_id += 1
                allocator_rules.use_count[self.id] = allocator_rules.use_count.get(self.id, 0) + 1

            def capture_end(self):
                if Graph.capturing in empty_for:
                    import warnings
                    warnings.warn("The CUDA Graph is empty. This usually means ...")

            def pool(self):
                return self.id

            def replay(self):
                pass

            def __del__(self):
                if self.id is not None:
                    allocator_rules.use_count[self.id] -= 1

        Graph.capturing = None
        return Graph


def test_captures_after_every_graph_is_gone_take_a_new_pool_and_empty_ones_run_eagerly(
        monkeypatch):
    """LayerGraphs._capture against a stand-in for torch's graph and pool rules (the GPU test
    in test_hybrid_gpu.py drops real graphs): once the last graph is dropped its pool id is
    dead, so the next capture must start a pool of its own rather than assert; and a capture
    that recorded nothing (torch's "graph is empty") leaves the layer eager instead of
    replaying nothing."""
    import contextlib
    import warnings

    from slipstream.runtime import layer_graphs

    rules = FakeAllocator()
    empty_for: set[int] = set()
    Graph = rules.graph_class(empty_for)

    class Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    graphs = layer_graphs.LayerGraphs(torch.device("cpu"))
    x = torch.ones(1, 4)

    def forward_of(i):
        def forward(inp, step):
            Graph.capturing = i
            return inp * 2
        return forward

    layers = [Layer(), Layer(), Layer()]
    assert graphs.run(0, layers[0], x, forward_of(0), 256) is not None
    assert graphs.run(1, layers[1], x, forward_of(1), 256) is not None
    first_pool = graphs.pool
    assert {g.graph.pool() for g in graphs.graphs.values()} == {first_pool}
    graphs.graphs.clear()  # every graph gone (layers rebuilt): the pool id is dead
    assert rules.use_count[first_pool] == 0
    assert graphs.run(0, layers[0], x, forward_of(0), 256) is not None
    assert graphs.pool != first_pool
    # one graph dropped while another lives keeps the shared pool
    shared = graphs.pool
    assert graphs.run(1, layers[1], x, forward_of(1), 256) is not None
    graphs.graphs.pop((0, 256))
    assert graphs.run(0, Layer(), x, forward_of(0), 256) is not None
    assert graphs.pool == shared
    # an empty capture: eager from then on, and the capture's warning not passed on
    empty_for.add(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphs.run(2, layers[2], x, forward_of(2), 256) is None
    assert (2, 256) in graphs.eager and (2, 256) not in graphs.graphs
