from __future__ import annotations

import pytest
import torch

from slipstream.runtime.sampler import BadSamplingParams, Sampler, SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
NO_FILTERS = dict(top_k=0, top_p=1.0, min_p=0.0)
EMPTY = torch.tensor([], dtype=torch.long)


def draws(params: SamplingParams, logits=LOGITS, n=3000, history=EMPTY) -> torch.Tensor:
    s = Sampler(params)
    return torch.stack([s(logits, history) for _ in range(n)])


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert int(Sampler(SamplingParams(temperature=0))(logits, EMPTY)) == int(logits.argmax())


def test_temperature_one_follows_the_distribution():
    counts = torch.bincount(draws(SamplingParams(temperature=1.0, seed=1, **NO_FILTERS)),
                            minlength=4).float()
    assert torch.allclose(counts / counts.sum(), PROBS, atol=0.03)


def test_seed_reproducible_and_seed_matters():
    p = dict(temperature=1.5, **NO_FILTERS)
    logits = torch.randn(500)
    a = draws(SamplingParams(seed=7, **p), logits, 50)
    b = draws(SamplingParams(seed=7, **p), logits, 50)
    c = draws(SamplingParams(seed=8, **p), logits, 50)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_one_is_greedy_at_any_temperature():
    assert set(draws(SamplingParams(temperature=5.0, top_k=1, top_p=1.0, min_p=0.0, seed=0),
                     n=300).tolist()) == {0}


def test_top_k_two_keeps_two():
    got = set(draws(SamplingParams(temperature=3.0, top_k=2, top_p=1.0, min_p=0.0, seed=0),
                    n=500).tolist())
    assert got == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1 survive
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=0),
                    n=1000).tolist())
    assert got == {0, 1}


def test_min_p_is_relative_to_the_top_token():
    # min_p 0.35: threshold 0.175 keeps 0.5 and 0.3, drops 0.15 and 0.05
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.35, seed=0),
                    n=1000).tolist())
    assert got == {0, 1}


def test_repeat_penalty_llama_cpp_style():
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    logits = torch.tensor([4.0, -1.0, 3.0])
    out = s.penalize(logits, torch.tensor([0, 1]))
    assert torch.equal(out, torch.tensor([2.0, -2.0, 3.0]))
    assert int(s(logits, torch.tensor([0, 1]))) == 2


def test_repeat_last_n_window():
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=1))
    out = s.penalize(torch.tensor([4.0, 4.0]), torch.tensor([0, 1]))
    assert torch.equal(out, torch.tensor([4.0, 2.0]))


def test_frequency_and_presence_penalties():
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0))
    out = s.penalize(torch.zeros(3), torch.tensor([0, 0, 0, 2]))
    assert torch.allclose(out, torch.tensor([-2.5, 0.0, -1.5]))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(temperature=-1), "temperature=-1"), (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_k=-3), "top_k=-3"), (dict(min_p=1.5), "min_p=1.5"),
    (dict(repeat_penalty=0), "repeat_penalty=0"),
])
def test_bad_params_name_the_value(kwargs, needle):
    with pytest.raises(BadSamplingParams, match=needle):
        SamplingParams(**kwargs)
