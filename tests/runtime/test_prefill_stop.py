"""A prefill stops between its layers once Engine.between_layers raises (what Ctrl-C sets,
cli.control), and leaves a cache the next generation can use."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import slipstream
from slipstream.cli.control import stream
from slipstream.synth import write_synth

PROMPT = list(range(5, 45))  # 40 tokens: a multi-token pass, as a prompt's prefill is


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("prefill_stop") / "deep.gguf", "tiny", "Q4_K",
                       n_layers=4, from_floats=True, std=0.08, seed=5)


@pytest.fixture(scope="module")
def model(deep):
    with slipstream.load(deep, device="cpu", ctx=64) as m:
        yield m


@pytest.fixture
def engine(model):
    eng = model.engine
    chunk = eng.prefill_chunk
    yield eng
    eng.layer_hook = eng.between_layers = None
    eng.prefill_chunk = chunk


def test_a_prefill_stops_after_the_layer_whose_check_raises(engine):
    engine.reset()
    want = engine.forward(PROMPT)
    done: list[int] = []
    engine.layer_hook = lambda i, x, y: done.append(i)

    def check() -> None:
        if len(done) >= 3:
            raise Stop

    engine.between_layers = check
    engine.reset()
    with pytest.raises(Stop):
        engine.forward(PROMPT)
    assert done == [0, 1, 2]
    assert engine.length == 0  # the unfinished chunk is not counted in the cache
    # a one-token step (decode) never calls it
    engine.between_layers = lambda: (_ for _ in ()).throw(Stop())
    engine.forward(PROMPT[:1])
    assert engine.length == 1
    # the next generation starts afresh and gives the same bits
    engine.between_layers = None
    engine.reset()
    assert torch.equal(engine.forward(PROMPT), want)


def test_a_stop_keeps_the_chunks_finished_before(engine):
    engine.prefill_chunk = 16
    done: list[int] = []
    engine.layer_hook = lambda i, x, y: done.append(i)
    n_layers = engine.cfg.n_layers

    def check() -> None:
        if len(done) >= n_layers + 2:  # two layers into the second chunk
            raise Stop

    engine.between_layers = check
    engine.reset()
    with pytest.raises(Stop):
        engine.forward(PROMPT)
    assert len(done) == n_layers + 2
    assert engine.length == 16


def test_ctrl_c_stops_the_prefill_at_the_next_layer(model, engine):
    """A real SIGINT, sent to this process while layer 1 of the prompt runs: the handler
    `stream` installs marks it, the engine stops after that layer, and `stream` reports a
    stopped generation with nothing generated."""
    done: list[int] = []

    def hook(i: int, x, y) -> None:
        done.append(i)
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    engine.layer_hook = hook
    before = signal.getsignal(signal.SIGINT)
    gen = model.generate(PROMPT, max_tokens=4, temperature=0)
    assert stream(gen, engine=engine) is True
    assert done == [0, 1]
    assert gen.stats.generated_tokens == 0 and gen.stats.prefill_s > 0
    assert engine.between_layers is None and signal.getsignal(signal.SIGINT) is before
    # the model generates as before afterwards
    engine.layer_hook = None
    again = model.generate(PROMPT, max_tokens=4, temperature=0)
    assert stream(again, engine=engine) is False
    assert again.stats.generated_tokens == 4
