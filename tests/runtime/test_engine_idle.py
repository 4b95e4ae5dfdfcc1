"""Engine.forward's idle hook: while the next layer's read has not landed (LayerStore.waiting),
the engine calls idle() instead of blocking, until idle has nothing left to do; the pass's
output does not depend on it. Speculation grows its draft's tree there (speculative.rounds)."""

from __future__ import annotations

import torch

from helpers import cpu_engine
from slipstream.synth import write_synth


def test_idle_runs_while_a_layer_waits_and_changes_nothing(tmp_path, monkeypatch):
    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", from_floats=True, std=0.1, seed=5)
    plain = cpu_engine(path, ctx=64, precision="exact")
    hooked = cpu_engine(path, ctx=64, precision="exact")
    store = hooked.layers
    waits = {0: 3, 1: 1}  # layer -> times the store says its read has not landed
    asked: list[int] = []

    def waiting(i: int) -> bool:
        asked.append(i)
        if waits.get(i, 0) > 0:
            waits[i] -= 1
            return True
        return False

    monkeypatch.setattr(store, "waiting", waiting)
    calls = []
    prompt = [3, 17, 99, 250, 7]
    want = plain.forward(prompt, all_logits=True)
    got = hooked.forward(prompt, all_logits=True, idle=lambda: calls.append(1) or True)
    assert torch.equal(got, want)
    assert len(calls) == 4  # three waits at layer 0, one at layer 1
    assert sorted(set(asked)) == list(range(hooked.cfg.n_layers))

    # idle with nothing left to do is not called again in that pass: the engine blocks
    waits.update({0: 5, 1: 5})
    calls.clear()
    got = hooked.forward([11], idle=lambda: calls.append(1) and False)
    assert calls == [1]
    assert torch.equal(got, plain.forward([11]))
