"""A model as several stages in one process: contiguous layer ranges, a KV cache
each, the hidden state handed from stage to stage; the tokens and logits stay one stage's."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.errors import BadArgument, DeviceNotFound
from slipstream.memory.devices import per_device_budgets, stage_ranges

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]


@pytest.fixture(scope="module")
def one_and_two(smollm_path):
    one = slipstream.load(smollm_path, device="cpu", ctx=256)
    two = slipstream.load(smollm_path, device=["cpu", "cpu"], ctx=256)
    yield one, two
    one.close()
    two.close()


@pytest.mark.slow
def test_two_stages_split_the_layers_contiguously(one_and_two):
    _, two = one_and_two
    stages = two.engine.stages
    n = two.engine.cfg.n_layers
    assert len(stages) == 2
    assert [i for st in stages for i in st.layers] == list(range(n))
    assert min(len(st.layers) for st in stages) >= n // 2
    # each stage's own cache holds its layers only
    assert [st.kv.k.shape[0] for st in stages] == [len(st.layers) for st in stages]
    assert two.plan.stages[0].holds_embedding and not two.plan.stages[0].holds_head
    assert two.plan.stages[1].holds_head and not two.plan.stages[1].holds_embedding


@pytest.mark.slow
def test_two_stages_give_one_stages_greedy_tokens_and_logits(one_and_two):
    one, two = one_and_two
    for prompt in PROMPTS:
        ids = one.tokenize(prompt)
        a = [e.id for e in one.generate(ids, max_tokens=48, temperature=0)]
        b = [e.id for e in two.generate(ids, max_tokens=48, temperature=0)]
        assert a == b, prompt
        assert torch.equal(one.logits(ids + a[:8]), two.logits(ids + a[:8])), prompt


def test_a_budget_list_must_name_one_budget_per_device():
    assert per_device_budgets("24GiB", 2) == ["24GiB", "24GiB"]
    assert per_device_budgets("24GiB,12GiB", 2) == ["24GiB", "12GiB"]
    with pytest.raises(BadArgument, match="3 VRAM budgets .* for 2 devices"):
        per_device_budgets("1GiB,2GiB,3GiB", 2)


def test_a_budget_list_that_does_not_match_fails_before_the_load(smollm_path):
    with pytest.raises(BadArgument, match="3 VRAM budgets"):
        slipstream.load(smollm_path, device=["cpu", "cpu"],
                        placement=slipstream.Placement(vram_budget="1GiB,2GiB,3GiB"))


def test_a_gpu_index_that_does_not_exist_is_named(smollm_path):
    missing = torch.cuda.device_count() + 3 if torch.cuda.is_available() else 3
    with pytest.raises(DeviceNotFound, match=f"cuda:{missing} does not exist"):
        slipstream.load(smollm_path, device=["cpu", f"cuda:{missing}"])


def test_stage_ranges_cover_the_layers_evenly():
    assert stage_ranges(30, 2) == [range(0, 15), range(15, 30)]
    assert stage_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(BadArgument, match="3 stages for a model of 2 layers"):
        stage_ranges(2, 3)


@pytest.mark.slow
def test_the_cli_names_a_missing_gpu_in_one_line(smollm_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", str(smollm_path),
                        "--gpus", "0,99", "-p", "Hi", "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], r.stderr


@pytest.mark.slow
def test_the_cli_runs_two_stages_as_one(smollm_path):
    import subprocess
    import sys

    def text(*flags):
        r = subprocess.run([sys.executable, "-m", "slipstream", "run", "-m", str(smollm_path),
                            *flags, "-p", "The capital of France is", "-n", "16", "--temp",
                            "0"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert text("--devices", "cpu,cpu") == text("--device", "cpu")
