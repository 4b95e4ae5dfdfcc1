"""The generation loop on the real default model: stops, limits, streaming text, context."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.errors import ContextOverflow, NonFiniteLogits
from slipstream.synth import write_synth
from slipstream.runtime.generate import _StopMatcher

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def model(smollm_path):
    return slipstream.load(smollm_path, device="cpu", ctx=256)


def greedy(model, prompt=PROMPT, **kw):
    events = list(model.generate(prompt, temperature=0, **kw))
    return events, "".join(e.text for e in events)


@pytest.mark.slow
def test_max_tokens_and_length_finish(model):
    events, text = greedy(model, max_tokens=12)
    assert len(events) == 12
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert text == model.detokenize([e.id for e in events])
    gen = model.generate(PROMPT, temperature=0, max_tokens=12)
    assert [e.id for e in gen] == [e.id for e in events]
    stats = gen.stats
    assert stats.generated_tokens == 12 and stats.prompt_tokens == len(model.tokenize(PROMPT))
    assert stats.finish_reason == "length" and stats.speculation is None
    assert stats.peak_memory is None  # on the CPU: not known


@pytest.mark.slow
def test_greedy_is_deterministic_and_seeded_sampling_reproducible(model):
    assert greedy(model, max_tokens=10)[1] == greedy(model, max_tokens=10)[1]
    a = [e.id for e in model.generate(PROMPT, max_tokens=10, temperature=1.0, seed=3)]
    b = [e.id for e in model.generate(PROMPT, max_tokens=10, temperature=1.0, seed=3)]
    assert a == b


@pytest.mark.slow
def test_stop_string_cuts_the_text(model):
    _, full = greedy(model, max_tokens=24)
    words = full.split()
    stop = words[len(words) // 2]
    events, text = greedy(model, max_tokens=24, stop=[stop])
    assert events[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


@pytest.mark.slow
def test_eot_token_stops_chat(model):
    events = list(model.chat([{"role": "user", "content": "Say hello."}], temperature=0,
                             max_tokens=64))
    assert events[-1].finish_reason == "stop"
    assert events[-1].id in model.tokenizer.eot_ids
    assert "<|im_end|>" not in "".join(e.text for e in events)


@pytest.mark.slow
def test_prompt_longer_than_context(model):
    ids = model.tokenize("word " * 300)
    assert len(ids) > model.ctx
    with pytest.raises(ContextOverflow, match=f"{len(ids)} tokens but the context holds 256"):
        list(model.generate(ids, max_tokens=4))


@pytest.mark.slow
def test_generation_capped_by_context(model):
    ids = model.tokenize("one two three " * 100)[:250]
    events = list(model.generate(ids, max_tokens=50, temperature=0))
    assert len(events) == 6 and events[-1].finish_reason == "length"


def test_stop_matcher_holds_back_possible_prefixes():
    m = _StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("O") == ("", False)
    assert m.push("x") == ("STOx", False)
    assert m.push("yy STOP zz") == ("yy ", True)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_nan_logits_end_generation_with_a_clear_error(tmp_path, temperature):
    """A weight gone NaN (what a corrupt file gives) makes every logit NaN: generation stops
    with NonFiniteLogits before any such token is emitted, greedy or sampled."""
    path = write_synth(tmp_path / "t.gguf", "tiny", "Q8_0", n_layers=2)
    with slipstream.load(path, device="cpu", ctx=64) as m:
        events = []
        for e in m.generate([1, 2, 3], max_tokens=4, temperature=temperature, seed=0):
            events.append(e)
        assert len(events) == 4  # the healthy model runs
        w = m.engine.weights  # a new tensor: the loaded one views the read-only file map
        w.output_norm = torch.full_like(w.output_norm, float("nan"))
        got = []
        with pytest.raises(NonFiniteLogits, match=r"NaN or Inf logits at generated token 0"):
            for e in m.generate([1, 2, 3], max_tokens=4, temperature=temperature, seed=0):
                got.append(e)
        assert got == []
